// StepGraph: stream capture into a graph with its own memory pool (core/cuda/graph.h).
#include "core/cuda/graph.h"

#include <atomic>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"

namespace megaton::cuda {

namespace {
std::atomic<bool> g_capturing{false};
std::vector<void*>* g_capturing_host_blocks = nullptr;
}  // namespace

bool capturing() { return g_capturing.load(std::memory_order_relaxed); }

void keep_for_capturing_graph(void* pinned) {
  MEGATON_CHECK(g_capturing_host_blocks != nullptr, "keep_for_capturing_graph outside a capture");
  g_capturing_host_blocks->push_back(pinned);
}

StepGraph::~StepGraph() { reset(); }

void StepGraph::reset() noexcept {
  if (exec_ || graph_) (void)cudaStreamSynchronize(stream());  // replays still queued
  if (exec_) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) (void)cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  exec_ = graph_ = nullptr;
  release_graph_pool(pool_);
  pool_ = nullptr;
  for (void* p : host_blocks_) (void)cudaFreeHost(p);
  host_blocks_.clear();
  num_nodes_ = 0;
  (void)cudaGetLastError();
}

void StepGraph::capture(const std::string& what, const std::function<void()>& body) {
  MEGATON_CHECK(!captured() && !capturing(), "StepGraph::capture: captured already, or nested");
  // Work queued before the capture must not become part of it, nor race it.
  synchronize();
  pool_ = begin_graph_pool();
  g_capturing_host_blocks = &host_blocks_;
  cudaGraph_t graph = nullptr;
  try {
    MEGATON_CUDA_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeRelaxed));
    g_capturing = true;
    auto end_capture = [&] {
      g_capturing = false;
      (void)cudaStreamEndCapture(stream(), &graph);  // ends it; the graph is unusable
      if (graph) (void)cudaGraphDestroy(graph);
      (void)cudaGetLastError();
    };
    try {
      body();
    } catch (const Error&) {
      end_capture();
      throw;
    } catch (const std::exception& e) {
      // A CUDA call the capture refused (a copy into pageable host memory ...).
      end_capture();
      throw Error(fmt::format("{}: the step does something a CUDA graph capture cannot hold: {}",
                              what, e.what()));
    }
    g_capturing = false;
    const cudaError_t ended = cudaStreamEndCapture(stream(), &graph);
    if (ended != cudaSuccess || graph == nullptr)
      throw Error(fmt::format("{}: the CUDA graph capture failed ({}): the step does something "
                              "a graph cannot hold", what, cudaGetErrorString(ended)));
    graph_ = graph;
    size_t nodes = 0;
    MEGATON_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    num_nodes_ = int64_t(nodes);
    cudaGraphExec_t exec = nullptr;
    MEGATON_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    exec_ = exec;
    MEGATON_CUDA_CHECK(cudaGraphUpload(exec, stream()));
  } catch (...) {
    g_capturing = false;
    g_capturing_host_blocks = nullptr;
    end_graph_pool();
    reset();
    throw;
  }
  g_capturing_host_blocks = nullptr;
  end_graph_pool();
}

void StepGraph::replay() {
  MEGATON_CHECK(captured(), "StepGraph::replay before capture");
  MEGATON_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), stream()));
}

int64_t StepGraph::pool_bytes() const { return graph_pool_bytes(pool_); }

}  // namespace megaton::cuda
