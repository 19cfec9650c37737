// Causal self-attention with grouped-query heads and probability dropout, CPU fp32 reference.
//
// One task per (batch, query head). Inside a task the sequence is cut into row blocks of
// kBlockRows queries; a block only multiplies against the keys at or before its last row,
// so the causal mask costs no GEMM work above the diagonal (beyond one block's triangle).
// Backward recomputes the probabilities from q, k and the saved lse (FlashAttention-2,
// Dao 2023, Algorithm 2) instead of storing the [S, S] matrix.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "core/rng.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

constexpr int64_t kBlockRows = 64;
// Below this many score multiply-adds (B * Hq * S^2 * D) a call runs on the calling
// thread: waking an OpenMP team costs more than the work (much more on a loaded machine).
constexpr int64_t kParallelMinWork = int64_t(1) << 18;

// Runs BLAS single-threaded for its lifetime, restoring the caller's setting after.
// Our OpenMP tasks (one per head) each call small GEMMs; a pthreads OpenBLAS (Debian's
// default libopenblas0-pthread) would start its own thread team inside every task,
// oversubscribing the cores: measured 10x slower on 2 and on 8 cores (B=4, S=512, 8 heads,
// D=64) than one BLAS thread per task. An OpenMP OpenBLAS already runs single-threaded
// inside a parallel region, and there openblas_set_num_threads would change our own
// OpenMP team size, so it is left alone.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas()
      : saved_(openblas_get_parallel() == OPENBLAS_THREAD ? openblas_get_num_threads() : 1) {
    if (saved_ != 1) openblas_set_num_threads(1);
  }
  ~SingleThreadedBlas() {
    if (saved_ != 1) openblas_set_num_threads(saved_);
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_;
};

struct AttentionDims {
  int64_t B, S, Hq, Hkv, D, Dv;  // D: q and k head dim; Dv: v and out head dim
  int64_t group() const { return Hq / Hkv; }
  // Row strides (elements between consecutive sequence positions) of q, k, v and out.
  int64_t q_row() const { return Hq * D; }
  int64_t kv_row() const { return Hkv * D; }
  int64_t v_row() const { return Hkv * Dv; }
  int64_t o_row() const { return Hq * Dv; }
};

void check_f32_cpu(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "attention: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CPU, "attention: {}: only the CPU backend is built", name);
  MEGATON_CHECK(t.dtype() == DType::F32, "attention: {} must be F32, got {}", name,
                dtype_name(t.dtype()));
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  MEGATON_CHECK(t.shape() == want, "attention: {} has shape {}, expected {}", name,
                shape_str(t.shape()), shape_str(want));
}

AttentionDims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, float dropout_p) {
  check_f32_cpu(q, "q");
  check_f32_cpu(k, "k");
  check_f32_cpu(v, "v");
  MEGATON_CHECK(q.ndim() == 4, "attention: q must be [B, S, Hq, D], got {}", shape_str(q.shape()));
  MEGATON_CHECK(k.ndim() == 4, "attention: k must be [B, S, Hkv, D], got {}", shape_str(k.shape()));
  MEGATON_CHECK(v.ndim() == 4, "attention: v must be [B, S, Hkv, Dv], got {}", shape_str(v.shape()));
  AttentionDims d{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3), v.dim(3)};
  MEGATON_CHECK(d.Hq > 0 && d.D > 0 && d.Dv > 0,
                "attention: q {} or v {} has no heads or an empty head dim",
                shape_str(q.shape()), shape_str(v.shape()));
  MEGATON_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0,
                "attention: query heads {} must be a multiple of key/value heads {}", d.Hq, d.Hkv);
  check_shape(k, {d.B, d.S, d.Hkv, d.D}, "k");
  check_shape(v, {d.B, d.S, d.Hkv, d.Dv}, "v");
  MEGATON_CHECK(d.S <= INT_MAX && d.q_row() <= INT_MAX && d.o_row() <= INT_MAX,
                "attention: S {} or Hq * D {} exceed the 32-bit BLAS interface", d.S,
                std::max(d.q_row(), d.o_row()));
  MEGATON_CHECK(dropout_p >= 0.0f && dropout_p < 1.0f, "attention: dropout_p {} must be in [0, 1)",
                dropout_p);
  return d;
}

// The dropout mask on the probabilities, regenerated identically in forward and backward.
// Probability (b, h, i, j) is kept when Philox(seed).uniform(stream, index) >= p, index =
// ((b * Hq + h) * S + i) * S + j (the rule of ops::dropout_forward), and kept values are
// scaled by 1 / (1 - p).
struct AttentionDropout {
  Philox philox;
  uint64_t stream;
  float p;
  float keep_scale;  // 1 / (1 - p)
  int64_t S;
  // Philox index of (bh, i, 0), with bh = b * Hq + h.
  uint64_t row_index(int64_t bh, int64_t i) const {
    return (uint64_t(bh) * uint64_t(S) + uint64_t(i)) * uint64_t(S);
  }
  // keep / (1 - p) for element j of the row starting at row_index.
  float multiplier(uint64_t row_index, int64_t j) const {
    return philox.uniform(stream, row_index + uint64_t(j)) >= p ? keep_scale : 0.0f;
  }
};

// scores[r, j] = scale * q[i0 + r] . k[j] for j < cols, one GEMM. q_h and k_h point at
// the head's first row; rows are strided by the [B, S, heads, D] layout.
void block_scores(const AttentionDims& d, const float* q_h, const float* k_h, int64_t i0,
                  int64_t rows, int64_t cols, float scale, float* scores, int64_t ld) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), int(d.D), scale,
              q_h + i0 * d.q_row(), int(d.q_row()), k_h, int(d.kv_row()), 0.0f, scores, int(ld));
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       float dropout_p, uint64_t seed, uint64_t stream, float softmax_scale) {
  MEGATON_CUDA_DISPATCH(
      q, cuda::attention_forward(q, k, v, out, lse, dropout_p, seed, stream, softmax_scale));
  const AttentionDims d = check_qkv(q, k, v, dropout_p);
  check_f32_cpu(out, "out");
  check_f32_cpu(lse, "lse");
  check_shape(out, {d.B, d.S, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.B, d.Hq, d.S}, "lse");
  if (d.B == 0 || d.S == 0) return;

  const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(d.D));
  const AttentionDropout dropout{Philox(seed), stream, dropout_p, 1.0f / (1.0f - dropout_p), d.S};
  const float *qp = q.f32(), *kp = k.f32(), *vp = v.f32();
  float *op = out.f32(), *lp = lse.f32();
  const int64_t S = d.S;
  SingleThreadedBlas single_threaded_blas;
  const bool parallel = d.B * d.Hq * S * S * d.D >= kParallelMinWork;

#pragma omp parallel if (parallel)
  {
    std::vector<float> probs(std::min(kBlockRows, S) * S);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.Hq; ++bh) {
      const int64_t b = bh / d.Hq, h = bh % d.Hq, hkv = h / d.group();
      const float* q_h = qp + b * S * d.q_row() + h * d.D;
      const float* k_h = kp + b * S * d.kv_row() + hkv * d.D;
      const float* v_h = vp + b * S * d.v_row() + hkv * d.Dv;
      float* o_h = op + b * S * d.o_row() + h * d.Dv;
      float* lse_h = lp + bh * S;
      for (int64_t i0 = 0; i0 < S; i0 += kBlockRows) {
        const int64_t rows = std::min(kBlockRows, S - i0), cols = i0 + rows;
        block_scores(d, q_h, k_h, i0, rows, cols, scale, probs.data(), S);
        // Row softmax over the causal prefix j <= i; later columns are zeroed so the
        // probs @ v GEMM below can run over the block's full width.
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          float* row = probs.data() + r * S;
          float row_max = row[0];
          for (int64_t j = 1; j <= i; ++j) row_max = std::max(row_max, row[j]);
          double sum = 0;
          for (int64_t j = 0; j <= i; ++j) {
            row[j] = std::exp(row[j] - row_max);
            sum += row[j];
          }
          const float inv_sum = float(1.0 / sum);
          for (int64_t j = 0; j <= i; ++j) row[j] *= inv_sum;
          for (int64_t j = i + 1; j < cols; ++j) row[j] = 0.0f;
          lse_h[i] = row_max + float(std::log(sum));
        }
        if (dropout_p > 0.0f) {
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            const uint64_t row_index = dropout.row_index(bh, i);
            float* row = probs.data() + r * S;
            for (int64_t j = 0; j <= i; ++j) row[j] *= dropout.multiplier(row_index, j);
          }
        }
        // out[i0 : i0 + rows] = probs[:, :cols] @ v[:cols]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(d.Dv), int(cols),
                    1.0f, probs.data(), int(S), v_h, int(d.v_row()), 0.0f, o_h + i0 * d.o_row(),
                    int(d.o_row()));
      }
    }
  }
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                        float dropout_p, uint64_t seed, uint64_t stream, float softmax_scale) {
  MEGATON_CUDA_DISPATCH(dout, cuda::attention_backward(dout, q, k, v, out, lse, dq, dk, dv,
                                                       dropout_p, seed, stream, softmax_scale));
  const AttentionDims d = check_qkv(q, k, v, dropout_p);
  check_f32_cpu(dout, "dout");
  check_f32_cpu(out, "out");
  check_f32_cpu(lse, "lse");
  check_f32_cpu(dq, "dq");
  check_f32_cpu(dk, "dk");
  check_f32_cpu(dv, "dv");
  check_shape(dout, {d.B, d.S, d.Hq, d.Dv}, "dout");
  check_shape(out, {d.B, d.S, d.Hq, d.Dv}, "out");
  check_shape(lse, {d.B, d.Hq, d.S}, "lse");
  check_shape(dq, q.shape(), "dq");
  check_shape(dk, k.shape(), "dk");
  check_shape(dv, v.shape(), "dv");
  if (d.B == 0 || d.S == 0) return;

  const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(d.D));
  const AttentionDropout dropout{Philox(seed), stream, dropout_p, 1.0f / (1.0f - dropout_p), d.S};
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
  SingleThreadedBlas single_threaded_blas;
  const bool parallel = d.B * d.Hq * S * S * d.D >= kParallelMinWork;

#pragma omp parallel if (parallel)
  {
    const int64_t block = std::min(kBlockRows, S);
    std::vector<float> probs(block * S), dprobs(block * S), row_dot(block);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < d.B * d.Hq; ++bh) {
      const int64_t b = bh / d.Hq, h = bh % d.Hq, hkv = h / d.group();
      const float* q_h = qp + b * S * d.q_row() + h * D;
      const float* k_h = kp + b * S * d.kv_row() + hkv * D;
      const float* v_h = vp + b * S * d.v_row() + hkv * Dv;
      const float* do_h = dop + b * S * d.o_row() + h * Dv;
      const float* o_h = op + b * S * d.o_row() + h * Dv;
      const float* lse_h = lp + bh * S;
      float* dq_h = dqp + b * S * d.q_row() + h * D;
      float* dk_h = group > 1 ? dk_heads.data() + bh * S * D : dkp + b * S * d.kv_row() + hkv * D;
      float* dv_h =
          group > 1 ? dv_heads.data() + bh * S * Dv : dvp + b * S * d.v_row() + hkv * Dv;
      const int64_t ld_dk = group > 1 ? D : d.kv_row(), ld_dv = group > 1 ? Dv : d.v_row();
      for (int64_t s = 0; s < S; ++s) {
        std::fill(dk_h + s * ld_dk, dk_h + s * ld_dk + D, 0.0f);
        std::fill(dv_h + s * ld_dv, dv_h + s * ld_dv + Dv, 0.0f);
      }
      for (int64_t i0 = 0; i0 < S; i0 += kBlockRows) {
        const int64_t rows = std::min(kBlockRows, S - i0), cols = i0 + rows;
        // P = exp(scores - lse) on the causal prefix, 0 after it.
        block_scores(d, q_h, k_h, i0, rows, cols, scale, probs.data(), S);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          float* row = probs.data() + r * S;
          for (int64_t j = 0; j <= i; ++j) row[j] = std::exp(row[j] - lse_h[i]);
          for (int64_t j = i + 1; j < cols; ++j) row[j] = 0.0f;
          // delta_i = sum_j P_ij dP_ij = dout_i . out_i (also with dropout, since
          // out = (P o M) v and dP = M o (dout v^T)).
          double acc = 0;
          for (int64_t c = 0; c < Dv; ++c)
            acc += double(do_h[i * d.o_row() + c]) * o_h[i * d.o_row() + c];
          row_dot[r] = float(acc);
        }
        // dP~ = dout v^T, the gradient of the dropped-out probabilities.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), int(Dv), 1.0f,
                    do_h + i0 * d.o_row(), int(d.o_row()), v_h, int(d.v_row()), 0.0f,
                    dprobs.data(), int(S));
        if (dropout_p > 0.0f) {
          // probs becomes P o M (for dv) and dprobs becomes dP = M o dP~, with M the
          // forward's mask regenerated.
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            const uint64_t row_index = dropout.row_index(bh, i);
            float* p_row = probs.data() + r * S;
            float* dp_row = dprobs.data() + r * S;
            for (int64_t j = 0; j <= i; ++j) {
              const float m = dropout.multiplier(row_index, j);
              // dS needs P itself, so form P o (dP - delta) before P is overwritten.
              const float p = p_row[j];
              p_row[j] = p * m;
              dp_row[j] = p * (dp_row[j] * m - row_dot[r]);
            }
            for (int64_t j = i + 1; j < cols; ++j) dp_row[j] = 0.0f;
          }
        } else {
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            const float* p_row = probs.data() + r * S;
            float* dp_row = dprobs.data() + r * S;
            for (int64_t j = 0; j <= i; ++j) dp_row[j] = p_row[j] * (dp_row[j] - row_dot[r]);
            for (int64_t j = i + 1; j < cols; ++j) dp_row[j] = 0.0f;
          }
        }
        // dprobs now holds dS, the gradient of the scores q k^T * scale.
        // dv[:cols] += (P o M)^T dout[block]
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(Dv), int(rows), 1.0f,
                    probs.data(), int(S), do_h + i0 * d.o_row(), int(d.o_row()), 1.0f, dv_h,
                    int(ld_dv));
        // dq[block] = scale * dS k[:cols]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(D), int(cols), scale,
                    dprobs.data(), int(S), k_h, int(d.kv_row()), 0.0f, dq_h + i0 * d.q_row(),
                    int(d.q_row()));
        // dk[:cols] += scale * dS^T q[block]
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(D), int(rows), scale,
                    dprobs.data(), int(S), q_h + i0 * d.q_row(), int(d.q_row()), 1.0f, dk_h,
                    int(ld_dk));
      }
    }

    // Sum each query group's per-head dk, dv into its kv head.
    if (group > 1) {
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < d.B; ++b) {
        for (int64_t s = 0; s < S; ++s) {
          for (int64_t hkv = 0; hkv < d.Hkv; ++hkv) {
            float* dk_row = dkp + (b * S + s) * d.kv_row() + hkv * D;
            float* dv_row = dvp + (b * S + s) * d.v_row() + hkv * Dv;
            for (int64_t c = 0; c < D; ++c) {
              float sk = 0.0f;
              for (int64_t g = 0; g < group; ++g)
                sk += dk_heads[((b * d.Hq + hkv * group + g) * S + s) * D + c];
              dk_row[c] = sk;
            }
            for (int64_t c = 0; c < Dv; ++c) {
              float sv = 0.0f;
              for (int64_t g = 0; g < group; ++g)
                sv += dv_heads[((b * d.Hq + hkv * group + g) * S + s) * Dv + c];
              dv_row[c] = sv;
            }
          }
        }
      }
    }
  }
}

}  // namespace megaton::ops
