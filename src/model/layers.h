// The basic layers: Linear, Norm (LayerNorm/RMSNorm), MLP; each with explicit backward.
//
// A layer's forward saves what its backward needs in its `Saved saved_` member (one
// micro-batch at a time: forward, then its backward). take_saved moves that state out
// and restore_saved moves it back, so a pipeline schedule can keep one per micro-batch in
// flight (GPTModel::take_activations). Members outside Saved are configuration or
// parameters.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/fp8_linear.h"
#include "model/packed_seq_params.h"
#include "model/parallel.h"
#include "model/param.h"

namespace megaton {

// Where a forward pass is: decides dropout and keys its random streams so that every
// mask is a function of (seed, iteration, micro-batch, layer, site) and nothing else.
struct ForwardContext {
  bool training = true;
  uint64_t seed = 1234;
  int64_t iteration = 0;
  int64_t micro_batch = 0;
  // This forward re-runs one already done for the same micro-batch, to remake what the
  // recompute choice did not keep (GPTConfig::recompute): the routers replay their kept
  // routing and record no statistics, nothing is discarded again. Dropout masks are keyed
  // as above, so the re-run gives the first forward's bits.
  bool recompute = false;
  // No backward follows (evaluation): each layer drops what its forward saved right after
  // that forward (TransformerLayer::discard_saved), so the pass holds one layer's
  // activations at a time. The model's own state (the logits) stays until the caller
  // drops it (GPTModel::take_activations).
  bool forward_only = false;
  // The micro-batch's packed documents (--reset-attention-mask, --reset-position-ids), or
  // null: each sample is one sequence. Shared, so that a context copied for a later
  // backward or recompute (GPTModel's saved context, a pipeline's stash) holds it alive.
  std::shared_ptr<const PackedSeqParams> packed_seq_params = nullptr;
  // Random stream for dropout site `site` of layer `layer` (layer -1: embedding).
  uint64_t stream(int64_t layer, int site) const {
    return ((uint64_t(iteration) * 4096 + uint64_t(micro_batch)) * 1024 + uint64_t(layer + 1)) * 8 +
           uint64_t(site);
  }
};

// Where parameters live and in which compute dtype (from GPTConfig).
struct Placement {
  Device device = Device::CPU;
  DType dtype = DType::F32;
  // Parameters without values (Tensor::unallocated weight and main_param), drawn later by
  // initial_values (--init-model-with-meta-device).
  bool meta_device = false;
  static Placement of(const GPTConfig& cfg) {
    return {cfg.device, cfg.compute_dtype(), cfg.init_model_with_meta_device};
  }
};

// New parameter named `name`: weights ~ N(0, std) from Philox keyed by (seed, hash of the
// name), so initial values do not depend on creation order, device or parallel layout.
// The fp32 main_param is drawn on the host and moved to the placement's device; weight
// is its compute-dtype copy there (the same tensor for fp32). main_grad is left undefined:
// the model assigns it a slice of its contiguous grad buffer.
Param make_param(const std::string& name, const Shape& shape, float std, uint64_t seed,
                 Placement where);
// The slice of make_param(name, full_shape, ...) that tensor-parallel rank `rank` of
// `size` holds along dim split_dim (0 or 1; full_shape[split_dim] divisible by size):
// the same values the one-rank model has there, whatever the layout. blocks (split_dim
// 0; Param::tp_blocks): the slice of each stacked block, e.g. each half of a SwiGLU fc1's
// [gate; up]. Sets the Param's tp_split_dim, tp_blocks and full_shape. size 1: make_param.
Param make_param_sharded(const std::string& name, const Shape& full_shape, float std, uint64_t seed,
                         Placement where, int split_dim, int rank, int size,
                         const std::vector<int64_t>& blocks = {});
// Rows or columns [rank * n / size, (rank + 1) * n / size) of a [rows, cols] host tensor
// (dim 0: rows, 1: columns), as make_param_sharded cuts it; blocks as there.
Tensor shard_of(const Tensor& full, int split_dim, int rank, int size,
                const std::vector<int64_t>& blocks = {});
// Elements [offset, offset + numel) of p's values on this rank (its tensor-parallel slice,
// flattened row-major), as make_param* drew or would draw them: [numel] F32 on the host.
// Only the elements asked for are drawn. InternalError when p has no recipe (p.init) or
// the range is outside p.
Tensor initial_values(const Param& p, int64_t offset, int64_t numel);
// Writes initial_values(p, offset, dst.numel()) into dst (any float dtype, any device; cast
// by ops::cast on dst's device, as place() casts a new weight).
void write_initial_values(const Param& p, int64_t offset, Tensor dst);
// Elements [offset, offset + numel) of p's fp32 main param, [numel] F32 on p's device: a
// view of p.main_param, or, for a param made without values (--init-model-with-meta-device,
// main_param unallocated), a new tensor of its initial_values.
Tensor main_param_values(const Param& p, int64_t offset, int64_t numel);
// A parameter drawn by a Uniform ParamInit (model/param.h: low, high, map), whole or, with
// size > 1, the slice make_param_sharded would cut (split_dim, rank, size, blocks).
Param make_uniform_param(const std::string& name, const Shape& full_shape, float low, float high,
                         ParamInit::Map map, bool no_weight_decay, uint64_t seed,
                         Placement where, int split_dim = -1, int rank = 0, int size = 1,
                         const std::vector<int64_t>& blocks = {});
// A parameter filled with `value` (norm weights 1, biases 0).
Param make_constant_param(const std::string& name, const Shape& shape, float value,
                          bool no_weight_decay, Placement where);
// Rewrites p.weight from p.main_param (after the optimizer or a checkpoint load).
void refresh_compute_weight(Param& p);

// A new uninitialised activation shaped `shape` with the dtype and device of `like`.
inline Tensor empty_like(const Tensor& like, const Shape& shape) {
  return Tensor::empty(shape, like.dtype(), like.device());
}

// How a Linear is split over the tensor-parallel group (Megatron's tensor_parallel/layers.py).
enum class TensorParallelMode {
  None,    // every rank holds the whole weight
  Column,  // ColumnParallelLinear: rows of the weight (output features) split over TP
  Row,     // RowParallelLinear: columns of the weight (input features) split over TP
};

// y = x W^T + b (torch.nn.Linear; Megatron's ColumnParallelLinear / RowParallelLinear).
// Full weight [out, in], bias [out] (absent when disable_bias_linear); with tp ranks:
// - Column: this rank holds weight rows [r out/tp, (r+1) out/tp) (of each block of
//   tp_blocks: a SwiGLU fc1's halves, a Mamba in_proj's parts) and that slice of the bias. forward: x [T, in] (under sequence
//   parallelism x [T/tp, in], all-gathered first) -> y [T, out/tp]; backward: the input
//   gradient is summed over TP (all-reduce, or reduce-scatter to [T/tp, in] under SP).
// - Row: this rank holds weight columns [r in/tp, (r+1) in/tp); the bias is whole.
//   forward: x [T, in/tp] -> partial products summed over TP (all-reduce, or
//   reduce-scatter to [T/tp, out] under SP), then the bias; backward mirrors it.
// in_features and out_features are the full sizes; initial values equal the one-rank
// layer's slice (make_param_sharded).
class Linear {
 public:
  Linear(const std::string& name, int64_t in_features, int64_t out_features, bool bias,
         float init_std, uint64_t seed, Placement where,
         TensorParallelMode mode = TensorParallelMode::None, const ModelParallel& mp = {},
         const std::vector<int64_t>& tp_blocks = {});
  // x -> y as above. Saves x unless save_input is false (the caller then passes x to
  // backward, e.g. recomputed).
  Tensor forward(const Tensor& x, bool save_input = true);
  // dy [T, out] -> dx [T, in]; accumulates weight/bias main_grad. InternalError when
  // no input was saved.
  Tensor backward(const Tensor& dy);
  // The same with the forward input given (forward was called with save_input = false).
  Tensor backward(const Tensor& dy, const Tensor& x);
  // The same with the forward input made on demand, after the input-gradient GEMM and
  // before the weight-gradient one: make_input(dx) gets dx (this rank's input gradient,
  // complete) and returns x. The MLP recomputes its activation this way, in the pass of
  // the activation's backward that reads dx. Not for a column-parallel linear under
  // tensor parallelism, whose dx is only a partial sum at that point (InternalError).
  Tensor backward(const Tensor& dy, const std::function<Tensor(const Tensor& dx)>& make_input);
  // Inference (generation): y = x W^T + b for x [T, in] -> [T, out], saving nothing and
  // leaving the training state untouched. One rank only (InternalError under tensor
  // parallelism).
  Tensor forward_inference(const Tensor& x) const;
  void collect_params(std::vector<Param*>& out);
  // Megatron's skip_bias_add: forward (training) leaves the bias out of y, for the caller
  // to add in a fused pass (TransformerLayer's ops::bias_dropout_add). The bias is still
  // this layer's parameter: backward computes its gradient from dy as before, and
  // forward_inference still adds it (after the GEMM, rounded as the caller's pass rounds).
  void set_skip_bias_add(bool skip) { skip_bias_add_ = skip; }

  // Runs the three GEMMs (forward, input gradient, weight gradient unless config.wgrad is
  // off) in FP8 by config's recipe (model/fp8_linear.h), as Transformer Engine's Linear:
  // forward then saves the FP8 column-wise copy of the input instead of the input (with
  // save_input false only its scale: backward(dy, x) quantizes the given, recomputed x
  // column-wise with it) and the weight's scale. Every GEMM dimension (tokens, in / out
  // features of this rank) must be a multiple of config.dimension_multiple()
  // (InternalError otherwise; the trainer checks the flags).
  void enable_fp8(const Fp8Config& config);
  bool fp8() const { return fp8_.enabled(); }
  // The delayed recipe's state (checkpoints): Fp8LinearGemms::state with <prefix> the
  // weight's name without ".weight". Empty unless FP8 with the delayed recipe.
  std::vector<std::pair<std::string, Tensor*>> fp8_state();

  // What forward saved for backward.
  struct Saved {
    Tensor x;  // the input [T, in] (this rank's rows under SP), undefined if not saved
    // FP8 runs: x^T (all of TP's rows under SP) or its scale, and the weight's scale.
    Fp8LinearGemms::Saved fp8;
  };
  // Moves the saved state out (the layer is left holding none) and back in.
  Saved take_saved() { return std::exchange(saved_, {}); }
  void restore_saved(Saved&& saved) { saved_ = std::move(saved); }

  Param weight, bias;

 private:
  // backward after the saved state is settled (given input included).
  // make_input: as in backward(dy, make_input), used when saved holds no input.
  Tensor backward_saved(const Tensor& dy, const Saved& saved,
                        const std::function<Tensor(const Tensor& dx)>& make_input = {});
  // Under sequence parallelism with a saved input (non-FP8): Column always overlaps the
  // all-gather of x with the dgrad GEMM and the reduce-scatter of dx with the wgrad GEMM
  // (as Megatron does); Row, under --tp-comm-overlap, the all-gather of dy with the dgrad
  // GEMM of its own rows. Same values as backward_saved's sequential form.
  Tensor column_backward_overlapped(const Tensor& dy, const Tensor& x);
  Tensor row_backward_overlapped(const Tensor& dy, const Tensor& x);
  // The operands whose amax differs between tensor-parallel ranks (reduced over TP).
  Fp8LinearGemms::Sharding fp8_sharding() const;

  TensorParallelMode mode_;
  bool skip_bias_add_ = false;
  ModelParallel mp_;
  Saved saved_;
  Fp8LinearGemms fp8_;
};

// LayerNorm (weight and bias) or RMSNorm (weight only), per config.normalization.
// Under sequence parallelism (sequence_parallel true) it runs on this rank's token rows
// and its weights are marked Param::sequence_parallel (gradients summed over TP); the
// q/k norms of --qk-layernorm pass true under any TP > 1 (each rank has its own heads).
class Norm {
 public:
  Norm(const std::string& name, int64_t hidden, Normalization kind, float eps, Placement where,
       bool sequence_parallel = false);
  // x [T, H] -> [T, H]. Saves x and the statistics.
  Tensor forward(const Tensor& x);
  // The pre-norm residual add fused with this norm (ops::add_rmsnorm_forward): x +=
  // residual in x's buffer, then returns the norm of the new x (saved as the input).
  // x, residual [T, H] of one dtype.
  Tensor forward_add(Tensor& x, const Tensor& residual);
  // The same y for inference (generation), saving nothing.
  Tensor forward_inference(const Tensor& x) const;
  // The last forward's output again, bitwise, from the kept input (the layernorm
  // recompute: the next layer kept no copy of it). InternalError when nothing was saved.
  Tensor recompute_output() const;
  // InternalError when nothing was saved. dresidual (optional, dy's shape): the gradient
  // reaching the input through the residual connection, added to the result in the same
  // pass.
  Tensor backward(const Tensor& dy, const Tensor& dresidual = Tensor());
  void collect_params(std::vector<Param*>& out);

  struct Saved {
    Tensor x;           // the input [T, H]
    Tensor mean, rstd;  // [T] fp32; mean for LayerNorm only
  };
  Saved take_saved() { return std::exchange(saved_, {}); }
  void restore_saved(Saved&& saved) { saved_ = std::move(saved); }

  Param weight, bias;

 private:
  Normalization kind_;
  float eps_;
  Saved saved_;
};

// The MLP activation of fc1's output, shared by MLP and the MoE experts: SwiGLU on
// [gate | up] ([T, 2F] -> [T, F]), GeLU or squared ReLU ([T, F] -> [T, F]), in fc1_out's
// dtype (ops::swiglu_forward, gelu_forward, squared_relu_forward).
Tensor mlp_activation(const Tensor& fc1_out, MlpActivation activation);
// Its backward: d fc1_out from dact [T, F]. act (optional, [T, F], allocated by the
// caller) receives the activation again in the same pass, the bits of mlp_activation:
// how the MLP and the experts recompute their activation for fc2's weight gradient
// instead of keeping it.
Tensor mlp_activation_backward(const Tensor& dact, const Tensor& fc1_out, MlpActivation activation,
                               Tensor* act = nullptr);

// The MoE experts' activation weighted by each row's routing probability (Megatron's
// weighted_bias_swiglu_impl / weighted_squared_relu_impl in TEGroupedMLP):
// act(fc1_out[r]) * probs[r], probs F32 [R] (0 for a padding row), in fc1_out's dtype
// (ops::weighted_swiglu_forward and its GeLU and squared-ReLU twins).
Tensor mlp_activation_weighted(const Tensor& fc1_out, const Tensor& probs,
                               MlpActivation activation);
// Its backward: d fc1_out from dact [R, F]; writes dprobs [R] F32 (allocated here):
// dprobs[r] = <dact[r], act(fc1_out[r])>. act (optional, [R, F], allocated by the caller)
// receives the weighted activation again, the bits of mlp_activation_weighted.
Tensor mlp_activation_weighted_backward(const Tensor& dact, const Tensor& fc1_out,
                                        const Tensor& probs, MlpActivation activation,
                                        Tensor& dprobs, Tensor* act = nullptr);

// Megatron's MLP: linear_fc1 -> activation (SwiGLU, GeLU or squared ReLU) -> linear_fc2.
// With SwiGLU, fc1 produces [gate | up] (2 * ffn outputs). fc2 is initialised with
// output_std (Megatron's scaled_init_method: init_method_std / sqrt(2 * num_layers)).
class MLP {
 public:
  // fc1 column-parallel, fc2 row-parallel over mp's tensor-parallel group.
  MLP(const std::string& prefix, int64_t hidden, int64_t ffn, MlpActivation activation, bool bias,
      float init_std, float output_std, uint64_t seed, Placement where,
      const ModelParallel& mp = {});
  // What forward keeps for backward (the recompute flags, set by the layer that owns the
  // MLP; both true by default). keep_input false: the input is not kept, backward's
  // `input` callback makes it again (the layernorm recompute). keep_fc1_out false: fc1's
  // output is not kept, backward runs fc1's forward GEMM again from the input (the mlp
  // and shared_experts recompute; fc2's forward is not re-run, its output is not needed).
  // The activation (fc2's input) is never kept: backward recomputes it in the pass of the
  // activation's backward (see MLP::forward).
  void set_recompute(bool keep_input, bool keep_fc1_out) {
    keep_input_ = keep_input;
    keep_fc1_out_ = keep_fc1_out;
  }
  Tensor forward(const Tensor& x);
  // input: the forward's input again, called when the MLP did not keep it (keep_input
  // false); InternalError when it is needed and not given, or nothing was saved.
  Tensor backward(const Tensor& dy, const std::function<Tensor()>& input = {});
  // The halves of forward and backward, for work placed beside the MoE dispatcher's
  // exchanges (the shared expert under --moe-shared-expert-overlap, MoELayer):
  // forward_fc1(x) then forward_fc2() is forward(x) (fc1 with its communication, then
  // the activation and fc2 with its own); backward_fc2(dy, input) then backward_fc1() is
  // backward(dy, input) (fc2 and the activation, then fc1). Between the halves the MLP
  // holds fc1's output, or the activation's gradient [T, fc1 outputs / tp]. InternalError
  // for a second half without its first.
  void forward_fc1(const Tensor& x);
  Tensor forward_fc2();
  void backward_fc2(const Tensor& dy, const std::function<Tensor()>& input = {});
  Tensor backward_fc1();
  // x [T, H] -> [T, H] for inference (generation), saving nothing; one rank only.
  Tensor forward_inference(const Tensor& x) const;
  void collect_params(std::vector<Param*>& out);

  struct Saved {
    bool held = false;  // a forward's state is held
    // [T, fc1 outputs / tp] (keep_fc1_out); the activation is recomputed from it.
    Tensor fc1_out;
    // The input [T, H] when fc1's output is recomputed and the input kept (fc1 itself then
    // keeps no copy: under FP8 it would keep only x^T, which cannot remake fc1's output).
    Tensor x;
  };
  // The MLP's saved state with its linears'.
  struct Activations {
    Saved mlp;
    Linear::Saved linear_fc1, linear_fc2;
  };
  Activations take_saved();
  void restore_saved(Activations&& saved);

  Linear linear_fc1, linear_fc2;

 private:
  // What the first half of forward or backward hands the second (see forward_fc1).
  struct Between {
    Tensor fc1_out;  // forward: fc1's output
    Tensor dfc1;     // backward: the gradient of fc1's output
    Tensor x;        // backward: the forward's input where fc1 did not keep it (or undefined)
    std::function<Tensor()> input;  // backward: makes x when it is needed and undefined
  };
  // The forward's input in backward (b.x, or made by b.input).
  const Tensor& forward_input(Between& b) const;

  MlpActivation activation_;
  bool keep_input_ = true, keep_fc1_out_ = true;
  Saved saved_;
  Between between_;
};

}  // namespace megaton
