// Small pieces shared by Mamba-2's CUDA kernels (ssm_conv.cu, ssm_scan*.cu, ssm_norm.cu):
// per-channel parameter vectors of any float dtype, softplus and SiLU as the CPU ops define
// them (ops/ssm.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda::ssm {

// A vector of F32, BF16 or F16 values read as fp32 (A_log, D, dt_bias, the conv weight and
// bias, the norm weight): the dtype is a runtime tag, so one kernel serves every mix of
// parameter and activation dtypes. data == nullptr reads as zeros (an absent bias).
struct ParamVector {
  const void* data = nullptr;
  int kind = 0;  // 0 F32, 1 BF16, 2 F16
};

// The tensor's data and dtype tag; an undefined tensor gives the zero vector. InternalError
// for a dtype other than F32, BF16 or F16 (the doors check it first).
inline ParamVector param_vector(const Tensor& t) {
  ParamVector v;
  if (!t.defined() || t.numel() == 0) return v;
  v.data = t.raw();
  switch (t.dtype()) {
    case DType::F32:
      v.kind = 0;
      break;
    case DType::BF16:
      v.kind = 1;
      break;
    case DType::F16:
      v.kind = 2;
      break;
    default:
      MEGATON_CHECK(false, "ssm: parameter of dtype {} (F32, BF16 or F16 expected)",
                    dtype_name(t.dtype()));
  }
  return v;
}

__device__ __forceinline__ float param_at(const ParamVector& v, int64_t i) {
  if (v.data == nullptr) return 0.0f;
  switch (v.kind) {
    case 1:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(v.data)[i]);
    case 2:
      return __half2float(static_cast<const __half*>(v.data)[i]);
    default:
      return static_cast<const float*>(v.data)[i];
  }
}

// torch.nn.functional.softplus with beta 1 and threshold 20 (mamba_ssm's dt_softplus).
__device__ __forceinline__ float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }
// Its derivative: sigmoid(v), 1 above the threshold.
__device__ __forceinline__ float softplus_grad(float v) {
  return v > 20.0f ? 1.0f : 1.0f / (1.0f + expf(-v));
}

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

}  // namespace megaton::ops::cuda::ssm
