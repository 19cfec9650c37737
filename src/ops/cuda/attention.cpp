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
// Dropout seed: ops/cuda/cudnn_sdpa.h (dropout_seed_offset).
//
// Caching. A built graph (operation graph + execution plan) is kept per shape, dtype,
// dropout probability (a compile-time attribute of the graph, so its value is part of the
// key) and direction; the first call with a new key pays cuDNN's plan build (slow: up to
// seconds), later calls only execute. The handle, workspace, lock and seed buffer are
// shared with the packed-sequence op (ops/cuda/cudnn_sdpa.h).
//
// GCC 12 reports a bogus -Wstringop-overflow (a size near 2^64) in the frontend's
// ReshapeNode, inlined here, at a libstdc++ line the header's push/pop cannot reach.
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/cudnn_sdpa.h"
#include "ops/determinism.h"

namespace megaton::ops::cuda {
namespace {

namespace fe = sdpa::fe;
using sdpa::TensorAttr;

// ---- argument checks -------------------------------------------------------------------

using AttentionDims = sdpa::Problem;

void check_device_tensor(const Tensor& t, const char* name) {
  sdpa::check_device_tensor(t, "cuda attention", name);
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
  AttentionDims d{q.dim(0), q.dim(1), q.dim(1),
                  q.dim(2), k.dim(2), q.dim(3),
                  v.dim(3), 0.0f,     sdpa::Mask::CausalTopLeft};
  d.scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(d.D));
  MEGATON_CHECK(d.Hq > 0 && d.D > 0 && d.Dv > 0,
                "cuda attention: q {} or v {} has no heads or an empty head dim",
                shape_str(q.shape()), shape_str(v.shape()));
  MEGATON_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0,
                "cuda attention: query heads {} must be a multiple of key/value heads {}", d.Hq,
                d.Hkv);
  check_shape(k, {d.B, d.Sq, d.Hkv, d.D}, "k");
  check_shape(v, {d.B, d.Sq, d.Hkv, d.Dv}, "v");
  sdpa::check_head_dims(d, "cuda attention");
  MEGATON_CHECK(dropout_p >= 0.0f && dropout_p < 1.0f,
                "cuda attention: dropout_p {} must be in [0, 1)", dropout_p);
  return d;
}

// ---- graphs ------------------------------------------------------------------------------

// One cached cuDNN graph: the built plan and the tensor handles its variant pack names.
struct SdpaGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  TensorAttr q, k, v, o, stats, seed, offset;  // forward and backward
  TensorAttr dout, dq, dk, dv;                 // backward only
  int64_t workspace_bytes = 0;
};

// (B, Sq, Skv, Hq, Hkv, D, Dv, scale bits, mask, dtype, dropout_p bits, backward,
// deterministic)
using GraphKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t,
                            int, int, uint32_t, bool, bool>;

GraphKey make_key(const AttentionDims& d, DType dtype, float dropout_p, bool backward) {
  const bool deterministic_backward = backward && deterministic();
  return GraphKey(d.B, d.Sq, d.Skv, d.Hq, d.Hkv, d.D, d.Dv, sdpa::float_bits(d.scale), int(d.mask),
                  int(dtype), sdpa::float_bits(dropout_p), backward, deterministic_backward);
}

const char* mask_name(sdpa::Mask mask) {
  switch (mask) {
    case sdpa::Mask::None:
      return "none";
    case sdpa::Mask::CausalTopLeft:
      return "causal";
    case sdpa::Mask::CausalBottomRight:
      return "causal bottom-right";
  }
  return "?";
}

std::string describe(const AttentionDims& d, DType dtype, float dropout_p, bool backward) {
  return fmt::format(
      "attention {}{} B={} Sq={} Skv={} Hq={} Hkv={} D={} Dv={} scale={} mask={} {} dropout_p={}",
      backward ? "backward" : "forward", backward && deterministic() ? " (deterministic)" : "", d.B,
      d.Sq, d.Skv, d.Hq, d.Hkv, d.D, d.Dv, d.scale, mask_name(d.mask), dtype_name(dtype),
      dropout_p);
}

// A [B, seq, heads, head_dim] tensor in cuDNN's [B, H, S, D] dim order.
TensorAttr bshd_tensor(fe::graph::Graph& graph, const char* name, int64_t B, int64_t seq,
                       int64_t heads, int64_t head_dim) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_dim({B, heads, seq, head_dim})
                          .set_stride({seq * heads * head_dim, head_dim, heads * head_dim, 1}));
}
// The same for an output of the graph.
void set_bshd_output(const TensorAttr& t, int64_t B, int64_t seq, int64_t heads, int64_t head_dim) {
  t->set_output(true)
      .set_dim({B, heads, seq, head_dim})
      .set_stride({seq * heads * head_dim, head_dim, heads * head_dim, 1});
}

// lse [B, Hq, Sq] as cuDNN's packed Stats [B, Hq, Sq, 1].
std::vector<int64_t> stats_dim(const AttentionDims& d) { return {d.B, d.Hq, d.Sq, 1}; }
std::vector<int64_t> stats_stride(const AttentionDims& d) { return {d.Hq * d.Sq, d.Sq, 1, 1}; }

// The mask on SDPA (forward) or SDPA_backward attributes.
template <typename Attributes>
void set_mask(Attributes& attributes, sdpa::Mask mask) {
  if (mask == sdpa::Mask::CausalTopLeft) attributes.set_causal_mask(true);
  if (mask == sdpa::Mask::CausalBottomRight) attributes.set_causal_mask_bottom_right(true);
}

std::unique_ptr<SdpaGraph> build_forward(const AttentionDims& d, DType dtype, float dropout_p,
                                         const std::string& what) {
  auto g = std::make_unique<SdpaGraph>();
  g->graph = sdpa::new_graph(dtype);
  fe::graph::Graph& graph = *g->graph;
  g->q = bshd_tensor(graph, "q", d.B, d.Sq, d.Hq, d.D);
  g->k = bshd_tensor(graph, "k", d.B, d.Skv, d.Hkv, d.D);
  g->v = bshd_tensor(graph, "v", d.B, d.Skv, d.Hkv, d.Dv);
  auto attributes = fe::graph::SDPA_attributes()
                        .set_name("attention_forward")
                        .set_generate_stats(true)
                        .set_attn_scale(d.scale);
  set_mask(attributes, d.mask);
  if (dropout_p > 0.0f) {
    g->seed = sdpa::scalar_int64_tensor(graph, "dropout_seed");
    g->offset = sdpa::scalar_int64_tensor(graph, "dropout_offset");
    attributes.set_dropout(dropout_p, g->seed, g->offset);
  }
  auto [o, stats] = graph.sdpa(g->q, g->k, g->v, attributes);
  set_bshd_output(o, d.B, d.Sq, d.Hq, d.Dv);
  stats->set_output(true)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dim(d))
      .set_stride(stats_stride(d));
  g->o = o;
  g->stats = stats;
  sdpa::build(*g->graph, g->workspace_bytes, what);
  return g;
}

std::unique_ptr<SdpaGraph> build_backward(const AttentionDims& d, DType dtype, float dropout_p,
                                          const std::string& what) {
  auto g = std::make_unique<SdpaGraph>();
  g->graph = sdpa::new_graph(dtype);
  fe::graph::Graph& graph = *g->graph;
  g->q = bshd_tensor(graph, "q", d.B, d.Sq, d.Hq, d.D);
  g->k = bshd_tensor(graph, "k", d.B, d.Skv, d.Hkv, d.D);
  g->v = bshd_tensor(graph, "v", d.B, d.Skv, d.Hkv, d.Dv);
  g->o = bshd_tensor(graph, "out", d.B, d.Sq, d.Hq, d.Dv);
  g->dout = bshd_tensor(graph, "dout", d.B, d.Sq, d.Hq, d.Dv);
  g->stats = graph.tensor(fe::graph::Tensor_attributes()
                              .set_name("lse")
                              .set_dim(stats_dim(d))
                              .set_stride(stats_stride(d))
                              .set_data_type(fe::DataType_t::FLOAT));
  auto attributes =
      fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(d.scale);
  set_mask(attributes, d.mask);
  if (deterministic()) attributes.set_deterministic_algorithm(true);
  if (dropout_p > 0.0f) {
    g->seed = sdpa::scalar_int64_tensor(graph, "dropout_seed");
    g->offset = sdpa::scalar_int64_tensor(graph, "dropout_offset");
    attributes.set_dropout(dropout_p, g->seed, g->offset);
  }
  auto [dq, dk, dv] = graph.sdpa_backward(g->q, g->k, g->v, g->o, g->dout, g->stats, attributes);
  set_bshd_output(dq, d.B, d.Sq, d.Hq, d.D);
  set_bshd_output(dk, d.B, d.Skv, d.Hkv, d.D);
  set_bshd_output(dv, d.B, d.Skv, d.Hkv, d.Dv);
  g->dq = dq;
  g->dk = dk;
  g->dv = dv;
  sdpa::build(*g->graph, g->workspace_bytes, what);
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
    int64_t* words = sdpa::dropout_seed_offset(seed, stream);
    pack[g.seed] = words;
    pack[g.offset] = words + 1;
  }
  void* ws = sdpa::workspace(g.workspace_bytes);
  fe::error_t status = g.graph->execute(sdpa::handle(), pack, ws);
  if (status.is_bad()) sdpa::check_fe(status, "execute", describe(d, dtype, dropout_p, backward));
}

}  // namespace

namespace sdpa {

void check_head_dims(const Problem& d, const char* op) {
  // cuDNN's fused kernels: head dims multiples of 8 (16-byte rows), at most 256 on Hopper
  // with cuDNN 9.14; the frontend reports the exact limit when building.
  MEGATON_CHECK(d.D % 8 == 0 && d.Dv % 8 == 0,
                "{}: head dims {} and {} must be multiples of 8 for cuDNN", op, d.D, d.Dv);
}

void forward(const Problem& d, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
             Tensor& stats, float dropout_p, uint64_t seed, uint64_t stream) {
  if (d.B == 0 || d.Sq == 0) return;
  std::lock_guard<std::mutex> lock(state_mutex());
  const SdpaGraph& g = cached_graph(d, q.dtype(), dropout_p, /*backward=*/false);
  std::unordered_map<TensorAttr, void*> pack = {
      {g.q, q.raw()}, {g.k, k.raw()}, {g.v, v.raw()}, {g.o, out.raw()}, {g.stats, stats.raw()}};
  execute(g, pack, d, q.dtype(), dropout_p, seed, stream, /*backward=*/false);
}

void backward(const Problem& d, const Tensor& dout, const Tensor& q, const Tensor& k,
              const Tensor& v, const Tensor& out, const Tensor& stats, Tensor& dq, Tensor& dk,
              Tensor& dv, float dropout_p, uint64_t seed, uint64_t stream) {
  if (d.B == 0 || d.Sq == 0) return;
  std::lock_guard<std::mutex> lock(state_mutex());
  const SdpaGraph& g = cached_graph(d, q.dtype(), dropout_p, /*backward=*/true);
  std::unordered_map<TensorAttr, void*> pack = {
      {g.q, q.raw()},   {g.k, k.raw()},       {g.v, v.raw()},
      {g.o, out.raw()}, {g.dout, dout.raw()}, {g.stats, stats.raw()},
      {g.dq, dq.raw()}, {g.dk, dk.raw()},     {g.dv, dv.raw()}};
  execute(g, pack, d, q.dtype(), dropout_p, seed, stream, /*backward=*/true);
}

}  // namespace sdpa

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       float dropout_p, uint64_t seed, uint64_t stream, float softmax_scale) {
  const AttentionDims d = check_qkv(q, k, v, dropout_p, softmax_scale);
  check_half_tensor(out, q.dtype(), "out");
  check_device_tensor(lse, "lse");
  MEGATON_CHECK(lse.dtype() == DType::F32, "cuda attention: lse must be F32, got {}",
                dtype_name(lse.dtype()));
  check_shape(out, {d.B, d.Sq, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.B, d.Hq, d.Sq}, "lse");
  sdpa::forward(d, q, k, v, out, lse, dropout_p, seed, stream);
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
  check_shape(dout, {d.B, d.Sq, d.Hq, d.Dv}, "dout");
  check_shape(out, {d.B, d.Sq, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.B, d.Hq, d.Sq}, "lse");
  check_shape(dq, q.shape(), "dq");
  check_shape(dk, k.shape(), "dk");
  check_shape(dv, v.shape(), "dv");
  sdpa::backward(d, dout, q, k, v, out, lse, dq, dk, dv, dropout_p, seed, stream);
}

}  // namespace megaton::ops::cuda
