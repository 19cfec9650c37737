// Device pieces shared by the MoE router kernels (moe_router.cu, moe_router_stats.cu):
// the router's score functions, warp reductions, the top-k order, and the launch shape.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/ops.h"

namespace megaton::ops::cuda::router {

// One warp per token row: lane l owns experts l, l + 32, ... (at most 32 per lane, so a
// 32-bit mask per lane marks the experts it has already chosen or may not choose).
constexpr int kMaxExperts = 1024;
constexpr int kWarpsPerBlock = 8;  // token rows per block
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kNoExpert = INT32_MAX;

inline unsigned row_blocks(int64_t rows) {
  return unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// Calls f(std::integral_constant<int, N>) with N = experts per lane, the smallest power of
// two with 32 N >= E (E <= kMaxExperts, checked at the door): the row then lives in N
// registers per lane.
template <typename F>
void with_experts_per_lane(int64_t E, F&& f) {
  if (E <= 32)
    f(std::integral_constant<int, 1>{});
  else if (E <= 64)
    f(std::integral_constant<int, 2>{});
  else if (E <= 128)
    f(std::integral_constant<int, 4>{});
  else if (E <= 256)
    f(std::integral_constant<int, 8>{});
  else if (E <= 512)
    f(std::integral_constant<int, 16>{});
  else
    f(std::integral_constant<int, 32>{});
}

// ---- device ----

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// (score a, expert ea) ranks before (b, eb) in the CPU's top-k order: larger score first,
// lower expert index on ties. kNoExpert ranks last. The order is total, so every lane of
// a warp reduction agrees on the winner.
__device__ __forceinline__ bool ranks_before(float a, int ea, float b, int eb) {
  if (eb == kNoExpert) return ea != kNoExpert;
  if (ea == kNoExpert) return false;
  return a > b || (a == b && ea < eb);
}

// A candidate of a warp arg-max: its ranking key, its expert, and a value carried along.
struct Candidate {
  float key = 0.0f;
  int expert = kNoExpert;
  float payload = 0.0f;
};

__device__ __forceinline__ void offer(Candidate& best, float key, int expert, float payload) {
  if (ranks_before(key, expert, best.key, best.expert)) best = {key, expert, payload};
}

// The best candidate of the warp, returned to every lane.
__device__ __forceinline__ Candidate warp_best(Candidate c) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    Candidate other;
    other.key = __shfl_xor_sync(0xffffffffu, c.key, offset);
    other.expert = __shfl_xor_sync(0xffffffffu, c.expert, offset);
    other.payload = __shfl_xor_sync(0xffffffffu, c.payload, offset);
    if (ranks_before(other.key, other.expert, c.key, c.expert)) c = other;
  }
  return c;
}

// torch.sigmoid, and torch.nn.functional.softplus with its threshold 20 (x above it
// passes through), under a square root (Megatron's "sqrtsoftplus" score function).
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float sqrt_softplus(float x) { return sqrtf(softplus(x)); }

// d score / dx of the two elementwise score functions, from x and the score s(x).
__device__ __forceinline__ float sigmoid_grad(float s) { return s * (1.0f - s); }
__device__ __forceinline__ float sqrt_softplus_grad(float x, float s) {
  // softplus'(x) = sigmoid(x) (1 above the threshold); sqrt'(u) = 1 / (2 sqrt(u)); 0 where
  // s underflows (the limit as x -> -inf), as the CPU.
  if (!(s > 0.0f)) return 0.0f;
  const float dsoftplus = x > 20.0f ? 1.0f : sigmoid(x);
  return dsoftplus / (2.0f * s);
}

// In-place softmax over a row held N per lane (valid bit i: lane + 32 i < E).
template <int N>
__device__ __forceinline__ void warp_softmax(float (&v)[N], uint32_t valid) {
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (valid >> i & 1u) m = fmaxf(m, v[i]);
  m = warp_max(m);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (valid >> i & 1u) {
      v[i] = expf(v[i] - m);
      s += v[i];
    }
  s = warp_sum(s);
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (valid >> i & 1u) v[i] = v[i] / s;
}

// Softmax statistics (max and sum of exp(x - max)) of a row read from global memory,
// valid in every lane.
__device__ __forceinline__ void warp_softmax_stats(const float* row, int E, int lane,
                                                   float& row_max, float& row_sum) {
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, row[e]);
  row_max = warp_max(m);
  float s = 0.0f;
  for (int e = lane; e < E; e += 32) s += expf(row[e] - row_max);
  row_sum = warp_sum(s);
}

}  // namespace megaton::ops::cuda::router
