// Softmax cross-entropy over the vocabulary on the GPU: one block per token row, fp32 math
// on BF16 or F32 logits, never materialising the fp32 probabilities.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

// ---- host: door checks and launch helpers ----

void check_on_gpu(const Tensor& t, DType want, const char* name) {
  MEGATON_CHECK(t.defined(), "cross_entropy: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CUDA, "cross_entropy: {} must be on the GPU", name);
  MEGATON_CHECK(t.dtype() == want, "cross_entropy: {} must be {}, got {}", name, dtype_name(want),
                dtype_name(t.dtype()));
}

void check_logits_labels(const Tensor& logits, const Tensor& labels) {
  MEGATON_CHECK(logits.defined() && logits.device() == Device::CUDA,
                "cross_entropy: logits must be allocated on the GPU");
  MEGATON_CHECK(logits.dtype() == DType::F32 || logits.dtype() == DType::BF16,
                "cross_entropy: logits must be F32 or BF16, got {}", dtype_name(logits.dtype()));
  MEGATON_CHECK(logits.ndim() == 2 && logits.dim(1) > 0,
                "cross_entropy: logits must be [T, V] with V > 0, got {}",
                shape_str(logits.shape()));
  MEGATON_CHECK(logits.dim(0) <= INT32_MAX, "cross_entropy: {} rows exceed the grid limit",
                logits.dim(0));
  check_on_gpu(labels, DType::I32, "labels");
  MEGATON_CHECK(labels.shape() == Shape{logits.dim(0)}, "cross_entropy: labels {} must be [{}]",
                shape_str(labels.shape()), logits.dim(0));
}

void check_vector(const Tensor& t, int64_t T, const char* name) {
  check_on_gpu(t, DType::F32, name);
  MEGATON_CHECK(t.shape() == Shape{T}, "cross_entropy: {} {} must be [{}]", name,
                shape_str(t.shape()), T);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Threads per row: enough for a few packs each, a multiple of the warp, at most 512.
int threads_for(int64_t packs) {
  int64_t want = (packs + 3) / 4;
  want = (want + 31) / 32 * 32;
  return int(want < 32 ? 32 : (want > 512 ? 512 : want));
}

// ---- device ----

using detail::from_float;  // round-to-nearest-even, as the CPU's float_to_bf16
using detail::to_float;

// kN consecutive elements moved as one aligned load/store (16 bytes when kN * sizeof(T) is).
template <typename T, int kN>
struct alignas(sizeof(T) * kN) Pack {
  T v[kN];
};

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
// at most 1024.
__device__ MaxSum block_merge(MaxSum v) {
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

// losses[t] = lse[t] - logits[t, labels[t]], lse[t] = logsumexp(logits[t, :]). One block
// per row; each thread keeps an online (max, sum) over its packs, rescaling once per pack.
// A label outside [0, V) gives a NaN loss (the CPU twin throws; here the loss shows it).
template <typename T, int kN>
__global__ void cross_entropy_forward_kernel(const T* __restrict__ logits,
                                             const int32_t* __restrict__ labels,
                                             float* __restrict__ losses, float* __restrict__ lse,
                                             int64_t V) {
  const int64_t t = blockIdx.x;
  const T* row = logits + t * V;
  const int64_t packs = V / kN;
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, kN> pack = reinterpret_cast<const Pack<T, kN>*>(row)[i];
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
  acc = block_merge(acc);
  if (threadIdx.x == 0) {
    const float row_lse = acc.max + logf(acc.sum);
    const int32_t label = labels[t];
    lse[t] = row_lse;
    losses[t] = (label >= 0 && label < V) ? row_lse - to_float(row[label]) : NAN;
  }
}

// dlogits[t, v] = dlosses[t] * (exp(logits[t, v] - lse[t]) - [v == labels[t]]). dlogits
// may alias logits: each thread reads a pack before writing the same pack, and no other
// thread touches it, so the pointers carry no __restrict__.
template <typename T, int kN>
__global__ void cross_entropy_backward_kernel(const float* __restrict__ dlosses, const T* logits,
                                              const int32_t* __restrict__ labels,
                                              const float* __restrict__ lse, T* dlogits,
                                              int64_t V) {
  const int64_t t = blockIdx.x;
  const T* row = logits + t * V;
  T* drow = dlogits + t * V;
  const int32_t label = labels[t];
  // A bad label turns the row into NaN, as the forward's loss.
  const float g = (label >= 0 && label < V) ? dlosses[t] : NAN;
  const float row_lse = lse[t];
  const int64_t packs = V / kN;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, kN> in = reinterpret_cast<const Pack<T, kN>*>(row)[i];
    Pack<T, kN> out;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float d = g * expf(to_float(in.v[j]) - row_lse);
      if (i * kN + j == label) d -= g;
      out.v[j] = from_float<T>(d);
    }
    reinterpret_cast<Pack<T, kN>*>(drow)[i] = out;
  }
}

template <typename T, int kN>
void launch_forward(const Tensor& logits, const Tensor& labels, Tensor& losses, Tensor& lse) {
  const int64_t T_rows = logits.dim(0), V = logits.dim(1);
  cross_entropy_forward_kernel<T, kN>
      <<<unsigned(T_rows), threads_for(V / kN), 0, ::megaton::cuda::stream()>>>(
          static_cast<const T*>(logits.raw()), labels.i32(), losses.f32(), lse.f32(), V);
  MEGATON_CUDA_CHECK_LAUNCH();
}

template <typename T, int kN>
void launch_backward(const Tensor& dlosses, const Tensor& logits, const Tensor& labels,
                     const Tensor& lse, Tensor& dlogits) {
  const int64_t T_rows = logits.dim(0), V = logits.dim(1);
  cross_entropy_backward_kernel<T, kN>
      <<<unsigned(T_rows), threads_for(V / kN), 0, ::megaton::cuda::stream()>>>(
          dlosses.f32(), static_cast<const T*>(logits.raw()), labels.i32(), lse.f32(),
          static_cast<T*>(dlogits.raw()), V);
  MEGATON_CUDA_CHECK_LAUNCH();
}

// Whether rows of V elements of size `elem` starting at every pointer in ptrs can be read
// in 16-byte packs.
bool packs_fit(int64_t V, size_t elem, std::initializer_list<const void*> ptrs) {
  if ((V * int64_t(elem)) % 16 != 0) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

}  // namespace

void cross_entropy_forward(const Tensor& logits, const Tensor& labels, Tensor& losses,
                           Tensor& lse) {
  check_logits_labels(logits, labels);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_vector(losses, T, "losses");
  check_vector(lse, T, "lse");
  if (T == 0) return;
  const bool packed = packs_fit(V, dtype_size(logits.dtype()), {logits.raw()});
  if (logits.dtype() == DType::BF16) {
    if (packed)
      launch_forward<__nv_bfloat16, 8>(logits, labels, losses, lse);
    else
      launch_forward<__nv_bfloat16, 1>(logits, labels, losses, lse);
  } else {
    if (packed)
      launch_forward<float, 4>(logits, labels, losses, lse);
    else
      launch_forward<float, 1>(logits, labels, losses, lse);
  }
}

void cross_entropy_backward(const Tensor& dlosses, const Tensor& logits, const Tensor& labels,
                            const Tensor& lse, Tensor& dlogits) {
  check_logits_labels(logits, labels);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_vector(dlosses, T, "dlosses");
  check_vector(lse, T, "lse");
  check_on_gpu(dlogits, logits.dtype(), "dlogits");
  MEGATON_CHECK(dlogits.shape() == logits.shape(), "cross_entropy: dlogits {} must match logits {}",
                shape_str(dlogits.shape()), shape_str(logits.shape()));
  // In place (the same elements) is supported; a partial overlap would let one row's
  // writes feed another row's reads.
  const char* in = static_cast<const char*>(logits.raw());
  const char* out = static_cast<const char*>(dlogits.raw());
  const size_t bytes = logits.nbytes();
  MEGATON_CHECK(in == out || in + bytes <= out || out + bytes <= in,
                "cross_entropy: dlogits partially overlaps logits (in place must be exact)");
  if (T == 0) return;
  const bool packed = packs_fit(V, dtype_size(logits.dtype()), {logits.raw(), dlogits.raw()});
  if (logits.dtype() == DType::BF16) {
    if (packed)
      launch_backward<__nv_bfloat16, 8>(dlosses, logits, labels, lse, dlogits);
    else
      launch_backward<__nv_bfloat16, 1>(dlosses, logits, labels, lse, dlogits);
  } else {
    if (packed)
      launch_backward<float, 4>(dlosses, logits, labels, lse, dlogits);
    else
      launch_backward<float, 1>(dlosses, logits, labels, lse, dlogits);
  }
}

}  // namespace megaton::ops::cuda
