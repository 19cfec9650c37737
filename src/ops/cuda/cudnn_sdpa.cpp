// What the cuDNN fused-attention ops share (ops/cuda/cudnn_sdpa.h).
#include "ops/cuda/cudnn_sdpa.h"

#include <cstring>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/rng.h"

namespace megaton::ops::cuda::sdpa {
namespace {

// Philox counter (low word) at which cuDNN's dropout seed is drawn: the last one, which no
// element index of another op's draw at the same (seed, stream) can reach.
constexpr uint64_t kSeedCounter = ~uint64_t(0);

}  // namespace

cudnnHandle_t handle() {
  static cudnnHandle_t h = [] {
    cudnnHandle_t created;
    MEGATON_CUDNN_CHECK(cudnnCreate(&created));
    MEGATON_CUDNN_CHECK(cudnnSetStream(created, ::megaton::cuda::stream()));
    return created;
  }();
  return h;
}

std::mutex& state_mutex() {
  static std::mutex m;
  return m;
}

void* workspace(int64_t bytes) {
  static void* ptr = nullptr;
  static size_t capacity = 0;
  if (size_t(bytes) > capacity) {
    if (ptr) ::megaton::cuda::device_free(ptr, capacity);
    ptr = ::megaton::cuda::device_allocate(size_t(bytes));
    capacity = size_t(bytes);
  }
  return ptr;
}

int64_t* dropout_seed_offset(uint64_t seed, uint64_t stream) {
  static int64_t* device_words =
      static_cast<int64_t*>(::megaton::cuda::device_allocate(2 * sizeof(int64_t)));
  uint32_t bits[4];
  Philox(seed).generate(kSeedCounter, stream, bits);
  const uint64_t cudnn_seed = uint64_t(bits[0]) | (uint64_t(bits[1]) << 32);
  int64_t host_words[2];
  std::memcpy(&host_words[0], &cudnn_seed, sizeof(int64_t));
  host_words[1] = 0;  // offset: streams are separated through the seed, see the header
  // As kernel parameters: in stream order (the copy queued after an earlier launch cannot
  // overtake it on the same stream), and the stack array may go out of scope at once.
  ::megaton::cuda::upload(device_words, host_words, sizeof(host_words));
  return device_words;
}

void check_fe(fe::error_t status, const char* step, const std::string& what) {
  if (status.is_bad()) {
    throw InternalError(fmt::format("cuDNN frontend {} failed for {}: {} (error code {})", step,
                                    what, status.get_message(), int(status.get_code())));
  }
}

std::shared_ptr<fe::graph::Graph> new_graph(DType dtype) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(dtype == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

TensorAttr scalar_int64_tensor(fe::graph::Graph& graph, const char* name) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_dim({1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT64));
}

void build(fe::graph::Graph& graph, int64_t& workspace_bytes, const std::string& what) {
  check_fe(graph.build(handle(), {fe::HeurMode_t::A}), "build", what);
  check_fe(graph.get_workspace_size(workspace_bytes), "get_workspace_size", what);
}

uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

void check_device_tensor(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} must be allocated", op, name);
  MEGATON_CHECK(t.device() == Device::CUDA, "{}: {} must be a CUDA tensor", op, name);
  MEGATON_CHECK(reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0,
                "{}: {} data pointer {} is not 16-byte aligned", op, name, t.raw());
}

}  // namespace megaton::ops::cuda::sdpa
