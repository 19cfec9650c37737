// MoELayer: Megatron's top-k router, token permutation, grouped expert MLPs, weighted combine.
#pragma once
#include <vector>

#include "model/layers.h"
#include "model/parallel.h"

namespace megaton {

// Router (Megatron TopKRouter, softmax score function, dropless): logits = x Wr^T in
// fp32; top-k; probabilities from moe_topk_softmax; the aux_loss load-balancing loss
// (switch_load_balancing_loss_func) when configured, whose gradient is injected in
// backward scaled by aux_grad_scale (MoEAuxLossAutoScaler: 1 / micro-batches).
// Experts run as grouped GEMMs over the tokens sorted by expert (one call for all
// experts, Megatron's GroupedMLP); their parameters keep SequentialMLP's names,
// "<prefix>.experts.local_experts.<e>.linear_fc1/.linear_fc2".
class MoELayer {
 public:
  MoELayer(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
           const ModelParallel& mp = {});
  // x [T, H] -> [T, H].
  Tensor forward(const Tensor& x, const ForwardContext& ctx);
  Tensor backward(const Tensor& dy);
  void collect_params(std::vector<Param*>& out);

  // Scale of the aux-loss gradient for the next backward (set by the trainer).
  float aux_grad_scale = 1.0f;
  // Aux loss of the last forward (including its coefficient), 0 when disabled.
  float last_aux_loss = 0.0f;
  // Tokens routed to each expert in the last forward (host copy).
  std::vector<int64_t> last_tokens_per_expert;

  struct Expert {
    Param fc1_weight, fc1_bias, fc2_weight, fc2_bias;  // biases absent with disable_bias_linear
  };
  Param router_weight;  // [E, H], "<prefix>.router.weight"
  std::vector<Expert> experts;

 private:
  // Adds (forward) or reduces (backward) each expert's bias on its rows.
  void expert_bias_forward(Tensor& y, Param Expert::*bias);
  void expert_bias_backward(const Tensor& dy, Param Expert::*bias);
  // SwiGLU/GeLU of fc1_out_ ([rows, ffn]); computed in forward and again in backward
  // instead of being kept (saves rows x ffn activations per layer).
  Tensor expert_activation() const;
  std::vector<Tensor> expert_weights(Param Expert::*w) const;
  std::vector<Tensor> expert_grads(Param Expert::*w) const;

  const GPTConfig& cfg_;
  ModelParallel mp_;
  Tensor x_, logits_, probs_, indices_, row_id_map_, permuted_, fc1_out_, expert_out_,
      aux_scores_, aux_counts_;
};

}  // namespace megaton
