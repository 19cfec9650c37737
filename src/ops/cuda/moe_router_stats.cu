// The MoE router's loss statistics and small helpers on the GPU, fp32: aux-loss scores,
// top-k counts and per-group score sums, their backward, the z-loss's log-sum-exp and
// backward, tokens per expert, Philox fills and mul_. Semantics: ops.h; CPU twin:
// ops/cpu/moe_router.cpp; source: Megatron-LM transformer/moe/moe_utils.py
// (compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func, z_loss_func).
//
// Every reduction has a fixed order: score sums are per-slice fp64 partials added in slice
// order, and counts are integer atomics (order-free), so two runs give the same bits.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/rng.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/moe_router_util.cuh"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using router::Candidate;
using router::kMaxExperts;
using router::kNoExpert;
using router::kThreads;
using router::kWarpsPerBlock;
using router::offer;
using router::row_blocks;
using router::warp_best;

// ---- host: door checks ----

// Door checks shared by the CUDA ops (pointwise_util.cuh).
using detail::check_dtype;
using detail::check_shape;

// logits [T, E] F32 on the GPU, 1 <= E <= kMaxExperts.
void check_logits(const Tensor& logits, const char* op) {
  check_dtype(logits, DType::F32, op, "logits");
  MEGATON_CHECK(logits.ndim() == 2, "{}: logits must be [T, E], got {}", op,
                shape_str(logits.shape()));
  MEGATON_CHECK(logits.dim(1) >= 1 && logits.dim(1) <= kMaxExperts,
                "{}: {} experts, the CUDA router takes 1 .. {}", op, logits.dim(1), kMaxExperts);
  MEGATON_CHECK(logits.dim(0) <= int64_t(INT32_MAX) * kWarpsPerBlock,
                "{}: {} tokens exceed the grid limit", op, logits.dim(0));
}

// Rows first_row .. first_row + T - 1 of groups of rows_per_group rows fall in [0, G).
void check_groups(int64_t T, int64_t first_row, int64_t rows_per_group, int64_t G, const char* op) {
  MEGATON_CHECK(first_row >= 0 && rows_per_group >= 1,
                "{}: first_row {} must be >= 0 and rows_per_group {} >= 1", op, first_row,
                rows_per_group);
  MEGATON_CHECK(T == 0 || (first_row + T - 1) / rows_per_group < G,
                "{}: rows {} .. {} in groups of {} need more than {} groups", op, first_row,
                first_row + T - 1, rows_per_group, G);
}

// ---- device ----

// Scores of the aux losses: softmax over E, or sigmoid / sqrt-softplus divided by their
// sum over E (+ 1e-20), in place on a row held N per lane.
template <int N>
__device__ __forceinline__ void aux_scores(float (&v)[N], uint32_t valid,
                                           RouterScoreFunction score_function) {
  if (score_function == RouterScoreFunction::Softmax) {
    router::warp_softmax(v, valid);
    return;
  }
  const bool sigmoid = score_function == RouterScoreFunction::Sigmoid;
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (valid >> i & 1u) {
      v[i] = sigmoid ? router::sigmoid(v[i]) : router::sqrt_softplus(v[i]);
      sum += v[i];
    }
  const float denom = router::warp_sum(sum) + 1e-20f;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (valid >> i & 1u) v[i] = v[i] / denom;
}

// Per row (one warp): scores written; the row's top-k experts counted into
// counts[g(row), e] with integer atomics.
template <int N>
__global__ void __launch_bounds__(kThreads)
    aux_scores_kernel(const float* __restrict__ logits, int64_t T, int E, int k,
                      RouterScoreFunction score_function, int64_t first_row, int64_t rows_per_group,
                      float* __restrict__ scores, int32_t* __restrict__ counts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= T) return;
  const float* row = logits + t * E;
  float* row_scores = scores + t * E;
  float v[N];
  uint32_t valid = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? row[e] : 0.0f;
    if (e < E) valid |= 1u << i;
  }
  aux_scores(v, valid, score_function);
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (valid >> i & 1u) row_scores[lane + 32 * i] = v[i];

  int32_t* group_counts = counts + (first_row + t) / rows_per_group * E;
  uint32_t taken = 0;
  for (int j = 0; j < k; ++j) {
    Candidate best;
#pragma unroll
    for (int i = 0; i < N; ++i)
      if ((valid & ~taken) >> i & 1u) offer(best, v[i], lane + 32 * i, 0.0f);
    best = warp_best(best);
    if (best.expert != kNoExpert && best.expert % 32 == lane) {
      taken |= 1u << (best.expert / 32);
      atomicAdd(group_counts + best.expert, 1);
    }
  }
}

// Score sums, pass 1. Block (32, 8): columns [32 x, +32) of group g, rows of its slice s
// (call rows [lo + s * kSliceRows, +kSliceRows) within the group's rows [lo, hi)),
// threadIdx.y taking every 8th row; the 8 partials are added in threadIdx.y order.
// grid: x = g * column_tiles + tile, y = s. partials [G, slices, E] fp64.
constexpr int kSumCols = 32, kSumRowThreads = 8, kSliceRows = 256;
__global__ void score_sum_partials_kernel(const float* __restrict__ scores, int64_t T, int E,
                                          int64_t first_row, int64_t rows_per_group,
                                          int column_tiles, double* __restrict__ partials) {
  __shared__ double sums[kSumRowThreads][kSumCols];
  const int64_t g = blockIdx.x / column_tiles;
  const int e = int(blockIdx.x % column_tiles) * kSumCols + threadIdx.x;
  const int64_t slice = blockIdx.y, slices = gridDim.y;
  // This call's rows of group g.
  const int64_t lo = std::clamp<int64_t>(g * rows_per_group - first_row, 0, T);
  const int64_t hi = std::clamp<int64_t>((g + 1) * rows_per_group - first_row, 0, T);
  const int64_t begin = std::min(hi, lo + slice * kSliceRows);
  const int64_t end = std::min(hi, begin + kSliceRows);
  double acc = 0.0;
  if (e < E)
    for (int64_t t = begin + threadIdx.y; t < end; t += kSumRowThreads) acc += scores[t * E + e];
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    double total = 0.0;
    for (int i = 0; i < kSumRowThreads; ++i) total += sums[i][threadIdx.x];
    partials[(g * slices + slice) * E + e] = total;
  }
}

// Pass 2: score_sums[g, e] = the slices' partials in slice order; counts as fp32.
__global__ void score_sum_finish_kernel(const double* __restrict__ partials, int64_t slices,
                                        int64_t groups, int E,
                                        const int32_t* __restrict__ int_counts,
                                        float* __restrict__ score_sums,
                                        float* __restrict__ counts) {
  const int64_t n = groups * E;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = i / E, e = i % E;
    double total = 0.0;
    for (int64_t s = 0; s < slices; ++s) total += partials[(g * slices + s) * E + e];
    score_sums[i] = float(total);
    counts[i] = float(int_counts[i]);
  }
}

// dlogits[t, :] += J^T c, c = coeffs[g(t), :] (one warp per row).
// softmax: J^T c = s o (c - <s, c>).
// score = u / n, u = f(x), n = sum u + 1e-20: J^T c = f'(x) / n o (c - <score, c>).
__global__ void __launch_bounds__(kThreads)
    aux_backward_kernel(const float* __restrict__ coeffs, const float* __restrict__ logits,
                        const float* __restrict__ scores, RouterScoreFunction score_function,
                        int64_t T, int E, int64_t first_row, int64_t rows_per_group,
                        float* __restrict__ dlogits) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= T) return;
  const float* c = coeffs + (first_row + t) / rows_per_group * E;
  const float* row = logits + t * E;
  const float* row_scores = scores + t * E;
  float* drow = dlogits + t * E;
  float dot = 0.0f;
  for (int e = lane; e < E; e += 32) dot += row_scores[e] * c[e];
  dot = router::warp_sum(dot);
  if (score_function == RouterScoreFunction::Softmax) {
    for (int e = lane; e < E; e += 32) drow[e] += row_scores[e] * (c[e] - dot);
    return;
  }
  const bool sigmoid = score_function == RouterScoreFunction::Sigmoid;
  float sum = 0.0f;
  for (int e = lane; e < E; e += 32)
    sum += sigmoid ? router::sigmoid(row[e]) : router::sqrt_softplus(row[e]);
  const float denom = router::warp_sum(sum) + 1e-20f;
  for (int e = lane; e < E; e += 32) {
    const float x = row[e];
    const float u = sigmoid ? router::sigmoid(x) : router::sqrt_softplus(x);
    const float du = sigmoid ? router::sigmoid_grad(u) : router::sqrt_softplus_grad(x, u);
    drow[e] += du / denom * (c[e] - dot);
  }
}

// lse[t] = max + log(sum exp(x - max)) (one warp per row).
__global__ void __launch_bounds__(kThreads)
    logsumexp_kernel(const float* __restrict__ logits, int64_t T, int E, float* __restrict__ lse) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= T) return;
  float row_max, row_sum;
  router::warp_softmax_stats(logits + t * E, E, lane, row_max, row_sum);
  if (lane == 0) lse[t] = row_max + logf(row_sum);
}

// dlogits[t, :] += scale * lse[t] * softmax(x[t, :]), the softmax recomputed from the
// logits (as the CPU; lse is the forward's value), one warp per row.
__global__ void __launch_bounds__(kThreads)
    z_loss_backward_kernel(float scale, const float* __restrict__ logits,
                           const float* __restrict__ lse, int64_t T, int E,
                           float* __restrict__ dlogits) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= T) return;
  const float* row = logits + t * E;
  float* drow = dlogits + t * E;
  float row_max, row_sum;
  router::warp_softmax_stats(row, E, lane, row_max, row_sum);
  const float factor = scale * lse[t];
  for (int e = lane; e < E; e += 32) drow[e] += factor * (expf(row[e] - row_max) / row_sum);
}

// histogram[e] += 1 for every index e in [0, E); other indices are dropped.
__global__ void expert_histogram_kernel(const int32_t* __restrict__ indices, int64_t n, int64_t E,
                                        int32_t* __restrict__ histogram) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t e = indices[i];
    if (e >= 0 && e < E) atomicAdd(histogram + e, 1);
  }
}

__global__ void add_histogram_kernel(const int32_t* __restrict__ histogram, int64_t E,
                                     float* __restrict__ counts) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < E;
       e += int64_t(gridDim.x) * blockDim.x)
    counts[e] += float(histogram[e]);
}

// Element i: Philox(seed) draw i of `stream`, computed exactly as on the CPU (core/rng.h is
// __host__ __device__). The uniform's affine map lo + (hi - lo) u is one fused multiply-add,
// as GCC compiles the CPU's expression (contracted: -ffp-contract=fast, x86-64-v3 FMA).
__global__ void fill_normal_kernel(float* __restrict__ out, int64_t n, uint64_t seed,
                                   uint64_t stream) {
  const Philox rng(seed);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = rng.normal(stream, uint64_t(i));
}

__global__ void fill_uniform_kernel(float* __restrict__ out, int64_t n, float lo, float hi,
                                    uint64_t seed, uint64_t stream) {
  const Philox rng(seed);
  const float range = __fsub_rn(hi, lo);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __fmaf_rn(range, rng.uniform(stream, uint64_t(i)), lo);
}

template <typename Y, typename X>
__global__ void mul_kernel(Y* __restrict__ y, const X* __restrict__ x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = detail::from_float<Y>(__fmul_rn(detail::to_float(y[i]), detail::to_float(x[i])));
}

}  // namespace

void moe_aux_loss_statistics(const Tensor& logits, RouterScoreFunction score_function, int topk,
                             int64_t first_row, int64_t rows_per_group, Tensor& scores,
                             Tensor& score_sums, Tensor& counts) {
  constexpr const char* op = "moe_aux_loss_statistics";
  check_logits(logits, op);
  const int64_t T = logits.dim(0);
  const int E = int(logits.dim(1));
  MEGATON_CHECK(topk >= 1 && topk <= E, "{}: top-k {} must be in [1, E = {}]", op, topk, E);
  check_dtype(scores, DType::F32, op, "scores");
  check_shape(scores, {T, E}, op, "scores");
  check_dtype(score_sums, DType::F32, op, "score_sums");
  MEGATON_CHECK(score_sums.ndim() == 2 && score_sums.dim(1) == E,
                "{}: score_sums must be [G, E = {}], got {}", op, E, shape_str(score_sums.shape()));
  const int64_t G = score_sums.dim(0);
  check_dtype(counts, DType::F32, op, "counts");
  check_shape(counts, {G, E}, op, "counts");
  check_groups(T, first_row, rows_per_group, G, op);
  if (G == 0) return;
  cudaStream_t stream = ::megaton::cuda::stream();

  Tensor int_counts = Tensor::empty({G, E}, DType::I32, Device::CUDA);
  MEGATON_CUDA_CHECK(cudaMemsetAsync(int_counts.raw(), 0, int_counts.nbytes(), stream));
  if (T > 0) {
    router::with_experts_per_lane(E, [&](auto n) {
      aux_scores_kernel<decltype(n)::value><<<row_blocks(T), kThreads, 0, stream>>>(
          logits.f32(), T, E, topk, score_function, first_row, rows_per_group, scores.f32(),
          int_counts.i32());
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  }

  // A group holds at most min(T, rows_per_group) of this call's rows.
  const int64_t max_rows = std::max<int64_t>(std::min(T, rows_per_group), 1);
  const int64_t slices = (max_rows + kSliceRows - 1) / kSliceRows;
  const int column_tiles = (E + kSumCols - 1) / kSumCols;
  MEGATON_CHECK(G * column_tiles <= INT32_MAX && slices <= 65535,
                "{}: {} groups of {} rows exceed the grid limit", op, G, max_rows);
  // fp64 scratch in an I64 tensor (same size; Tensor has no F64 dtype).
  Tensor partials = Tensor::empty({G, slices, E}, DType::I64, Device::CUDA);
  auto* partials_ptr = static_cast<double*>(partials.raw());
  score_sum_partials_kernel<<<dim3(unsigned(G * column_tiles), unsigned(slices)),
                              dim3(kSumCols, kSumRowThreads), 0, stream>>>(
      scores.f32(), T, E, first_row, rows_per_group, column_tiles, partials_ptr);
  MEGATON_CUDA_CHECK_LAUNCH();
  score_sum_finish_kernel<<<detail::grid_for(G * E, 256), 256, 0, stream>>>(
      partials_ptr, slices, G, E, int_counts.i32(), score_sums.f32(), counts.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void moe_aux_loss_statistics_backward(const Tensor& coeffs, const Tensor& logits,
                                      const Tensor& scores, RouterScoreFunction score_function,
                                      int64_t first_row, int64_t rows_per_group, Tensor& dlogits) {
  constexpr const char* op = "moe_aux_loss_statistics_backward";
  check_logits(logits, op);
  const int64_t T = logits.dim(0);
  const int E = int(logits.dim(1));
  check_dtype(coeffs, DType::F32, op, "coeffs");
  MEGATON_CHECK(coeffs.ndim() == 2 && coeffs.dim(1) == E, "{}: coeffs must be [G, E = {}], got {}",
                op, E, shape_str(coeffs.shape()));
  check_groups(T, first_row, rows_per_group, coeffs.dim(0), op);
  check_dtype(scores, DType::F32, op, "scores");
  check_shape(scores, {T, E}, op, "scores");
  check_dtype(dlogits, DType::F32, op, "dlogits");
  check_shape(dlogits, {T, E}, op, "dlogits");
  if (T == 0) return;
  aux_backward_kernel<<<row_blocks(T), kThreads, 0, ::megaton::cuda::stream()>>>(
      coeffs.f32(), logits.f32(), scores.f32(), score_function, T, E, first_row, rows_per_group,
      dlogits.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void moe_router_logsumexp(const Tensor& logits, Tensor& lse) {
  constexpr const char* op = "moe_router_logsumexp";
  check_dtype(logits, DType::F32, op, "logits");
  MEGATON_CHECK(logits.ndim() == 2, "{}: logits must be [T, E], got {}", op,
                shape_str(logits.shape()));
  const int64_t T = logits.dim(0);
  MEGATON_CHECK(T <= int64_t(INT32_MAX) * kWarpsPerBlock && logits.dim(1) <= INT32_MAX,
                "{}: logits {} exceed the grid limit", op, shape_str(logits.shape()));
  check_dtype(lse, DType::F32, op, "lse");
  check_shape(lse, {T}, op, "lse");
  if (T == 0) return;
  logsumexp_kernel<<<row_blocks(T), kThreads, 0, ::megaton::cuda::stream()>>>(
      logits.f32(), T, int(logits.dim(1)), lse.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void moe_z_loss_backward(float scale, const Tensor& logits, const Tensor& lse, Tensor& dlogits) {
  constexpr const char* op = "moe_z_loss_backward";
  check_dtype(logits, DType::F32, op, "logits");
  MEGATON_CHECK(logits.ndim() == 2, "{}: logits must be [T, E], got {}", op,
                shape_str(logits.shape()));
  const int64_t T = logits.dim(0);
  MEGATON_CHECK(T <= int64_t(INT32_MAX) * kWarpsPerBlock && logits.dim(1) <= INT32_MAX,
                "{}: logits {} exceed the grid limit", op, shape_str(logits.shape()));
  check_dtype(lse, DType::F32, op, "lse");
  check_shape(lse, {T}, op, "lse");
  check_dtype(dlogits, DType::F32, op, "dlogits");
  check_shape(dlogits, logits.shape(), op, "dlogits");
  if (T == 0) return;
  z_loss_backward_kernel<<<row_blocks(T), kThreads, 0, ::megaton::cuda::stream()>>>(
      scale, logits.f32(), lse.f32(), T, int(logits.dim(1)), dlogits.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void moe_tokens_per_expert(const Tensor& indices, int64_t num_experts, Tensor& counts) {
  constexpr const char* op = "moe_tokens_per_expert";
  check_dtype(indices, DType::I32, op, "indices");
  MEGATON_CHECK(num_experts >= 1, "{}: num_experts {} must be >= 1", op, num_experts);
  check_dtype(counts, DType::F32, op, "counts");
  check_shape(counts, {num_experts}, op, "counts");
  const int64_t n = indices.numel();
  if (n == 0) return;
  cudaStream_t stream = ::megaton::cuda::stream();
  // Indices come from the router, in [0, num_experts); one outside is dropped here (the CPU
  // twin throws; checking would cost a host copy and a synchronization).
  Tensor histogram = Tensor::empty({num_experts}, DType::I32, Device::CUDA);
  MEGATON_CUDA_CHECK(cudaMemsetAsync(histogram.raw(), 0, histogram.nbytes(), stream));
  expert_histogram_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(
      indices.i32(), n, num_experts, histogram.i32());
  MEGATON_CUDA_CHECK_LAUNCH();
  add_histogram_kernel<<<detail::grid_for(num_experts, 256), 256, 0, stream>>>(
      histogram.i32(), num_experts, counts.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

namespace {
// One block: the mean summed in expert order by one thread (as the CPU twin), then each
// thread updates its experts.
__global__ void expert_bias_update_kernel(const float* counts, int64_t num_experts, float rate,
                                          float* bias) {
  __shared__ float mean;
  if (threadIdx.x == 0) {
    float total = 0;
    for (int64_t e = 0; e < num_experts; ++e) total += counts[e];
    mean = total / float(num_experts);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const float d = mean - counts[e];
    bias[e] += rate * float((d > 0) - (d < 0));
  }
}
}  // namespace

void moe_expert_bias_update(const Tensor& counts, float rate, Tensor& bias) {
  constexpr const char* op = "moe_expert_bias_update";
  check_dtype(counts, DType::F32, op, "counts");
  MEGATON_CHECK(counts.ndim() == 1, "{}: counts must be [E], got {}", op, shape_str(counts.shape()));
  const int64_t E = counts.numel();
  check_dtype(bias, DType::F32, op, "bias");
  check_shape(bias, {E}, op, "bias");
  if (E == 0) return;
  expert_bias_update_kernel<<<1, 256, 0, ::megaton::cuda::stream()>>>(counts.f32(), E, rate,
                                                                     bias.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void fill_normal(Tensor& t, uint64_t seed, uint64_t stream) {
  check_dtype(t, DType::F32, "fill_normal", "t");
  const int64_t n = t.numel();
  if (n == 0) return;
  fill_normal_kernel<<<detail::grid_for(n, 256), 256, 0, ::megaton::cuda::stream()>>>(t.f32(), n,
                                                                                      seed, stream);
  MEGATON_CUDA_CHECK_LAUNCH();
}

void fill_uniform(Tensor& t, float lo, float hi, uint64_t seed, uint64_t stream) {
  check_dtype(t, DType::F32, "fill_uniform", "t");
  const int64_t n = t.numel();
  if (n == 0) return;
  fill_uniform_kernel<<<detail::grid_for(n, 256), 256, 0, ::megaton::cuda::stream()>>>(
      t.f32(), n, lo, hi, seed, stream);
  MEGATON_CUDA_CHECK_LAUNCH();
}

void mul_(Tensor& y, const Tensor& x) {
  constexpr const char* op = "mul_";
  detail::check_float(y, op, "y");
  detail::check_cuda_tensor(x, op, "x");
  MEGATON_CHECK(x.dtype() == DType::F32 || x.dtype() == y.dtype(),
                "{}: x must be F32 or y's dtype {}, got {}", op, dtype_name(y.dtype()),
                dtype_name(x.dtype()));
  detail::check_same_shape(x, y, op, "x", "y");
  const int64_t n = y.numel();
  if (n == 0) return;
  detail::dispatch_float(y.dtype(), [&](auto y_tag) {
    using Y = decltype(y_tag);
    detail::dispatch_float(x.dtype(), [&](auto x_tag) {
      using X = decltype(x_tag);
      mul_kernel<Y, X><<<detail::grid_for(n, 256), 256, 0, detail::compute_stream()>>>(
          static_cast<Y*>(y.raw()), static_cast<const X*>(x.raw()), n);
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace megaton::ops::cuda
