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

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;

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

// A moment or a main grad: F32 or BF16.
void check_f32_or_bf16(const Tensor& t, int64_t numel, Device device, const char* op,
                       const char* name, size_t i) {
  check_entry(t, t.dtype() == DType::BF16 ? DType::BF16 : DType::F32, numel, device, op, name, i);
}

// multi_tensor_adamw_param_remainder's checks (both overloads, both devices).
void check_remainder_lists(const std::vector<Tensor>& params, const std::vector<Tensor>& remainders,
                           const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avg,
                           const std::vector<Tensor>& exp_avg_sq,
                           const std::vector<float>& weight_decays,
                           const std::vector<MomentRoundingKey>& rounding_keys, float beta1,
                           float beta2) {
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
    check_f32_or_bf16(exp_avg[i], numel, device, kOp, "exp_avg", i);
    check_f32_or_bf16(exp_avg_sq[i], numel, device, kOp, "exp_avg_sq", i);
  }
}

void adamw_param_remainder_tensor(Tensor& param, Tensor& remainder, const Tensor& grad,
                                  Tensor& exp_avg, Tensor& exp_avg_sq, float lr,
                                  float weight_decay, const AdamPrecisionConstants& c,
                                  const MomentRoundingKey& key, int64_t step) {
  auto* w = static_cast<uint16_t*>(param.raw());
  auto* r = static_cast<uint16_t*>(remainder.raw());
  const cpu_adam::GradRef g(grad);
  const cpu_adam::MomentRef m(exp_avg), v(exp_avg_sq);
  const float decay = adam_precision_decay(lr, weight_decay);
  const int64_t n = param.numel();
#pragma omp parallel if (n >= kParallelMin)
  {
    // One stream per thread: one Philox call per four consecutive elements.
    MomentRoundingStream random(key, uint64_t(step));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      uint16_t wi = w[i], ri = r[i];
      float mi = m.load(i), vi = v.load(i);
      adamw_param_remainder_update(wi, ri, g.load(i), mi, vi, decay, c);
      const uint32_t bits = random.bits(i);
      w[i] = wi;
      r[i] = ri;
      m.store(i, mi, bits & 0xFFFFu);
      v.store(i, vi, bits >> 16);
    }
  }
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
    int64_t step, float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys) {
  constexpr const char* kOp = "multi_tensor_adamw_param_remainder";
  check_remainder_lists(params, remainders, grads, exp_avg, exp_avg_sq, weight_decays,
                        rounding_keys, beta1, beta2);
  MEGATON_CHECK(step >= 1, "{}: step {} must be >= 1 (1-based)", kOp, step);
  MEGATON_CHECK(std::isfinite(grad_scale), "{}: grad_scale {} must be finite", kOp, grad_scale);
  if (params.empty()) return;
  MEGATON_CUDA_DISPATCH(params[0], cuda::multi_tensor_adamw_param_remainder(
                                       params, remainders, grads, exp_avg, exp_avg_sq,
                                       weight_decays, lr, beta1, beta2, eps, step, grad_scale,
                                       nullptr, rounding_keys));
  const AdamPrecisionConstants constants =
      adam_precision_constants(lr, beta1, beta2, eps, step, grad_scale);
  for (size_t i = 0; i < params.size(); ++i)
    adamw_param_remainder_tensor(params[i], remainders[i], grads[i], exp_avg[i], exp_avg_sq[i], lr,
                                 weight_decays[i], constants, rounding_keys[i], step);
}

void multi_tensor_adamw_param_remainder(
    std::vector<Tensor>& params, std::vector<Tensor>& remainders, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float beta1, float beta2, float eps,
    const Tensor& control, const std::vector<MomentRoundingKey>& rounding_keys) {
  check_remainder_lists(params, remainders, grads, exp_avg, exp_avg_sq, weight_decays,
                        rounding_keys, beta1, beta2);
  if (params.empty()) return;
  MEGATON_CHECK(control.defined() && control.dtype() == DType::F32 &&
                    control.numel() == kAdamControlSize && control.device() == params[0].device(),
                "multi_tensor_adamw_param_remainder: control must be F32 [{}] on the params' "
                "device",
                kAdamControlSize);
  // Step 1, lr 0 and scale 1 stand in for the host scalars; the kernel reads control's.
  MEGATON_CUDA_DISPATCH(params[0], cuda::multi_tensor_adamw_param_remainder(
                                       params, remainders, grads, exp_avg, exp_avg_sq,
                                       weight_decays, 0.0f, beta1, beta2, eps, 1, 1.0f,
                                       control.f32(), rounding_keys));
  const float* c = control.f32();
  if (c[kAdamSkip] != 0.0f) return;
  multi_tensor_adamw_param_remainder(params, remainders, grads, exp_avg, exp_avg_sq, weight_decays,
                                     c[kAdamLr], beta1, beta2, eps, int64_t(c[kAdamStep]),
                                     c[kAdamGradScale], rounding_keys);
}

}  // namespace megaton::ops
