// Causal attention of one query head over one sequence, CPU fp32 (ops/cpu/attention_head.h).
#include "ops/cpu/attention_head.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace megaton::ops::cpu_attention {
namespace {

// scores[r, j] = scale * q[i0 + r] . k[j] for j < cols, one GEMM.
void block_scores(const HeadGeometry& g, const float* q, const float* k, int64_t i0, int64_t rows,
                  int64_t cols, float* scores, int64_t ld) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), int(g.D), g.scale,
              q + i0 * g.q_row, int(g.q_row), k, int(g.k_row), 0.0f, scores, int(ld));
}

void grow(std::vector<float>& buffer, int64_t size) {
  if (int64_t(buffer.size()) < size) buffer.resize(size_t(size));
}

}  // namespace

SingleThreadedBlas::SingleThreadedBlas()
    : saved_(openblas_get_parallel() == OPENBLAS_THREAD ? openblas_get_num_threads() : 1) {
  if (saved_ != 1) openblas_set_num_threads(1);
}

SingleThreadedBlas::~SingleThreadedBlas() {
  if (saved_ != 1) openblas_set_num_threads(saved_);
}

void forward_head(const HeadGeometry& g, const float* q, const float* k, const float* v, float* out,
                  float* lse, const HeadDropout& dropout, HeadScratch& scratch) {
  const int64_t S = g.S;
  grow(scratch.probs, std::min(kBlockRows, S) * S);
  float* probs = scratch.probs.data();
  for (int64_t i0 = 0; i0 < S; i0 += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, S - i0), cols = i0 + rows;
    block_scores(g, q, k, i0, rows, cols, probs, S);
    // Row softmax over the causal prefix j <= i; later columns are zeroed so the
    // probs @ v GEMM below can run over the block's full width.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      float* row = probs + r * S;
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
      lse[i * g.lse_stride] = row_max + float(std::log(sum));
    }
    if (dropout.active()) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        float* row = probs + r * S;
        for (int64_t j = 0; j <= i; ++j) row[j] *= dropout.multiplier(i, j);
      }
    }
    // out[i0 : i0 + rows] = probs[:, :cols] @ v[:cols]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(g.Dv), int(cols), 1.0f,
                probs, int(S), v, int(g.v_row), 0.0f, out + i0 * g.o_row, int(g.o_row));
  }
}

void backward_head(const HeadGeometry& g, const float* q, const float* k, const float* v,
                   const float* out, const float* dout, const float* lse, float* dq, float* dk,
                   int64_t dk_row, float* dv, int64_t dv_row, const HeadDropout& dropout,
                   HeadScratch& scratch) {
  const int64_t S = g.S, D = g.D, Dv = g.Dv;
  const int64_t block = std::min(kBlockRows, S);
  grow(scratch.probs, block * S);
  grow(scratch.dprobs, block * S);
  grow(scratch.row_dot, block);
  float *probs = scratch.probs.data(), *dprobs = scratch.dprobs.data(),
        *row_dot = scratch.row_dot.data();
  for (int64_t s = 0; s < S; ++s) {
    std::fill(dk + s * dk_row, dk + s * dk_row + D, 0.0f);
    std::fill(dv + s * dv_row, dv + s * dv_row + Dv, 0.0f);
  }
  for (int64_t i0 = 0; i0 < S; i0 += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, S - i0), cols = i0 + rows;
    // P = exp(scores - lse) on the causal prefix, 0 after it.
    block_scores(g, q, k, i0, rows, cols, probs, S);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      const float lse_i = lse[i * g.lse_stride];
      float* row = probs + r * S;
      for (int64_t j = 0; j <= i; ++j) row[j] = std::exp(row[j] - lse_i);
      for (int64_t j = i + 1; j < cols; ++j) row[j] = 0.0f;
      // delta_i = sum_j P_ij dP_ij = dout_i . out_i (also with dropout, since
      // out = (P o M) v and dP = M o (dout v^T)).
      double acc = 0;
      for (int64_t c = 0; c < Dv; ++c) acc += double(dout[i * g.o_row + c]) * out[i * g.o_row + c];
      row_dot[r] = float(acc);
    }
    // dP~ = dout v^T, the gradient of the dropped-out probabilities.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), int(Dv), 1.0f,
                dout + i0 * g.o_row, int(g.o_row), v, int(g.v_row), 0.0f, dprobs, int(S));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      float* p_row = probs + r * S;
      float* dp_row = dprobs + r * S;
      if (dropout.active()) {
        // probs becomes P o M (for dv) and dprobs becomes dS = P o (M o dP~ - delta),
        // with M the forward's mask regenerated; dS needs P itself, so it is formed first.
        for (int64_t j = 0; j <= i; ++j) {
          const float m = dropout.multiplier(i, j);
          const float p = p_row[j];
          p_row[j] = p * m;
          dp_row[j] = p * (dp_row[j] * m - row_dot[r]);
        }
      } else {
        for (int64_t j = 0; j <= i; ++j) dp_row[j] = p_row[j] * (dp_row[j] - row_dot[r]);
      }
      for (int64_t j = i + 1; j < cols; ++j) dp_row[j] = 0.0f;
    }
    // dprobs now holds dS, the gradient of the scores q k^T * scale.
    // dv[:cols] += (P o M)^T dout[block]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(Dv), int(rows), 1.0f, probs,
                int(S), dout + i0 * g.o_row, int(g.o_row), 1.0f, dv, int(dv_row));
    // dq[block] = scale * dS k[:cols]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(D), int(cols), g.scale,
                dprobs, int(S), k, int(g.k_row), 0.0f, dq + i0 * g.q_row, int(g.q_row));
    // dk[:cols] += scale * dS^T q[block]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cols), int(D), int(rows), g.scale,
                dprobs, int(S), q + i0 * g.q_row, int(g.q_row), 1.0f, dk, int(dk_row));
  }
}

void sum_query_groups(const float* heads, int64_t B, int64_t S, int64_t Hq, int64_t Hkv,
                      int64_t width, float* x) {
  const int64_t group = Hq / Hkv;
#pragma omp for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t hkv = 0; hkv < Hkv; ++hkv) {
        float* x_row = x + ((b * S + s) * Hkv + hkv) * width;
        for (int64_t c = 0; c < width; ++c) {
          float sum = 0.0f;
          for (int64_t g = 0; g < group; ++g)
            sum += heads[((b * Hq + hkv * group + g) * S + s) * width + c];
          x_row[c] = sum;
        }
      }
    }
  }
}

void check_f32_cpu(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} must be allocated", op, name);
  MEGATON_CHECK(t.device() == Device::CPU, "{}: {}: only the CPU backend is built", op, name);
  MEGATON_CHECK(t.dtype() == DType::F32, "{}: {} must be F32, got {}", op, name,
                dtype_name(t.dtype()));
}

void check_shape(const Tensor& t, const Shape& want, const char* op, const char* name) {
  MEGATON_CHECK(t.shape() == want, "{}: {} has shape {}, expected {}", op, name,
                shape_str(t.shape()), shape_str(want));
}

}  // namespace megaton::ops::cpu_attention
