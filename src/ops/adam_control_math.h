// The scalar math of a device-controlled AdamW step (ops.h, adamw_step_control), shared
// by the CPU twin and the one-thread CUDA kernel so both compute the same bits.
#pragma once
#include <cmath>
#include <cstdint>

#include "ops/ops.h"

#ifdef __CUDACC__
#define MEGATON_HOST_DEVICE __host__ __device__
#else
#define MEGATON_HOST_DEVICE
#endif

namespace megaton::ops {

// base^n (n >= 0) by repeated squaring in fp64. Only IEEE multiplications, so the host
// and the GPU give the same bits (libm's and CUDA's pow may differ in the last ulp): the
// GPU AdamW's bias corrections use it whether computed on the host or on the device.
MEGATON_HOST_DEVICE inline double power_by_squaring(double base, int64_t n) {
  double result = 1.0;
  while (n > 0) {
    if (n & 1) result *= base;
    base *= base;
    n >>= 1;
  }
  return result;
}

// adamw_step_control's update of state, control and the norm (see ops.h), from the summed
// squares `sum`. loss: null, or the value checked under check_nan.
MEGATON_HOST_DEVICE inline void adam_control_math(double sum, double norm_scale, double max_norm,
                                                  float grad_scale_factor, const float* loss,
                                                  bool check_nan, float lr, float beta1,
                                                  float beta2, int64_t* state, float* control,
                                                  double* grad_norm) {
  const double norm = std::sqrt(sum) * norm_scale;
  *grad_norm = norm;
  const bool finite = std::isfinite(norm);
  if (check_nan && (!finite || (loss != nullptr && !std::isfinite(*loss)))) state[1] = 1;
  control[kAdamLr] = lr;
  const bool skip = state[1] != 0 || !finite;
  control[kAdamSkip] = skip ? 1.0f : 0.0f;
  if (skip) return;
  const int64_t step = ++state[0];
  // optim::clip_coefficient: a coefficient of 1 or more means no clipping.
  double clip = 1.0;
  if (max_norm > 0) {
    const double coeff = max_norm / (norm + 1.0e-6);
    clip = coeff < 1.0 ? coeff : 1.0;
  }
  const double bias_correction1 = 1.0 - power_by_squaring(double(beta1), step);
  const double bias_correction2 = 1.0 - power_by_squaring(double(beta2), step);
  control[kAdamStepSize] = float(double(lr) / bias_correction1);
  control[kAdamInvSqrtBc2] = float(1.0 / std::sqrt(bias_correction2));
  control[kAdamGradScale] = float(clip) * grad_scale_factor;
  control[kAdamStep] = float(step);
}

}  // namespace megaton::ops
