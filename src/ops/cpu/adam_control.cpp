// AdamW steps decided on the device: adamw_step_control and multi_tensor_adamw with a
// control tensor, on the CPU (the reference; the GPU versions are ops/cuda/adam_control.cu
// and multi_tensor.cu).
#include <bit>
#include <cmath>

#include "ops/adam_control_math.h"
#include "ops/adam_precision.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/multi_tensor_adamw.h"
#endif

namespace megaton::ops {

namespace {
void check_tensor(const Tensor& t, DType dtype, int64_t numel, const char* name) {
  MEGATON_CHECK(t.defined() && t.dtype() == dtype && t.numel() == numel,
                "adamw_step_control: {} must be {} with {} element(s)", name, dtype_name(dtype),
                numel);
}
}  // namespace

void adamw_step_control(const Tensor& sum_sq_parts, double norm_scale, double max_norm,
                        float grad_scale_factor, const Tensor& loss, bool check_nan,
                        const Tensor& lr, float beta1, float beta2, Tensor& state,
                        Tensor& control, Tensor& grad_norm_out) {
  // Checked here for both devices (the CUDA door checks nothing again).
  MEGATON_CHECK(sum_sq_parts.defined() && sum_sq_parts.dtype() == DType::I64,
                "adamw_step_control: sum_sq_parts must be I64 (fp64 bits)");
  check_tensor(state, DType::I64, 2, "state");
  check_tensor(control, DType::F32, kAdamControlSize, "control");
  check_tensor(grad_norm_out, DType::I64, 1, "grad_norm_out");
  if (loss.defined()) check_tensor(loss, DType::F32, 1, "loss");
  check_tensor(lr, DType::F32, 1, "lr");
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "adamw_step_control: betas ({}, {}) must be in [0, 1)", beta1, beta2);
  const std::initializer_list<const Tensor*> all = {&sum_sq_parts, &loss, &lr, &state, &control,
                                                    &grad_norm_out};
  for (const Tensor* t : all)
    MEGATON_CHECK(!t->defined() || t->device() == sum_sq_parts.device(),
                  "adamw_step_control: tensors on different devices");
  MEGATON_CUDA_DISPATCH(sum_sq_parts,
                        cuda::adamw_step_control(sum_sq_parts, norm_scale, max_norm,
                                                 grad_scale_factor, loss, check_nan, lr, beta1,
                                                 beta2, state, control, grad_norm_out));
  double sum = 0.0;
  for (int64_t i = 0; i < sum_sq_parts.numel(); ++i)
    sum += std::bit_cast<double>(sum_sq_parts.i64()[i]);
  double norm = 0.0;
  adam_control_math(sum, norm_scale, max_norm, grad_scale_factor,
                    loss.defined() ? loss.f32() : nullptr, check_nan, lr.f32()[0], beta1, beta2,
                    state.i64(), control.f32(), &norm);
  grad_norm_out.i64()[0] = std::bit_cast<int64_t>(norm);
}

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control) {
  multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, beta1, beta2,
                     eps, control, list_order_rounding_keys(params.size()));
}

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control,
                        const std::vector<MomentRoundingKey>& rounding_keys,
                        const AdamMomentScales& scales) {
  check_rounding_keys(rounding_keys, params.size(), "multi_tensor_adamw");
  if (params.empty()) return;
  MEGATON_CUDA_DISPATCH(
      params[0],
      cuda::multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays,
                               beta1, beta2, eps, control, rounding_keys, scales));
  MEGATON_CHECK(control.defined() && control.dtype() == DType::F32 &&
                    control.numel() == kAdamControlSize && control.device() == Device::CPU,
                "multi_tensor_adamw: control must be F32 [{}] on the params' device",
                kAdamControlSize);
  const float* c = control.f32();
  if (c[kAdamSkip] != 0.0f) return;
  multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, c[kAdamLr],
                     beta1, beta2, eps, int64_t(c[kAdamStep]), c[kAdamGradScale], rounding_keys,
                     scales);
}

}  // namespace megaton::ops
