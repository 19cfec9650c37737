// Shared pieces of the pointwise and row-wise CUDA ops (norm, activation, dropout,
// embedding): door checks, float/BF16/F16 dtype dispatch, packed loads, atomics and block sums.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "core/cuda/cuda_check.h"
#include "core/tensor.h"

namespace megaton::ops::cuda::detail {

// The process's compute stream (megaton::cuda::stream(); inside megaton::ops::cuda the
// name `cuda::` means this namespace).
inline cudaStream_t compute_stream() { return ::megaton::cuda::stream(); }

// ---- door checks (host) ----

inline void check_cuda_tensor(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.device() == Device::CUDA, "{}: {} must be on the GPU, it is on the CPU", op,
                name);
}

// Whether the CUDA ops compute with tensors of this dtype: F32, BF16 (--bf16) or F16
// (--fp16).
inline bool is_cuda_float(DType dtype) {
  return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16;
}

// An activation or weight: F32, BF16 or F16, on the GPU.
inline void check_float(const Tensor& t, const char* op, const char* name) {
  check_cuda_tensor(t, op, name);
  MEGATON_CHECK(is_cuda_float(t.dtype()), "{}: {} must be F32, BF16 or F16, got {}", op, name,
                dtype_name(t.dtype()));
}

inline void check_dtype(const Tensor& t, DType want, const char* op, const char* name) {
  check_cuda_tensor(t, op, name);
  MEGATON_CHECK(t.dtype() == want, "{}: {} must be {}, got {}", op, name, dtype_name(want),
                dtype_name(t.dtype()));
}

inline void check_shape(const Tensor& t, const Shape& want, const char* op, const char* name) {
  MEGATON_CHECK(t.shape() == want, "{}: {} has shape {}, expected {}", op, name,
                shape_str(t.shape()), shape_str(want));
}

inline void check_same_shape(const Tensor& t, const Tensor& ref, const char* op, const char* name,
                             const char* ref_name) {
  MEGATON_CHECK(t.shape() == ref.shape(), "{}: {} {} must have the shape of {} {}", op, name,
                shape_str(t.shape()), ref_name, shape_str(ref.shape()));
}

inline void check_same_dtype(const Tensor& t, const Tensor& ref, const char* op, const char* name,
                             const char* ref_name) {
  MEGATON_CHECK(t.dtype() == ref.dtype(), "{}: {} ({}) must have the dtype of {} ({})", op, name,
                dtype_name(t.dtype()), ref_name, dtype_name(ref.dtype()));
}

// Calls f(T{}) with T = float for F32, __nv_bfloat16 for BF16 and __half for F16 (the
// dtype is checked at the door; anything else is an internal error here).
template <typename F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32:
      f(float{});
      return;
    case DType::BF16:
      f(__nv_bfloat16{});
      return;
    case DType::F16:
      f(__half{});
      return;
    default:
      MEGATON_CHECK(false, "no CUDA kernel for dtype {}", dtype_name(dtype));
  }
}

// Calls f(T{}) with T = float for F32 and __nv_bfloat16 for BF16 only: the FP8 ops, which
// quantize from and dequantize to those two (FP8 with --fp16 is refused before training
// starts; the CPU doors, ops/cpu/fp8_checks.h, refuse F16 inputs).
template <typename F>
void dispatch_f32_bf16(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32:
      f(float{});
      return;
    case DType::BF16:
      f(__nv_bfloat16{});
      return;
    default:
      MEGATON_CHECK(false, "no CUDA FP8 kernel for dtype {} (F32 or BF16)", dtype_name(dtype));
  }
}

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Elements per 16-byte load of T (8 for BF16 and F16, 4 for F32).
template <typename T>
constexpr int kPackElems = int(16 / sizeof(T));

// Blocks for a grid-stride loop over `items`: enough to fill the GPU several times over,
// within the 2^31 - 1 limit of gridDim.x.
inline unsigned grid_for(int64_t items, int threads) {
  int64_t blocks = (items + threads - 1) / threads;
  return unsigned(std::min<int64_t>(std::max<int64_t>(blocks, 1), int64_t(1) << 20));
}

// ---- device ----

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// Round-to-nearest-even, as the CPU's float_to_bf16 and float_to_fp16.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// N consecutive elements moved as aligned vector loads/stores of at most 16 bytes each
// (N = 1: a plain scalar access). Eight F32 weights next to eight 16-bit activations are
// two 16-byte loads, so a pack never needs more than 16-byte alignment.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

// Whether p may be accessed as Pack<T, N> (host side, before choosing a kernel).
template <int N, typename T>
bool pack_aligned(const T* p) {
  return is_aligned(p, alignof(Pack<T, N>));
}

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}
template <int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// dst[k] += v[k] for k < N (embedding backwards into fp32 main grads); four at a time with
// the float4 atomics of compute capability 9.0+, which take global memory only: dst must
// be a global address, 16-byte aligned when N == 4.
template <int N, typename T>
__device__ __forceinline__ void atomic_add_pack(float* dst, const Pack<T, N>& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (N == 4) {
    atomicAdd(reinterpret_cast<float4*>(dst),
              make_float4(to_float(v.v[0]), to_float(v.v[1]), to_float(v.v[2]), to_float(v.v[3])));
  } else
#endif
  {
#pragma unroll
    for (int k = 0; k < N; ++k) atomicAdd(dst + k, to_float(v.v[k]));
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of v over the block, returned to every thread. blockDim.x must be a multiple of 32.
// Every warp reduces the per-warp partials itself in the same order, so all threads get
// the same value and the result depends only on the block size, not on timing.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_partials[32];
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // an earlier call's readers are done with warp_partials
  if (lane == 0) warp_partials[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? warp_partials[lane] : 0.0f;
  return warp_sum(v);
}

}  // namespace megaton::ops::cuda::detail
