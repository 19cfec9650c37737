// Causal attention over packed sequences (ops/attention_varlen.h), CPU fp32 reference.
//
// One task per (sequence, query head), running ops/cpu/attention_head.h's kernel, the dense
// op's, on the sequence's rows: the [T, heads, D] layout is the dense [B, S, heads, D] one
// with B = 1, so a sequence is a run of rows with the same strides; only lse ([T, Hq],
// token-major) and the dropout index differ.
#include "ops/attention_varlen.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "ops/cpu/attention_head.h"
#include "ops/dispatch.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/attention_varlen.h"
#endif

namespace megaton::ops {
namespace {

using cpu_attention::check_f32_cpu;
using cpu_attention::HeadDropout;
using cpu_attention::HeadGeometry;
using cpu_attention::HeadScratch;

constexpr const char* kOp = "attention_varlen";

struct VarlenDims {
  int64_t T, Hq, Hkv, D, Dv;  // D: q and k head dim; Dv: v and out head dim
  int64_t group() const { return Hq / Hkv; }
};

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  cpu_attention::check_shape(t, want, kOp, name);
}

VarlenDims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, float dropout_p) {
  check_f32_cpu(q, kOp, "q");
  check_f32_cpu(k, kOp, "k");
  check_f32_cpu(v, kOp, "v");
  MEGATON_CHECK(q.ndim() == 3, "{}: q must be [T, Hq, Dqk], got {}", kOp, shape_str(q.shape()));
  MEGATON_CHECK(k.ndim() == 3, "{}: k must be [T, Hkv, Dqk], got {}", kOp, shape_str(k.shape()));
  MEGATON_CHECK(v.ndim() == 3, "{}: v must be [T, Hkv, Dv], got {}", kOp, shape_str(v.shape()));
  const VarlenDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2)};
  MEGATON_CHECK(d.Hq > 0 && d.D > 0 && d.Dv > 0,
                "{}: q {} or v {} has no heads or an empty head dim", kOp, shape_str(q.shape()),
                shape_str(v.shape()));
  MEGATON_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0,
                "{}: query heads {} must be a multiple of key/value heads {}", kOp, d.Hq, d.Hkv);
  check_shape(k, {d.T, d.Hkv, d.D}, "k");
  check_shape(v, {d.T, d.Hkv, d.Dv}, "v");
  MEGATON_CHECK(d.T <= INT_MAX && d.Hq * std::max(d.D, d.Dv) <= INT_MAX,
                "{}: T {} or Hq * D {} exceed the 32-bit BLAS interface", kOp, d.T,
                d.Hq * std::max(d.D, d.Dv));
  MEGATON_CHECK(dropout_p >= 0.0f && dropout_p < 1.0f, "{}: dropout_p {} must be in [0, 1)", kOp,
                dropout_p);
  return d;
}

// The sequence starts c0..cN, checked against ops/attention_varlen.h's rules.
std::vector<int64_t> check_cu_seqlens(const Tensor& cu_seqlens, int64_t T, int64_t max_seqlen) {
  MEGATON_CHECK(cu_seqlens.defined() && cu_seqlens.device() == Device::CPU,
                "{}: cu_seqlens must be an allocated CPU tensor", kOp);
  MEGATON_CHECK(
      cu_seqlens.dtype() == DType::I32 && cu_seqlens.ndim() == 1 && cu_seqlens.dim(0) >= 2,
      "{}: cu_seqlens must be I32 [N + 1] with N >= 1, got {} {}", kOp,
      dtype_name(cu_seqlens.dtype()), shape_str(cu_seqlens.shape()));
  MEGATON_CHECK(T == 0 || max_seqlen >= 1, "{}: max_seqlen {} must be at least 1", kOp, max_seqlen);
  const int32_t* c = cu_seqlens.i32();
  const int64_t N = cu_seqlens.dim(0) - 1;
  MEGATON_CHECK(c[0] == 0 && c[N] == T, "{}: cu_seqlens must run from 0 to T = {}, got {} .. {}",
                kOp, T, c[0], c[N]);
  std::vector<int64_t> starts(size_t(N + 1));
  for (int64_t n = 0; n <= N; ++n) {
    starts[n] = c[n];
    if (n == 0) continue;
    const int64_t length = int64_t(c[n]) - c[n - 1];
    MEGATON_CHECK(length >= 0 && length <= max_seqlen,
                  "{}: sequence {} = rows [{}, {}) has length {}, expected 0 .. max_seqlen {}", kOp,
                  n - 1, c[n - 1], c[n], length, max_seqlen);
  }
  return starts;
}

// Sequence [start, start + S) of one head: rows strided by the [T, heads, D] layouts, lse
// [T, Hq] token-major.
HeadGeometry geometry(const VarlenDims& d, int64_t S, float softmax_scale) {
  const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(d.D));
  return {S, d.D, d.Dv, d.Hq * d.D, d.Hkv * d.D, d.Hkv * d.Dv, d.Hq * d.Dv, d.Hq, scale};
}

// The dense op's mask for B = 1, S = T (ops/attention_varlen.h): (h, t, u) at index
// (h * T + t) * T + u, with t = start + i and u = start + j.
HeadDropout head_dropout(const Philox& philox, uint64_t stream, float p, int64_t h, int64_t start,
                         int64_t T) {
  const uint64_t t = uint64_t(T);
  return {&philox, stream, p, (uint64_t(h) * t + uint64_t(start)) * t + uint64_t(start), t};
}

// The (sequence, head) tasks and whether they are worth an OpenMP team.
struct Tasks {
  std::vector<int64_t> sequences;  // the non-empty sequences' indices
  bool parallel;
};

Tasks tasks(const std::vector<int64_t>& starts, const VarlenDims& d) {
  Tasks t{{}, false};
  int64_t work = 0;
  for (size_t n = 0; n + 1 < starts.size(); ++n) {
    const int64_t S = starts[n + 1] - starts[n];
    if (S == 0) continue;
    t.sequences.push_back(int64_t(n));
    work += d.Hq * S * S * d.D;
  }
  t.parallel = work >= cpu_attention::kParallelMinWork;
  return t;
}

}  // namespace

void attention_varlen_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                              Tensor& lse, const Tensor& cu_seqlens, int64_t max_seqlen,
                              float dropout_p, uint64_t seed, uint64_t stream,
                              float softmax_scale) {
  MEGATON_CUDA_DISPATCH(q, cuda::attention_varlen_forward(q, k, v, out, lse, cu_seqlens, max_seqlen,
                                                          dropout_p, seed, stream, softmax_scale));
  const VarlenDims d = check_qkv(q, k, v, dropout_p);
  check_f32_cpu(out, kOp, "out");
  check_f32_cpu(lse, kOp, "lse");
  check_shape(out, {d.T, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.T, d.Hq}, "lse");
  const std::vector<int64_t> starts = check_cu_seqlens(cu_seqlens, d.T, max_seqlen);
  if (d.T == 0) return;

  const Philox philox(seed);
  const float *qp = q.f32(), *kp = k.f32(), *vp = v.f32();
  float *op = out.f32(), *lp = lse.f32();
  const Tasks work = tasks(starts, d);
  const int64_t num_tasks = int64_t(work.sequences.size()) * d.Hq;
  cpu_attention::SingleThreadedBlas single_threaded_blas;

#pragma omp parallel if (work.parallel)
  {
    HeadScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t n = work.sequences[task / d.Hq], h = task % d.Hq, hkv = h / d.group();
      const int64_t start = starts[n];
      const HeadGeometry g = geometry(d, starts[n + 1] - start, softmax_scale);
      cpu_attention::forward_head(
          g, qp + start * g.q_row + h * d.D, kp + start * g.k_row + hkv * d.D,
          vp + start * g.v_row + hkv * d.Dv, op + start * g.o_row + h * d.Dv, lp + start * d.Hq + h,
          head_dropout(philox, stream, dropout_p, h, start, d.T), scratch);
    }
  }
}

void attention_varlen_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse,
                               const Tensor& cu_seqlens, int64_t max_seqlen, Tensor& dq, Tensor& dk,
                               Tensor& dv, float dropout_p, uint64_t seed, uint64_t stream,
                               float softmax_scale) {
  MEGATON_CUDA_DISPATCH(
      dout, cuda::attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, dq, dk,
                                            dv, dropout_p, seed, stream, softmax_scale));
  const VarlenDims d = check_qkv(q, k, v, dropout_p);
  check_f32_cpu(dout, kOp, "dout");
  check_f32_cpu(out, kOp, "out");
  check_f32_cpu(lse, kOp, "lse");
  check_f32_cpu(dq, kOp, "dq");
  check_f32_cpu(dk, kOp, "dk");
  check_f32_cpu(dv, kOp, "dv");
  check_shape(dout, {d.T, d.Hq, d.Dv}, "dout");
  check_shape(out, {d.T, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.T, d.Hq}, "lse");
  check_shape(dq, q.shape(), "dq");
  check_shape(dk, k.shape(), "dk");
  check_shape(dv, v.shape(), "dv");
  const std::vector<int64_t> starts = check_cu_seqlens(cu_seqlens, d.T, max_seqlen);
  if (d.T == 0) return;

  const Philox philox(seed);
  const int64_t T = d.T, D = d.D, Dv = d.Dv, group = d.group();
  const float *qp = q.f32(), *kp = k.f32(), *vp = v.f32(), *dop = dout.f32(), *op = out.f32(),
              *lp = lse.f32();
  float *dqp = dq.f32(), *dkp = dk.f32(), *dvp = dv.f32();
  // With GQA each query head accumulates its own dk, dv in [Hq, T, D] scratch, summed into
  // the shared kv head afterwards (as the dense op); without it a task owns its rows of its
  // kv head. Every row belongs to one sequence (c0 = 0, cN = T), so every row is written.
  std::vector<float> dk_heads, dv_heads;
  if (group > 1) {
    dk_heads.resize(d.Hq * T * D);
    dv_heads.resize(d.Hq * T * Dv);
  }
  const Tasks work = tasks(starts, d);
  const int64_t num_tasks = int64_t(work.sequences.size()) * d.Hq;
  cpu_attention::SingleThreadedBlas single_threaded_blas;

#pragma omp parallel if (work.parallel)
  {
    HeadScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t n = work.sequences[task / d.Hq], h = task % d.Hq, hkv = h / group;
      const int64_t start = starts[n];
      const HeadGeometry g = geometry(d, starts[n + 1] - start, softmax_scale);
      float* dk_h =
          group > 1 ? dk_heads.data() + (h * T + start) * D : dkp + start * g.k_row + hkv * D;
      float* dv_h =
          group > 1 ? dv_heads.data() + (h * T + start) * Dv : dvp + start * g.v_row + hkv * Dv;
      cpu_attention::backward_head(g, qp + start * g.q_row + h * D, kp + start * g.k_row + hkv * D,
                                   vp + start * g.v_row + hkv * Dv, op + start * g.o_row + h * Dv,
                                   dop + start * g.o_row + h * Dv, lp + start * d.Hq + h,
                                   dqp + start * g.q_row + h * D, dk_h, group > 1 ? D : g.k_row,
                                   dv_h, group > 1 ? Dv : g.v_row,
                                   head_dropout(philox, stream, dropout_p, h, start, T), scratch);
    }
    if (group > 1) {
      cpu_attention::sum_query_groups(dk_heads.data(), 1, T, d.Hq, d.Hkv, D, dkp);
      cpu_attention::sum_query_groups(dv_heads.data(), 1, T, d.Hq, d.Hkv, Dv, dvp);
    }
  }
}

}  // namespace megaton::ops
