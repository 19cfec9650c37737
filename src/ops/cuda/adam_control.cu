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
                                    bool check_nan, float lr, float beta1, float beta2,
                                    int64_t* state, float* control, double* grad_norm) {
  double sum = 0.0;
  for (int64_t i = 0; i < num_parts; ++i) sum += parts[i];  // in index order, as the host
  adam_control_math(sum, norm_scale, max_norm, grad_scale_factor, loss, check_nan, lr, beta1,
                    beta2, state, control, grad_norm);
}

void check_tensor(const Tensor& t, DType dtype, int64_t numel, const char* name) {
  MEGATON_CHECK(t.defined() && t.dtype() == dtype && t.numel() == numel &&
                    t.device() == Device::CUDA,
                "adamw_step_control: {} must be {} with {} element(s) on the GPU", name,
                dtype_name(dtype), numel);
}
}  // namespace

void adamw_step_control(const Tensor& sum_sq_parts, double norm_scale, double max_norm,
                        float grad_scale_factor, const Tensor& loss, bool check_nan, float lr,
                        float beta1, float beta2, Tensor& state, Tensor& control,
                        Tensor& grad_norm_out) {
  MEGATON_CHECK(sum_sq_parts.dtype() == DType::I64 && sum_sq_parts.device() == Device::CUDA,
                "adamw_step_control: sum_sq_parts must be I64 (fp64 bits) on the GPU");
  check_tensor(state, DType::I64, 2, "state");
  check_tensor(control, DType::F32, kAdamControlSize, "control");
  check_tensor(grad_norm_out, DType::I64, 1, "grad_norm_out");
  if (loss.defined()) check_tensor(loss, DType::F32, 1, "loss");
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "adamw_step_control: betas ({}, {}) must be in [0, 1)", beta1, beta2);
  adam_control_kernel<<<1, 1, 0, ::megaton::cuda::stream()>>>(
      static_cast<const double*>(sum_sq_parts.raw()), sum_sq_parts.numel(), norm_scale, max_norm,
      grad_scale_factor, loss.defined() ? loss.f32() : nullptr, check_nan, lr, beta1, beta2,
      state.i64(), control.f32(), static_cast<double*>(grad_norm_out.raw()));
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
