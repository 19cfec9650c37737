// The param an update rule beside AdamW (optim::Muon, optim::SgdLion) steps, and where the
// step reads and writes it.
#pragma once

#include "model/param.h"

namespace megaton::optim {

// One param (or one piece of it) a rule updates. `target` holds what the step writes: an
// fp32 main_param (or an fp32 weight that is its own main param), its main_grad (F32 or
// BF16, the same numel) and, when main_param is separate, the compute weight rewritten
// from it. `model` is the model's param (the same object when the update is replicated; the
// owner's piece of it under the distributed optimizer): its name keys the state, and its
// no_weight_decay, tensor-parallel split (tp_split_dim, full_shape, is_expert) and
// qkv_split_rows hold.
struct RuleParam {
  Param* target = nullptr;
  const Param* model = nullptr;
};

// The fp32 tensor a step updates: the main param, or an fp32 weight that is its own.
inline Tensor& main_of(Param& p) { return p.main_param.defined() ? p.main_param : p.weight; }

// The compute weight a step rewrites from the main param (bf16 runs), or undefined when
// the weight is the main param itself.
inline Tensor compute_copy_of(const Param& p) {
  return p.main_param.defined() && !p.main_param.same_data(p.weight) ? p.weight : Tensor();
}

}  // namespace megaton::optim
