// MoELayer forward/backward.
#include "model/moe.h"

#include <cmath>
#include <utility>

#include "core/error.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace megaton {

MoELayer::MoELayer(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                   const ModelParallel& mp, int64_t layer)
    : router(prefix, cfg, seed, mp, layer),
      cfg_(cfg),
      mp_(mp),
      layer_(layer),
      dispatcher_(make_token_dispatcher(cfg.num_experts, mp)) {
  Placement where = Placement::of(cfg);
  float output_std = cfg.scaled_init_method_std();
  int64_t h = cfg.hidden_size, f = cfg.moe_ffn_hidden_size, f1 = cfg.swiglu ? 2 * f : f;
  const int etp = mp.etp_size(), etp_rank = mp.etp_rank();
  if (f % etp != 0)
    fail("moe-ffn-hidden-size ({}) is not divisible by expert-tensor-parallel-size ({})", f, etp);
  if (cfg.moe_shared_expert_intermediate_size > 0)
    shared_expert = std::make_unique<SharedExpertMLP>(prefix + ".shared_experts", cfg, seed, mp);
  first_local_expert_ = dispatcher_->first_local_expert();
  for (int64_t l = 0; l < dispatcher_->num_local_experts(); ++l) {
    // Megatron's checkpoints name experts by their global index.
    std::string name = prefix + ".experts.local_experts." + std::to_string(first_local_expert_ + l);
    Expert ex;
    // Column-parallel fc1 (each SwiGLU half split), row-parallel fc2 over etp; the values
    // are the one-rank expert's slices.
    ex.fc1_weight = make_param_sharded(name + ".linear_fc1.weight", {f1, h}, cfg.init_method_std,
                                       seed, where, 0, etp_rank, etp, cfg.swiglu);
    ex.fc2_weight = make_param_sharded(name + ".linear_fc2.weight", {h, f}, output_std, seed, where,
                                       1, etp_rank, etp);
    if (!cfg.disable_bias_linear) {
      ex.fc1_bias = make_constant_param(name + ".linear_fc1.bias", {f1 / etp}, 0.0f, true, where);
      if (etp > 1) {  // zeros: the slice is zeros too
        ex.fc1_bias.tp_split_dim = 0;
        ex.fc1_bias.swiglu_halves = cfg.swiglu;
        ex.fc1_bias.full_shape = {f1};
      }
      ex.fc2_bias = make_constant_param(name + ".linear_fc2.bias", {h}, 0.0f, true, where);
    }
    for (Param* param : {&ex.fc1_weight, &ex.fc2_weight, &ex.fc1_bias, &ex.fc2_bias})
      param->is_expert = true;
    experts.push_back(std::move(ex));
  }
}

bool MoELayer::splits_rows() const { return mp_.tp_size() > 1 && !mp_.sequence_parallel; }

std::vector<Tensor> MoELayer::expert_weights(Param Expert::*w) const {
  std::vector<Tensor> out;
  for (const Expert& e : experts) out.push_back((e.*w).weight);
  return out;
}

std::vector<Tensor> MoELayer::expert_grads(Param Expert::*w) const {
  std::vector<Tensor> out;
  for (const Expert& e : experts) out.push_back((e.*w).main_grad);
  return out;
}

void MoELayer::expert_bias_forward(Tensor& y, Param Expert::*bias) {
  if (cfg_.disable_bias_linear) return;
  int64_t start = 0;
  for (size_t e = 0; e < experts.size(); ++e) {
    int64_t n = saved_.expert_rows[e];
    if (n > 0) {
      Tensor rows = y.rows(start, n);
      ops::bias_add_(rows, (experts[e].*bias).weight);
    }
    start += n;
  }
}

void MoELayer::expert_bias_backward(const Tensor& dy, Param Expert::*bias) {
  if (cfg_.disable_bias_linear) return;
  int64_t start = 0;
  for (size_t e = 0; e < experts.size(); ++e) {
    int64_t n = saved_.expert_rows[e];
    if (n > 0) ops::bias_backward(dy.rows(start, n), (experts[e].*bias).main_grad);
    start += n;
  }
}

Tensor MoELayer::pad_to_capacity(const Tensor& rows) const {
  const Saved& s = saved_;
  if (s.expert_capacity == 0) return rows;
  const int64_t groups = int64_t(s.expert_rows.size());
  Tensor padded = empty_like(rows, {groups * s.expert_capacity, rows.dim(1)});
  ops::moe_pad_rows_to_capacity(rows, s.tokens_per_local_expert, s.expert_capacity, padded);
  return padded;
}

Tensor MoELayer::unpad_from_capacity(const Tensor& padded) const {
  const Saved& s = saved_;
  if (s.expert_capacity == 0) return padded;
  int64_t routed = 0;
  for (int64_t n : s.tokens_per_local_expert) routed += n;
  Tensor rows = empty_like(padded, {routed, padded.dim(1)});
  ops::moe_unpad_rows_from_capacity(padded, s.tokens_per_local_expert, s.expert_capacity, rows);
  return rows;
}

Tensor MoELayer::expert_activation() const {
  const Tensor& fc1_out = saved_.fc1_out;
  Tensor act = empty_like(fc1_out, {fc1_out.dim(0), experts[0].fc2_weight.weight.dim(1)});
  if (cfg_.swiglu)
    ops::swiglu_forward(fc1_out, act);
  else
    ops::gelu_forward(fc1_out, act);
  return act;
}

Tensor MoELayer::forward(const Tensor& x_in, const ForwardContext& ctx) {
  Tensor x = x_in;
  if (splits_rows()) {
    const int64_t tp = mp_.tp_size();
    MEGATON_CHECK(x_in.dim(0) % tp == 0,
                  "MoE layer: {} token rows are not divisible by tensor-parallel size {}",
                  x_in.dim(0), tp);
    x = x_in.rows(mp_.tp_rank() * (x_in.dim(0) / tp), x_in.dim(0) / tp);
  }
  const int64_t tokens = x.dim(0), hidden = x.dim(1);
  Saved& s = saved_;
  s.x = x;
  // This rank's rows are block tp_rank of the tensor-parallel group's token rows (under
  // sequence parallelism, or split here without it).
  const TopKRouter::Output routing =
      router.forward(x, ctx, mp_.tp_size() > 1 ? int64_t(mp_.tp_rank()) * tokens : 0);
  s.aux_loss = float(router.last_loss());

  // The kept copies routed to this rank's experts, grouped by local expert; padded to a
  // fixed size per expert: each rank of the expert-model-parallel group sends an expert at
  // most `capacity` copies (all ranks have the same token count, hence capacity).
  s.expert_in = dispatcher_->dispatch(x, routing.probs, routing.indices);
  s.tokens_per_local_expert = dispatcher_->tokens_per_local_expert();
  s.expert_rows = s.tokens_per_local_expert;
  s.expert_capacity = 0;
  if (cfg_.moe_pad_expert_input_to_capacity) {
    MEGATON_CHECK(cfg_.moe_expert_capacity_factor > 0,
                  "moe-pad-expert-input-to-capacity needs moe-expert-capacity-factor");
    s.expert_capacity = routing.capacity * mp_.group(dist::GroupKind::ExpertMP).size();
    s.expert_rows.assign(s.tokens_per_local_expert.size(), s.expert_capacity);
    s.expert_in = pad_to_capacity(s.expert_in);
  }
  const int64_t rows = s.expert_in.dim(0);
  s.fc1_out = empty_like(x, {rows, experts[0].fc1_weight.weight.dim(0)});
  ops::grouped_gemm(s.expert_in, expert_weights(&Expert::fc1_weight), true, s.fc1_out,
                    s.expert_rows);
  expert_bias_forward(s.fc1_out, &Expert::fc1_bias);
  // Unpadded, the expert output is handed to combine as it is: the dispatcher's buffer.
  Tensor expert_out = s.expert_capacity == 0
                          ? dispatcher_->new_exchanged_rows({rows, hidden}, x.dtype(), x.device())
                          : empty_like(x, {rows, hidden});
  ops::grouped_gemm(expert_activation(), expert_weights(&Expert::fc2_weight), true, expert_out,
                    s.expert_rows);
  // Row-parallel fc2: the partial outputs are summed over etp, the bias counted once.
  if (mp_.etp_rank() == 0) expert_bias_forward(expert_out, &Expert::fc2_bias);

  Tensor out = dispatcher_->combine(unpad_from_capacity(expert_out));
  if (splits_rows()) out = gather_sequence(out, mp_);
  if (shared_expert) ops::add_(out, shared_expert->forward(x_in));
  return out;
}

Tensor MoELayer::backward(const Tensor& dy_in) {
  MEGATON_CHECK(saved_.x.defined(), "MoE layer '{}': backward without a forward",
                router.weight.name);
  const Saved& s = saved_;
  Tensor dy = dy_in;
  if (splits_rows()) {  // dy is whole on every TP rank: this rank's block of it
    const int64_t tp = mp_.tp_size();
    dy = dy_in.rows(mp_.tp_rank() * (dy_in.dim(0) / tp), dy_in.dim(0) / tp);
  }
  Tensor dprobs;
  // The padding rows' output gradient is zero (a padding row is no copy's).
  Tensor dexpert_out = pad_to_capacity(dispatcher_->combine_backward(dy, dprobs));

  // linear_fc2 of every local expert; its input, the activation, is recomputed (not kept).
  Tensor act = expert_activation();
  Tensor dact = empty_like(dy, act.shape());
  ops::grouped_gemm(dexpert_out, expert_weights(&Expert::fc2_weight), false, dact, s.expert_rows);
  std::vector<Tensor> fc2_grads = expert_grads(&Expert::fc2_weight);
  ops::grouped_gemm_wgrad(dexpert_out, act, fc2_grads, s.expert_rows);
  act = Tensor();
  // dexpert_out is whole on every ETP rank: each computes the same fc2 bias gradient.
  expert_bias_backward(dexpert_out, &Expert::fc2_bias);
  // activation and linear_fc1.
  Tensor dfc1 = empty_like(dy, s.fc1_out.shape());
  if (cfg_.swiglu)
    ops::swiglu_backward(dact, s.fc1_out, dfc1);
  else
    ops::gelu_backward(dact, s.fc1_out, dfc1);
  Tensor dexpert_in = s.expert_capacity == 0 ? dispatcher_->new_exchanged_rows(
                                                   s.expert_in.shape(), dy.dtype(), dy.device())
                                             : empty_like(dy, s.expert_in.shape());
  ops::grouped_gemm(dfc1, expert_weights(&Expert::fc1_weight), false, dexpert_in, s.expert_rows);
  std::vector<Tensor> fc1_grads = expert_grads(&Expert::fc1_weight);
  ops::grouped_gemm_wgrad(dfc1, s.expert_in, fc1_grads, s.expert_rows);
  expert_bias_backward(dfc1, &Expert::fc1_bias);
  dfc1 = Tensor();
  Tensor dx = dispatcher_->dispatch_backward(unpad_from_capacity(dexpert_in));

  // Router: the probabilities' and the injected losses' gradients, then the gating linear.
  router.backward(dprobs, aux_grad_scale, dx);
  // The tensors are used up; last_aux_loss() and last_tokens_per_local_expert() stay
  // readable until the next forward (or take_saved).
  Saved reported;
  reported.aux_loss = s.aux_loss;
  reported.tokens_per_local_expert = std::move(saved_.tokens_per_local_expert);
  saved_ = std::move(reported);
  if (splits_rows()) dx = gather_sequence(dx, mp_);
  if (shared_expert) ops::add_(dx, shared_expert->backward(dy_in));
  return dx;
}

MoELayer::Activations MoELayer::take_saved() {
  Activations out{std::exchange(saved_, {}), router.take_saved(), dispatcher_->take_saved(), {}};
  if (shared_expert) out.shared_expert = shared_expert->take_saved();
  return out;
}

void MoELayer::restore_saved(Activations&& saved) {
  saved_ = std::move(saved.moe);
  router.restore_saved(std::move(saved.router));
  dispatcher_->restore_saved(std::move(saved.dispatcher));
  if (shared_expert) shared_expert->restore_saved(std::move(saved.shared_expert));
}

void MoELayer::collect_params(std::vector<Param*>& out) {
  router.collect_params(out);
  if (shared_expert) shared_expert->collect_params(out);
  for (Expert& e : experts) {
    out.push_back(&e.fc1_weight);
    if (e.fc1_bias.weight.defined()) out.push_back(&e.fc1_bias);
    out.push_back(&e.fc2_weight);
    if (e.fc2_bias.weight.defined()) out.push_back(&e.fc2_bias);
  }
}

}  // namespace megaton
