// SGD and Lion steps over lists of params (optim/sgd_lion_optimizer.h).
#include "optim/sgd_lion_optimizer.h"

#include "core/error.h"
#include "ops/sgd_lion.h"

namespace megaton::optim {

SgdLion::SgdLion(Kind kind, std::vector<RuleParam> params, float beta1, float beta2,
                 float weight_decay)
    : kind_(kind),
      params_(std::move(params)),
      beta1_(beta1),
      beta2_(beta2),
      weight_decay_(weight_decay) {
  for (const RuleParam& rp : params_) {
    MEGATON_CHECK(rp.target && rp.model, "SgdLion: a param without its target or model");
    Param& t = *rp.target;
    const Tensor& main = main_of(t);
    MEGATON_CHECK(main.defined() && main.dtype() == DType::F32,
                  "SgdLion: '{}' needs an fp32 main param", rp.model->name);
    MEGATON_CHECK(t.main_grad.defined() && t.main_grad.numel() == main.numel(),
                  "SgdLion: '{}' has no main grad of its {} elements", rp.model->name,
                  main.numel());
    state_.push_back(Tensor::zeros(main.shape(), DType::F32, main.device()));
  }
}

const char* SgdLion::state_suffix() const {
  return kind_ == Kind::Sgd ? ".momentum_buffer" : ".exp_avg";
}

std::vector<std::pair<std::string, Tensor*>> SgdLion::state_tensors() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (size_t i = 0; i < params_.size(); ++i)
    out.emplace_back(params_[i].model->name + state_suffix(), &state_[i]);
  return out;
}

void SgdLion::step(const Tensor& control) {
  if (params_.empty()) return;
  std::vector<Tensor> mains, grads, copies;
  std::vector<float> wds;
  for (const RuleParam& rp : params_) {
    Param& t = *rp.target;
    mains.push_back(main_of(t));
    grads.push_back(t.main_grad);
    copies.push_back(compute_copy_of(t));
    wds.push_back(rp.model->no_weight_decay ? 0.0f : weight_decay_);
  }
  if (kind_ == Kind::Sgd)
    ops::multi_tensor_sgd(mains, grads, state_, copies, wds, beta1_, control);
  else
    ops::multi_tensor_lion(mains, grads, state_, copies, wds, beta1_, beta2_, control);
}

}  // namespace megaton::optim
