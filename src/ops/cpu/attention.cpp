// Causal self-attention with grouped-query heads and probability dropout, CPU fp32 reference.
//
// One task per (batch, query head), each running ops/cpu/attention_head.h's kernel over its
// sequence: row blocks of queries multiplied only against the keys at or before them, and a
// backward that recomputes the probabilities from the saved lse.
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "core/rng.h"
#include "ops/cpu/attention_head.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

using cpu_attention::check_f32_cpu;
using cpu_attention::HeadDropout;
using cpu_attention::HeadGeometry;
using cpu_attention::HeadScratch;

constexpr const char* kOp = "attention";

struct AttentionDims {
  int64_t B, S, Hq, Hkv, D, Dv;  // D: q and k head dim; Dv: v and out head dim
  int64_t group() const { return Hq / Hkv; }
};

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  cpu_attention::check_shape(t, want, kOp, name);
}

AttentionDims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, float dropout_p) {
  check_f32_cpu(q, kOp, "q");
  check_f32_cpu(k, kOp, "k");
  check_f32_cpu(v, kOp, "v");
  MEGATON_CHECK(q.ndim() == 4, "attention: q must be [B, S, Hq, D], got {}", shape_str(q.shape()));
  MEGATON_CHECK(k.ndim() == 4, "attention: k must be [B, S, Hkv, D], got {}", shape_str(k.shape()));
  MEGATON_CHECK(v.ndim() == 4, "attention: v must be [B, S, Hkv, Dv], got {}",
                shape_str(v.shape()));
  AttentionDims d{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3), v.dim(3)};
  MEGATON_CHECK(d.Hq > 0 && d.D > 0 && d.Dv > 0,
                "attention: q {} or v {} has no heads or an empty head dim", shape_str(q.shape()),
                shape_str(v.shape()));
  MEGATON_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0,
                "attention: query heads {} must be a multiple of key/value heads {}", d.Hq, d.Hkv);
  check_shape(k, {d.B, d.S, d.Hkv, d.D}, "k");
  check_shape(v, {d.B, d.S, d.Hkv, d.Dv}, "v");
  MEGATON_CHECK(d.S <= INT_MAX && d.Hq * d.D <= INT_MAX && d.Hq * d.Dv <= INT_MAX,
                "attention: S {} or Hq * D {} exceed the 32-bit BLAS interface", d.S,
                d.Hq * std::max(d.D, d.Dv));
  MEGATON_CHECK(dropout_p >= 0.0f && dropout_p < 1.0f, "attention: dropout_p {} must be in [0, 1)",
                dropout_p);
  return d;
}

// Batch b's sequence of one head: rows strided by the [B, S, heads, D] layouts, lse [B, Hq, S]
// contiguous per head.
HeadGeometry geometry(const AttentionDims& d, float softmax_scale) {
  const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(d.D));
  return {d.S, d.D, d.Dv, d.Hq * d.D, d.Hkv * d.D, d.Hkv * d.Dv, d.Hq * d.Dv, 1, scale};
}

// The dropout mask on the probabilities, regenerated identically in forward and backward:
// probability (b, h, i, j) is kept when Philox(seed).uniform(stream, index) >= p, index =
// ((b * Hq + h) * S + i) * S + j (the rule of ops::dropout_forward).
HeadDropout head_dropout(const Philox& philox, uint64_t stream, float p, int64_t bh, int64_t S) {
  return {&philox, stream, p, uint64_t(bh) * uint64_t(S) * uint64_t(S), uint64_t(S)};
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       float dropout_p, uint64_t seed, uint64_t stream, float softmax_scale) {
  MEGATON_CUDA_DISPATCH(
      q, cuda::attention_forward(q, k, v, out, lse, dropout_p, seed, stream, softmax_scale));
  const AttentionDims d = check_qkv(q, k, v, dropout_p);
  check_f32_cpu(out, kOp, "out");
  check_f32_cpu(lse, kOp, "lse");
  check_shape(out, {d.B, d.S, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.B, d.Hq, d.S}, "lse");
  if (d.B == 0 || d.S == 0) return;

  const HeadGeometry g = geometry(d, softmax_scale);
  const Philox philox(seed);
  const float *qp = q.f32(), *kp = k.f32(), *vp = v.f32();
  float *op = out.f32(), *lp = lse.f32();
  const int64_t S = d.S;
  cpu_attention::SingleThreadedBlas single_threaded_blas;
  const bool parallel = d.B * d.Hq * S * S * d.D >= cpu_attention::kParallelMinWork;

#pragma omp parallel if (parallel)
  {
    HeadScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.Hq; ++bh) {
      const int64_t b = bh / d.Hq, h = bh % d.Hq, hkv = h / d.group();
      cpu_attention::forward_head(
          g, qp + b * S * g.q_row + h * d.D, kp + b * S * g.k_row + hkv * d.D,
          vp + b * S * g.v_row + hkv * d.Dv, op + b * S * g.o_row + h * d.Dv, lp + bh * S,
          head_dropout(philox, stream, dropout_p, bh, S), scratch);
    }
  }
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                        float dropout_p, uint64_t seed, uint64_t stream, float softmax_scale) {
  MEGATON_CUDA_DISPATCH(dout, cuda::attention_backward(dout, q, k, v, out, lse, dq, dk, dv,
                                                       dropout_p, seed, stream, softmax_scale));
  const AttentionDims d = check_qkv(q, k, v, dropout_p);
  check_f32_cpu(dout, kOp, "dout");
  check_f32_cpu(out, kOp, "out");
  check_f32_cpu(lse, kOp, "lse");
  check_f32_cpu(dq, kOp, "dq");
  check_f32_cpu(dk, kOp, "dk");
  check_f32_cpu(dv, kOp, "dv");
  check_shape(dout, {d.B, d.S, d.Hq, d.Dv}, "dout");
  check_shape(out, {d.B, d.S, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.B, d.Hq, d.S}, "lse");
  check_shape(dq, q.shape(), "dq");
  check_shape(dk, k.shape(), "dk");
  check_shape(dv, v.shape(), "dv");
  if (d.B == 0 || d.S == 0) return;

  const HeadGeometry g = geometry(d, softmax_scale);
  const Philox philox(seed);
  const int64_t S = d.S, D = d.D, Dv = d.Dv;
  const float *qp = q.f32(), *kp = k.f32(), *vp = v.f32(), *dop = dout.f32(), *op = out.f32(),
              *lp = lse.f32();
  float *dqp = dq.f32(), *dkp = dk.f32(), *dvp = dv.f32();
  const int64_t group = d.group();
  // With GQA (group > 1) each query head accumulates its own dk, dv in [B, Hq, S, D]
  // scratch, summed into the shared kv head afterwards, so tasks never write the same
  // memory. Without it, each task owns its kv head and accumulates in place.
  std::vector<float> dk_heads, dv_heads;
  if (group > 1) {
    dk_heads.resize(d.B * d.Hq * S * D);
    dv_heads.resize(d.B * d.Hq * S * Dv);
  }
  cpu_attention::SingleThreadedBlas single_threaded_blas;
  const bool parallel = d.B * d.Hq * S * S * d.D >= cpu_attention::kParallelMinWork;

#pragma omp parallel if (parallel)
  {
    HeadScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.Hq; ++bh) {
      const int64_t b = bh / d.Hq, h = bh % d.Hq, hkv = h / group;
      float* dk_h = group > 1 ? dk_heads.data() + bh * S * D : dkp + b * S * g.k_row + hkv * D;
      float* dv_h = group > 1 ? dv_heads.data() + bh * S * Dv : dvp + b * S * g.v_row + hkv * Dv;
      cpu_attention::backward_head(g, qp + b * S * g.q_row + h * D, kp + b * S * g.k_row + hkv * D,
                                   vp + b * S * g.v_row + hkv * Dv, op + b * S * g.o_row + h * Dv,
                                   dop + b * S * g.o_row + h * Dv, lp + bh * S,
                                   dqp + b * S * g.q_row + h * D, dk_h, group > 1 ? D : g.k_row,
                                   dv_h, group > 1 ? Dv : g.v_row,
                                   head_dropout(philox, stream, dropout_p, bh, S), scratch);
    }
    if (group > 1) {
      cpu_attention::sum_query_groups(dk_heads.data(), d.B, S, d.Hq, d.Hkv, D, dkp);
      cpu_attention::sum_query_groups(dv_heads.data(), d.B, S, d.Hq, d.Hkv, Dv, dvp);
    }
  }
}

}  // namespace megaton::ops
