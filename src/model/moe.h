// MoELayer: Megatron's top-k router, token permutation, grouped expert MLPs (routing
// probabilities applied after the activation), combine.
#pragma once
#include <any>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/fp8_linear.h"
#include "model/layers.h"
#include "model/parallel.h"
#include "model/router.h"
#include "model/shared_experts.h"
#include "model/token_dispatcher.h"

namespace megaton {

// Router: TopKRouter (router.h; every Megatron routing and load-balancing option, token
// dropping by capacity included), whose injected loss gradients are scaled by aux_grad_scale
// (MoEAuxLossAutoScaler: 1 / micro-batches). An optional shared expert (a dense MLP over
// all tokens, optionally sigmoid-gated: SharedExpertMLP) is added to the routed output.
// Experts run as grouped GEMMs over the tokens sorted by expert (one call for all local
// experts, Megatron's GroupedMLP); their parameters keep SequentialMLP's names with the
// global expert index, "<prefix>.experts.local_experts.<e>.linear_fc1/.linear_fc2".
// The routing probabilities are applied inside the experts, after the activation, as in
// Megatron's TEGroupedMLP: y_r = fc2(act(fc1(x_r)) * p_r) + p_r b2 (the fc2 bias scaled by
// the probability, _apply_bias), and the dispatcher's combine adds a token's rows
// unweighted. The probabilities' gradient is <dact_r, act(fc1(x_r))> (+ <dy_r, b2>), from
// the activation recomputed in backward: no expert output is kept (docs/memory.md).
// Copies dropped by capacity reach no expert (token_dispatcher.h): the expert input holds
// the kept copies only. --moe-pad-expert-input-to-capacity then pads each local expert's
// input with zero rows (of probability 0) to exactly capacity x (ranks of the
// expert-model-parallel group, ep x etp) rows, the most its copies can number
// (ops::moe_pad_rows), and strips the padding from the expert output and, in backward,
// from the input gradient.
// Megatron instead pads at the source rank with zero-probability copies, which are
// exchanged; a zero-weight row adds nothing to the output nor to any gradient (its output
// gradient is 0), so the numbers are the same, but the communication is not padded here.
// FP8 (enable_fp8): the experts' fc1 and fc2 GEMMs run in FP8 with a quantizer per expert
// and operand (Transformer Engine's GroupedLinear: one scale per expert), as one grouped
// FP8 GEMM for all experts (Fp8GroupedLinearGemms). Each expert's rows are first padded
// with zero rows to a multiple of Fp8Config::dimension_multiple() (16, or 128 for
// blockwise), as Megatron's Fp8Padding does: zero rows change no amax, no block scale of
// the real rows, no output and no gradient, so the padding is invisible in the numbers.
//
// Parallelism (mp):
// - expert parallel (ep): this rank builds experts ep_rank * E/ep .. + E/ep - 1 only; a
//   token dispatcher (mp.dispatcher: all-to-all or all-gather, token_dispatcher.h) moves
//   the routed token copies to the ranks of their experts and back. The router weight is
//   replicated (a dense parameter).
// - expert tensor parallel (etp): linear_fc1 column-parallel (each rank holds its slice of
//   the gate and of the up half with SwiGLU), linear_fc2 row-parallel; the dispatcher
//   all-gathers the copies over etp before the experts and reduce-scatters the outputs.
//   The fc2 bias is added on etp rank 0 only (the reduction then adds it once).
// - tensor parallel (tp > 1): the layer works on this rank's block of T / tp token rows,
//   the rows it holds under sequence parallelism. Without sequence parallelism (every TP
//   rank holds all T rows; Megatron refuses MoE training there) it takes its block of the
//   rows and all-gathers the output over TP, and the input gradient likewise. The router
//   weight is then fed by this rank's rows only: Param::sequence_parallel (its gradient is
//   summed over TP after backward). The aux loss counts tokens per expert over the TP x CP
//   group (Megatron's aux_loss with its tp_cp group): each rank's last_aux_loss() is its
//   share, and their sum over TP x CP is the loss of the group's tokens.
class MoELayer {
 public:
  // Throws megaton::Error when moe_ffn_hidden_size is not divisible by the
  // expert-tensor-parallel size (and InternalError when num_experts is not divisible by ep,
  // which the layout checks reject first).
  // layer: the global layer number.
  MoELayer(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
           const ModelParallel& mp = {}, int64_t layer = 0);
  // x [T, H] -> [T, H] (T: this rank's token rows, compute dtype). Collective over the
  // expert groups (and tp, tp_cp when they have more than one rank).
  Tensor forward(const Tensor& x, const ForwardContext& ctx);
  // dy [T, H] -> dx [T, H]; accumulates the main_grad of the router and the local experts
  // (zero for an expert that received no token). InternalError when nothing was saved.
  Tensor backward(const Tensor& dy);
  void collect_params(std::vector<Param*>& out);

  // Runs the local experts' fc1 and fc2 in FP8 by config's recipe (see above); the router
  // and the shared expert's own switch stay as they are.
  void enable_fp8(const Fp8Config& config);
  // The experts' delayed-recipe state (checkpoints): Fp8LinearGemms::state of each local
  // expert's "<prefix>.experts.local_experts.<e>.linear_fc1" / ".linear_fc2". Empty
  // unless FP8 with the delayed recipe.
  std::vector<std::pair<std::string, Tensor*>> fp8_state();

  // Scale of the aux-loss gradient for the next backward (set by the trainer).
  float aux_grad_scale = 1.0f;
  // Aux loss of the last forward (including its coefficient), 0 when disabled. Under
  // tensor parallelism this rank's share (see above). Kept after backward; moved out and
  // back with the rest of the forward's state by take_saved / restore_saved. The tensor
  // ([1] fp32 on the layer's device) is written by kernels: reading it (last_aux_loss) is
  // a host synchronization on the GPU.
  const Tensor& last_aux_loss_tensor() const { return saved_.aux_loss; }
  float last_aux_loss() const {
    return saved_.aux_loss.defined() ? saved_.aux_loss.to(Device::CPU).f32()[0] : 0.0f;
  }
  // The global layer number (router random streams, logs, checkpoint names).
  int64_t layer_number() const { return layer_; }
  // Rows the last forward gave each local expert (all ranks' kept copies routed to it,
  // without the padding to capacity), likewise; read from the device when the counts
  // stayed there (a host synchronization).
  std::vector<int64_t> last_tokens_per_local_expert() const;

  // What forward saved for backward (T: this rank's token rows, R: rows of the local
  // experts' copies).
  struct Chunk;
  struct Saved {
    // The layer's token rows [T, H]: defined between forward and backward, except while
    // the moe or full recompute holds only the routing (recompute_input, or the group's
    // input in GPTModel).
    Tensor x;
    // The dispatched copies [R, H] (padded: [sum(expert_rows), H]); undefined in FP8 runs
    // with FP8 weight gradients, which keep each expert's FP8 x^T instead.
    Tensor expert_in;
    Tensor fc1_out;  // [R, fc1 outputs / etp]; the activation is recomputed
    // [R] fp32: each row's routing probability (0 on padding rows), applied after the
    // activation (Megatron's TEGroupedMLP), so no expert output is kept for the
    // probabilities' gradient (docs/memory.md, "MoE: probabilities inside the experts").
    Tensor expert_probs;
    Tensor aux_loss;  // last_aux_loss_tensor()
    // [local experts], host; empty when the counts stayed on the device (expert_counts).
    std::vector<int64_t> tokens_per_local_expert;
    // [local experts] int64 on the device when the dispatcher kept the counts there (one
    // expert rank, nothing dropped or padded, no expert biases, bf16): the grouped GEMMs
    // read them, and expert_rows is empty. Undefined otherwise.
    Tensor expert_counts;
    // Rows of expert_in per local expert (the GEMMs' groups): tokens_per_local_expert, or
    // padded: expert_capacity each, and in FP8 runs rounded up to the FP8 multiple.
    std::vector<int64_t> expert_rows;
    int64_t expert_capacity = 0;  // rows per local expert when padded to capacity, else 0
    bool padded = false;          // expert_rows differ from tokens_per_local_expert
    // FP8 runs: what each local expert's fc1 / fc2 forward kept (x^T or its scale, W's scale).
    Fp8GroupedLinearGemms::Saved fc1_fp8, fc2_fp8;
    // The moe recompute (--recompute-modules moe): the layer's input and forward context,
    // all the layer keeps besides its routing; backward re-runs forward from them first.
    Tensor recompute_input;
    ForwardContext recompute_ctx;
    // --overlap-moe-expert-parallel-comm: each chunk of the rows dispatched on its own,
    // with its dispatch fields above and its dispatcher state (empty without the overlap;
    // the layer's own dispatch fields then stay empty but tokens_per_local_expert, both
    // chunks' sum).
    std::vector<Chunk> chunks;
  };
  struct Chunk {
    Saved moe;
    std::any dispatcher;  // MoETokenDispatcher::take_saved
  };
  // The layer's saved state with its router's, token dispatcher's and shared expert's.
  struct Activations {
    Saved moe;
    TopKRouter::Saved router;
    std::any dispatcher;  // MoETokenDispatcher::take_saved
    SharedExpertMLP::Activations shared_expert;
  };
  Activations take_saved();
  void restore_saved(Activations&& saved);
  // Calls fn on each tensor slot of `saved` (taken from this layer by take_saved) that
  // only its backward reads: the layer's, the router's, the dispatcher's and the shared
  // expert's (model/saved_tensors.h). Not the aux loss, which the model reads after the
  // forward and the trainer after the backward.
  void for_each_saved_tensor(Activations& saved, const std::function<void(Tensor&)>& fn) const;
  // The recompute of this layer (full granularity, or the moe module): drops everything
  // `saved` holds (taken by take_saved) but the routing (TopKRouter::keep_routing_only),
  // the aux loss and the token counts, which it puts back: the re-run (forward with
  // ctx.recompute) replays the routing and records nothing twice.
  void keep_routing(Activations&& saved);

  struct Expert {
    Param fc1_weight, fc1_bias, fc2_weight, fc2_bias;  // biases absent with disable_bias_linear
  };
  TopKRouter router;            // "<prefix>.router.weight" [E, H] (+ expert_bias)
  std::vector<Expert> experts;  // the local experts, in global order
  // --moe-shared-expert-intermediate-size: a dense MLP over every token (sigmoid-gated with
  // --moe-shared-expert-gate), added to the routed experts' output
  // ("<prefix>.shared_experts.*", shared_experts.h). Null without.
  std::unique_ptr<SharedExpertMLP> shared_expert;
  int64_t first_local_expert() const { return first_local_expert_; }

 private:
  // The halves of forward and backward around the exchanges, on the state in saved_
  // (the layer's, or one chunk's inside in_chunk). dispatch_phase: the rows x [t, H] of the
  // routing (probs, indices [t, k]) dispatched to the local experts (beside: run beside
  // the exchange), padded to expert_capacity rows per expert when > 0. experts_phase:
  // fc1, the weighted activation and fc2 -> the expert output [R, H] (`like`: dtype and
  // device). combine_phase: -> [t, H]. Backward: combine_backward_phase (dy [t, H] -> the
  // expert output's gradient, padded), experts_backward_phase (-> the expert input's
  // gradient and the routing probabilities' [t, k], through the dispatcher's
  // probs_backward), dispatch_backward_phase (-> dx [t, H] without the router's part).
  void dispatch_phase(const Tensor& x, const Tensor& probs, const Tensor& indices,
                      int64_t expert_capacity, const MoETokenDispatcher::Beside& beside);
  Tensor experts_phase(const Tensor& like);
  Tensor combine_phase(const Tensor& expert_out, const MoETokenDispatcher::Beside& beside);
  Tensor combine_backward_phase(const Tensor& dy, const MoETokenDispatcher::Beside& beside);
  struct ExpertsBackward {
    Tensor dexpert_in, dprobs;
  };
  ExpertsBackward experts_backward_phase(const Tensor& dexpert_out, const Tensor& like);
  Tensor dispatch_backward_phase(const Tensor& dexpert_in,
                                 const MoETokenDispatcher::Beside& beside);
  // Runs fn with `chunk`'s state (its Saved and dispatcher state) in place of the current
  // one, then puts both back: nests (a chunk's experts beside another chunk's exchange).
  void in_chunk(Chunk& chunk, const std::function<void()>& fn);
  // 2 with --overlap-moe-expert-parallel-comm where the all-to-all dispatcher has more than
  // one EP rank, else 1; the ModelParallel the dispatcher is built with (the chunks
  // regroup: see the constructor).
  static int chunks_per_layer(const GPTConfig& cfg, const ModelParallel& mp);
  static ModelParallel dispatcher_parallel(const GPTConfig& cfg, const ModelParallel& mp);
  void for_each_saved_tensor(Saved& s, const std::function<void(Tensor&)>& fn) const;

  // Adds (forward) or reduces (backward) each expert's bias on its rows; with probs ([rows]
  // F32) the bias scaled by each row's probability (fc2's, Megatron's _apply_bias), whose
  // backward also adds <dy[r], bias> to dprobs[r] when given.
  void expert_bias_forward(Tensor& y, Param Expert::*bias, const Tensor& probs = Tensor());
  void expert_bias_backward(const Tensor& dy, Param Expert::*bias, const Tensor& probs = Tensor(),
                            Tensor* dprobs = nullptr);
  std::vector<Tensor> expert_weights(Param Expert::*w) const;
  std::vector<Tensor*> expert_grads(Param Expert::*w);
  // Rows [R, W] grouped by local expert -> [sum(expert_rows), W] with zero padding rows
  // (to capacity, FP8 multiples), and back (the padding dropped). Both return their
  // argument when the last forward did not pad.
  Tensor pad_expert_rows(const Tensor& rows) const;
  Tensor unpad_expert_rows(const Tensor& padded) const;
  // out = in @ W_e^T for each local expert's rows (fc: &Expert::fc1_weight or fc2_weight):
  // one grouped GEMM (bf16 or FP8; keep_input: FP8 saves each expert's x^T).
  void experts_forward(Param Expert::*fc, const Tensor& in, bool keep_input, Tensor& out);
  // din = dout @ W_e and W_e's main_grad += dout^T @ in for each local expert's rows.
  // in() gives the forward input (fc1's kept copies, fc2's recomputed activation); it is
  // called after din is complete, except under the blockwise FP8 recipe (after the first
  // expert's part of din).
  void experts_backward(Param Expert::*fc, const Tensor& dout, const std::function<Tensor()>& in,
                        Tensor& din);
  // The expert-tensor-parallel split of fc1 (column-parallel) or fc2 (row-parallel).
  Fp8LinearGemms::Sharding fp8_sharding(Param Expert::*fc) const;
  // Without sequence parallelism under TP: the layer runs on block tp_rank of the rows.
  bool splits_rows() const;
  // Whether the shared expert's halves run beside the exchanges that have no other work
  // beside them: --moe-shared-expert-overlap, and under the chunks the dispatch of the
  // first and the combine of the last.
  bool shared_expert_beside() const {
    return shared_expert && (cfg_.moe_shared_expert_overlap || chunks_per_layer_ > 1);
  }

  const GPTConfig& cfg_;
  ModelParallel mp_;
  int64_t layer_;
  int64_t first_local_expert_ = 0;
  int chunks_per_layer_ = 1;  // chunks_per_layer(cfg, mp)
  std::unique_ptr<MoETokenDispatcher> dispatcher_;
  Saved saved_;
  // FP8: the local experts' fc1 / fc2 GEMMs (disabled in bf16 runs); rows padded to fp8_rows_.
  Fp8GroupedLinearGemms fc1_fp8_, fc2_fp8_;
  int64_t fp8_rows_ = 0;
};

}  // namespace megaton
