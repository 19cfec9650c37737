// SGD and Lion: the elementwise update rules DistributedAdamW hosts beside AdamW and Muon
// (--optimizer sgd; --optimizer lion's matrices; --muon-scalar-optimizer lion). Elementwise,
// so any piece of a param (the distributed optimizer's flat shards) updates exactly as
// the whole would.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "optim/rule_param.h"

namespace megaton::optim {

class SgdLion {
 public:
  enum class Kind { Sgd, Lion };
  // Sgd: torch.optim.SGD as Megatron builds it (momentum `beta1`, no dampening, no
  // Nesterov, L2 weight decay added to the gradient; ops::multi_tensor_sgd). Lion: NVIDIA
  // Emerging-Optimizers' Lion (betas beta1, beta2, decoupled weight decay;
  // ops::multi_tensor_lion). weight_decay: 0 for Param::no_weight_decay. The params are not
  // owned and must outlive the optimizer. InternalError on a target without an fp32 main
  // param or with a main grad of another numel.
  SgdLion(Kind kind, std::vector<RuleParam> params, float beta1, float beta2, float weight_decay);

  // One step decided on the device (ops::adamw_step_control's control: learning rate,
  // gradient scale, skip). Nothing changes when it skips.
  void step(const Tensor& control);

  // The one state per param, F32, the target's shape: "<model name>.momentum_buffer" (SGD,
  // torch's name) or "<model name>.exp_avg" (Lion, EO's name).
  std::vector<std::pair<std::string, Tensor*>> state_tensors();
  // The state's suffix: ".momentum_buffer" or ".exp_avg".
  const char* state_suffix() const;
  void set_weight_decay(float weight_decay) { weight_decay_ = weight_decay; }
  const std::vector<RuleParam>& params() const { return params_; }

 private:
  Kind kind_;
  std::vector<RuleParam> params_;
  float beta1_, beta2_, weight_decay_;
  std::vector<Tensor> state_;
};

}  // namespace megaton::optim
