// AdamW optimizer state and step.
#include "optim/adamw.h"

#include <set>
#include <vector>

#include "core/error.h"
#include "ops/ops.h"

namespace megaton::optim {

AdamW::AdamW(std::vector<Param*> params, AdamWConfig config, Device state_device)
    : params_(std::move(params)), config_(config) {
  std::set<std::string> names;
  exp_avg_.reserve(params_.size());
  exp_avg_sq_.reserve(params_.size());
  for (Param* p : params_) {
    MEGATON_CHECK(p != nullptr, "null Param in the optimizer's list");
    const Tensor& master = p->main_param.defined() ? p->main_param : p->weight;
    MEGATON_CHECK(master.defined() && master.dtype() == DType::F32 &&
                      master.shape() == p->weight.shape(),
                  "param '{}' needs an fp32 main_param (or fp32 weight)", p->name);
    MEGATON_CHECK(p->main_grad.defined() && p->main_grad.dtype() == DType::F32 &&
                      p->main_grad.shape() == p->weight.shape(),
                  "param '{}': main_grad {} {} does not match weight {}", p->name,
                  dtype_name(p->main_grad.dtype()), shape_str(p->main_grad.shape()),
                  shape_str(p->weight.shape()));
    MEGATON_CHECK(names.insert(p->name).second, "two params named '{}'", p->name);
    exp_avg_.push_back(Tensor::zeros(p->weight.shape(), DType::F32, p->weight.device()));
    exp_avg_sq_.push_back(Tensor::zeros(p->weight.shape(), DType::F32, p->weight.device()));
  }
  state_ = Tensor::zeros({2}, DType::I64,
                         params_.empty() ? state_device : params_[0]->weight.device());
}

AdamW::Lists AdamW::lists() const {
  // Rebuilt on every step (handles only, no copies of data): the trainer may have
  // reassigned a Param's tensors since the last step.
  Lists out;
  for (Param* p : params_) {
    const Tensor& master = p->main_param.defined() ? p->main_param : p->weight;
    out.masters.push_back(master);
    out.grads.push_back(p->main_grad);
    // The compute copy (bf16 in a bf16 run) follows the updated fp32 master.
    out.copies.push_back(master.raw() != p->weight.raw() ? p->weight : Tensor());
    out.weight_decays.push_back(p->no_weight_decay ? 0.0f : config_.weight_decay);
  }
  return out;
}

void AdamW::step(const Tensor& control) {
  Lists l = lists();
  ops::multi_tensor_adamw(l.masters, l.grads, exp_avg_, exp_avg_sq_, l.copies, l.weight_decays,
                          config_.adam_beta1, config_.adam_beta2, config_.adam_eps, control);
}

int64_t AdamW::step_count() const { return state_.to(Device::CPU).i64()[0]; }

void AdamW::step(float lr, float grad_scale) {
  const int64_t step = step_count() + 1;
  set_step_count(step);
  Lists l = lists();
  ops::multi_tensor_adamw(l.masters, l.grads, exp_avg_, exp_avg_sq_, l.copies, l.weight_decays, lr,
                          config_.adam_beta1, config_.adam_beta2, config_.adam_eps, step,
                          grad_scale);
}

void AdamW::set_step_count(int64_t count) {
  MEGATON_CHECK(count >= 0, "optimizer step count {}", count);
  Tensor host = state_.to(Device::CPU);
  host.i64()[0] = count;
  state_.copy_from(host);
}

std::vector<std::pair<std::string, Tensor*>> AdamW::state_tensors() {
  std::vector<std::pair<std::string, Tensor*>> out;
  out.reserve(2 * params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i]->name + ".exp_avg", &exp_avg_[i]);
    out.emplace_back(params_[i]->name + ".exp_avg_sq", &exp_avg_sq_[i]);
  }
  return out;
}

}  // namespace megaton::optim
