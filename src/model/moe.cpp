// MoELayer forward/backward.
#include "model/moe.h"

#include <cmath>

#include "ops/ops.h"

namespace megaton {

MoELayer::MoELayer(const std::string& prefix, const GPTConfig& cfg, uint64_t seed)
    : router_weight(make_param(prefix + ".router.weight", {cfg.num_experts, cfg.hidden_size},
                               cfg.init_method_std, seed)),
      cfg_(cfg) {
  float output_std = cfg.init_method_std / std::sqrt(2.0f * float(cfg.num_layers));
  for (int64_t e = 0; e < cfg.num_experts; ++e)
    experts.push_back(std::make_unique<MLP>(
        prefix + ".experts.local_experts." + std::to_string(e), cfg.hidden_size,
        cfg.moe_ffn_hidden_size, cfg.swiglu, !cfg.disable_bias_linear, cfg.init_method_std,
        output_std, seed));
}

Tensor MoELayer::forward(const Tensor& x, const ForwardContext& ctx) {
  int64_t tokens = x.dim(0), hidden = x.dim(1), num_experts = cfg_.num_experts;
  int k = int(cfg_.moe_router_topk);
  x_ = x;
  logits_ = Tensor::empty({tokens, num_experts});
  ops::gemm(x, false, router_weight.weight, true, logits_);
  probs_ = Tensor::empty({tokens, k});
  indices_ = Tensor::empty({tokens, k}, DType::I32);
  ops::moe_topk_softmax_forward(logits_, k, cfg_.moe_router_pre_softmax, probs_, indices_);
  last_aux_loss = 0.0f;
  if (cfg_.use_aux_loss()) {
    aux_scores_ = Tensor::empty({tokens, num_experts});
    aux_counts_ = Tensor::empty({num_experts});
    last_aux_loss =
        ops::moe_aux_loss_forward(logits_, k, cfg_.moe_aux_loss_coeff, aux_scores_, aux_counts_);
  }

  Tensor permuted = Tensor::empty({tokens * k, hidden});
  row_id_map_ = Tensor::empty({tokens * k}, DType::I32);
  last_tokens_per_expert = Tensor::empty({num_experts}, DType::I64);
  ops::moe_permute(x, indices_, int(num_experts), permuted, row_id_map_, last_tokens_per_expert);

  expert_out_ = Tensor::empty({tokens * k, hidden});
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t n = last_tokens_per_expert.i64()[e];
    if (n > 0) expert_out_.rows(start, n).copy_from(experts[e]->forward(permuted.rows(start, n)));
    start += n;
  }
  Tensor out = Tensor::empty({tokens, hidden});
  ops::moe_unpermute(expert_out_, row_id_map_, probs_, out);
  return out;
}

Tensor MoELayer::backward(const Tensor& dy) {
  int64_t tokens = dy.dim(0), hidden = dy.dim(1), num_experts = cfg_.num_experts;
  int k = int(cfg_.moe_router_topk);
  Tensor dexpert_out = Tensor::empty({tokens * k, hidden});
  Tensor dprobs = Tensor::empty({tokens, k});
  ops::moe_unpermute_backward(dy, expert_out_, row_id_map_, probs_, dexpert_out, dprobs);

  Tensor dpermuted = Tensor::empty({tokens * k, hidden});
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t n = last_tokens_per_expert.i64()[e];
    if (n > 0) dpermuted.rows(start, n).copy_from(experts[e]->backward(dexpert_out.rows(start, n)));
    start += n;
  }
  Tensor dx = Tensor::empty({tokens, hidden});
  ops::moe_permute_backward(dpermuted, row_id_map_, k, dx);

  Tensor dlogits = Tensor::empty({tokens, num_experts});
  ops::moe_topk_softmax_backward(dprobs, logits_, probs_, indices_, cfg_.moe_router_pre_softmax,
                                 dlogits);
  if (cfg_.use_aux_loss())
    ops::moe_aux_loss_backward(aux_grad_scale, aux_scores_, aux_counts_, k,
                               cfg_.moe_aux_loss_coeff, dlogits);
  ops::gemm(dlogits, false, router_weight.weight, false, dx, 1.0f, 1.0f);
  ops::gemm(dlogits, true, x_, false, router_weight.main_grad, 1.0f, 1.0f);
  x_ = logits_ = probs_ = indices_ = row_id_map_ = expert_out_ = aux_scores_ = aux_counts_ =
      Tensor();
  return dx;
}

void MoELayer::collect_params(std::vector<Param*>& out) {
  out.push_back(&router_weight);
  for (auto& e : experts) e->collect_params(out);
}

}  // namespace megaton
