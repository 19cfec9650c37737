// CUDA graphs of the training step (--cuda-graph-impl full_iteration, train/step_graph.h):
// the work a step queues on the compute stream is captured once and replayed with one
// launch per step (CUDA Programming Guide, "CUDA Graphs": stream capture). CUDA builds only.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace megaton::cuda {

struct GraphPool;

// Whether a StepGraph is capturing the compute stream now. While it is, nothing queued on
// the stream runs; cuda::synchronize() throws megaton::Error (a captured step cannot wait
// for the GPU), and cuda::upload keeps the bytes of a large copy in a pinned block the
// graph owns (small copies travel as kernel parameters, which the graph keeps).
bool capturing();

// One captured graph and its memory.
//
// capture(body) runs `body` with the compute stream in capture mode
// (cudaStreamCaptureModeRelaxed: the pool may cudaMalloc) and instantiates what it queued.
// Nothing runs: replay() then runs it. Every device allocation inside `body` comes from
// the graph's own pool (core/cuda/allocator.h), so the addresses the graph replays stay
// its own while it lives; tensors allocated inside and kept by the caller (the step's
// outputs) are rewritten by every replay. Values the host passes to kernels inside
// `body` (scalars, uploads) are frozen: what must change from step to step has to be in
// device memory written before replay() (train/step_graph.h's inputs).
//
// Errors: megaton::Error when `body` makes a host synchronization (the message names the
// `what` given), InternalError on a CUDA failure; either way the capture is ended, the
// pool released, and the object stays uncaptured. Single-threaded, one capture at a time.
class StepGraph {
 public:
  StepGraph() = default;
  ~StepGraph();  // waits for the replays, then frees the graph and returns its pool
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  void capture(const std::string& what, const std::function<void()>& body);
  // Queues one run of the captured work on the compute stream (does not wait).
  void replay();
  bool captured() const { return exec_ != nullptr; }
  // Device bytes the graph's pool holds; kernel nodes in the graph.
  int64_t pool_bytes() const;
  int64_t num_nodes() const { return num_nodes_; }

 private:
  void reset() noexcept;

  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
  GraphPool* pool_ = nullptr;
  std::vector<void*> host_blocks_;  // pinned copies of large uploads captured
  int64_t num_nodes_ = 0;
};

// For cuda::upload during a capture: keeps `pinned` (cudaMallocHost) alive until the
// capturing graph is destroyed.
void keep_for_capturing_graph(void* pinned);

}  // namespace megaton::cuda
