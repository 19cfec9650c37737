// Attention of new queries over a KV cache on the GPU (generation), F32, BF16 and F16.
// Semantics: ops.h attention_kv_cache; CPU twin: ops/cpu/attention_kv_cache.cpp.
//
// One thread block per (query, head); its kWarps warps split the causal prefix of the
// cache (warp w takes keys w, w + kWarps, ...). A warp holds the query in registers, Dqk/32
// values a lane, and its value accumulator, Dv/32 a lane (lane l owns elements l, l + 32,
// ...: each key and value row is read as coalesced 32-element runs), computes one score
// per key with a warp reduction and keeps an online softmax (running max, sum and weighted
// value sum; Milakov & Gimelshein 2018) in fp32. The warps' partial results are merged in
// shared memory at the end, rescaled to the common max. A decode step is bound by reading
// the cache once per query head: simple and correct first (no split over blocks, no tensor
// cores).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::from_float;
using detail::to_float;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxChunks = 16;  // Dqk, Dv <= 16 x 32 = 512
constexpr int kMaxD = kMaxChunks * 32;

// kChunks = ceil(max(Dqk, Dv) / 32) rounded up to a power of two, so the per-lane arrays stay
// in registers (fully unrolled loops) without paying for 512 values at small head dims.
template <typename T, int kChunks>
__global__ void __launch_bounds__(kThreads)
    attention_kv_cache_kernel(const T* __restrict__ q, const T* __restrict__ key_cache,
                              const T* __restrict__ value_cache, T* __restrict__ out,
                              int64_t first_position, int Hq, int Hkv, int D, int Dv, float scale) {
  __shared__ float warp_acc[kWarps][kMaxD];
  __shared__ float warp_max[kWarps], warp_denominator[kWarps];
  const int64_t task = blockIdx.x;  // i * Hq + h
  const int64_t i = task / Hq;
  const int h = int(task % Hq), kv_head = h / (Hq / Hkv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t keys = first_position + i + 1;
  const int64_t k_row = int64_t(Hkv) * D, v_row = int64_t(Hkv) * Dv;
  const T* q_i = q + task * D;

  float q_reg[kChunks], acc[kChunks];
#pragma unroll
  for (int t = 0; t < kChunks; ++t) {
    const int c = lane + 32 * t;
    q_reg[t] = c < D ? to_float(q_i[c]) : 0.0f;
    acc[t] = 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  for (int64_t j = warp; j < keys; j += kWarps) {
    const T* k_j = key_cache + j * k_row + int64_t(kv_head) * D;
    const T* v_j = value_cache + j * v_row + int64_t(kv_head) * Dv;
    float dot = 0.0f;
#pragma unroll
    for (int t = 0; t < kChunks; ++t) {
      const int c = lane + 32 * t;
      if (c < D) dot += q_reg[t] * to_float(k_j[c]);
    }
    const float score = detail::warp_sum(dot) * scale;
    // The first key of a warp has running_max = -inf: correction exp(-inf) = 0 on the
    // (zero) state. Scores are finite, so the new max is too.
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);
    const float p = expf(score - new_max);
    running_sum = running_sum * correction + p;
#pragma unroll
    for (int t = 0; t < kChunks; ++t) {
      const int c = lane + 32 * t;
      acc[t] = acc[t] * correction + (c < Dv ? p * to_float(v_j[c]) : 0.0f);
    }
    running_max = new_max;
  }
#pragma unroll
  for (int t = 0; t < kChunks; ++t) {
    const int c = lane + 32 * t;
    if (c < Dv) warp_acc[warp][c] = acc[t];
  }
  if (lane == 0) {
    warp_max[warp] = running_max;
    warp_denominator[warp] = running_sum;
  }
  __syncthreads();
  // Warp 0 always has key 0, so the common max is finite; a warp that had no key
  // (running_max -inf) gets weight exp(-inf) = 0.
  float block_max = warp_max[0];
  for (int w = 1; w < kWarps; ++w) block_max = fmaxf(block_max, warp_max[w]);
  float weights[kWarps];
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    weights[w] = expf(warp_max[w] - block_max);
    total += weights[w] * warp_denominator[w];
  }
  const float inv_total = 1.0f / total;
  T* o_i = out + task * Dv;
  for (int c = threadIdx.x; c < Dv; c += kThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      if (weights[w] > 0.0f) v += weights[w] * warp_acc[w][c];
    o_i[c] = from_float<T>(v * inv_total);
  }
}

template <typename T, int kChunks>
void launch(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
            int64_t first_position, Tensor& out, float scale) {
  const int64_t n = q.dim(0);
  const int Hq = int(q.dim(1)), D = int(q.dim(2)), Hkv = int(key_cache.dim(1));
  const int Dv = int(value_cache.dim(2));
  auto ptr = [](const Tensor& t) { return static_cast<T*>(t.raw()); };
  attention_kv_cache_kernel<T, kChunks>
      <<<unsigned(n * Hq), kThreads, 0, detail::compute_stream()>>>(
          ptr(q), ptr(key_cache), ptr(value_cache), ptr(out), first_position, Hq, Hkv, D, Dv,
          scale);
  MEGATON_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_for_d(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                  int64_t first_position, Tensor& out, float scale) {
  const int64_t chunks = (std::max(q.dim(2), value_cache.dim(2)) + 31) / 32;
  if (chunks <= 1) launch<T, 1>(q, key_cache, value_cache, first_position, out, scale);
  else if (chunks <= 2) launch<T, 2>(q, key_cache, value_cache, first_position, out, scale);
  else if (chunks <= 4) launch<T, 4>(q, key_cache, value_cache, first_position, out, scale);
  else if (chunks <= 8) launch<T, 8>(q, key_cache, value_cache, first_position, out, scale);
  else launch<T, 16>(q, key_cache, value_cache, first_position, out, scale);
}

}  // namespace

void attention_kv_cache(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                        int64_t first_position, Tensor& out, float softmax_scale) {
  const char* op = "cuda attention_kv_cache";
  detail::check_float(q, op, "q");
  detail::check_float(key_cache, op, "key_cache");
  detail::check_float(value_cache, op, "value_cache");
  detail::check_float(out, op, "out");
  detail::check_same_dtype(key_cache, q, op, "key_cache", "q");
  detail::check_same_dtype(value_cache, q, op, "value_cache", "q");
  detail::check_same_dtype(out, q, op, "out", "q");
  MEGATON_CHECK(q.ndim() == 3, "{}: q must be [n, Hq, Dqk], got {}", op, shape_str(q.shape()));
  MEGATON_CHECK(key_cache.ndim() == 3, "{}: key_cache must be [max_positions, Hkv, Dqk], got {}",
                op, shape_str(key_cache.shape()));
  MEGATON_CHECK(value_cache.ndim() == 3, "{}: value_cache must be [max_positions, Hkv, Dv], got {}",
                op, shape_str(value_cache.shape()));
  const int64_t n = q.dim(0), Hq = q.dim(1), D = q.dim(2), Dv = value_cache.dim(2);
  const int64_t max_positions = key_cache.dim(0), Hkv = key_cache.dim(1);
  MEGATON_CHECK(Hq > 0 && D > 0 && Dv > 0,
                "{}: q {} or value_cache {} has no heads or an empty head dim", op,
                shape_str(q.shape()), shape_str(value_cache.shape()));
  MEGATON_CHECK(Hkv > 0 && Hq % Hkv == 0,
                "{}: query heads {} must be a multiple of key/value heads {}", op, Hq, Hkv);
  MEGATON_CHECK(key_cache.dim(2) == D, "{}: key_cache {} and q {} differ in Dqk", op,
                shape_str(key_cache.shape()), shape_str(q.shape()));
  MEGATON_CHECK(value_cache.dim(0) == max_positions && value_cache.dim(1) == Hkv,
                "{}: value_cache {} must have key_cache {}'s positions and heads", op,
                shape_str(value_cache.shape()), shape_str(key_cache.shape()));
  MEGATON_CHECK(out.shape() == Shape({n, Hq, Dv}), "{}: out {} must be [n, Hq, Dv] = [{}, {}, {}]",
                op, shape_str(out.shape()), n, Hq, Dv);
  MEGATON_CHECK(D <= kMaxD && Dv <= kMaxD, "{}: head dims {} and {} exceed the supported {}", op, D,
                Dv, kMaxD);
  MEGATON_CHECK(n * Hq <= INT32_MAX, "{}: n * Hq = {} exceeds the grid limit", op, n * Hq);
  MEGATON_CHECK(first_position >= 0 && first_position + n <= max_positions,
                "{}: positions [{}, {}) outside the cache's {}", op, first_position,
                first_position + n, max_positions);
  if (n == 0) return;
  // As the CPU op.
  const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(D));
  detail::dispatch_float(q.dtype(), [&](auto tag) {
    launch_for_d<decltype(tag)>(q, key_cache, value_cache, first_position, out, scale);
  });
}

}  // namespace megaton::ops::cuda
