// adamw_step_control on the GPU: one thread runs the shared scalar math
// (ops/adam_control_math.h), so the step's clipping, skip and bias corrections never
// leave the device.
#include <bit>

#include "core/cuda/cuda_check.h"
#include "ops/adam_control_math.h"
#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {

namespace {
__global__ void adam_control_kernel(const double* parts, int64_t num_parts, double norm_scale,
                                    double max_norm, float grad_scale_factor, const float* loss,
                                    bool check_nan, const float* lr, float beta1, float beta2,
                                    int64_t* state, float* control, double* grad_norm) {
  double sum = 0.0;
  for (int64_t i = 0; i < num_parts; ++i) sum += parts[i];  // in index order, as the host
  adam_control_math(sum, norm_scale, max_norm, grad_scale_factor, loss, check_nan, *lr, beta1,
                    beta2, state, control, grad_norm);
}

}  // namespace

void adamw_step_control(const Tensor& sum_sq_parts, double norm_scale, double max_norm,
                        float grad_scale_factor, const Tensor& loss, bool check_nan,
                        const Tensor& lr, float beta1, float beta2, Tensor& state,
                        Tensor& control, Tensor& grad_norm_out) {
  // The ops door (ops/cpu/adam_control.cpp) has checked the dtypes, sizes and devices.
  adam_control_kernel<<<1, 1, 0, ::megaton::cuda::stream()>>>(
      static_cast<const double*>(sum_sq_parts.raw()), sum_sq_parts.numel(), norm_scale, max_norm,
      grad_scale_factor, loss.defined() ? loss.f32() : nullptr, check_nan, lr.f32(), beta1, beta2,
      state.i64(), control.f32(), static_cast<double*>(grad_norm_out.raw()));
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
