// MoELayer forward/backward.
#include "model/moe.h"

#include <cmath>
#include <utility>

#include "core/error.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace megaton {

MoELayer::MoELayer(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                   const ModelParallel& mp)
    : router_weight(make_param(prefix + ".router.weight", {cfg.num_experts, cfg.hidden_size},
                               cfg.init_method_std, seed, Placement::of(cfg))),
      cfg_(cfg),
      mp_(mp),
      dispatcher_(make_token_dispatcher(cfg.num_experts, mp)) {
  Placement where = Placement::of(cfg);
  float output_std = cfg.init_method_std / std::sqrt(2.0f * float(cfg.num_layers));
  int64_t h = cfg.hidden_size, f = cfg.moe_ffn_hidden_size, f1 = cfg.swiglu ? 2 * f : f;
  const int etp = mp.etp_size(), etp_rank = mp.etp_rank();
  if (f % etp != 0)
    fail("moe-ffn-hidden-size ({}) is not divisible by expert-tensor-parallel-size ({})", f, etp);
  // The router sees only this rank's token rows under TP (see moe.h): its gradient is a
  // partial sum over the tensor-parallel group.
  router_weight.sequence_parallel = mp.tp_size() > 1;
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
    int64_t n = saved_.tokens_per_local_expert[e];
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
    int64_t n = saved_.tokens_per_local_expert[e];
    if (n > 0) ops::bias_backward(dy.rows(start, n), (experts[e].*bias).main_grad);
    start += n;
  }
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

float MoELayer::aux_loss_forward() {
  Saved& s = saved_;
  const int64_t tokens = s.logits.dim(0), num_experts = cfg_.num_experts;
  const int k = int(cfg_.moe_router_topk);
  s.aux_scores = Tensor::empty({tokens, num_experts}, DType::F32, s.logits.device());
  s.aux_counts = Tensor::empty({num_experts}, DType::F32, s.logits.device());
  const float local =
      ops::moe_aux_loss_forward(s.logits, k, cfg_.moe_aux_loss_coeff, s.aux_scores, s.aux_counts);
  const dist::Group& group = mp_.tp_cp();
  if (group.size() == 1) return local;
  // Megatron's aux_loss: tokens_per_expert summed over the TP x CP group and
  // T = local tokens x its size, with this rank's scores:
  //   coeff * E / (k (T S)^2) * sum_e (sum_t scores[t, e]) * tokens_per_expert[e].
  mp_.comm->all_reduce(s.aux_counts, group);
  const double size = double(group.size());
  Tensor weighted = Tensor::empty({tokens, 1}, DType::F32, s.logits.device());
  ops::gemm(s.aux_scores, false, s.aux_counts.view({num_experts, 1}), false, weighted);
  const double aux = double(cfg_.moe_aux_loss_coeff) * double(num_experts) /
                     (double(k) * double(tokens) * double(tokens) * size * size) *
                     ops::sum(weighted);
  // moe_aux_loss_backward divides by the local T^2: counts / S^2 give the factor above.
  ops::scale_(s.aux_counts, float(1.0 / (size * size)));
  return float(aux);
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
  int64_t tokens = x.dim(0), hidden = x.dim(1), num_experts = cfg_.num_experts;
  int k = int(cfg_.moe_router_topk);
  Device dev = x.device();
  Saved& s = saved_;
  s.x = x;
  // Router math in fp32 (Megatron computes the routing scores in fp32).
  s.logits = Tensor::empty({tokens, num_experts}, DType::F32, dev);
  ops::gemm(x, false, router_weight.weight, true, s.logits);
  s.probs = Tensor::empty({tokens, k}, DType::F32, dev);
  s.indices = Tensor::empty({tokens, k}, DType::I32, dev);
  ops::moe_topk_softmax_forward(s.logits, k, cfg_.moe_router_pre_softmax, s.probs, s.indices);
  if (cfg_.use_aux_loss()) {
    s.aux_loss = aux_loss_forward();
  } else {
    s.aux_loss = 0.0f;
    s.aux_scores = s.aux_counts = Tensor();
  }

  // The copies routed to this rank's experts, grouped by local expert.
  s.expert_in = dispatcher_->dispatch(x, s.probs, s.indices);
  s.tokens_per_local_expert = dispatcher_->tokens_per_local_expert();
  const int64_t rows = s.expert_in.dim(0);
  s.fc1_out = empty_like(x, {rows, experts[0].fc1_weight.weight.dim(0)});
  ops::grouped_gemm(s.expert_in, expert_weights(&Expert::fc1_weight), true, s.fc1_out,
                    s.tokens_per_local_expert);
  expert_bias_forward(s.fc1_out, &Expert::fc1_bias);
  Tensor expert_out = empty_like(x, {rows, hidden});
  ops::grouped_gemm(expert_activation(), expert_weights(&Expert::fc2_weight), true, expert_out,
                    s.tokens_per_local_expert);
  // Row-parallel fc2: the partial outputs are summed over etp, the bias counted once.
  if (mp_.etp_rank() == 0) expert_bias_forward(expert_out, &Expert::fc2_bias);

  Tensor out = dispatcher_->combine(expert_out);
  return splits_rows() ? gather_sequence(out, mp_) : out;
}

Tensor MoELayer::backward(const Tensor& dy_in) {
  MEGATON_CHECK(saved_.x.defined(), "MoE layer '{}': backward without a forward",
                router_weight.name);
  const Saved& s = saved_;
  Tensor dy = dy_in;
  if (splits_rows()) {  // dy is whole on every TP rank: this rank's block of it
    const int64_t tp = mp_.tp_size();
    dy = dy_in.rows(mp_.tp_rank() * (dy_in.dim(0) / tp), dy_in.dim(0) / tp);
  }
  int64_t tokens = dy.dim(0), num_experts = cfg_.num_experts;
  int k = int(cfg_.moe_router_topk);
  Tensor dprobs;
  Tensor dexpert_out = dispatcher_->combine_backward(dy, dprobs);

  // linear_fc2 of every local expert; its input, the activation, is recomputed (not kept).
  Tensor act = expert_activation();
  Tensor dact = empty_like(dy, act.shape());
  ops::grouped_gemm(dexpert_out, expert_weights(&Expert::fc2_weight), false, dact,
                    s.tokens_per_local_expert);
  std::vector<Tensor> fc2_grads = expert_grads(&Expert::fc2_weight);
  ops::grouped_gemm_wgrad(dexpert_out, act, fc2_grads, s.tokens_per_local_expert);
  act = Tensor();
  // dexpert_out is whole on every ETP rank: each computes the same fc2 bias gradient.
  expert_bias_backward(dexpert_out, &Expert::fc2_bias);
  // activation and linear_fc1.
  Tensor dfc1 = empty_like(dy, s.fc1_out.shape());
  if (cfg_.swiglu)
    ops::swiglu_backward(dact, s.fc1_out, dfc1);
  else
    ops::gelu_backward(dact, s.fc1_out, dfc1);
  Tensor dexpert_in = empty_like(dy, s.expert_in.shape());
  ops::grouped_gemm(dfc1, expert_weights(&Expert::fc1_weight), false, dexpert_in,
                    s.tokens_per_local_expert);
  std::vector<Tensor> fc1_grads = expert_grads(&Expert::fc1_weight);
  ops::grouped_gemm_wgrad(dfc1, s.expert_in, fc1_grads, s.tokens_per_local_expert);
  expert_bias_backward(dfc1, &Expert::fc1_bias);
  dfc1 = Tensor();

  Tensor dx = dispatcher_->dispatch_backward(dexpert_in);

  // Router: probabilities and the injected aux-loss gradient, then the gating linear.
  Tensor dlogits = Tensor::empty({tokens, num_experts}, DType::F32, dy.device());
  ops::moe_topk_softmax_backward(dprobs, s.logits, s.probs, s.indices, cfg_.moe_router_pre_softmax,
                                 dlogits);
  if (cfg_.use_aux_loss())
    ops::moe_aux_loss_backward(aux_grad_scale, s.aux_scores, s.aux_counts, k,
                               cfg_.moe_aux_loss_coeff, dlogits);
  Tensor dlogits_compute = dlogits;
  if (dy.dtype() != DType::F32) {
    dlogits_compute = empty_like(dy, dlogits.shape());
    ops::cast(dlogits, dlogits_compute);
  }
  ops::gemm(dlogits_compute, false, router_weight.weight, false, dx, 1.0f, 1.0f);
  ops::gemm(dlogits_compute, true, s.x, false, router_weight.main_grad, 1.0f, 1.0f);
  // The tensors are used up; last_aux_loss() and last_tokens_per_local_expert() stay
  // readable until the next forward (or take_saved).
  Saved reported;
  reported.aux_loss = s.aux_loss;
  reported.tokens_per_local_expert = std::move(saved_.tokens_per_local_expert);
  saved_ = std::move(reported);
  return splits_rows() ? gather_sequence(dx, mp_) : dx;
}

MoELayer::Activations MoELayer::take_saved() {
  return {std::exchange(saved_, {}), dispatcher_->take_saved()};
}

void MoELayer::restore_saved(Activations&& saved) {
  saved_ = std::move(saved.moe);
  dispatcher_->restore_saved(std::move(saved.dispatcher));
}

void MoELayer::collect_params(std::vector<Param*>& out) {
  out.push_back(&router_weight);
  for (Expert& e : experts) {
    out.push_back(&e.fc1_weight);
    if (e.fc1_bias.weight.defined()) out.push_back(&e.fc1_bias);
    out.push_back(&e.fc2_weight);
    if (e.fc2_bias.weight.defined()) out.push_back(&e.fc2_bias);
  }
}

}  // namespace megaton
