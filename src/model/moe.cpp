// MoELayer forward/backward.
#include "model/moe.h"

#include <cmath>

#include "ops/ops.h"

namespace megaton {

MoELayer::MoELayer(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                   const ModelParallel& mp)
    : router_weight(make_param(prefix + ".router.weight", {cfg.num_experts, cfg.hidden_size},
                               cfg.init_method_std, seed, Placement::of(cfg))),
      cfg_(cfg),
      mp_(mp) {
  Placement where = Placement::of(cfg);
  float output_std = cfg.init_method_std / std::sqrt(2.0f * float(cfg.num_layers));
  int64_t h = cfg.hidden_size, f = cfg.moe_ffn_hidden_size, f1 = cfg.swiglu ? 2 * f : f;
  for (int64_t e = 0; e < cfg.num_experts; ++e) {
    std::string name = prefix + ".experts.local_experts." + std::to_string(e);
    Expert ex;
    ex.fc1_weight = make_param(name + ".linear_fc1.weight", {f1, h}, cfg.init_method_std, seed, where);
    ex.fc2_weight = make_param(name + ".linear_fc2.weight", {h, f}, output_std, seed, where);
    if (!cfg.disable_bias_linear) {
      ex.fc1_bias = make_constant_param(name + ".linear_fc1.bias", {f1}, 0.0f, true, where);
      ex.fc2_bias = make_constant_param(name + ".linear_fc2.bias", {h}, 0.0f, true, where);
    }
    for (Param* param : {&ex.fc1_weight, &ex.fc2_weight, &ex.fc1_bias, &ex.fc2_bias})
      param->is_expert = true;
    experts.push_back(std::move(ex));
  }
}

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
    int64_t n = last_tokens_per_expert[e];
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
    int64_t n = last_tokens_per_expert[e];
    if (n > 0) ops::bias_backward(dy.rows(start, n), (experts[e].*bias).main_grad);
    start += n;
  }
}

Tensor MoELayer::expert_activation() const {
  Tensor act = empty_like(fc1_out_, {fc1_out_.dim(0), experts[0].fc2_weight.weight.dim(1)});
  if (cfg_.swiglu) ops::swiglu_forward(fc1_out_, act);
  else ops::gelu_forward(fc1_out_, act);
  return act;
}

Tensor MoELayer::forward(const Tensor& x, const ForwardContext& ctx) {
  int64_t tokens = x.dim(0), hidden = x.dim(1), num_experts = cfg_.num_experts;
  int k = int(cfg_.moe_router_topk);
  Device dev = x.device();
  x_ = x;
  // Router math in fp32 (Megatron computes the routing scores in fp32).
  logits_ = Tensor::empty({tokens, num_experts}, DType::F32, dev);
  ops::gemm(x, false, router_weight.weight, true, logits_);
  probs_ = Tensor::empty({tokens, k}, DType::F32, dev);
  indices_ = Tensor::empty({tokens, k}, DType::I32, dev);
  ops::moe_topk_softmax_forward(logits_, k, cfg_.moe_router_pre_softmax, probs_, indices_);
  last_aux_loss = 0.0f;
  if (cfg_.use_aux_loss()) {
    aux_scores_ = Tensor::empty({tokens, num_experts}, DType::F32, dev);
    aux_counts_ = Tensor::empty({num_experts}, DType::F32, dev);
    last_aux_loss =
        ops::moe_aux_loss_forward(logits_, k, cfg_.moe_aux_loss_coeff, aux_scores_, aux_counts_);
  }

  int64_t rows = tokens * k;
  permuted_ = empty_like(x, {rows, hidden});
  row_id_map_ = Tensor::empty({rows}, DType::I32, dev);
  Tensor counts = Tensor::empty({num_experts}, DType::I64, dev);
  ops::moe_permute(x, indices_, int(num_experts), permuted_, row_id_map_, counts);
  // The grouped GEMMs need the group sizes on the host (as Megatron's dropless MoE does).
  Tensor host_counts = counts.to(Device::CPU);
  last_tokens_per_expert.assign(host_counts.i64(), host_counts.i64() + num_experts);

  fc1_out_ = empty_like(x, {rows, experts[0].fc1_weight.weight.dim(0)});
  ops::grouped_gemm(permuted_, expert_weights(&Expert::fc1_weight), true, fc1_out_,
                    last_tokens_per_expert);
  expert_bias_forward(fc1_out_, &Expert::fc1_bias);
  expert_out_ = empty_like(x, {rows, hidden});
  ops::grouped_gemm(expert_activation(), expert_weights(&Expert::fc2_weight), true, expert_out_,
                    last_tokens_per_expert);
  expert_bias_forward(expert_out_, &Expert::fc2_bias);

  Tensor out = empty_like(x, {tokens, hidden});
  ops::moe_unpermute(expert_out_, row_id_map_, probs_, out);
  return out;
}

Tensor MoELayer::backward(const Tensor& dy) {
  int64_t tokens = dy.dim(0), hidden = dy.dim(1), num_experts = cfg_.num_experts;
  int64_t rows = expert_out_.dim(0);
  int k = int(cfg_.moe_router_topk);
  Tensor dexpert_out = empty_like(dy, {rows, hidden});
  Tensor dprobs = Tensor::empty({tokens, k}, DType::F32, dy.device());
  ops::moe_unpermute_backward(dy, expert_out_, row_id_map_, probs_, dexpert_out, dprobs);

  // linear_fc2 of every expert; its input, the activation, is recomputed (not kept).
  Tensor act = expert_activation();
  Tensor dact = empty_like(dy, act.shape());
  ops::grouped_gemm(dexpert_out, expert_weights(&Expert::fc2_weight), false, dact,
                    last_tokens_per_expert);
  std::vector<Tensor> fc2_grads = expert_grads(&Expert::fc2_weight);
  ops::grouped_gemm_wgrad(dexpert_out, act, fc2_grads, last_tokens_per_expert);
  act = Tensor();
  expert_bias_backward(dexpert_out, &Expert::fc2_bias);
  // activation and linear_fc1.
  Tensor dfc1 = empty_like(dy, fc1_out_.shape());
  if (cfg_.swiglu) ops::swiglu_backward(dact, fc1_out_, dfc1);
  else ops::gelu_backward(dact, fc1_out_, dfc1);
  Tensor dpermuted = empty_like(dy, permuted_.shape());
  ops::grouped_gemm(dfc1, expert_weights(&Expert::fc1_weight), false, dpermuted,
                    last_tokens_per_expert);
  std::vector<Tensor> fc1_grads = expert_grads(&Expert::fc1_weight);
  ops::grouped_gemm_wgrad(dfc1, permuted_, fc1_grads, last_tokens_per_expert);
  expert_bias_backward(dfc1, &Expert::fc1_bias);

  Tensor dx = empty_like(dy, {tokens, hidden});
  ops::moe_permute_backward(dpermuted, row_id_map_, k, dx);

  // Router: probabilities and the injected aux-loss gradient, then the gating linear.
  Tensor dlogits = Tensor::empty({tokens, num_experts}, DType::F32, dy.device());
  ops::moe_topk_softmax_backward(dprobs, logits_, probs_, indices_, cfg_.moe_router_pre_softmax,
                                 dlogits);
  if (cfg_.use_aux_loss())
    ops::moe_aux_loss_backward(aux_grad_scale, aux_scores_, aux_counts_, k,
                               cfg_.moe_aux_loss_coeff, dlogits);
  Tensor dlogits_compute = dlogits;
  if (dy.dtype() != DType::F32) {
    dlogits_compute = empty_like(dy, dlogits.shape());
    ops::cast(dlogits, dlogits_compute);
  }
  ops::gemm(dlogits_compute, false, router_weight.weight, false, dx, 1.0f, 1.0f);
  ops::gemm(dlogits_compute, true, x_, false, router_weight.main_grad, 1.0f, 1.0f);
  x_ = logits_ = probs_ = indices_ = row_id_map_ = permuted_ = fc1_out_ = expert_out_ =
      aux_scores_ = aux_counts_ = Tensor();
  return dx;
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
