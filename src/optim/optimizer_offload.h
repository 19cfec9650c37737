// OptimizerOffload: Megatron's --optimizer-cpu-offload (HybridDeviceOptimizer,
// megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py) for an AdamW: the fp32 main
// params and Adam moments of the first --optimizer-offload-fraction of its elements live in
// pinned host memory, and their update runs on the host while the device updates the rest.
// docs/memory.md, "Optimizer offloading".
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/copy_stream.h"
#include "core/tensor.h"
#include "model/param.h"
#include "ops/adam_precision_math.h"

namespace megaton::optim {

struct AdamWConfig;

// Megatron's choice of the offloaded params (_get_sub_optimizer_param_groups): in list
// order, each param is offloaded while the elements offloaded so far are below
// fraction x all elements (so the param that crosses the threshold goes too). One flag
// per param.
std::vector<uint8_t> choose_offloaded_params(const std::vector<Param*>& params, double fraction);

class OptimizerOffload {
 public:
  // Takes the params flagged in `offloaded`: each one's fp32 main param (joined from its
  // remainder, or the weight itself in an fp32 run) is copied into pinned host memory and
  // becomes Param::main_param (a host tensor; main_param_remainder is released, the device
  // weight stays, the compute copy the forward reads). Makes their moments on the host,
  // zero, in the config's dtypes: `exp_avg` and `exp_avg_sq` receive them at the params'
  // indices (the others are left as they are). The host copy of each main grad keeps its
  // dtype (F32, or BF16 under --main-grads-dtype bf16: widened as the host update reads it).
  // InternalError when a flagged param has no F32 or BF16 main_grad on its device.
  OptimizerOffload(const std::vector<Param*>& params, const std::vector<uint8_t>& offloaded,
                   const AdamWConfig& config, std::vector<Tensor>& exp_avg,
                   std::vector<Tensor>& exp_avg_sq);
  ~OptimizerOffload();

  bool empty() const { return index_.empty(); }
  // The offloaded params' elements (for logs and tests).
  int64_t numel() const { return numel_; }

  // The first half of a step, before the device's own update is queued: the side stream
  // waits for the compute stream (the reduced gradients and, with `control`, the step's
  // control values) and copies the offloaded params' main grads and `control` (when
  // defined) to the host.
  void start(const Tensor& control);
  // The second half, after the device's update is queued (it runs meanwhile): waits for the
  // copies, runs the host update (ops::multi_tensor_adamw on the CPU, with the host copy of
  // control, or with lr/step/grad_scale when control was undefined), then queues the
  // copies of the updated weights (bf16/fp16 compute copies, or the fp32 weights
  // themselves) back to the device; the compute stream waits for them before anything
  // queued later. Nothing is written when control says skip.
  void finish(const std::vector<float>& weight_decays, const std::vector<ops::MomentRoundingKey>& keys,
              const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
              float beta1, float beta2, float eps, float lr, int64_t step, float grad_scale);

 private:
  std::vector<Param*> params_;  // the offloaded ones
  std::vector<size_t> index_;   // their indices in the optimizer's list
  int64_t numel_ = 0;
  Device device_;
  HostBuffer host_;  // masters, moments, grads, compute copies, control
  std::unique_ptr<HostCopyStream> stream_;
  CopyEvent copied_in_, copied_out_;
  std::vector<Tensor> grads_, copies_;  // host staging: main grads, compute copies
  Tensor control_;                      // host F32 [kAdamControlSize] (the control path)
  bool with_control_ = false;
};

}  // namespace megaton::optim
