// Multi-tensor optimizer ops on the CPU: multi_tensor_sum_of_squares,
// multi_tensor_count_zeros, multi_tensor_scale_, multi_tensor_adamw. The CPU has no launch
// or synchronization cost to save, so each is the single-tensor op (or, for count_zeros, a
// plain loop) applied to the list in order (and therefore bitwise equal to it); the GPU
// versions (ops/cuda/multi_tensor.cu) are where the batching happens. multi_tensor_adamw
// reads F32 or BF16 main grads (a BF16 one widened to fp32 as it is read); with bf16 moments (the
// precision-aware optimizer) updates each element by adamw_precision_update and stores the moments
// stochastically rounded (ops/adam_precision_math.h) instead.
#include <bit>
#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"
#include "ops/cpu/adam_state_ref.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/multi_tensor_adamw.h"
#endif

namespace megaton::ops {
namespace {

// Every tensor of `list` is defined and on `device` (the device the call dispatched on).
void check_list(const std::vector<Tensor>& list, Device device, const char* op, const char* name) {
  for (size_t i = 0; i < list.size(); ++i) {
    MEGATON_CHECK(list[i].defined(), "{}: {}[{}] is undefined", op, name, i);
    MEGATON_CHECK(list[i].device() == device, "{}: {}[{}] is on the {}, the first tensor on the {}",
                  op, name, i, list[i].device() == Device::CPU ? "CPU" : "GPU",
                  device == Device::CPU ? "CPU" : "GPU");
  }
}

using cpu_adam::kParallelMin;

// The precision-aware update of one tensor (adam_precision_math.h), the gradient scaled
// as it is read; the random bits of its moments from `key` at `step`.
void adamw_precision_tensor(Tensor& param, const Tensor& grad, const AdamStateRef& exp_avg,
                            const AdamStateRef& exp_avg_sq, float lr, float weight_decay,
                            const AdamPrecisionConstants& c, const MomentRoundingKey& key,
                            int64_t step) {
  cpu_adam::adamw_state_loop(cpu_adam::F32MainParam{param.f32()}, cpu_adam::GradRef(grad), exp_avg,
                             exp_avg_sq, param.numel(), adam_precision_decay(lr, weight_decay), c,
                             key, step);
}

}  // namespace

double multi_tensor_sum_of_squares(const std::vector<Tensor>& tensors) {
  if (tensors.empty()) return 0.0;
  MEGATON_CUDA_DISPATCH(tensors[0], cuda::multi_tensor_sum_of_squares(tensors));
  check_list(tensors, Device::CPU, "multi_tensor_sum_of_squares", "tensors");
  // Added in list order: the same total as summing sum_of_squares per tensor.
  double total = 0.0;
  for (const Tensor& t : tensors) total += sum_of_squares(t);
  return total;
}

void multi_tensor_sum_of_squares(const std::vector<Tensor>& tensors, Tensor& out) {
  MEGATON_CHECK(out.defined() && out.dtype() == DType::I64 && out.numel() == 1,
                "multi_tensor_sum_of_squares: out must be I64 [1] (fp64 bits)");
  MEGATON_CUDA_DISPATCH(out, cuda::multi_tensor_sum_of_squares(tensors, out));
  out.i64()[0] = std::bit_cast<int64_t>(multi_tensor_sum_of_squares(tensors));
}

int64_t multi_tensor_count_zeros(const std::vector<Tensor>& tensors) {
  if (tensors.empty()) return 0;
  MEGATON_CUDA_DISPATCH(tensors[0], cuda::multi_tensor_count_zeros(tensors));
  constexpr const char* kOp = "multi_tensor_count_zeros";
  check_list(tensors, Device::CPU, kOp, "tensors");
  for (size_t i = 0; i < tensors.size(); ++i)
    MEGATON_CHECK(tensors[i].dtype() == DType::F32, "{}: tensors[{}] must be F32, got {}", kOp, i,
                  dtype_name(tensors[i].dtype()));
  int64_t zeros = 0;
  for (const Tensor& t : tensors) {
    const float* x = t.f32();
    const int64_t n = t.numel();
    // +0 and -0 are the two floats whose bits, sign dropped, are all zero. Testing bits
    // rather than x == 0.0f keeps denormals nonzero even under a denormals-are-zero mode.
#pragma omp parallel for reduction(+ : zeros) schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) zeros += (std::bit_cast<uint32_t>(x[i]) << 1) == 0;
  }
  return zeros;
}

void multi_tensor_scale_(std::vector<Tensor>& tensors, float scale) {
  if (tensors.empty()) return;
  MEGATON_CUDA_DISPATCH(tensors[0], cuda::multi_tensor_scale_(tensors, scale));
  check_list(tensors, Device::CPU, "multi_tensor_scale_", "tensors");
  for (Tensor& t : tensors) scale_(t, scale);
}

AdamStateKind adam_state_kind(DType dtype, const char* op) {
  switch (dtype) {
    case DType::F32:
      return kStateF32;
    case DType::BF16:
      return kStateBF16;
    case DType::F16:
      return kStateF16;
    case DType::F8E4M3:
      return kStateF8E4M3;
    default:
      MEGATON_CHECK(false, "{}: a moment must be F32, BF16, F16 or F8_E4M3, got {}", op,
                    dtype_name(dtype));
  }
  return kStateF32;
}

void check_moment_scales(const AdamMomentScales& scales, const std::vector<Tensor>& exp_avg,
                         const std::vector<Tensor>& exp_avg_sq, Device device, const char* op) {
  const size_t n = exp_avg.size();
  const bool given = !scales.scale.empty() || !scales.absmax.empty();
  MEGATON_CHECK(!given || (scales.scale.size() == n && scales.absmax.size() == n),
                "{}: {} scales and {} absmax entries for {} tensors", op, scales.scale.size(),
                scales.absmax.size(), n);
  for (size_t i = 0; i < n; ++i) {
    const bool scaled = state_kind_scaled(adam_state_kind(exp_avg[i].dtype(), op)) ||
                        state_kind_scaled(adam_state_kind(exp_avg_sq[i].dtype(), op));
    MEGATON_CHECK(!scaled || given, "{}: tensor {} has an F16 or F8_E4M3 moment and no scales", op,
                  i);
    if (!given) continue;
    for (const Tensor* t : {&scales.scale[i], &scales.absmax[i]})
      MEGATON_CHECK(
          t->defined() && t->dtype() == DType::F32 && t->numel() == 2 && t->device() == device,
          "{}: scales of tensor {} must be F32 [2] on the lists' device", op, i);
  }
}

void multi_tensor_adamw_moment_absmax(const std::vector<Tensor>& grads,
                                      const std::vector<Tensor>& exp_avg,
                                      const std::vector<Tensor>& exp_avg_sq,
                                      const AdamMomentScales& scales, float beta1, float beta2,
                                      float grad_scale, const Tensor& control) {
  constexpr const char* kOp = "multi_tensor_adamw_moment_absmax";
  const size_t n = grads.size();
  MEGATON_CHECK(exp_avg.size() == n && exp_avg_sq.size() == n,
                "{}: list lengths differ: grads {}, exp_avg {}, exp_avg_sq {}", kOp, n,
                exp_avg.size(), exp_avg_sq.size());
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "{}: betas ({}, {}) must be in [0, 1)", kOp, beta1, beta2);
  if (n == 0) return;
  MEGATON_CHECK(grads[0].defined(), "{}: grads[0] is undefined", kOp);
  const Device device = grads[0].device();
  check_list(grads, device, kOp, "grads");
  check_list(exp_avg, device, kOp, "exp_avg");
  check_list(exp_avg_sq, device, kOp, "exp_avg_sq");
  for (size_t i = 0; i < n; ++i) {
    MEGATON_CHECK(grads[i].dtype() == DType::F32 || grads[i].dtype() == DType::BF16,
                  "{}: grads[{}] must be F32 or BF16, got {}", kOp, i,
                  dtype_name(grads[i].dtype()));
    MEGATON_CHECK(
        exp_avg[i].numel() == grads[i].numel() && exp_avg_sq[i].numel() == grads[i].numel(),
        "{}: tensor {}: moments of {} and {} elements, grad {}", kOp, i, exp_avg[i].numel(),
        exp_avg_sq[i].numel(), grads[i].numel());
  }
  check_moment_scales(scales, exp_avg, exp_avg_sq, device, kOp);
  if (control.defined())
    MEGATON_CHECK(control.dtype() == DType::F32 && control.numel() == kAdamControlSize &&
                      control.device() == device,
                  "{}: control must be F32 [{}] on the lists' device", kOp, kAdamControlSize);
  if (scales.empty()) return;
  MEGATON_CUDA_DISPATCH(grads[0], cuda::multi_tensor_adamw_moment_absmax(
                                      grads, exp_avg, exp_avg_sq, scales, beta1, beta2, grad_scale,
                                      control.defined() ? control.f32() : nullptr));
  // Step 1 and lr 0 stand in: the pass reads only the betas and the gradient scale.
  const AdamPrecisionConstants c = adam_precision_constants(
      0.0f, beta1, beta2, 1e-8f, 1, control.defined() ? control.f32()[kAdamGradScale] : grad_scale);
  for (size_t i = 0; i < n; ++i) {
    const AdamStateRef m = cpu_adam::state_ref(exp_avg[i], scales, i, 0);
    const AdamStateRef v = cpu_adam::state_ref(exp_avg_sq[i], scales, i, 1);
    if (!state_kind_scaled(m.kind) && !state_kind_scaled(v.kind)) continue;
    uint32_t m_bits = 0, v_bits = 0;
    cpu_adam::moment_absmax_loop(cpu_adam::GradRef(grads[i]), m, v, grads[i].numel(), c, m_bits,
                                 v_bits);
    float* absmax = scales.absmax[i].f32();
    if (state_kind_scaled(m.kind)) absmax[0] = std::bit_cast<float>(m_bits);
    if (state_kind_scaled(v.kind)) absmax[1] = std::bit_cast<float>(v_bits);
  }
}

std::vector<MomentRoundingKey> list_order_rounding_keys(size_t n) {
  std::vector<MomentRoundingKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i].param_key = uint64_t(i);
  return keys;
}

void check_rounding_keys(const std::vector<MomentRoundingKey>& rounding_keys, size_t n,
                         const char* op) {
  MEGATON_CHECK(rounding_keys.size() == n, "{}: {} rounding keys for {} tensors", op,
                rounding_keys.size(), n);
  for (size_t i = 0; i < n; ++i) {
    const MomentRoundingKey& k = rounding_keys[i];
    MEGATON_CHECK(k.offset >= 0 && k.run >= 0 && k.base >= 0 && (k.run == 0 || k.stride >= k.run),
                  "{}: rounding key {}: offset {}, run {}, stride {}, base {}", op, i, k.offset,
                  k.run, k.stride, k.base);
  }
}

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale) {
  multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, lr, beta1,
                     beta2, eps, step, grad_scale, list_order_rounding_keys(params.size()));
}

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys,
                        const AdamMomentScales& scales) {
  const size_t n = params.size();
  MEGATON_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n &&
                    param_copies.size() == n && weight_decays.size() == n,
                "multi_tensor_adamw: list lengths differ: params {}, grads {}, exp_avg {}, "
                "exp_avg_sq {}, param_copies {}, weight_decays {}",
                n, grads.size(), exp_avg.size(), exp_avg_sq.size(), param_copies.size(),
                weight_decays.size());
  const char* op = "multi_tensor_adamw";
  check_rounding_keys(rounding_keys, n, op);
  if (n == 0) return;
  MEGATON_CUDA_DISPATCH(
      params[0],
      cuda::multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, lr,
                               beta1, beta2, eps, step, grad_scale, rounding_keys, scales));
  check_list(params, Device::CPU, op, "params");
  check_list(grads, Device::CPU, op, "grads");
  check_list(exp_avg, Device::CPU, op, "exp_avg");
  check_list(exp_avg_sq, Device::CPU, op, "exp_avg_sq");
  // Everything is checked before the first update, so a bad list changes nothing.
  MEGATON_CHECK(step >= 1, "{}: step {} must be >= 1 (1-based)", op, step);
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "{}: betas ({}, {}) must be in [0, 1)", op, beta1, beta2);
  MEGATON_CHECK(std::isfinite(grad_scale), "{}: grad_scale {} must be finite", op, grad_scale);
  for (size_t i = 0; i < n; ++i) {
    const Tensor* entries[] = {&params[i], &grads[i], &exp_avg[i], &exp_avg_sq[i]};
    for (const Tensor* t : entries) {
      // The grads may be BF16 (--main-grads-dtype bf16, widened as they are read), the
      // moments BF16, F16 or F8_E4M3 (the precision-aware optimizer); params are F32.
      const bool grad = t == &grads[i];
      const bool moment = t == &exp_avg[i] || t == &exp_avg_sq[i];
      const DType d = t->dtype();
      MEGATON_CHECK(d == DType::F32 || ((grad || moment) && d == DType::BF16) ||
                        (moment && (d == DType::F16 || d == DType::F8E4M3)),
                    "{}: tensor {}: {} in a list that must be F32{}", op, i, dtype_name(d),
                    moment ? ", BF16, F16 or F8_E4M3"
                    : grad ? " or BF16"
                           : "");
      MEGATON_CHECK(t->numel() == params[i].numel(),
                    "{}: tensor {}: {} elements in a list, param has {}", op, i, t->numel(),
                    params[i].numel());
    }
    const Tensor& copy = param_copies[i];
    if (!copy.defined()) continue;
    MEGATON_CHECK(copy.device() == Device::CPU,
                  "{}: param_copies[{}] is on the GPU, params on the CPU", op, i);
    // F16: an --fp16 run's compute weights (the host half of --optimizer-cpu-offload).
    MEGATON_CHECK(copy.dtype() == DType::F32 || copy.dtype() == DType::BF16 ||
                      copy.dtype() == DType::F16,
                  "{}: param_copies[{}] must be F32, BF16 or F16, got {}", op, i,
                  dtype_name(copy.dtype()));
    MEGATON_CHECK(copy.numel() == params[i].numel(),
                  "{}: param_copies[{}] {} has {} elements, param has {}", op, i,
                  shape_str(copy.shape()), copy.numel(), params[i].numel());
  }
  check_moment_scales(scales, exp_avg, exp_avg_sq, Device::CPU, op);
  const AdamPrecisionConstants constants =
      adam_precision_constants(lr, beta1, beta2, eps, step, grad_scale);
  for (size_t i = 0; i < n; ++i) {
    if (exp_avg[i].dtype() != DType::F32 || exp_avg_sq[i].dtype() != DType::F32) {
      adamw_precision_tensor(params[i], grads[i], cpu_adam::state_ref(exp_avg[i], scales, i, 0),
                             cpu_adam::state_ref(exp_avg_sq[i], scales, i, 1), lr, weight_decays[i],
                             constants, rounding_keys[i], step);
      if (param_copies[i].defined()) cast(params[i], param_copies[i]);
      continue;
    }
    // The scaled gradient in a scratch copy, one tensor at a time (the caller's grads stay
    // as they are): by construction the same bits as scale_ on the grads then adamw_step.
    // A BF16 grad is widened first (exact), so it updates as its fp32 value would.
    Tensor scaled_grad = grads[i];
    if (grads[i].dtype() != DType::F32) {
      scaled_grad = Tensor::empty(grads[i].shape(), DType::F32, Device::CPU);
      cast(grads[i], scaled_grad);
    }
    if (grad_scale != 1.0f) {
      if (scaled_grad.raw() == grads[i].raw()) scaled_grad = grads[i].clone();
      scale_(scaled_grad, grad_scale);
    }
    adamw_step(params[i], scaled_grad, exp_avg[i], exp_avg_sq[i], lr, beta1, beta2, eps,
               weight_decays[i], step);
    if (param_copies[i].defined()) cast(params[i], param_copies[i]);
  }
  // After every update: the loops read the old scales.
  cpu_adam::commit_moment_scales(exp_avg, exp_avg_sq, scales);
}

}  // namespace megaton::ops
