// Block attention with log-sum-exp merging (ops/attention_block.h): the CPU fp32 reference,
// one OpenMP task per query head (backward: per kv head), plain loops (the sizes context
// parallelism meets on CPU ranks are small). The GPU path: ops/cuda/attention_block.cpp.
#include "ops/attention_block.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "ops/cpu/attention_head.h"
#include "ops/dispatch.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/attention_block.h"
#endif

namespace megaton::ops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct BlockDims {
  int64_t Sq, Skv, Hq, Hkv, D, Dv;
};

constexpr const char* kOp = "attention_block";

// The dense op's argument checks (ops/cpu/attention_head.h), naming this op.
void check_f32_cpu(const Tensor& t, const char* what) {
  cpu_attention::check_f32_cpu(t, kOp, what);
}
void check_shape(const Tensor& t, const Shape& want, const char* what) {
  cpu_attention::check_shape(t, want, kOp, what);
}

BlockDims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  check_f32_cpu(q, "q");
  check_f32_cpu(k, "k");
  check_f32_cpu(v, "v");
  MEGATON_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3,
                "attention_block: q, k, v must be [S, heads, D], got {}, {}, {}",
                shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  BlockDims d{q.dim(0), k.dim(0), q.dim(1), k.dim(1), q.dim(2), v.dim(2)};
  MEGATON_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0 && d.D > 0 && d.Dv > 0,
                "attention_block: {} query heads over {} key/value heads (D {}, Dv {})", d.Hq,
                d.Hkv, d.D, d.Dv);
  check_shape(k, {d.Skv, d.Hkv, d.D}, "k");
  check_shape(v, {d.Skv, d.Hkv, d.Dv}, "v");
  return d;
}

float scale_of(float softmax_scale, int64_t D) {
  return softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(D));
}

// The keys query i sees: rows [0, end) of the block (all of them without the mask).
int64_t visible_end(const BlockDims& d, int64_t i, int64_t q_offset, int64_t kv_offset,
                    bool causal) {
  if (!causal) return d.Skv;
  const int64_t last = q_offset + i - kv_offset;  // the last visible key row
  return std::clamp<int64_t>(last + 1, 0, d.Skv);
}

}  // namespace

void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t q_offset,
                             int64_t kv_offset, bool causal, Tensor& out, Tensor& lse,
                             float softmax_scale) {
  MEGATON_CUDA_DISPATCH(q, cuda::attention_block_forward(q, k, v, q_offset, kv_offset, causal, out,
                                                         lse, softmax_scale));
  const BlockDims d = check_qkv(q, k, v);
  check_shape(out, {d.Sq, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.Sq, d.Hq}, "lse");
  const float scale = scale_of(softmax_scale, d.D);
  const float *Q = q.f32(), *K = k.f32(), *V = v.f32();
  float *O = out.f32(), *L = lse.f32();
  const int64_t group = d.Hq / d.Hkv;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t h = 0; h < d.Hq; ++h) {
    const int64_t hk = h / group;
    std::vector<float> s(size_t(std::max<int64_t>(d.Skv, 1)));
    for (int64_t i = 0; i < d.Sq; ++i) {
      const int64_t end = visible_end(d, i, q_offset, kv_offset, causal);
      float* o = O + (i * d.Hq + h) * d.Dv;
      const float* qi = Q + (i * d.Hq + h) * d.D;
      float m = kNegInf;
      for (int64_t j = 0; j < end; ++j) {
        const float* kj = K + (j * d.Hkv + hk) * d.D;
        float dot = 0.0f;
        for (int64_t x = 0; x < d.D; ++x) dot += qi[x] * kj[x];
        s[size_t(j)] = dot * scale;
        m = std::max(m, s[size_t(j)]);
      }
      for (int64_t x = 0; x < d.Dv; ++x) o[x] = 0.0f;
      if (end == 0) {
        L[i * d.Hq + h] = kNegInf;
        continue;
      }
      double sum = 0.0;
      for (int64_t j = 0; j < end; ++j) sum += std::exp(double(s[size_t(j)] - m));
      const float l = m + float(std::log(sum));
      L[i * d.Hq + h] = l;
      for (int64_t j = 0; j < end; ++j) {
        const float p = std::exp(s[size_t(j)] - l);
        const float* vj = V + (j * d.Hkv + hk) * d.Dv;
        for (int64_t x = 0; x < d.Dv; ++x) o[x] += p * vj[x];
      }
    }
  }
}

void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, int64_t q_offset,
                              int64_t kv_offset, bool causal, Tensor& dq, Tensor& dk, Tensor& dv,
                              float softmax_scale) {
  MEGATON_CUDA_DISPATCH(
      q, cuda::attention_block_backward(dout, q, k, v, out, lse, q_offset, kv_offset, causal, dq,
                                        dk, dv, softmax_scale));
  const BlockDims d = check_qkv(q, k, v);
  check_shape(dout, {d.Sq, d.Hq, d.Dv}, "dout");
  check_shape(out, {d.Sq, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.Sq, d.Hq}, "lse");
  check_shape(dq, {d.Sq, d.Hq, d.D}, "dq");
  check_shape(dk, {d.Skv, d.Hkv, d.D}, "dk");
  check_shape(dv, {d.Skv, d.Hkv, d.Dv}, "dv");
  const float scale = scale_of(softmax_scale, d.D);
  const float *Q = q.f32(), *K = k.f32(), *V = v.f32(), *O = out.f32(), *L = lse.f32(),
              *dO = dout.f32();
  float *dQ = dq.f32(), *dK = dk.f32(), *dV = dv.f32();
  const int64_t group = d.Hq / d.Hkv;
  // One task per kv head: its query heads write dq rows of their own and share dk, dv.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t hk = 0; hk < d.Hkv; ++hk) {
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
      for (int64_t i = 0; i < d.Sq; ++i) {
        const int64_t end = visible_end(d, i, q_offset, kv_offset, causal);
        const float l = L[i * d.Hq + h];
        if (end == 0 || !std::isfinite(l)) continue;
        const float* qi = Q + (i * d.Hq + h) * d.D;
        const float* oi = O + (i * d.Hq + h) * d.Dv;
        const float* doi = dO + (i * d.Hq + h) * d.Dv;
        float* dqi = dQ + (i * d.Hq + h) * d.D;
        float Di = 0.0f;
        for (int64_t x = 0; x < d.Dv; ++x) Di += doi[x] * oi[x];
        for (int64_t j = 0; j < end; ++j) {
          const float* kj = K + (j * d.Hkv + hk) * d.D;
          const float* vj = V + (j * d.Hkv + hk) * d.Dv;
          float dot = 0.0f;
          for (int64_t x = 0; x < d.D; ++x) dot += qi[x] * kj[x];
          const float p = std::exp(dot * scale - l);
          float dp = 0.0f;
          for (int64_t x = 0; x < d.Dv; ++x) dp += doi[x] * vj[x];
          const float ds = p * (dp - Di) * scale;
          float* dkj = dK + (j * d.Hkv + hk) * d.D;
          float* dvj = dV + (j * d.Hkv + hk) * d.Dv;
          for (int64_t x = 0; x < d.D; ++x) {
            dqi[x] += ds * kj[x];
            dkj[x] += ds * qi[x];
          }
          for (int64_t x = 0; x < d.Dv; ++x) dvj[x] += p * doi[x];
        }
      }
  }
}

namespace {

void check_pieces(const std::vector<AttentionPiece>& pieces, int64_t Tq, int64_t Tkv, bool causal) {
  for (const AttentionPiece& p : pieces)
    MEGATON_CHECK(p.q_first >= 0 && p.q_count >= 1 && p.q_first + p.q_count <= Tq &&
                      p.kv_first >= 0 && p.kv_count >= 1 && p.kv_first + p.kv_count <= Tkv &&
                      (!causal || p.kv_count >= p.q_count),
                  "attention_pieces: piece of queries [{}, +{}) and keys [{}, +{}) does not fit "
                  "{} queries and {} keys{}",
                  p.q_first, p.q_count, p.kv_first, p.kv_count, Tq, Tkv,
                  causal ? " (causal: at least as many keys as queries)" : "");
}

}  // namespace

void attention_pieces_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::vector<AttentionPiece>& pieces, bool causal, Tensor& out,
                              Tensor& lse, float softmax_scale) {
  MEGATON_CUDA_DISPATCH(
      q, cuda::attention_pieces_forward(q, k, v, pieces, causal, out, lse, softmax_scale));
  check_pieces(pieces, q.dim(0), k.dim(0), causal);
  for (const AttentionPiece& p : pieces) {
    Tensor o = out.rows(p.q_first, p.q_count), l = lse.rows(p.q_first, p.q_count);
    attention_block_forward(q.rows(p.q_first, p.q_count), k.rows(p.kv_first, p.kv_count),
                            v.rows(p.kv_first, p.kv_count), p.kv_count - p.q_count, 0, causal, o, l,
                            softmax_scale);
  }
}

void attention_pieces_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse,
                               const std::vector<AttentionPiece>& pieces, bool causal, Tensor& dq,
                               Tensor& dk, Tensor& dv, float softmax_scale) {
  MEGATON_CUDA_DISPATCH(q, cuda::attention_pieces_backward(dout, q, k, v, out, lse, pieces, causal,
                                                           dq, dk, dv, softmax_scale));
  check_pieces(pieces, q.dim(0), k.dim(0), causal);
  for (const AttentionPiece& p : pieces) {
    Tensor dqp = dq.rows(p.q_first, p.q_count), dkp = dk.rows(p.kv_first, p.kv_count),
           dvp = dv.rows(p.kv_first, p.kv_count);
    attention_block_backward(dout.rows(p.q_first, p.q_count), q.rows(p.q_first, p.q_count),
                             k.rows(p.kv_first, p.kv_count), v.rows(p.kv_first, p.kv_count),
                             out.rows(p.q_first, p.q_count), lse.rows(p.q_first, p.q_count),
                             p.kv_count - p.q_count, 0, causal, dqp, dkp, dvp, softmax_scale);
  }
}

void attention_lse_merge(Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) {
  MEGATON_CUDA_DISPATCH(out, cuda::attention_lse_merge(out, lse, out_b, lse_b));
  check_f32_cpu(out, "out");
  MEGATON_CHECK(out.ndim() == 3, "attention_lse_merge: out must be [S, H, Dv], got {}",
                shape_str(out.shape()));
  const int64_t S = out.dim(0), H = out.dim(1), Dv = out.dim(2);
  check_shape(out_b, out.shape(), "out_b");
  check_shape(lse, {S, H}, "lse");
  check_shape(lse_b, {S, H}, "lse_b");
  float *O = out.f32(), *L = lse.f32();
  const float *Ob = out_b.f32(), *Lb = lse_b.f32();
  for (int64_t r = 0; r < S * H; ++r) {
    const float a = L[r], b = Lb[r];
    if (b == kNegInf) continue;
    if (a == kNegInf) {
      L[r] = b;
      for (int64_t x = 0; x < Dv; ++x) O[r * Dv + x] = Ob[r * Dv + x];
      continue;
    }
    const float hi = std::max(a, b), lo = std::min(a, b);
    const float merged = hi + std::log1p(std::exp(lo - hi));
    const float wa = std::exp(a - merged), wb = std::exp(b - merged);
    for (int64_t x = 0; x < Dv; ++x) O[r * Dv + x] = O[r * Dv + x] * wa + Ob[r * Dv + x] * wb;
    L[r] = merged;
  }
}

}  // namespace megaton::ops
