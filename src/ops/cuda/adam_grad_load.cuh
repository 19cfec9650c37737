// Loads of the main grads the AdamW kernels read (multi_tensor_adamw.cu,
// param_remainder.cu): F32, or BF16 (--main-grads-dtype bf16) widened to fp32 (exact), as
// the CPU twin's GradRef (ops/cpu/adam_state_ref.h) reads them. The dtype is one flag per
// tensor, so the branch is uniform across a block and no kernel is instantiated twice.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda::detail {

// Element j of a main grad.
__device__ __forceinline__ float load_main_grad(const void* grad, bool bf16, int64_t j) {
  if (bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(grad)[j]);
  return static_cast<const float*>(grad)[j];
}

// Elements [i, i + 4) of a main grad as one aligned load (16 bytes F32, 8 bytes BF16:
// main_grad_pack_aligned).
__device__ __forceinline__ Pack<float, 4> load_main_grad_pack(const void* grad, bool bf16,
                                                              int64_t i) {
  if (!bf16) return load_pack<4>(static_cast<const float*>(grad) + i);
  const Pack<__nv_bfloat16, 4> b = load_pack<4>(static_cast<const __nv_bfloat16*>(grad) + i);
  Pack<float, 4> out;
#pragma unroll
  for (int k = 0; k < 4; ++k) out.v[k] = __bfloat162float(b.v[k]);
  return out;
}

// Whether a main grad at `grad` may be read by load_main_grad_pack (host side).
inline bool main_grad_pack_aligned(const void* grad, bool bf16) {
  return is_aligned(grad, bf16 ? 8 : 16);
}

}  // namespace megaton::ops::cuda::detail
