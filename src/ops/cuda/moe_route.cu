// MoE router math on the GPU: top-k softmax routing and the aux load-balancing loss, fp32.
// Semantics of the CPU twin (ops/cpu/moe_route.cpp) and Megatron-LM
// transformer/moe/router.py (topk_routing_with_score_function,
// compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func).
//
// One warp per token row: lane l owns experts l, l + 32, l + 64, ... (E <= 1024, so a
// lane owns at most 32 experts and one 32-bit mask marks those already chosen). Top-k is
// k rounds of a warp arg-max under the CPU's order: larger score first, lower expert
// index on ties; the order is total, so every lane agrees on each winner.
#include <cmath>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {
namespace {

constexpr int kMaxExperts = 1024;  // 32 lanes x 32 bits of the per-lane "chosen" mask
constexpr int kWarpsPerBlock = 8;  // token rows per block
constexpr int kNoExpert = INT32_MAX;

// ---- host: door checks ----

void check_on_gpu(const Tensor& t, DType want, const char* name) {
  MEGATON_CHECK(t.defined(), "moe_route: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CUDA, "moe_route: {} must be on the GPU", name);
  MEGATON_CHECK(t.dtype() == want, "moe_route: {} must be {}, got {}", name, dtype_name(want),
                dtype_name(t.dtype()));
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  MEGATON_CHECK(t.shape() == want, "moe_route: {} has shape {}, expected {}", name,
                shape_str(t.shape()), shape_str(want));
}

// [T, E] router tensor with 1 <= k <= E <= kMaxExperts.
void check_router_matrix(const Tensor& t, int k, const char* name) {
  check_on_gpu(t, DType::F32, name);
  MEGATON_CHECK(t.ndim() == 2, "moe_route: {} must be [T, E], got {}", name, shape_str(t.shape()));
  MEGATON_CHECK(t.dim(1) <= kMaxExperts, "moe_route: {} experts exceed the CUDA router's {}",
                t.dim(1), kMaxExperts);
  MEGATON_CHECK(k >= 1 && k <= t.dim(1), "moe_route: top-k {} must be in [1, E = {}]", k, t.dim(1));
  MEGATON_CHECK(t.dim(0) <= int64_t(INT32_MAX) * kWarpsPerBlock,
                "moe_route: {} tokens exceed the grid limit", t.dim(0));
}

unsigned row_blocks(int64_t T) { return unsigned((T + kWarpsPerBlock - 1) / kWarpsPerBlock); }

// ---- device ----

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// (score a, expert ea) ranks before (b, eb): the CPU's topk_row order. kNoExpert ranks last.
__device__ __forceinline__ bool ranks_before(float a, int ea, float b, int eb) {
  if (eb == kNoExpert) return ea != kNoExpert;
  if (ea == kNoExpert) return false;
  return a > b || (a == b && ea < eb);
}

// Softmax statistics of a row (max and sum of exp(x - max)), valid in every lane.
__device__ __forceinline__ void warp_softmax_stats(const float* row, int E, int lane,
                                                   float& row_max, float& row_sum) {
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, row[e]);
  row_max = warp_max(m);
  float s = 0.0f;
  for (int e = lane; e < E; e += 32) s += expf(row[e] - row_max);
  row_sum = warp_sum(s);
}

// The k best experts of a row, best first. score(e) is called only for the lane's own
// experts; emit(j, expert, score) is called in every lane for j = 0 .. k-1, in order.
template <typename Score, typename Emit>
__device__ __forceinline__ void warp_topk(int E, int k, int lane, Score score, Emit emit) {
  uint32_t chosen = 0;  // bit i: expert lane + 32 i is already taken
  for (int j = 0; j < k; ++j) {
    float best = 0.0f;
    int best_e = kNoExpert;
    for (int i = 0, e = lane; e < E; ++i, e += 32) {
      if (chosen >> i & 1u) continue;
      const float v = score(e);
      if (ranks_before(v, e, best, best_e)) {
        best = v;
        best_e = e;
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
      if (ranks_before(other, other_e, best, best_e)) {
        best = other;
        best_e = other_e;
      }
    }
    if (best_e != kNoExpert && best_e % 32 == lane) chosen |= 1u << (best_e / 32);
    emit(j, best_e, best);
  }
}

// Megatron default: top-k of the logits, softmax over the k chosen (probs written twice by
// lane 0: the chosen logits first, then their softmax).
// pre_softmax: softmax over all E, top-k of those scores, no renormalisation.
template <bool kPreSoftmax>
__global__ void topk_softmax_forward_kernel(const float* __restrict__ logits, int64_t T, int E,
                                            int k, float* __restrict__ probs,
                                            int32_t* __restrict__ indices) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= T) return;  // whole warps leave together
  const float* row = logits + t * E;
  float* row_probs = probs + t * k;
  int32_t* row_indices = indices + t * k;
  if constexpr (kPreSoftmax) {
    float row_max, row_sum;
    warp_softmax_stats(row, E, lane, row_max, row_sum);
    warp_topk(
        E, k, lane, [&](int e) { return expf(row[e] - row_max) / row_sum; },
        [&](int j, int e, float v) {
          if (lane == 0) {
            row_indices[j] = e;
            row_probs[j] = v;
          }
        });
  } else {
    float top = 0.0f, sum = 0.0f;  // the best logit, and sum_j exp(logit_j - top)
    warp_topk(
        E, k, lane, [&](int e) { return row[e]; },
        [&](int j, int e, float v) {
          if (j == 0) top = v;
          sum += expf(v - top);
          if (lane == 0) {
            row_indices[j] = e;
            row_probs[j] = v;
          }
        });
    if (lane == 0)
      for (int j = 0; j < k; ++j) row_probs[j] = expf(row_probs[j] - top) / sum;
  }
}

// Softmax backward dz = y o (dy - <y, dy>); in both modes <y, dy> over the softmax's
// outputs is sum_j probs_j dprobs_j (dy is zero off the chosen experts). Every lane writes
// its own experts, looking the chosen ones up in the row's k indices.
template <bool kPreSoftmax>
__global__ void topk_softmax_backward_kernel(const float* __restrict__ dprobs,
                                             const float* __restrict__ logits,
                                             const float* __restrict__ probs,
                                             const int32_t* __restrict__ indices, int64_t T, int E,
                                             int k, float* __restrict__ dlogits) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= T) return;
  const float* row_probs = probs + t * k;
  const float* row_dprobs = dprobs + t * k;
  const int32_t* row_indices = indices + t * k;
  float* drow = dlogits + t * E;
  float dot = 0.0f;
  for (int j = lane; j < k; j += 32) dot += row_probs[j] * row_dprobs[j];
  dot = warp_sum(dot);
  if constexpr (kPreSoftmax) {
    const float* row = logits + t * E;
    float row_max, row_sum;
    warp_softmax_stats(row, E, lane, row_max, row_sum);
    for (int e = lane; e < E; e += 32) {
      const float score = expf(row[e] - row_max) / row_sum;
      float d = -score * dot;
      for (int j = 0; j < k; ++j)
        if (row_indices[j] == e) d += score * row_dprobs[j];
      drow[e] = d;
    }
  } else {
    for (int e = lane; e < E; e += 32) {
      float d = 0.0f;
      for (int j = 0; j < k; ++j)
        if (row_indices[j] == e) d = row_probs[j] * (row_dprobs[j] - dot);
      drow[e] = d;
    }
  }
}

// Aux-loss routing: scores = softmax over all E (written), routing map = top-k of those
// scores, counted per expert with integer atomics (order-free, hence deterministic).
__global__ void aux_scores_kernel(const float* __restrict__ logits, int64_t T, int E, int k,
                                  float* scores, int32_t* __restrict__ counts) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= T) return;
  const float* row = logits + t * E;
  float* row_scores = scores + t * E;
  float row_max, row_sum;
  warp_softmax_stats(row, E, lane, row_max, row_sum);
  for (int e = lane; e < E; e += 32) row_scores[e] = expf(row[e] - row_max) / row_sum;
  // Each lane reads back only the scores it wrote itself.
  warp_topk(
      E, k, lane, [&](int e) { return row_scores[e]; },
      [&](int, int e, float) {
        if (lane == 0) atomicAdd(counts + e, 1);
      });
}

constexpr int kAuxRowsPerChunk = 64;
constexpr int kAuxThreads = 256;

// partial[chunk, e] = sum of scores[t, e] over the chunk's rows, fp64, in row order.
__global__ void aux_score_sums_kernel(const float* __restrict__ scores, int64_t T, int E,
                                      double* __restrict__ partial) {
  const int64_t first = int64_t(blockIdx.x) * kAuxRowsPerChunk;
  const int64_t last = min(first + kAuxRowsPerChunk, T);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double acc = 0.0;
    for (int64_t t = first; t < last; ++t) acc += scores[t * E + e];
    partial[int64_t(blockIdx.x) * E + e] = acc;
  }
}

// One block: tokens_per_expert[e] = counts[e]; *aux_sum = sum_e (sum_t scores[t, e]) *
// counts[e], every sum in a fixed order.
__global__ void aux_finish_kernel(const double* __restrict__ partial, int chunks,
                                  const int32_t* __restrict__ counts, int E,
                                  float* __restrict__ tokens_per_expert,
                                  double* __restrict__ aux_sum) {
  __shared__ double terms[kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double score_sum = 0.0;
    for (int c = 0; c < chunks; ++c) score_sum += partial[int64_t(c) * E + e];
    tokens_per_expert[e] = float(counts[e]);
    terms[e] = score_sum * double(counts[e]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double aux = 0.0;
    for (int e = 0; e < E; ++e) aux += terms[e];
    *aux_sum = aux;
  }
}

// dlogits[t, :] += s o (c - <s, c>), c[e] = factor * tokens_per_expert[e] = d aux / d s[t, e].
__global__ void aux_backward_kernel(const float* __restrict__ scores,
                                    const float* __restrict__ tokens_per_expert, float factor,
                                    int64_t T, int E, float* __restrict__ dlogits) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= T) return;
  const float* row = scores + t * E;
  float* drow = dlogits + t * E;
  float dot = 0.0f;
  for (int e = lane; e < E; e += 32) dot += row[e] * (factor * tokens_per_expert[e]);
  dot = warp_sum(dot);
  for (int e = lane; e < E; e += 32) drow[e] += row[e] * (factor * tokens_per_expert[e] - dot);
}

}  // namespace

void moe_topk_softmax_forward(const Tensor& logits, int k, bool pre_softmax, Tensor& probs,
                              Tensor& indices) {
  check_router_matrix(logits, k, "logits");
  const int64_t T = logits.dim(0);
  const int E = int(logits.dim(1));
  check_on_gpu(probs, DType::F32, "probs");
  check_shape(probs, {T, k}, "probs");
  check_on_gpu(indices, DType::I32, "indices");
  check_shape(indices, {T, k}, "indices");
  if (T == 0) return;
  auto launch = [&](auto kernel) {
    kernel<<<row_blocks(T), kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
        logits.f32(), T, E, k, probs.f32(), indices.i32());
    MEGATON_CUDA_CHECK_LAUNCH();
  };
  if (pre_softmax)
    launch(topk_softmax_forward_kernel<true>);
  else
    launch(topk_softmax_forward_kernel<false>);
}

void moe_topk_softmax_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& probs,
                               const Tensor& indices, bool pre_softmax, Tensor& dlogits) {
  check_on_gpu(probs, DType::F32, "probs");
  MEGATON_CHECK(probs.ndim() == 2, "moe_route: probs must be [T, k], got {}",
                shape_str(probs.shape()));
  const int k = int(probs.dim(1));
  check_router_matrix(logits, k, "logits");
  const int64_t T = logits.dim(0);
  const int E = int(logits.dim(1));
  check_shape(probs, {T, k}, "probs");
  check_on_gpu(dprobs, DType::F32, "dprobs");
  check_shape(dprobs, {T, k}, "dprobs");
  check_on_gpu(indices, DType::I32, "indices");
  check_shape(indices, {T, k}, "indices");
  check_on_gpu(dlogits, DType::F32, "dlogits");
  check_shape(dlogits, {T, E}, "dlogits");
  if (T == 0) return;
  // Indices come from moe_topk_softmax_forward; one outside [0, E) matches no expert and
  // its gradient is dropped (the CPU twin checks them, which here would cost a host copy).
  auto launch = [&](auto kernel) {
    kernel<<<row_blocks(T), kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
        dprobs.f32(), logits.f32(), probs.f32(), indices.i32(), T, E, k, dlogits.f32());
    MEGATON_CUDA_CHECK_LAUNCH();
  };
  if (pre_softmax)
    launch(topk_softmax_backward_kernel<true>);
  else
    launch(topk_softmax_backward_kernel<false>);
}

float moe_aux_loss_forward(const Tensor& logits, int k, float coeff, Tensor& scores,
                           Tensor& tokens_per_expert) {
  check_router_matrix(logits, k, "logits");
  const int64_t T = logits.dim(0);
  const int E = int(logits.dim(1));
  check_on_gpu(scores, DType::F32, "scores");
  check_shape(scores, {T, E}, "scores");
  check_on_gpu(tokens_per_expert, DType::F32, "tokens_per_expert");
  check_shape(tokens_per_expert, {E}, "tokens_per_expert");
  if (T == 0) {
    tokens_per_expert.zero();
    return 0.0f;
  }
  cudaStream_t stream = ::megaton::cuda::stream();
  const int64_t chunks = (T + kAuxRowsPerChunk - 1) / kAuxRowsPerChunk;
  MEGATON_CHECK(chunks <= INT32_MAX, "moe_route: {} tokens exceed the grid limit", T);
  Tensor counts = Tensor::zeros({E}, DType::I32, Device::CUDA);
  // fp64 scratch held in I64 tensors (same size; Tensor has no F64 dtype).
  Tensor partial_f64 = Tensor::empty({chunks, E}, DType::I64, Device::CUDA);
  Tensor aux_f64 = Tensor::empty({1}, DType::I64, Device::CUDA);
  auto* partial_ptr = static_cast<double*>(partial_f64.raw());
  auto* aux_ptr = static_cast<double*>(aux_f64.raw());

  aux_scores_kernel<<<row_blocks(T), kWarpsPerBlock * 32, 0, stream>>>(logits.f32(), T, E, k,
                                                                       scores.f32(), counts.i32());
  MEGATON_CUDA_CHECK_LAUNCH();
  aux_score_sums_kernel<<<unsigned(chunks), kAuxThreads, 0, stream>>>(scores.f32(), T, E,
                                                                      partial_ptr);
  MEGATON_CUDA_CHECK_LAUNCH();
  aux_finish_kernel<<<1, kAuxThreads, 0, stream>>>(partial_ptr, int(chunks), counts.i32(), E,
                                                   tokens_per_expert.f32(), aux_ptr);
  MEGATON_CUDA_CHECK_LAUNCH();
  double aux = 0.0;
  MEGATON_CUDA_CHECK(
      cudaMemcpyAsync(&aux, aux_ptr, sizeof(double), cudaMemcpyDeviceToHost, stream));
  ::megaton::cuda::synchronize();
  // switch_load_balancing_loss_func: coeff * E / (k * T^2) * sum_e (sum_t p[t,e]) * n[e].
  return float(double(coeff) * double(E) / (double(k) * double(T) * double(T)) * aux);
}

void moe_aux_loss_backward(float grad_scale, const Tensor& scores, const Tensor& tokens_per_expert,
                           int k, float coeff, Tensor& dlogits) {
  check_router_matrix(scores, k, "scores");
  const int64_t T = scores.dim(0);
  const int E = int(scores.dim(1));
  check_on_gpu(tokens_per_expert, DType::F32, "tokens_per_expert");
  check_shape(tokens_per_expert, {E}, "tokens_per_expert");
  check_on_gpu(dlogits, DType::F32, "dlogits");
  check_shape(dlogits, {T, E}, "dlogits");
  if (T == 0) return;
  // tokens_per_expert is a constant (counts from a top-k carry no gradient in Megatron).
  const double factor =
      double(grad_scale) * double(coeff) * double(E) / (double(k) * double(T) * double(T));
  aux_backward_kernel<<<row_blocks(T), kWarpsPerBlock * 32, 0, ::megaton::cuda::stream()>>>(
      scores.f32(), tokens_per_expert.f32(), float(factor), T, E, dlogits.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
