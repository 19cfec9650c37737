// fp32 main params as bf16 weights plus int16 remainders (ops/param_remainder.h): the doors
// (every check, for both devices) and the CPU twin, element by element with
// ops/param_remainder_math.h.
#include "ops/param_remainder.h"

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "ops/adam_precision.h"
#include "ops/cpu/adam_state_ref.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#include "ops/param_remainder_math.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/multi_tensor_adamw.h"
#endif

namespace megaton::ops {
namespace {

using cpu_adam::kParallelMin;

const char* device_name(Device d) { return d == Device::CPU ? "CPU" : "GPU"; }

void check_entry(const Tensor& t, DType dtype, int64_t numel, Device device, const char* op,
                 const char* name, size_t i) {
  MEGATON_CHECK(t.defined(), "{}: {}[{}] is undefined", op, name, i);
  MEGATON_CHECK(t.dtype() == dtype, "{}: {}[{}] must be {}, got {}", op, name, i,
                dtype_name(dtype), dtype_name(t.dtype()));
  MEGATON_CHECK(t.numel() == numel, "{}: {}[{}] {} has {} elements, expected {}", op, name, i,
                shape_str(t.shape()), t.numel(), numel);
  MEGATON_CHECK(t.device() == device, "{}: {}[{}] is on the {}, the weights on the {}", op, name,
                i, device_name(t.device()), device_name(device));
}

// A main grad: F32 or BF16.
void check_f32_or_bf16(const Tensor& t, int64_t numel, Device device, const char* op,
                       const char* name, size_t i) {
  check_entry(t, t.dtype() == DType::BF16 ? DType::BF16 : DType::F32, numel, device, op, name, i);
}

// A moment: F32, BF16, F16 or F8_E4M3 (the last two scaled).
void check_moment(const Tensor& t, int64_t numel, Device device, const char* op, const char* name,
                  size_t i) {
  const DType d = t.defined() ? t.dtype() : DType::F32;
  const bool known = d == DType::BF16 || d == DType::F16 || d == DType::F8E4M3 || d == DType::F32;
  check_entry(t, known ? d : DType::F32, numel, device, op, name, i);
}

// multi_tensor_adamw_param_remainder's checks (both overloads, both devices).
void check_remainder_lists(const std::vector<Tensor>& params, const std::vector<Tensor>& remainders,
                           const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avg,
                           const std::vector<Tensor>& exp_avg_sq,
                           const std::vector<float>& weight_decays,
                           const std::vector<MomentRoundingKey>& rounding_keys,
                           const AdamMomentScales& scales, float beta1, float beta2) {
  constexpr const char* kOp = "multi_tensor_adamw_param_remainder";
  const size_t n = params.size();
  MEGATON_CHECK(remainders.size() == n && grads.size() == n && exp_avg.size() == n &&
                    exp_avg_sq.size() == n && weight_decays.size() == n,
                "{}: list lengths differ: params {}, remainders {}, grads {}, exp_avg {}, "
                "exp_avg_sq {}, weight_decays {}",
                kOp, n, remainders.size(), grads.size(), exp_avg.size(), exp_avg_sq.size(),
                weight_decays.size());
  check_rounding_keys(rounding_keys, n, kOp);
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "{}: betas ({}, {}) must be in [0, 1)", kOp, beta1, beta2);
  if (n == 0) return;
  MEGATON_CHECK(params[0].defined(), "{}: params[0] is undefined", kOp);
  const Device device = params[0].device();
  for (size_t i = 0; i < n; ++i) {
    MEGATON_CHECK(params[i].defined(), "{}: params[{}] is undefined", kOp, i);
    const int64_t numel = params[i].numel();
    check_entry(params[i], DType::BF16, numel, device, kOp, "params", i);
    check_entry(remainders[i], DType::I16, numel, device, kOp, "remainders", i);
    // BF16 grads: --main-grads-dtype bf16, widened to fp32 as they are read.
    check_f32_or_bf16(grads[i], numel, device, kOp, "grads", i);
    check_moment(exp_avg[i], numel, device, kOp, "exp_avg", i);
    check_moment(exp_avg_sq[i], numel, device, kOp, "exp_avg_sq", i);
  }
  check_moment_scales(scales, exp_avg, exp_avg_sq, device, kOp);
}

}  // namespace

void split_param_remainders(const Tensor& master, Tensor& weight, Tensor& remainder) {
  constexpr const char* kOp = "split_param_remainders";
  MEGATON_CHECK(master.defined() && master.dtype() == DType::F32, "{}: master must be F32", kOp);
  const int64_t n = master.numel();
  check_entry(weight, DType::BF16, n, master.device(), kOp, "weight", 0);
  if (remainder.defined()) check_entry(remainder, DType::I16, n, master.device(), kOp, "remainder", 0);
  MEGATON_CUDA_DISPATCH(master, cuda::split_param_remainders(master, weight, remainder));
  const float* x = master.f32();
  auto* w = static_cast<uint16_t*>(weight.raw());
  auto* r = remainder.defined() ? static_cast<uint16_t*>(remainder.raw()) : nullptr;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = param_remainder_float_bits(x[i]);
    w[i] = param_remainder_weight(bits);
    if (r) r[i] = param_remainder_low(bits);
  }
}

void join_param_remainders(const Tensor& weight, const Tensor& remainder, Tensor& master) {
  constexpr const char* kOp = "join_param_remainders";
  MEGATON_CHECK(weight.defined() && weight.dtype() == DType::BF16, "{}: weight must be BF16", kOp);
  const int64_t n = weight.numel();
  check_entry(remainder, DType::I16, n, weight.device(), kOp, "remainder", 0);
  check_entry(master, DType::F32, n, weight.device(), kOp, "master", 0);
  MEGATON_CUDA_DISPATCH(weight, cuda::join_param_remainders(weight, remainder, master));
  const auto* w = static_cast<const uint16_t*>(weight.raw());
  const auto* r = static_cast<const uint16_t*>(remainder.raw());
  float* x = master.f32();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] = param_remainder_bits_float(param_remainder_join(w[i], r[i]));
}

void multi_tensor_adamw_param_remainder(
    std::vector<Tensor>& params, std::vector<Tensor>& remainders, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys,
    const AdamMomentScales& scales) {
  constexpr const char* kOp = "multi_tensor_adamw_param_remainder";
  check_remainder_lists(params, remainders, grads, exp_avg, exp_avg_sq, weight_decays,
                        rounding_keys, scales, beta1, beta2);
  MEGATON_CHECK(step >= 1, "{}: step {} must be >= 1 (1-based)", kOp, step);
  MEGATON_CHECK(std::isfinite(grad_scale), "{}: grad_scale {} must be finite", kOp, grad_scale);
  if (params.empty()) return;
  MEGATON_CUDA_DISPATCH(
      params[0], cuda::multi_tensor_adamw_param_remainder(
                     params, remainders, grads, exp_avg, exp_avg_sq, weight_decays, lr, beta1,
                     beta2, eps, step, grad_scale, nullptr, rounding_keys, scales));
  const AdamPrecisionConstants constants =
      adam_precision_constants(lr, beta1, beta2, eps, step, grad_scale);
  for (size_t i = 0; i < params.size(); ++i) {
    const cpu_adam::RemainderMainParam main{static_cast<uint16_t*>(params[i].raw()),
                                            static_cast<uint16_t*>(remainders[i].raw())};
    cpu_adam::adamw_state_loop(
        main, cpu_adam::GradRef(grads[i]), cpu_adam::state_ref(exp_avg[i], scales, i, 0),
        cpu_adam::state_ref(exp_avg_sq[i], scales, i, 1), params[i].numel(),
        adam_precision_decay(lr, weight_decays[i]), constants, rounding_keys[i], step);
  }
  cpu_adam::commit_moment_scales(exp_avg, exp_avg_sq, scales);
}

void multi_tensor_adamw_param_remainder(
    std::vector<Tensor>& params, std::vector<Tensor>& remainders, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float beta1, float beta2, float eps,
    const Tensor& control, const std::vector<MomentRoundingKey>& rounding_keys,
    const AdamMomentScales& scales) {
  check_remainder_lists(params, remainders, grads, exp_avg, exp_avg_sq, weight_decays,
                        rounding_keys, scales, beta1, beta2);
  if (params.empty()) return;
  MEGATON_CHECK(control.defined() && control.dtype() == DType::F32 &&
                    control.numel() == kAdamControlSize && control.device() == params[0].device(),
                "multi_tensor_adamw_param_remainder: control must be F32 [{}] on the params' "
                "device",
                kAdamControlSize);
  // Step 1, lr 0 and scale 1 stand in for the host scalars; the kernel reads control's.
  MEGATON_CUDA_DISPATCH(
      params[0], cuda::multi_tensor_adamw_param_remainder(
                     params, remainders, grads, exp_avg, exp_avg_sq, weight_decays, 0.0f, beta1,
                     beta2, eps, 1, 1.0f, control.f32(), rounding_keys, scales));
  const float* c = control.f32();
  if (c[kAdamSkip] != 0.0f) return;
  multi_tensor_adamw_param_remainder(params, remainders, grads, exp_avg, exp_avg_sq, weight_decays,
                                     c[kAdamLr], beta1, beta2, eps, int64_t(c[kAdamStep]),
                                     c[kAdamGradScale], rounding_keys, scales);
}

}  // namespace megaton::ops
