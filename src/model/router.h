// TopKRouter: Megatron's MoE router with every routing and load-balancing option.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/layers.h"
#include "model/parallel.h"
#include "ops/ops.h"

namespace megaton {

// Megatron-LM transformer/moe/router.py (TopKRouter) and moe_utils.py. One per MoE layer.
//
// forward: logits = x W^T (W: [E, H], "<prefix>.router.weight"; fp32 math whatever the
// compute dtype: Megatron computes the scores in fp32 even with --moe-router-dtype fp64,
// whose fp64 gating GEMM Megaton runs in fp32), then top-k routing
// (ops::moe_router_topk_forward with the score function, pre-softmax, scaling factor,
// group limit and expert bias of the config), and in training the load-balancing
// losses, whose gradients backward injects (Megatron's MoEAuxLossAutoScaler; the loss
// values are not added to the LM loss):
// - aux_loss: tokens per expert summed over the TP x CP group, T = local rows x its size;
// - seq_aux_loss: the same per sequence (rows grouped by sequence_length), divided by
//   the number of sequences;
// - global_aux_loss: tokens per expert summed over TP x DP x CP and averaged over the
//   step's micro-batches so far (running mean), T = local rows x that group's size. Its
//   gradient is scaled by the data-parallel size on top of 1 / micro-batches, so that after
//   the data-parallel mean it equals the gradient of the same loss computed on the whole
//   global batch on one rank (Megatron leaves it 1 / DP of that);
// - z-loss (--moe-z-loss-coeff): coeff / (TP x CP) x mean over rows of logsumexp^2.
// Options that change the input: --moe-input-jitter-eps (router input times
// Uniform(1 - eps, 1 + eps), training only here), --moe-router-force-load-balancing
// (standard-normal logits replace the real ones, Megatron's RandomSTE: the gradient
// passes straight to the real logits).
// Token dropping (--moe-expert-capacity-factor cf): each expert keeps at most
// capacity = ceil(T k / E cf) of its routed copies (by probability, or the first rows
// with --moe-token-drop-policy position); a dropped copy's probability is 0, so it adds
// nothing to the output and gets no gradient (Megatron's apply_router_token_dropping), and
// its index in Output is E, the "dropped" marker: the token dispatchers send it to no
// expert, so the experts compute only kept copies (the routing map after dropping, as
// Megatron's). --moe-pad-expert-input-to-capacity is applied by MoELayer (moe.h) with
// Output::capacity. The losses ignore the dropping, as Megatron's; the expert bias and
// tokens_per_expert count the kept copies only.
// The expert bias (--moe-router-enable-expert-bias, fp32 whatever the model dtype) is added
// to the selection scores only; the trainer updates it after each optimizer step from the
// tokens per expert of the step's training forwards (update_expert_bias).
class TopKRouter {
 public:
  // layer: the global layer number (random streams).
  TopKRouter(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
             const ModelParallel& mp, int64_t layer);

  struct Output {
    Tensor probs;  // [T, k] fp32; 0 for a copy dropped by capacity
    // [T, k] int32: the chosen expert in [0, E), or E for a copy dropped by capacity.
    Tensor indices;
    int64_t capacity = 0;  // per-expert capacity of this forward (copies), 0 when dropless
  };
  // x [T, H] compute dtype: this rank's token rows, which are rows first_row .. of the
  // tensor-parallel group's [B * S] token list (batch-major; seq_aux_loss groups rows by
  // sequence). Saves what backward needs. With ctx.recompute (a recompute re-run of this
  // micro-batch's forward) it replays the routing it kept instead (replay).
  Output forward(const Tensor& x, const ForwardContext& ctx, int64_t first_row);
  // The recompute of a layer that holds this router: keep_routing_only drops the kept
  // input and the jitter noise (the [T, H] tensors) and keeps the routing (logits,
  // probabilities, indices, capacity mask and the loss terms). replay then gives the
  // first forward's Output again from them without the gating GEMM, the collectives of
  // the losses or any statistic (tokens per expert, metrics, routed copies, the global
  // aux loss's running counts: they were recorded once), and keeps x (times the jitter
  // noise, drawn again from ctx's keys: the same values) for the weight gradient.
  // InternalError when no routing is kept.
  void keep_routing_only() { saved_.x = saved_.jitter = Tensor(); }
  Output replay(const Tensor& x, const ForwardContext& ctx);
  // dprobs [T, k] fp32 -> dx [T, H] += the router's input gradient; accumulates the
  // weight's main_grad. aux_grad_scale: the injected losses' gradient scale
  // (1 / micro-batches).
  void backward(const Tensor& dprobs, float aux_grad_scale, Tensor& dx);

  void collect_params(std::vector<Param*>& out) { out.push_back(&weight); }
  // Sum of this forward's injected losses with their coefficients (the MoE aux loss of a
  // micro-batch; this rank's share under TP x CP): a [1] fp32 tensor on the model's
  // device, written by forward's kernels (no host synchronization), or undefined before
  // the first forward. last_loss() reads it to the host (a synchronization on the GPU).
  const Tensor& last_loss_tensor() const { return last_loss_; }
  double last_loss() const;

  // Per-step state, reset by start_step (after each optimizer step):
  //   tokens_per_expert [E] fp32: routed rows of this step's training forwards (local);
  //   metric_sums [kMetricSlots] fp32 on the model's device: sums over the step's
  //   micro-batches of each loss divided by its coefficient, in the slots below;
  //   metrics(): the same on the host with the routed copies (reads the device).
  static constexpr int kAuxSlot = 0, kSeqAuxSlot = 1, kGlobalAuxSlot = 2, kZSlot = 3,
                       kMetricSlots = 4;
  struct Metrics {
    double aux_loss = 0, seq_aux_loss = 0, global_aux_loss = 0, z_loss = 0;
    double routed = 0;  // routed copies (rows x k) of the step's training forwards
  };
  const Tensor& tokens_per_expert() const { return tokens_per_expert_; }
  const Tensor& metric_sums() const { return metric_sums_; }
  double routed_copies() const { return routed_; }
  Metrics metrics() const;
  void start_step();
  // bias += rate * sign(mean(counts) - counts) (Megatron's get_updated_expert_bias,
  // ops::moe_expert_bias_update); counts [E] fp32: tokens per expert summed over
  // TP x DP x CP (host or device; on the bias's device no host synchronization).
  void update_expert_bias(const Tensor& counts);

  Param weight;        // [E, H]
  Tensor expert_bias;  // [E] fp32 on the model's device when enabled, else undefined

 private:
  ops::RouterTopK topk_options(bool training) const;
  // The router's input: x_in, or in training with --moe-input-jitter-eps x_in times
  // Uniform(1 - eps, 1 + eps) noise keyed by ctx, layer and saved_.first_row (kept in
  // saved_.jitter); kept in saved_.x.
  Tensor apply_jitter(const Tensor& x_in, const ForwardContext& ctx);
  // Adds one load-balancing loss's statistics and its value (last_loss_, metric_sums_).
  void aux_loss_forward(const std::string& type, float coeff, int64_t first_row);
  // last_loss_ += loss_scale x value, metric_sums_[metric_slot] += metric_scale x value
  // (value: [1] fp32 on the device).
  void add_loss(const Tensor& value, double loss_scale, int metric_slot, double metric_scale);

  const GPTConfig& cfg_;
  ModelParallel mp_;
  int64_t layer_;
  int64_t num_experts_;
  int topk_;
  ops::RouterScoreFunction score_function_;
  Tensor tokens_per_expert_;
  Tensor global_tokens_per_expert_;  // [E] fp32, summed over the step's micro-batches
  int64_t global_micro_batches_ = 0;
  Tensor metric_sums_;  // [kMetricSlots] fp32
  double routed_ = 0;
  Tensor last_loss_;  // [1] fp32

  // Saved by forward for backward (one micro-batch): moved out and back by the pipeline
  // schedules (take_saved / restore_saved).
 public:
  struct AuxTerm {
    Tensor coeffs;  // [G, E] fp32: d loss / d scores per group (without the grad scale)
    Tensor scores;  // [T, E]
    int64_t rows_per_group = 0;
    float extra_scale = 1.0f;  // global_aux_loss: the data-parallel size
  };
  struct Saved {
    Tensor x;            // router input (after jitter)
    Tensor jitter;       // [T, H] fp32 noise, when jitter applied
    Tensor logits;       // [T, E] fp32 (random under force balancing)
    Tensor probs, indices;  // before dropping (indices: the chosen experts, all in [0, E))
    Tensor keep;            // [T, k] fp32 1/0 with token dropping, else undefined
    Tensor lse;          // [T] fp32 (z-loss)
    float z_scale = 0;   // 2 coeff / (tp cp T)
    std::vector<AuxTerm> aux;
    int64_t first_row = 0;
    int64_t capacity = 0;  // Output::capacity
    bool training = false;
  };
  Saved take_saved() { return std::exchange(saved_, {}); }
  void restore_saved(Saved&& saved) { saved_ = std::move(saved); }

 private:
  Saved saved_;
};

}  // namespace megaton
