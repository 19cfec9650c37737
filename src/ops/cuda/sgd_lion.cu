// multi_tensor_sgd and multi_tensor_lion on the GPU (ops/sgd_lion.h): each a rule of the
// multi-tensor launch in muon_elementwise.cuh, every fp32 operation an explicitly rounded
// intrinsic (__fmul_rn, __fmaf_rn, ...) so that nvcc contracts nothing and the CPU reference
// (ops/cpu/sgd_lion.cpp) computes the same bits.
#include <vector>

#include "ops/adam_precision_math.h"
#include "ops/cuda/muon_elementwise.cuh"
#include "ops/cuda/sgd_lion.h"

namespace megaton::ops::cuda {
namespace {

// torch.optim.SGD (momentum, dampening 0, no Nesterov, weight decay in the gradient).
struct SgdRule {
  float momentum;
  struct Consts {
    float lr, grad_scale, weight_decay;
  };
  __device__ Consts consts(const float* control, float weight_decay, float) const {
    return {control[kAdamLr], control[kAdamGradScale], weight_decay};
  }
  __device__ void update(const Consts& c, float& main, float grad, float* buf) const {
    float g = __fmul_rn(grad, c.grad_scale);
    if (c.weight_decay != 0.0f) g = __fmaf_rn(c.weight_decay, main, g);
    const float b = __fmaf_rn(momentum, *buf, g);
    *buf = b;
    main = __fmaf_rn(-c.lr, b, main);
  }
};

// torch's lerp (at::lerp), each branch one fma.
__device__ __forceinline__ float torch_lerp_rn(float a, float b, float w) {
  const float diff = __fsub_rn(b, a);
  return fabsf(w) < 0.5f ? __fmaf_rn(w, diff, a) : __fmaf_rn(-diff, __fsub_rn(1.0f, w), b);
}

// EO's Lion with decoupled weight decay.
struct LionRule {
  float one_minus_beta1, one_minus_beta2;
  struct Consts {
    float lr, grad_scale, decay;
  };
  __device__ Consts consts(const float* control, float weight_decay, float) const {
    const float lr = control[kAdamLr];
    return {lr, control[kAdamGradScale], adam_precision_decay(lr, weight_decay)};
  }
  __device__ void update(const Consts& c, float& main, float grad, float* exp_avg) const {
    const float g = __fmul_rn(grad, c.grad_scale);
    const float m = *exp_avg;
    const float interpolated = torch_lerp_rn(m, g, one_minus_beta1);
    // sign, with sign(0) = 0 (and NaN kept, as torch.sign)
    const float sign = interpolated > 0.0f ? 1.0f : interpolated < 0.0f ? -1.0f : interpolated;
    main = __fmaf_rn(-c.lr, sign, __fmul_rn(main, c.decay));
    *exp_avg = torch_lerp_rn(m, g, one_minus_beta2);
  }
};

}  // namespace

void multi_tensor_sgd(std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                      std::vector<Tensor>& momentum_bufs, std::vector<Tensor>& copies,
                      const std::vector<float>& weight_decays, float momentum,
                      const Tensor& control) {
  launch_rule("multi_tensor_sgd", SgdRule{momentum}, mains, grads, &momentum_bufs, copies,
              weight_decays, nullptr, control);
}

void multi_tensor_lion(std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                       std::vector<Tensor>& exp_avgs, std::vector<Tensor>& copies,
                       const std::vector<float>& weight_decays, float beta1, float beta2,
                       const Tensor& control) {
  // EO passes the Python floats 1 - beta to lerp, which torch rounds to fp32.
  const LionRule rule{float(1.0 - double(beta1)), float(1.0 - double(beta2))};
  launch_rule("multi_tensor_lion", rule, mains, grads, &exp_avgs, copies, weight_decays, nullptr,
              control);
}

}  // namespace megaton::ops::cuda
