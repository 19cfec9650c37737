// The element update of the precision-aware AdamW (moments stored in bf16), shared by the
// CPU twin (ops/cpu/multi_tensor.cpp) and the CUDA kernel (ops/cuda/multi_tensor.cu) so
// that both compute the same bits.
//
// multi_tensor_adamw (ops.h) dispatches on the moments' dtypes: with exp_avg and
// exp_avg_sq both F32 it runs the fp32-state update ops.h documents (unchanged); with
// either one BF16 (--use-precision-aware-optimizer --exp-avg-dtype / --exp-avg-sq-dtype
// bf16) every element is updated by adamw_precision_update below: the stored moment is
// widened to fp32, the update computed in fp32, the new moment rounded to nearest even
// into its dtype, as Transformer Engine's FusedAdam does for bf16 states (its
// multi_tensor_adam kernel reads and writes the bf16 moments, fp32 arithmetic in
// registers: transformer_engine/pytorch/optimizers/fused_adam.py, fuse_unscale). An F32
// moment in such a list is read and written as fp32 by the same formula.
//
// Each operation is one IEEE fp32 operation rounded on its own: products that feed a sum
// are written as explicit fused multiply-adds (std::fma / __fmaf_rn, both correctly
// rounded) and nothing else is left for a compiler to contract, so the host (GCC, FMA
// contraction on by default) and the GPU (nvcc --fmad) cannot differ. The formula is the
// fp32-state GPU kernel's (Megaton's form of torch.optim.AdamW):
//   g = grad * grad_scale
//   m = fma(b1, m, (1 - b1) * g)
//   v = fma(b2, v, ((1 - b2) * g) * g)
//   p = fma(-step_size, m / fma(sqrt(v), inv_sqrt_bc2, eps), p * decay)
// with step_size = float(lr / (1 - b1^step)), inv_sqrt_bc2 = float(1 / sqrt(1 - b2^step))
// (fp64, powers by squaring: adam_control_math.h) and decay = float(1 - lr * wd) (fp64).
#pragma once
#include <cmath>
#include <cstdint>

#include "ops/adam_control_math.h"

namespace megaton::ops {

// The step's constants of adamw_precision_update (one set for the whole list).
struct AdamPrecisionConstants {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float step_size, inv_sqrt_bc2, grad_scale;
};

// The constants for step `step` (>= 1) with learning rate lr, computed on the host in
// fp64 as the fp32-state GPU path computes them (launch_adamw), and as
// adamw_step_control writes them (control[kAdamStepSize], control[kAdamInvSqrtBc2]).
inline AdamPrecisionConstants adam_precision_constants(float lr, float beta1, float beta2,
                                                       float eps, int64_t step,
                                                       float grad_scale) {
  const double bias_correction1 = 1.0 - power_by_squaring(double(beta1), step);
  const double bias_correction2 = 1.0 - power_by_squaring(double(beta2), step);
  return {beta1,
          1.0f - beta1,
          beta2,
          1.0f - beta2,
          eps,
          float(double(lr) / bias_correction1),
          float(1.0 / std::sqrt(bias_correction2)),
          grad_scale};
}

// float(1 - lr * wd), each fp64 operation rounded on its own (the GPU's adamw_decay).
MEGATON_HOST_DEVICE inline float adam_precision_decay(float lr, float weight_decay) {
#ifdef __CUDA_ARCH__
  return float(__dsub_rn(1.0, __dmul_rn(double(lr), double(weight_decay))));
#else
  const volatile double product = double(lr) * double(weight_decay);  // not fused
  return float(1.0 - product);
#endif
}

// One element: p (fp32 main param), m and v (the moments widened to fp32) updated in
// place from the stored gradient `grad`.
MEGATON_HOST_DEVICE inline void adamw_precision_update(float& p, float grad, float& m, float& v,
                                                       float decay,
                                                       const AdamPrecisionConstants& c) {
#ifdef __CUDA_ARCH__
  const float g = __fmul_rn(grad, c.grad_scale);
  m = __fmaf_rn(c.beta1, m, __fmul_rn(c.one_minus_beta1, g));
  v = __fmaf_rn(c.beta2, v, __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
  const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_sqrt_bc2, c.eps);
  p = __fmaf_rn(-c.step_size, __fdiv_rn(m, denom), __fmul_rn(p, decay));
#else
  const float g = grad * c.grad_scale;
  m = std::fma(c.beta1, m, c.one_minus_beta1 * g);
  v = std::fma(c.beta2, v, (c.one_minus_beta2 * g) * g);
  const float denom = std::fma(std::sqrt(v), c.inv_sqrt_bc2, c.eps);
  p = std::fma(-c.step_size, m / denom, p * decay);
#endif
}

}  // namespace megaton::ops
