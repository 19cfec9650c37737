// DistributedAdamW's update rules (optim/distrib_optimizer.h): which rule takes each
// parameter, the rules built over the targets, their states' checkpoint names, and the
// loading of the states other than AdamW's moments.
#include <algorithm>

#include "core/error.h"
#include "ops/ops.h"
#include "optim/distrib_optimizer.h"

namespace megaton::optim {

namespace {
// The rounding key of the elements from `offset` of p's slice on this rank (the
// tensor-parallel group of an expert param is etp's).
ops::MomentRoundingKey rounding_key_of(const Param& p, int64_t offset, const dist::Grid& grid) {
  const dist::Group& tp = p.is_expert ? grid.etp() : grid.tp();
  return moment_rounding_key(p, tp.rank, tp.size(), offset);
}
}  // namespace

std::vector<const char*> DistributedAdamW::state_suffixes(Rule rule) {
  switch (rule) {
    case Rule::Adam:
      return {".exp_avg", ".exp_avg_sq"};
    case Rule::Muon:
    case Rule::Sgd:
      return {".momentum_buffer"};
    case Rule::Lion:
      return {".exp_avg"};
  }
  return {};
}

DistributedAdamW::Rule DistributedAdamW::rule_of(const OptimizerConfig& optimizer, const Param& p) {
  switch (optimizer.kind) {
    case OptimizerKind::Adam:
      return Rule::Adam;
    case OptimizerKind::Sgd:
      return Rule::Sgd;
    case OptimizerKind::Muon:
      if (muon_param(p)) return Rule::Muon;
      return optimizer.muon.scalar_optimizer == OptimizerKind::Lion ? Rule::Lion : Rule::Adam;
    case OptimizerKind::Lion:  // Megatron's _is_nonlinear_or_embedding goes to Adam
      return p.weight.ndim() == 2 && !p.padded_vocab_rows ? Rule::Lion : Rule::Adam;
  }
  return Rule::Adam;
}

void DistributedAdamW::make_rules(const std::vector<Param*>& targets,
                                  const std::vector<const Param*>& models,
                                  const std::vector<int64_t>& offsets, const AdamWConfig& config) {
  std::vector<Param*> adam;
  std::vector<ops::MomentRoundingKey> keys;
  std::vector<RuleParam> muon;
  std::vector<RuleParam> elementwise;
  std::vector<size_t> index(targets.size());  // the target's index in its rule's list
  for (size_t i = 0; i < targets.size(); ++i) {
    const Rule rule = rule_of(optimizer_, *models[i]);
    rule_.push_back(rule);
    target_model_.push_back(models[i]);
    if (rule == Rule::Adam) {
      index[i] = adam.size();
      adam_target_.push_back(i);
      adam.push_back(targets[i]);
      keys.push_back(rounding_key_of(*models[i], offsets[i], grid_));
    } else if (rule == Rule::Muon) {
      index[i] = muon.size();
      muon.push_back({targets[i], models[i]});
    } else {
      index[i] = elementwise.size();
      elementwise.push_back({targets[i], models[i]});
    }
  }
  adam_ = std::make_unique<AdamW>(adam, config, comm_.device());
  adam_->set_rounding_keys(std::move(keys));
  if (!muon.empty())
    muon_ =
        std::make_unique<Muon>(std::move(muon), optimizer_.muon, config.weight_decay, grid_, comm_);
  if (!elementwise.empty()) {
    // SGD's momentum; Lion's betas: --lion-beta1/2 as Muon's scalar optimizer, Adam's betas
    // for a top-level --optimizer lion (Megatron's _default_adam_based_eopt_config_to_kwargs).
    const bool sgd = optimizer_.kind == OptimizerKind::Sgd;
    const bool top_lion = optimizer_.kind == OptimizerKind::Lion;
    const float beta1 =
        sgd ? optimizer_.sgd_momentum : (top_lion ? config.adam_beta1 : optimizer_.lion_beta1);
    const float beta2 = sgd ? 0.0f : (top_lion ? config.adam_beta2 : optimizer_.lion_beta2);
    elementwise_ =
        std::make_unique<SgdLion>(sgd ? SgdLion::Kind::Sgd : SgdLion::Kind::Lion,
                                  std::move(elementwise), beta1, beta2, config.weight_decay);
  }
  // Each target's states by suffix, for the checkpoint walks.
  const auto adam_states = adam_->state_tensors();
  const auto muon_states =
      muon_ ? muon_->state_tensors() : std::vector<std::pair<std::string, Tensor*>>{};
  const auto elementwise_states =
      elementwise_ ? elementwise_->state_tensors() : std::vector<std::pair<std::string, Tensor*>>{};
  for (size_t i = 0; i < targets.size(); ++i) {
    const size_t k = index[i];
    std::vector<Tensor*> states;
    if (rule_[i] == Rule::Adam)
      states = {adam_states[2 * k].second, adam_states[2 * k + 1].second};
    else
      states = {(rule_[i] == Rule::Muon ? muon_states : elementwise_states)[k].second};
    const std::vector<const char*> suffixes = state_suffixes(rule_[i]);
    target_states_.emplace_back();
    for (size_t s = 0; s < states.size(); ++s)
      target_states_.back().emplace_back(suffixes[s], states[s]);
  }
}

void DistributedAdamW::set_weight_decay(float weight_decay) {
  adam_->set_weight_decay(weight_decay);
  if (muon_) muon_->set_weight_decay(weight_decay);
  if (elementwise_) elementwise_->set_weight_decay(weight_decay);
}

Tensor DistributedAdamW::host_control(float lr, float grad_scale) const {
  Tensor control = Tensor::zeros({ops::kAdamControlSize});
  control.f32()[ops::kAdamLr] = lr;
  control.f32()[ops::kAdamGradScale] = grad_scale;
  return control.to(adam_->device_state().device());
}

void DistributedAdamW::load_rule_states(
    const std::function<const Tensor*(const std::string&)>& find, const std::string& source,
    const RangeReads& ranges) {
  const bool by_range = distributed_ && ranges.dtype_of && ranges.read_range;
  // Every rank checks every state, not only its own pieces': a missing one then fails on all
  // ranks alike instead of on its owner while the others go on into collectives.
  for (ParamAndGradBuffer& b : each_buffer())
    for (const Param* p : b.params()) {
      const Rule rule = rule_of(optimizer_, *p);
      if (rule == Rule::Adam) continue;
      for (const char* suffix : state_suffixes(rule)) {
        const std::string name = "optimizer." + p->name + suffix;
        if (by_range ? !ranges.dtype_of(name) : find(name) == nullptr)
          fail("checkpoint '{}' has no tensor '{}'", source, name);
      }
    }
  for (size_t i = 0; i < rule_.size(); ++i) {
    if (rule_[i] == Rule::Adam) continue;  // load_moments
    const Param* p = target_model_[i];
    int64_t offset = 0, numel = p->weight.numel();
    if (distributed_) {
      offset = shard_pieces_[i].param_offset;
      numel = shard_pieces_[i].numel;
    }
    for (const auto& [suffix, state] : target_states_[i]) {
      const std::string name = "optimizer." + p->name + suffix;
      Tensor piece;
      if (by_range) {
        const std::optional<DType> d = ranges.dtype_of(name);
        if (!d) fail("checkpoint '{}' has no tensor '{}'", source, name);
        if (*d != DType::F32)
          fail("checkpoint '{}': tensor '{}' is {}, the optimizer expects F32", source, name,
               dtype_name(*d));
        piece = ranges.read_range(name, offset, numel);
      } else {
        const Tensor* t = find(name);
        if (!t) fail("checkpoint '{}' has no tensor '{}'", source, name);
        if (t->shape() != p->weight.shape() || t->dtype() != DType::F32)
          fail("checkpoint '{}': tensor '{}' is {} {}, the optimizer expects F32 {}", source, name,
               dtype_name(t->dtype()), shape_str(t->shape()), shape_str(p->weight.shape()));
        piece = t->view({t->numel()}).rows(offset, numel);
      }
      state->view({numel}).copy_from(piece);
    }
  }
}

}  // namespace megaton::optim
