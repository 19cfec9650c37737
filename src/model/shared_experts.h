// SharedExpertMLP: the MoE layer's shared expert, a dense MLP over every token, optionally gated.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/layers.h"
#include "model/parallel.h"

namespace megaton {

// Megatron-LM transformer/moe/shared_experts.py (SharedExpertMLP): an MLP of
// --moe-shared-expert-intermediate-size ("<prefix>.linear_fc1/2", tensor-parallel like the
// dense MLP) whose output is added to the routed experts' output. With
// --moe-shared-expert-gate the output is scaled per token by a learned sigmoid gate
// (Qwen2-MoE's shared_expert_gate):
//   out[t, :] = MLP(x)[t, :] * sigmoid(x[t, :] . gate_weight),
// gate_weight [1, H] ("<prefix>.gate_weight", drawn like the other weights with
// init_method_std, replicated over TP). The gate logit is computed in fp32 from the
// compute-dtype x and weight (Megatron's F.linear and sigmoid run in the compute dtype).
// Under sequence parallelism x is this rank's sequence shard, so gate_weight is marked
// Param::sequence_parallel (its gradient is summed over TP, as Megatron's
// setattr(gate_weight, 'sequence_parallel', ...)); without it every TP rank sees every row
// and computes the same gradient.
class SharedExpertMLP {
 public:
  SharedExpertMLP(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                  const ModelParallel& mp);
  // x [T, H] (compute dtype; under SP this rank's rows) -> [T, H]. Saves what backward
  // needs.
  Tensor forward(const Tensor& x);
  // dy [T, H] -> dx [T, H]; accumulates the MLP's and the gate's main_grad. InternalError
  // when nothing was saved.
  Tensor backward(const Tensor& dy);
  // The halves of forward and backward beside the MoE dispatcher's exchanges
  // (--moe-shared-expert-overlap, MLP::forward_fc1): forward_begin(x) (fc1, the gate's
  // logits) then forward_end() (fc2, the gate) is forward(x); backward_begin(dy) (the gate,
  // fc2) then backward_end() (fc1, the gate's input and weight gradients) is backward(dy).
  // InternalError for a second half without its first.
  void forward_begin(const Tensor& x);
  Tensor forward_end();
  void backward_begin(const Tensor& dy);
  Tensor backward_end();
  void collect_params(std::vector<Param*>& out);

  bool gated() const { return gate_weight.weight.defined(); }

  // What forward saved for the gate (undefined without the gate).
  struct Saved {
    Tensor x;        // the input [T, H]
    Tensor mlp_out;  // the MLP's output before the gate [T, H]
    Tensor logits;   // gate logits [T, 1] fp32
  };
  struct Activations {
    Saved gate;
    MLP::Activations mlp;
  };
  Activations take_saved() { return {std::exchange(saved_, {}), mlp.take_saved()}; }
  void restore_saved(Activations&& saved) {
    saved_ = std::move(saved.gate);
    mlp.restore_saved(std::move(saved.mlp));
  }

  MLP mlp;
  Param gate_weight;  // [1, H], undefined without --moe-shared-expert-gate

 private:
  Saved saved_;
  // Between backward_begin and backward_end (gated): the forward's input and the gate
  // logits' gradient in the compute dtype.
  Tensor backward_x_, backward_dlogits_;
};

}  // namespace megaton
