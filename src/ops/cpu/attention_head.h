// Causal attention of one query head over one sequence, CPU fp32: the kernel that the dense
// op (ops/cpu/attention.cpp, [B, S, H, D]) and the packed-sequence op
// (ops/cpu/attention_varlen.cpp, [T, H, D] cut by cu_seqlens) both run per (sequence, head).
// Internal to ops/cpu.
#pragma once
#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace megaton::ops::cpu_attention {

// Rows of a block of queries multiplied at once; a block only multiplies against the keys at
// or before its last row, so the causal mask costs no GEMM work above the diagonal beyond
// one block's triangle.
constexpr int64_t kBlockRows = 64;
// Below this many score multiply-adds (heads * sum of S^2 * D) a call runs on the calling
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
  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_;
};

// One (sequence, query head): S positions; q, k, v, out, dout, dq rows `*_row` elements
// apart (the [.., heads, D] layouts' row strides); lse entries `lse_stride` apart.
struct HeadGeometry {
  int64_t S;      // positions in the sequence
  int64_t D, Dv;  // q and k head dim; v, out head dim
  int64_t q_row, k_row, v_row, o_row;
  int64_t lse_stride;
  float scale;  // the scores' scale
};

// The dropout mask of one head: probability (i, j) is kept when
// philox.uniform(stream, first_index + i * row_stride + j) >= p, and kept values are scaled
// by 1 / (1 - p). p == 0: no dropout (philox is not read).
struct HeadDropout {
  const Philox* philox = nullptr;
  uint64_t stream = 0;
  float p = 0.0f;
  uint64_t first_index = 0;  // the Philox index of (0, 0)
  uint64_t row_stride = 0;   // index distance from (i, j) to (i + 1, j)
  bool active() const { return p > 0.0f; }
  float multiplier(int64_t i, int64_t j) const {
    return philox->uniform(stream, first_index + uint64_t(i) * row_stride + uint64_t(j)) >= p
               ? 1.0f / (1.0f - p)
               : 0.0f;
  }
};

// Per-thread buffers, grown as needed.
struct HeadScratch {
  std::vector<float> probs, dprobs, row_dot;
};

// out[i] = sum_j softmax_j(scale q_i . k_j, j <= i) (dropped out) v_j, and lse[i] the
// log-sum-exp of the scaled scores (before dropout). S >= 1. Pointers at the head's first
// element of position 0.
void forward_head(const HeadGeometry& g, const float* q, const float* k, const float* v, float* out,
                  float* lse, const HeadDropout& dropout, HeadScratch& scratch);

// The gradients of forward_head from dout (same layout as out) and the saved out, lse:
// dq overwritten (rows q_row apart); dk, dv overwritten (rows dk_row, dv_row apart:
// either the tensor's own rows, or a per-query-head scratch summed later with
// sum_query_groups). Backward recomputes the probabilities from q, k and lse
// (FlashAttention-2, Dao 2023, Algorithm 2) instead of storing the [S, S] matrix.
void backward_head(const HeadGeometry& g, const float* q, const float* k, const float* v,
                   const float* out, const float* dout, const float* lse, float* dq, float* dk,
                   int64_t dk_row, float* dv, int64_t dv_row, const HeadDropout& dropout,
                   HeadScratch& scratch);

// GQA: x[b, s, hkv, :] = sum over the group's query heads h of heads[b, h, s, :], with
// heads [B, Hq, S, width] and x [B, S, Hkv, width] (overwritten). Run inside an OpenMP
// parallel region (an orphaned `omp for`) or alone.
void sum_query_groups(const float* heads, int64_t B, int64_t S, int64_t Hq, int64_t Hkv,
                      int64_t width, float* x);

// Argument checks shared by the CPU attention doors; `op` names the op in the message.
void check_f32_cpu(const Tensor& t, const char* op, const char* name);
void check_shape(const Tensor& t, const Shape& want, const char* op, const char* name);

}  // namespace megaton::ops::cpu_attention
