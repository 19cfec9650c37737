// Row pieces shared by the full-vocabulary (cross_entropy.cu) and vocab-parallel
// (vocab_parallel.cu) softmax cross entropy: launch shapes, the online (max, sum of
// exp) reduction of one row, and one row of the backward.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda::detail {

// ---- host: launch shapes ----

// Threads per row: enough for a few packs each, a multiple of the warp, at most 512.
inline int cross_entropy_threads(int64_t packs) {
  int64_t want = (packs + 3) / 4;
  want = (want + 31) / 32 * 32;
  return int(want < 32 ? 32 : (want > 512 ? 512 : want));
}

// Whether rows of V elements of size `elem` starting at every pointer in ptrs can be read
// in 16-byte packs.
inline bool rows_fit_packs(int64_t V, size_t elem, std::initializer_list<const void*> ptrs) {
  if ((V * int64_t(elem)) % 16 != 0) return false;
  for (const void* p : ptrs)
    if (!is_aligned(p, 16)) return false;
  return true;
}

// ---- device ----

// Running (max, sum of exp(x - max)) of a softmax denominator; (−inf, 0) is empty.
struct MaxSum {
  float max;
  float sum;
};

// Merges b into a. An empty side contributes nothing (no exp(-inf - -inf) = NaN); a NaN
// sum propagates.
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  if (b.max == -INFINITY && b.sum == 0.0f) return a;
  if (a.max == -INFINITY && a.sum == 0.0f) return b;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// Block-wide merge; the result is valid in every thread. blockDim.x is a multiple of 32,
// at most 1024. Called once per kernel (no barrier guards a second call's shared writes).
__device__ __forceinline__ MaxSum block_merge(MaxSum v) {
  __shared__ MaxSum warp_parts[32];
  __shared__ MaxSum result;
  for (int offset = 16; offset > 0; offset /= 2) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset),
                 __shfl_xor_sync(0xffffffffu, v.sum, offset)};
    v = merge(v, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_parts[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    v = lane < warps ? warp_parts[lane] : MaxSum{-INFINITY, 0.0f};
    for (int offset = 16; offset > 0; offset /= 2) {
      MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset),
                   __shfl_xor_sync(0xffffffffu, v.sum, offset)};
      v = merge(v, other);
    }
    if (lane == 0) result = v;
  }
  __syncthreads();
  return result;
}

// (max, sum of exp(x - max)) of row[0, V), V a multiple of kN, row aligned for kN-packs;
// valid in every thread of the block. Each thread keeps an online (max, sum) over its
// packs, rescaling once per pack.
template <typename T, int kN>
__device__ __forceinline__ MaxSum block_row_max_sum(const T* row, int64_t V) {
  const int64_t packs = V / kN;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, kN> pack = load_pack<kN>(row + i * kN);
    float x[kN];
    float pack_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      x[j] = to_float(pack.v[j]);
      pack_max = fmaxf(pack_max, x[j]);
    }
    // !(a <= b) rather than a > b: a NaN pack (fmaxf skips NaN unless all are) poisons.
    if (!(pack_max <= acc.max)) {
      acc.sum *= expf(acc.max - pack_max);
      acc.max = pack_max;
    }
    if (acc.max != -INFINITY) {
#pragma unroll
      for (int j = 0; j < kN; ++j) acc.sum += expf(x[j] - acc.max);
    }
  }
  return block_merge(acc);
}

// One row of the backward over a vocabulary shard [vocab_start, vocab_start + V):
// drow[v] = g * (exp(row[v] - row_lse) - [v + vocab_start == label]), g = dloss, or NaN
// for the whole row when the label is outside [0, label_end) (the full-vocabulary op
// passes V; a shard, which cannot know the global vocabulary, passes INT64_MAX). drow may
// alias row: each thread reads a pack before writing the same pack, and no other thread
// touches it, so the pointers carry no __restrict__. V a multiple of kN, rows aligned
// for kN-packs.
template <typename T, int kN>
__device__ __forceinline__ void cross_entropy_backward_row(float dloss, const T* row, int32_t label,
                                                           float row_lse, T* drow, int64_t V,
                                                           int64_t vocab_start, int64_t label_end) {
  const float g = (label >= 0 && label < label_end) ? dloss : NAN;
  const int64_t local_label = int64_t(label) - vocab_start;  // outside [0, V): no one-hot
  const int64_t packs = V / kN;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, kN> in = load_pack<kN>(row + i * kN);
    Pack<T, kN> out;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float d = g * expf(to_float(in.v[j]) - row_lse);
      if (i * kN + j == local_label) d -= g;
      out.v[j] = from_float<T>(d);
    }
    store_pack<kN>(drow + i * kN, out);
  }
}

}  // namespace megaton::ops::cuda::detail
