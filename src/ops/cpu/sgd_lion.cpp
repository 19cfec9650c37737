// multi_tensor_sgd and multi_tensor_lion (ops/sgd_lion.h): the doors, which check every
// list before anything is written and send GPU tensors to ops/cuda/sgd_lion.cu, and the
// CPU reference, the kernels' formulas operation for operation (each fp32 operation
// rounded on its own), so that both give the same bits.
#include "ops/sgd_lion.h"

#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/adam_precision_math.h"
#include "ops/cpu/optimizer_elementwise.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/sgd_lion.h"
#endif

namespace megaton::ops {
namespace {

using cpu_optimizer::describe;
using cpu_optimizer::device_name;
using cpu_optimizer::load;
using cpu_optimizer::product;

// torch's lerp (at::lerp), each branch one fma: a + w (b - a), or b - (b - a)(1 - w).
float torch_lerp(float a, float b, float w) {
  const float diff = b - a;
  return std::fabs(w) < 0.5f ? std::fma(w, diff, a) : std::fma(-diff, 1.0f - w, b);
}

// The lists' checks (both ops): `state` is the momentum buffer or Lion's exp_avg.
void check_lists(const std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                 const std::vector<Tensor>& state, const std::vector<Tensor>& copies,
                 const std::vector<float>& weight_decays, const Tensor& control, const char* op,
                 const char* state_name) {
  const size_t n = mains.size();
  MEGATON_CHECK(
      grads.size() == n && state.size() == n && copies.size() == n && weight_decays.size() == n,
      "{}: lists of different lengths: mains {}, grads {}, {} {}, copies {}, "
      "weight_decays {}",
      op, n, grads.size(), state_name, state.size(), copies.size(), weight_decays.size());
  const Device device = n > 0 && mains[0].defined() ? mains[0].device() : control.device();
  cpu_optimizer::check_control(control, device, op);
  for (size_t i = 0; i < n; ++i) {
    const Tensor& main = mains[i];
    MEGATON_CHECK(main.defined() && main.dtype() == DType::F32 && main.device() == device,
                  "{}: mains[{}] is {}, expected F32 on {}", op, i, describe(main),
                  device_name(device));
    const Tensor& grad = grads[i];
    MEGATON_CHECK(grad.defined() && (grad.dtype() == DType::F32 || grad.dtype() == DType::BF16) &&
                      grad.numel() == main.numel() && grad.device() == device,
                  "{}: grads[{}] is {}, expected F32 or BF16 with {} elements on {}", op, i,
                  describe(grad), main.numel(), device_name(device));
    const Tensor& s = state[i];
    MEGATON_CHECK(
        s.defined() && s.dtype() == DType::F32 && s.numel() == main.numel() && s.device() == device,
        "{}: {}[{}] is {}, expected F32 with {} elements on {}", op, state_name, i, describe(s),
        main.numel(), device_name(device));
    const Tensor& copy = copies[i];
    MEGATON_CHECK(!copy.defined() || ((copy.dtype() == DType::F32 || copy.dtype() == DType::BF16 ||
                                       copy.dtype() == DType::F16) &&
                                      copy.numel() == main.numel() && copy.device() == device),
                  "{}: copies[{}] is {}, expected undefined or F32, BF16 or F16 with {} elements "
                  "on {}",
                  op, i, describe(copy), main.numel(), device_name(device));
  }
}

}  // namespace

void multi_tensor_sgd(std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                      std::vector<Tensor>& momentum_bufs, std::vector<Tensor>& copies,
                      const std::vector<float>& weight_decays, float momentum,
                      const Tensor& control) {
  const char* op = "multi_tensor_sgd";
  check_lists(mains, grads, momentum_bufs, copies, weight_decays, control, op, "momentum_bufs");
  MEGATON_CHECK(momentum >= 0.0f && std::isfinite(momentum), "{}: momentum {} must be >= 0", op,
                momentum);
  if (mains.empty()) return;
  MEGATON_CUDA_DISPATCH(mains[0], cuda::multi_tensor_sgd(mains, grads, momentum_bufs, copies,
                                                         weight_decays, momentum, control));
  MEGATON_CHECK(mains[0].device() == Device::CPU, "{}: no CUDA backend here", op);
  const float* c = control.f32();
  if (c[kAdamSkip] != 0.0f) return;
  const float lr = c[kAdamLr], scale = c[kAdamGradScale];
  for (size_t i = 0; i < mains.size(); ++i) {
    float* p = mains[i].f32();
    float* buf = momentum_bufs[i].f32();
    const float wd = weight_decays[i];
    for (int64_t j = 0; j < mains[i].numel(); ++j) {
      float g = product(load(grads[i], j), scale);
      if (wd != 0.0f) g = std::fma(wd, p[j], g);  // torch adds nothing when wd == 0
      buf[j] = std::fma(momentum, buf[j], g);
      p[j] = std::fma(-lr, buf[j], p[j]);
    }
    if (copies[i].defined()) cast(mains[i], copies[i]);
  }
}

void multi_tensor_lion(std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                       std::vector<Tensor>& exp_avgs, std::vector<Tensor>& copies,
                       const std::vector<float>& weight_decays, float beta1, float beta2,
                       const Tensor& control) {
  const char* op = "multi_tensor_lion";
  check_lists(mains, grads, exp_avgs, copies, weight_decays, control, op, "exp_avgs");
  MEGATON_CHECK(beta1 >= 0.0f && beta1 <= 1.0f && beta2 >= 0.0f && beta2 <= 1.0f,
                "{}: betas ({}, {}) must be in [0, 1]", op, beta1, beta2);
  if (mains.empty()) return;
  MEGATON_CUDA_DISPATCH(mains[0], cuda::multi_tensor_lion(mains, grads, exp_avgs, copies,
                                                          weight_decays, beta1, beta2, control));
  MEGATON_CHECK(mains[0].device() == Device::CPU, "{}: no CUDA backend here", op);
  const float* c = control.f32();
  if (c[kAdamSkip] != 0.0f) return;
  const float lr = c[kAdamLr], scale = c[kAdamGradScale];
  // EO passes the Python floats 1 - beta to lerp, which torch rounds to fp32.
  const float w1 = float(1.0 - double(beta1)), w2 = float(1.0 - double(beta2));
  for (size_t i = 0; i < mains.size(); ++i) {
    float* p = mains[i].f32();
    float* m = exp_avgs[i].f32();
    const float decay = adam_precision_decay(lr, weight_decays[i]);
    for (int64_t j = 0; j < mains[i].numel(); ++j) {
      const float g = product(load(grads[i], j), scale);
      const float interpolated = torch_lerp(m[j], g, w1);
      // sign, with sign(0) = 0 (and NaN kept, as torch.sign)
      const float sign = interpolated > 0.0f ? 1.0f : interpolated < 0.0f ? -1.0f : interpolated;
      p[j] = std::fma(-lr, sign, product(p[j], decay));
      m[j] = torch_lerp(m[j], g, w2);
    }
    if (copies[i].defined()) cast(mains[i], copies[i]);
  }
}

}  // namespace megaton::ops
