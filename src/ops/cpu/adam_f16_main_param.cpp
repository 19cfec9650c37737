// fp16 main params (ops/adam_f16_main_param.h): the doors (every check, for both devices)
// and the CPU twin, element by element with ops/adam_f16_main_param_math.h.
#include "ops/adam_f16_main_param.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "ops/adam_f16_main_param_math.h"
#include "ops/adam_precision.h"
#include "ops/cpu/adam_state_ref.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/adam_f16_main_param.h"
#endif

namespace megaton::ops {
namespace {

using cpu_adam::kParallelMin;

void check_tensor(const Tensor& t, DType dtype, int64_t numel, Device device, const char* op,
                  const char* name, size_t i) {
  MEGATON_CHECK(t.defined(), "{}: {}[{}] is undefined", op, name, i);
  MEGATON_CHECK(t.dtype() == dtype, "{}: {}[{}] must be {}, got {}", op, name, i,
                dtype_name(dtype), dtype_name(t.dtype()));
  MEGATON_CHECK(t.numel() == numel, "{}: {}[{}] {} has {} elements, expected {}", op, name, i,
                shape_str(t.shape()), t.numel(), numel);
  MEGATON_CHECK(t.device() == device, "{}: {}[{}] is on another device than masters[0]", op,
                name, i);
}

// The checks shared by the absmax pass and the update (copies: null for the pass).
void check_lists(const std::vector<Tensor>& masters, const std::vector<Tensor>* copies,
                 const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avg,
                 const std::vector<Tensor>& exp_avg_sq, const std::vector<float>& weight_decays,
                 const AdamMomentScales& moment_scales, const AdamMainParamScales& main_scales,
                 int64_t step, float grad_scale, const Tensor& control, const char* op) {
  const size_t n = masters.size();
  MEGATON_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n &&
                    weight_decays.size() == n && (!copies || copies->size() == n) &&
                    main_scales.scale.size() == n && main_scales.absmax.size() == n,
                "{}: list lengths differ: masters {}, grads {}, exp_avg {}, exp_avg_sq {}, "
                "weight_decays {}, scales {}, absmax {}",
                op, n, grads.size(), exp_avg.size(), exp_avg_sq.size(), weight_decays.size(),
                main_scales.scale.size(), main_scales.absmax.size());
  if (n == 0) return;
  MEGATON_CHECK(masters[0].defined(), "{}: masters[0] is undefined", op);
  const Device device = masters[0].device();
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = masters[i].defined() ? masters[i].numel() : 0;
    check_tensor(masters[i], DType::F16, numel, device, op, "masters", i);
    check_tensor(grads[i], grads[i].defined() && grads[i].dtype() == DType::BF16 ? DType::BF16
                                                                                  : DType::F32,
                 numel, device, op, "grads", i);
    for (const Tensor* m : {&exp_avg[i], &exp_avg_sq[i]}) {
      MEGATON_CHECK(m->defined(), "{}: moment {} is undefined", op, i);
      adam_state_kind(m->dtype(), op);  // F32, BF16, F16 or F8E4M3
      check_tensor(*m, m->dtype(), numel, device, op, "moments", i);
    }
    if (copies) {
      const Tensor& c = (*copies)[i];
      check_tensor(c, c.defined() && c.dtype() == DType::F16 ? DType::F16 : DType::BF16, numel,
                   device, op, "copies", i);
    }
    check_tensor(main_scales.scale[i], DType::F32, 1, device, op, "scale", i);
    check_tensor(main_scales.absmax[i], DType::F32, 1, device, op, "absmax", i);
  }
  check_moment_scales(moment_scales, exp_avg, exp_avg_sq, device, op);
  if (control.defined()) {
    MEGATON_CHECK(control.dtype() == DType::F32 && control.numel() == kAdamControlSize &&
                      control.device() == device,
                  "{}: control must be F32 [{}] on the lists' device", op, kAdamControlSize);
  } else {
    MEGATON_CHECK(step >= 1, "{}: step {} must be >= 1 (1-based)", op, step);
    MEGATON_CHECK(std::isfinite(grad_scale), "{}: grad_scale {} must be finite", op, grad_scale);
  }
}

// An fp16 main param and its compute copy (BF16 or F16) as adamw_state_loop sees them.
struct ScaledF16MainParam {
  uint16_t* stored;
  uint16_t* copy;
  bool copy_f16;
  float scale, new_rscale;
  float load(int64_t i) const { return load_scaled_fp16(stored[i], scale); }
  void store(int64_t i, float x) const {
    copy[i] = copy_f16 ? fp16_round_nearest(x) : float_to_bf16(x);
    stored[i] = store_scaled_fp16_nearest(x, new_rscale);
  }
};

}  // namespace

float f16_main_param_absmax(const Tensor& value) {
  MEGATON_CHECK(value.defined() && value.dtype() == DType::F32,
                "f16_main_param_absmax: value must be F32");
  const Tensor host = value.device() == Device::CPU ? value : value.to(Device::CPU);
  const float* x = host.f32();
  uint32_t bits = 0;
  for (int64_t i = 0; i < host.numel(); ++i) bits = std::max(bits, absmax_bits(x[i]));
  return scaled_state_bits_float(bits);
}

float f16_main_param_scale(float absmax) { return main_param_scale_from_absmax(absmax); }

void f16_main_param_quantize(const Tensor& value, float s, Tensor& stored, Tensor& scale) {
  constexpr const char* kOp = "f16_main_param_quantize";
  MEGATON_CHECK(value.defined() && value.dtype() == DType::F32, "{}: value must be F32", kOp);
  check_tensor(stored, DType::F16, value.numel(), value.device(), kOp, "stored", 0);
  check_tensor(scale, DType::F32, 1, value.device(), kOp, "scale", 0);
  const float rscale = state_rscale(s);
  const Tensor host = value.device() == Device::CPU ? value : value.to(Device::CPU);
  Tensor out = Tensor::empty({value.numel()}, DType::F16);
  auto* h = static_cast<uint16_t*>(out.raw());
  for (int64_t i = 0; i < host.numel(); ++i) h[i] = store_scaled_fp16_nearest(host.f32()[i], rscale);
  stored.view({stored.numel()}).copy_from(out.to(stored.device()));
  scale.copy_from(Tensor::from({1}, {s}).to(scale.device()).view(scale.shape()));
}

void f16_main_param_dequantize(const Tensor& stored, const Tensor& scale, Tensor& value) {
  constexpr const char* kOp = "f16_main_param_dequantize";
  MEGATON_CHECK(stored.defined() && stored.dtype() == DType::F16, "{}: stored must be F16", kOp);
  check_tensor(scale, DType::F32, 1, stored.device(), kOp, "scale", 0);
  check_tensor(value, DType::F32, stored.numel(), stored.device(), kOp, "value", 0);
  const Tensor h = stored.device() == Device::CPU ? stored : stored.to(Device::CPU);
  const float s = scale.to(Device::CPU).f32()[0];
  Tensor out = Tensor::empty({stored.numel()});
  const auto* bits = static_cast<const uint16_t*>(h.raw());
  for (int64_t i = 0; i < h.numel(); ++i) out.f32()[i] = load_scaled_fp16(bits[i], s);
  value.view({value.numel()}).copy_from(out.to(value.device()));
}

void multi_tensor_adamw_f16_main_param_absmax(
    const std::vector<Tensor>& masters, const std::vector<Tensor>& grads,
    const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
    const AdamMomentScales& moment_scales, const AdamMainParamScales& main_scales,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const Tensor& control) {
  constexpr const char* kOp = "multi_tensor_adamw_f16_main_param_absmax";
  check_lists(masters, nullptr, grads, exp_avg, exp_avg_sq, weight_decays, moment_scales,
              main_scales, step, grad_scale, control, kOp);
  if (masters.empty()) return;
  MEGATON_CUDA_DISPATCH(masters[0], cuda::multi_tensor_adamw_f16_main_param_absmax(
                                        masters, grads, exp_avg, exp_avg_sq, moment_scales,
                                        main_scales, weight_decays, lr, beta1, beta2, eps, step,
                                        grad_scale, control));
  if (control.defined()) {
    const float* c = control.f32();
    lr = c[kAdamLr];
    step = std::max<int64_t>(int64_t(c[kAdamStep]), 1);  // a skipped first step reads 0
    grad_scale = c[kAdamGradScale];
  }
  const AdamPrecisionConstants constants =
      adam_precision_constants(lr, beta1, beta2, eps, step, grad_scale);
  for (size_t i = 0; i < masters.size(); ++i) {
    const auto* stored = static_cast<const uint16_t*>(masters[i].raw());
    const float scale = main_scales.scale[i].f32()[0];
    const cpu_adam::GradRef grad(grads[i]);
    const AdamStateRef m = cpu_adam::state_ref(exp_avg[i], moment_scales, i, 0);
    const AdamStateRef v = cpu_adam::state_ref(exp_avg_sq[i], moment_scales, i, 1);
    const float decay = adam_precision_decay(lr, weight_decays[i]);
    const int64_t n = masters[i].numel();
    uint32_t bits = 0;
#pragma omp parallel for reduction(max : bits) schedule(static) if (n >= kParallelMin)
    for (int64_t j = 0; j < n; ++j) {
      float p = load_scaled_fp16(stored[j], scale), mj = m.load(j), vj = v.load(j);
      adamw_precision_update(p, grad.load(j), mj, vj, decay, constants);
      bits = std::max(bits, absmax_bits(p));
    }
    float* absmax = main_scales.absmax[i].f32();
    absmax[0] = scaled_state_bits_float(std::max(absmax_bits(absmax[0]), bits));
  }
}

void multi_tensor_adamw_f16_main_param(
    std::vector<Tensor>& masters, std::vector<Tensor>& copies, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const Tensor& control,
    const std::vector<MomentRoundingKey>& rounding_keys, const AdamMomentScales& moment_scales,
    const AdamMainParamScales& main_scales) {
  constexpr const char* kOp = "multi_tensor_adamw_f16_main_param";
  check_lists(masters, &copies, grads, exp_avg, exp_avg_sq, weight_decays, moment_scales,
              main_scales, step, grad_scale, control, kOp);
  check_rounding_keys(rounding_keys, masters.size(), kOp);
  if (masters.empty()) return;
  MEGATON_CUDA_DISPATCH(masters[0], cuda::multi_tensor_adamw_f16_main_param(
                                        masters, copies, grads, exp_avg, exp_avg_sq,
                                        weight_decays, lr, beta1, beta2, eps, step, grad_scale,
                                        control, rounding_keys, moment_scales, main_scales));
  if (control.defined()) {
    const float* c = control.f32();
    if (c[kAdamSkip] != 0.0f) return;
    lr = c[kAdamLr];
    step = int64_t(c[kAdamStep]);
    grad_scale = c[kAdamGradScale];
  }
  const AdamPrecisionConstants constants =
      adam_precision_constants(lr, beta1, beta2, eps, step, grad_scale);
  for (size_t i = 0; i < masters.size(); ++i) {
    const float scale = main_scales.scale[i].f32()[0];
    const ScaledF16MainParam main{
        static_cast<uint16_t*>(masters[i].raw()), static_cast<uint16_t*>(copies[i].raw()),
        copies[i].dtype() == DType::F16, scale,
        state_rscale(main_param_scale_from_absmax(main_scales.absmax[i].f32()[0]))};
    cpu_adam::adamw_state_loop(main, cpu_adam::GradRef(grads[i]),
                               cpu_adam::state_ref(exp_avg[i], moment_scales, i, 0),
                               cpu_adam::state_ref(exp_avg_sq[i], moment_scales, i, 1),
                               masters[i].numel(), adam_precision_decay(lr, weight_decays[i]),
                               constants, rounding_keys[i], step);
  }
  // After every update (the loops read the old scales).
  for (size_t i = 0; i < masters.size(); ++i)
    main_scales.scale[i].f32()[0] = main_param_scale_from_absmax(main_scales.absmax[i].f32()[0]);
  cpu_adam::commit_moment_scales(exp_avg, exp_avg_sq, moment_scales);
}

}  // namespace megaton::ops
