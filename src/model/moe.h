// MoELayer: Megatron's top-k router, token permutation, per-expert MLPs, weighted combine.
#pragma once
#include <memory>

#include "model/layers.h"

namespace megaton {

// Router (Megatron TopKRouter, softmax score function, dropless): logits = x Wr^T in
// fp32; top-k; probabilities from moe_topk_softmax; the aux_loss load-balancing loss
// (switch_load_balancing_loss_func) when configured, whose gradient is injected in
// backward scaled by aux_grad_scale (MoEAuxLossAutoScaler: 1 / micro-batches).
// Experts are SequentialMLP-style: expert e owns
// "<prefix>.experts.local_experts.<e>.linear_fc1/.linear_fc2".
class MoELayer {
 public:
  MoELayer(const std::string& prefix, const GPTConfig& cfg, uint64_t seed);
  // x [T, H] -> [T, H].
  Tensor forward(const Tensor& x, const ForwardContext& ctx);
  Tensor backward(const Tensor& dy);
  void collect_params(std::vector<Param*>& out);

  // Scale of the aux-loss gradient for the next backward (set by the trainer).
  float aux_grad_scale = 1.0f;
  // Aux loss of the last forward (including its coefficient), 0 when disabled.
  float last_aux_loss = 0.0f;
  // Tokens routed to each expert in the last forward [E] (int64).
  Tensor last_tokens_per_expert;

  Param router_weight;  // [E, H], "<prefix>.router.weight"
  std::vector<std::unique_ptr<MLP>> experts;

 private:
  const GPTConfig& cfg_;
  Tensor x_, logits_, probs_, indices_, row_id_map_, expert_out_, aux_scores_, aux_counts_;
};

}  // namespace megaton
