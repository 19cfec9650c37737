// The elementwise optimizer rules besides AdamW: torch.optim.SGD with momentum (Megatron's
// --optimizer sgd) and Emerging-Optimizers' Lion (--optimizer lion, and Muon's
// --muon-scalar-optimizer lion), as multi-tensor ops with the step's scalars read from
// adamw_step_control's control tensor (ops.h: control[kAdamLr], control[kAdamGradScale],
// control[kAdamSkip]), so that clipping and the skip of a non-finite step stay on the device.
//
// The doors (ops/cpu/sgd_lion.cpp) check every list before anything is written
// (megaton::InternalError: a wrong list is a bug in the caller) and run the CUDA kernels
// (ops/cuda/sgd_lion.cu) for GPU tensors or the CPU reference. Both compute the same bits:
// every fp32 operation is rounded on its own, products feeding a sum written as explicit
// fused multiply-adds, so no compiler contraction can tell the host from the device.
//
// Lists, for both ops (one entry per parameter or shard):
//   mains:         F32 main params, updated in place.
//   grads:         F32 or BF16 main grads (BF16 widened exactly), numel of mains[i]; read
//                  as g = grad * control[kAdamGradScale] (one fp32 multiply).
//   state:         F32, numel of mains[i], updated in place.
//   copies:        per entry undefined or a BF16, F16 or F32 tensor with mains[i]'s numel,
//                  overwritten with the updated main param rounded to nearest even.
//   weight_decays: per entry (0 for biases and norms).
//   control:       F32 [kAdamControlSize] on the tensors' device.
// All lists of one length, every tensor on one device; shapes may differ where numels
// agree. Nothing is written when control[kAdamSkip] != 0. InternalError on a length,
// dtype, numel or device mismatch, or a hyperparameter out of range.
#pragma once
#include <vector>

#include "core/tensor.h"

namespace megaton::ops {

// torch.optim.SGD as Megatron builds it (optimizer/__init__.py: momentum = --sgd-momentum,
// dampening 0, no Nesterov, weight decay added to the gradient; torch's _single_tensor_sgd):
//   g   = grad * scale;  g = fma(wd_i, main, g) when wd_i != 0    (torch: d_p.add(p, alpha=wd))
//   buf = fma(momentum, buf, g)                                   (buf.mul_(mu).add_(d_p))
//   main = fma(-lr, buf, main)                                    (p.add_(buf, alpha=-lr))
// momentum_bufs start at zero, which equals torch's first step (buf = d_p.clone()).
// momentum >= 0 and finite.
void multi_tensor_sgd(std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                      std::vector<Tensor>& momentum_bufs, std::vector<Tensor>& copies,
                      const std::vector<float>& weight_decays, float momentum,
                      const Tensor& control);

// EO's Lion (scalar_optimizers: decoupled weight decay, then update_functions/lion.py
// calculate_lion_update; docs/research/muon.md 2.7), with torch's lerp (at::lerp:
// a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w), each an fma here):
//   g    = grad * scale
//   main = main * float(1 - lr * wd_i)                      (fp64 factor, as AdamW's)
//   c    = lerp(m, g, float(1 - beta1))                     (beta1 m + (1 - beta1) g)
//   main = fma(-lr, sign(c), main)                          (sign(0) = 0)
//   m    = lerp(m, g, float(1 - beta2))                     (beta2 m + (1 - beta2) g)
// exp_avgs: the state m (EO's "exp_avg"), zero at the start. beta1, beta2 in [0, 1].
void multi_tensor_lion(std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                       std::vector<Tensor>& exp_avgs, std::vector<Tensor>& copies,
                       const std::vector<float>& weight_decays, float beta1, float beta2,
                       const Tensor& control);

}  // namespace megaton::ops
