// Causal GQA attention on the GPU: cuDNN's fused flash attention (frontend SDPA graphs).
//
// Host code only, compiled by the C++ compiler: the cuDNN frontend is a large header-only
// library, slow to push through nvcc, and needs no device code of ours.
//
// Layout. ops.h keeps attention tensors as [B, S, heads, D]. cuDNN's SDPA names its dims
// [B, H, S, D] and takes arbitrary strides, so the same memory is described as
// dims {B, H, S, D} with strides {S*H*D, D, H*D, 1}: no transpose is ever made. lse
// [B, Hq, S] is cuDNN's Stats output [B, Hq, S, 1], packed (strides {Hq*S, S, 1, 1}),
// which is the only Stats layout cuDNN below 9.26 reads back correctly in backward.
//
// Semantics (cuDNN frontend SDPA_attributes, 1.32):
//   - scores scale: attn_scale = softmax_scale (default 1/sqrt(D)), applied before the
//     mask and softmax; q and k have head dim D, v and out Dv (cuDNN takes d_qk != d_v,
//     e.g. MLA's 192 / 128, on Hopper from 9.13 for backward);
//   - causal mask: set_causal_mask (top-left diagonal, right bound 0): query i sees keys
//     j <= i, the ops.h mask (q and kv have the same S here, so top-left = bottom-right);
//   - Stats = max + ln(sum exp(s - max)) of the scaled, masked scores, in natural log
//     (stats_use_log2 is left off), before dropout: exactly ops.h's lse;
//   - GQA: k, v carry Hkv heads and cuDNN maps query head h to kv head h / (Hq / Hkv),
//     as ops.h does; dk, dv come back summed over each query group;
//   - dropout: cuDNN's own Philox Bernoulli mask on the probabilities, scaled by
//     1 / (1 - p). It is NOT the mask of the CPU op (Philox(seed).uniform(stream, index)):
//     same distribution, different bits. Forward and backward on the GPU regenerate the
//     same mask from the same (seed, stream), which is all training needs; a CPU forward
//     with a GPU backward (or the reverse) under dropout is not supported;
//   - determinism: the forward is bitwise reproducible; the backward is not guaranteed to
//     be (cuDNN accumulates dq in fp32 with atomics) unless ops::deterministic()
//     (--deterministic-mode), which builds it with set_deterministic_algorithm: slower,
//     and an error naming the shape where this cuDNN has no such engine.
//
// Dropout seed. cuDNN's Philox takes a 64-bit seed and a 64-bit offset (a position in the
// counter sequence). Mapping our `stream` to the offset would make stream s+1 a shifted
// copy of stream s (correlated masks between the layers that use consecutive streams), so
// the stream is folded into the seed instead: cudnn_seed = Philox(seed) drawn at counter
// (kSeedCounter, stream), offset 0. Distinct (seed, stream) pairs get unrelated keys.
//
// Caching. A built graph (operation graph + execution plan) is kept per shape, dtype,
// dropout probability (a compile-time attribute of the graph, so its value is part of the
// key) and direction; the first call with a new key pays cuDNN's plan build (slow: up to
// seconds), later calls only execute. One cudnnHandle bound to megaton::cuda::stream(); one
// workspace buffer grown to the largest graph's need; one small device buffer for the seed and
// offset.
#include <cudnn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wall"
#pragma GCC diagnostic ignored "-Wextra"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wunused-variable"
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/rng.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/determinism.h"

// MEGATON_CUDNN_CHECK(cudnnSetStream(...)): throws InternalError naming the call, the file
// and line, and cuDNN's status string.
#define MEGATON_CUDNN_CHECK(call)                                                     \
  do {                                                                                \
    cudnnStatus_t megaton_status_ = (call);                                           \
    if (megaton_status_ != CUDNN_STATUS_SUCCESS) {                                    \
      throw ::megaton::InternalError(                                                 \
          ::fmt::format("{}:{}: {} failed: {} ({})", __FILE__, __LINE__, #call,       \
                        cudnnGetErrorString(megaton_status_), int(megaton_status_))); \
    }                                                                                 \
  } while (0)

namespace megaton::ops::cuda {
namespace {

namespace fe = cudnn_frontend;
using TensorAttr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Philox counter (low word) at which cuDNN's dropout seed is drawn: the last one, which no
// element index of another op's draw at the same (seed, stream) can reach.
constexpr uint64_t kSeedCounter = ~uint64_t(0);

// ---- argument checks -------------------------------------------------------------------

struct AttentionDims {
  int64_t B, S, Hq, Hkv, D, Dv;  // D: q and k head dim; Dv: v and out head dim
  float scale;                   // the scores' scale
};

void check_device_tensor(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "cuda attention: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CUDA, "cuda attention: {} must be a CUDA tensor", name);
  // cuDNN's SDPA kernels load with 16-byte vectors and TMA; the frontend also checks this
  // at execute, but here the message names the tensor.
  MEGATON_CHECK(reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0,
                "cuda attention: {} data pointer {} is not 16-byte aligned", name, t.raw());
}

void check_half_tensor(const Tensor& t, DType dtype, const char* name) {
  check_device_tensor(t, name);
  MEGATON_CHECK(t.dtype() == dtype, "cuda attention: {} must be {} like q, got {}", name,
                dtype_name(dtype), dtype_name(t.dtype()));
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  MEGATON_CHECK(t.shape() == want, "cuda attention: {} has shape {}, expected {}", name,
                shape_str(t.shape()), shape_str(want));
}

AttentionDims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, float dropout_p,
                        float softmax_scale) {
  check_device_tensor(q, "q");
  MEGATON_CHECK(q.dtype() == DType::BF16 || q.dtype() == DType::F16,
                "cuda attention: q must be BF16 or F16 (cuDNN fused attention), got {}",
                dtype_name(q.dtype()));
  check_half_tensor(k, q.dtype(), "k");
  check_half_tensor(v, q.dtype(), "v");
  MEGATON_CHECK(q.ndim() == 4, "cuda attention: q must be [B, S, Hq, D], got {}",
                shape_str(q.shape()));
  MEGATON_CHECK(k.ndim() == 4, "cuda attention: k must be [B, S, Hkv, D], got {}",
                shape_str(k.shape()));
  MEGATON_CHECK(v.ndim() == 4, "cuda attention: v must be [B, S, Hkv, Dv], got {}",
                shape_str(v.shape()));
  AttentionDims d{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3), v.dim(3), 0.0f};
  d.scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(d.D));
  MEGATON_CHECK(d.Hq > 0 && d.D > 0 && d.Dv > 0,
                "cuda attention: q {} or v {} has no heads or an empty head dim",
                shape_str(q.shape()), shape_str(v.shape()));
  MEGATON_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0,
                "cuda attention: query heads {} must be a multiple of key/value heads {}", d.Hq,
                d.Hkv);
  check_shape(k, {d.B, d.S, d.Hkv, d.D}, "k");
  check_shape(v, {d.B, d.S, d.Hkv, d.Dv}, "v");
  // cuDNN's fused kernels: head dims multiples of 8 (16-byte rows), at most 256 on Hopper
  // with cuDNN 9.14; the frontend reports the exact limit when building.
  MEGATON_CHECK(d.D % 8 == 0 && d.Dv % 8 == 0,
                "cuda attention: head dims {} and {} must be multiples of 8 for cuDNN", d.D, d.Dv);
  MEGATON_CHECK(dropout_p >= 0.0f && dropout_p < 1.0f,
                "cuda attention: dropout_p {} must be in [0, 1)", dropout_p);
  return d;
}

// ---- cuDNN state -----------------------------------------------------------------------

cudnnHandle_t handle() {
  static cudnnHandle_t h = [] {
    cudnnHandle_t created;
    MEGATON_CUDNN_CHECK(cudnnCreate(&created));
    // Every Megaton kernel runs on the one compute stream; so do cuDNN's.
    MEGATON_CUDNN_CHECK(cudnnSetStream(created, ::megaton::cuda::stream()));
    return created;
  }();
  return h;
}

// Everything below is guarded by one mutex: graph building and the shared buffers are
// not reentrant (the training step is single-threaded; the lock makes that safe to forget).
std::mutex& state_mutex() {
  static std::mutex m;
  return m;
}

// The workspace, grown to the largest need seen and never shrunk. Reuse is safe without
// events: every use is ordered on the single compute stream.
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

// [seed, offset] as two int64 on the device (cuDNN reads its Philox seed and offset from
// device tensors). Rewritten, in stream order, before every dropout launch: the copy
// queued after an earlier launch cannot overtake it on the same stream.
int64_t* dropout_seed_offset(uint64_t seed, uint64_t stream) {
  static int64_t* device_words =
      static_cast<int64_t*>(::megaton::cuda::device_allocate(2 * sizeof(int64_t)));
  uint32_t bits[4];
  Philox(seed).generate(kSeedCounter, stream, bits);
  const uint64_t cudnn_seed = uint64_t(bits[0]) | (uint64_t(bits[1]) << 32);
  int64_t host_words[2];
  std::memcpy(&host_words[0], &cudnn_seed, sizeof(int64_t));
  host_words[1] = 0;  // offset: streams are separated through the seed, see the file comment
  // As kernel parameters: in stream order, and the stack array may go out of scope at once.
  ::megaton::cuda::upload(device_words, host_words, sizeof(host_words));
  return device_words;
}

void check_fe(fe::error_t status, const char* step, const std::string& what) {
  if (status.is_bad()) {
    throw InternalError(fmt::format("cuDNN frontend {} failed for {}: {} (error code {})", step,
                                    what, status.get_message(), int(status.get_code())));
  }
}

// ---- graphs ------------------------------------------------------------------------------

// One cached cuDNN graph: the built plan and the tensor handles its variant pack names.
struct SdpaGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  TensorAttr q, k, v, o, stats, seed, offset;  // forward and backward
  TensorAttr dout, dq, dk, dv;                 // backward only
  int64_t workspace_bytes = 0;
};

// (B, S, Hq, Hkv, D, Dv, scale bits, dtype, dropout_p bits, backward, deterministic)
using GraphKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t, int,
                            uint32_t, bool, bool>;

uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

GraphKey make_key(const AttentionDims& d, DType dtype, float dropout_p, bool backward) {
  return {d.B,        d.S,      d.Hq,     d.Hkv, d.D, d.Dv, float_bits(d.scale), int(dtype),
          float_bits(dropout_p), backward, backward && deterministic()};
}

std::string describe(const AttentionDims& d, DType dtype, float dropout_p, bool backward) {
  return fmt::format("attention {}{} B={} S={} Hq={} Hkv={} D={} Dv={} scale={} {} dropout_p={}",
                     backward ? "backward" : "forward",
                     backward && deterministic() ? " (deterministic)" : "", d.B, d.S, d.Hq,
                     d.Hkv, d.D, d.Dv, d.scale, dtype_name(dtype), dropout_p);
}

// A [B, S, heads, head_dim] tensor in cuDNN's [B, H, S, D] dim order.
TensorAttr bshd_tensor(fe::graph::Graph& graph, const char* name, const AttentionDims& d,
                       int64_t heads, int64_t head_dim) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_dim({d.B, heads, d.S, head_dim})
                          .set_stride({d.S * heads * head_dim, head_dim, heads * head_dim, 1}));
}

// lse [B, Hq, S] as cuDNN's packed Stats [B, Hq, S, 1].
std::vector<int64_t> stats_dim(const AttentionDims& d) { return {d.B, d.Hq, d.S, 1}; }
std::vector<int64_t> stats_stride(const AttentionDims& d) { return {d.Hq * d.S, d.S, 1, 1}; }

TensorAttr scalar_int64_tensor(fe::graph::Graph& graph, const char* name) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_dim({1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT64));
}

std::shared_ptr<fe::graph::Graph> new_graph(DType dtype) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(dtype == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

void build(SdpaGraph& g, const std::string& what) {
  check_fe(g.graph->build(handle(), {fe::HeurMode_t::A}), "build", what);
  check_fe(g.graph->get_workspace_size(g.workspace_bytes), "get_workspace_size", what);
}

std::unique_ptr<SdpaGraph> build_forward(const AttentionDims& d, DType dtype, float dropout_p,
                                         const std::string& what) {
  auto g = std::make_unique<SdpaGraph>();
  g->graph = new_graph(dtype);
  fe::graph::Graph& graph = *g->graph;
  g->q = bshd_tensor(graph, "q", d, d.Hq, d.D);
  g->k = bshd_tensor(graph, "k", d, d.Hkv, d.D);
  g->v = bshd_tensor(graph, "v", d, d.Hkv, d.Dv);
  auto attributes = fe::graph::SDPA_attributes()
                        .set_name("attention_forward")
                        .set_generate_stats(true)
                        .set_causal_mask(true)
                        .set_attn_scale(d.scale);
  if (dropout_p > 0.0f) {
    g->seed = scalar_int64_tensor(graph, "dropout_seed");
    g->offset = scalar_int64_tensor(graph, "dropout_offset");
    attributes.set_dropout(dropout_p, g->seed, g->offset);
  }
  auto [o, stats] = graph.sdpa(g->q, g->k, g->v, attributes);
  o->set_output(true)
      .set_dim({d.B, d.Hq, d.S, d.Dv})
      .set_stride({d.S * d.Hq * d.Dv, d.Dv, d.Hq * d.Dv, 1});
  stats->set_output(true)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dim(d))
      .set_stride(stats_stride(d));
  g->o = o;
  g->stats = stats;
  build(*g, what);
  return g;
}

std::unique_ptr<SdpaGraph> build_backward(const AttentionDims& d, DType dtype, float dropout_p,
                                          const std::string& what) {
  auto g = std::make_unique<SdpaGraph>();
  g->graph = new_graph(dtype);
  fe::graph::Graph& graph = *g->graph;
  g->q = bshd_tensor(graph, "q", d, d.Hq, d.D);
  g->k = bshd_tensor(graph, "k", d, d.Hkv, d.D);
  g->v = bshd_tensor(graph, "v", d, d.Hkv, d.Dv);
  g->o = bshd_tensor(graph, "out", d, d.Hq, d.Dv);
  g->dout = bshd_tensor(graph, "dout", d, d.Hq, d.Dv);
  g->stats = graph.tensor(fe::graph::Tensor_attributes()
                              .set_name("lse")
                              .set_dim(stats_dim(d))
                              .set_stride(stats_stride(d))
                              .set_data_type(fe::DataType_t::FLOAT));
  auto attributes = fe::graph::SDPA_backward_attributes()
                        .set_name("attention_backward")
                        .set_causal_mask(true)
                        .set_attn_scale(d.scale);
  if (deterministic()) attributes.set_deterministic_algorithm(true);
  if (dropout_p > 0.0f) {
    g->seed = scalar_int64_tensor(graph, "dropout_seed");
    g->offset = scalar_int64_tensor(graph, "dropout_offset");
    attributes.set_dropout(dropout_p, g->seed, g->offset);
  }
  auto [dq, dk, dv] = graph.sdpa_backward(g->q, g->k, g->v, g->o, g->dout, g->stats, attributes);
  dq->set_output(true)
      .set_dim({d.B, d.Hq, d.S, d.D})
      .set_stride({d.S * d.Hq * d.D, d.D, d.Hq * d.D, 1});
  dk->set_output(true)
      .set_dim({d.B, d.Hkv, d.S, d.D})
      .set_stride({d.S * d.Hkv * d.D, d.D, d.Hkv * d.D, 1});
  dv->set_output(true)
      .set_dim({d.B, d.Hkv, d.S, d.Dv})
      .set_stride({d.S * d.Hkv * d.Dv, d.Dv, d.Hkv * d.Dv, 1});
  g->dq = dq;
  g->dk = dk;
  g->dv = dv;
  build(*g, what);
  return g;
}

// The cached graph for this call, built on first use. Caller holds state_mutex().
const SdpaGraph& cached_graph(const AttentionDims& d, DType dtype, float dropout_p, bool backward) {
  // Never destroyed: destroying cuDNN descriptors during static teardown, after the CUDA
  // runtime may have shut down, can fail or crash at exit.
  static auto* cache = new std::map<GraphKey, std::unique_ptr<SdpaGraph>>();
  const GraphKey key = make_key(d, dtype, dropout_p, backward);
  auto it = cache->find(key);
  if (it == cache->end()) {
    const std::string what = describe(d, dtype, dropout_p, backward);
    auto g = backward ? build_backward(d, dtype, dropout_p, what)
                      : build_forward(d, dtype, dropout_p, what);
    it = cache->emplace(key, std::move(g)).first;
  }
  return *it->second;
}

void execute(const SdpaGraph& g, std::unordered_map<TensorAttr, void*>& pack,
             const AttentionDims& d, DType dtype, float dropout_p, uint64_t seed, uint64_t stream,
             bool backward) {
  if (dropout_p > 0.0f) {
    int64_t* words = dropout_seed_offset(seed, stream);
    pack[g.seed] = words;
    pack[g.offset] = words + 1;
  }
  void* ws = workspace(g.workspace_bytes);
  fe::error_t status = g.graph->execute(handle(), pack, ws);
  if (status.is_bad()) check_fe(status, "execute", describe(d, dtype, dropout_p, backward));
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       float dropout_p, uint64_t seed, uint64_t stream, float softmax_scale) {
  const AttentionDims d = check_qkv(q, k, v, dropout_p, softmax_scale);
  check_half_tensor(out, q.dtype(), "out");
  check_device_tensor(lse, "lse");
  MEGATON_CHECK(lse.dtype() == DType::F32, "cuda attention: lse must be F32, got {}",
                dtype_name(lse.dtype()));
  check_shape(out, {d.B, d.S, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.B, d.Hq, d.S}, "lse");
  if (d.B == 0 || d.S == 0) return;

  std::lock_guard<std::mutex> lock(state_mutex());
  const SdpaGraph& g = cached_graph(d, q.dtype(), dropout_p, /*backward=*/false);
  std::unordered_map<TensorAttr, void*> pack = {
      {g.q, q.raw()}, {g.k, k.raw()}, {g.v, v.raw()}, {g.o, out.raw()}, {g.stats, lse.raw()}};
  execute(g, pack, d, q.dtype(), dropout_p, seed, stream, /*backward=*/false);
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                        float dropout_p, uint64_t seed, uint64_t stream, float softmax_scale) {
  const AttentionDims d = check_qkv(q, k, v, dropout_p, softmax_scale);
  check_half_tensor(dout, q.dtype(), "dout");
  check_half_tensor(out, q.dtype(), "out");
  check_half_tensor(dq, q.dtype(), "dq");
  check_half_tensor(dk, q.dtype(), "dk");
  check_half_tensor(dv, q.dtype(), "dv");
  check_device_tensor(lse, "lse");
  MEGATON_CHECK(lse.dtype() == DType::F32, "cuda attention: lse must be F32, got {}",
                dtype_name(lse.dtype()));
  check_shape(dout, {d.B, d.S, d.Hq, d.Dv}, "dout");
  check_shape(out, {d.B, d.S, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.B, d.Hq, d.S}, "lse");
  check_shape(dq, q.shape(), "dq");
  check_shape(dk, k.shape(), "dk");
  check_shape(dv, v.shape(), "dv");
  if (d.B == 0 || d.S == 0) return;

  std::lock_guard<std::mutex> lock(state_mutex());
  const SdpaGraph& g = cached_graph(d, q.dtype(), dropout_p, /*backward=*/true);
  std::unordered_map<TensorAttr, void*> pack = {
      {g.q, q.raw()},   {g.k, k.raw()},       {g.v, v.raw()},
      {g.o, out.raw()}, {g.dout, dout.raw()}, {g.stats, lse.raw()},
      {g.dq, dq.raw()}, {g.dk, dk.raw()},     {g.dv, dv.raw()}};
  execute(g, pack, d, q.dtype(), dropout_p, seed, stream, /*backward=*/true);
}

}  // namespace megaton::ops::cuda
