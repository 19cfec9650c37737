// AdamW optimizer step on the CPU (fp32 param and state, fp64 arithmetic per element).
#include <cmath>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

void check_f32(const Tensor& t, int64_t numel, const char* name) {
  MEGATON_CHECK(t.defined(), "adamw_step: {} is undefined", name);
  MEGATON_CHECK(t.dtype() == DType::F32, "adamw_step: {} must be F32, got {}", name,
                dtype_name(t.dtype()));
  MEGATON_CHECK(t.numel() == numel, "adamw_step: {} {} has {} elements, param has {}", name,
                shape_str(t.shape()), t.numel(), numel);
  // A CUDA backend dispatches on the device after the checks; this binary has only CPU.
  MEGATON_CHECK(t.device() == Device::CPU, "adamw_step: no CUDA backend in this build ({})", name);
}

namespace cpu {

// torch.optim.AdamW (_single_tensor_adamw) in the form ops.h documents:
//   p -= lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//   p -= lr * (m / bc1) / (sqrt(v / bc2) + eps), bc_i = 1 - b_i^step.
void adamw_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step) {
  const double bias_correction1 = 1.0 - std::pow(beta1, double(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, double(step));
  const double decay = 1.0 - lr * weight_decay;
#pragma omp parallel for schedule(static) if (n >= (1 << 15))
  for (int64_t i = 0; i < n; ++i) {
    double g = grad[i];
    double m = beta1 * exp_avg[i] + (1.0 - beta1) * g;
    double v = beta2 * exp_avg_sq[i] + (1.0 - beta2) * g * g;
    double p = double(param[i]) * decay;
    p -= lr * (m / bias_correction1) / (std::sqrt(v / bias_correction2) + eps);
    exp_avg[i] = float(m);
    exp_avg_sq[i] = float(v);
    param[i] = float(p);
  }
}

}  // namespace cpu
}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, float lr,
                float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  MEGATON_CUDA_DISPATCH(param, cuda::adamw_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step));
  int64_t n = param.numel();
  check_f32(param, n, "param");
  check_f32(grad, n, "grad");
  check_f32(exp_avg, n, "exp_avg");
  check_f32(exp_avg_sq, n, "exp_avg_sq");
  MEGATON_CHECK(step >= 1, "adamw_step: step {} must be >= 1 (1-based)", step);
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "adamw_step: betas ({}, {}) must be in [0, 1)", beta1, beta2);
  cpu::adamw_step(param.f32(), grad.f32(), exp_avg.f32(), exp_avg_sq.f32(), n, lr, beta1, beta2,
                  eps, weight_decay, step);
}

}  // namespace megaton::ops
