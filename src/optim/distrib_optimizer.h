// DistributedAdamW: AdamW across data-parallel ranks: the global grad norm counted once
// per distinct element, and either a replicated update or Megatron's distributed
// optimizer (main params and Adam state sharded over the data-parallel ranks). The
// gradient reduction before it and the weight all-gather after it are
// DistributedDataParallel's.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <ranges>
#include <string>
#include <utility>
#include <vector>

#include "dist/comm.h"
#include "dist/grid.h"
#include "model/param_buffer.h"
#include "optim/adamw.h"
#include "optim/muon_optimizer.h"
#include "optim/optimizer_config.h"
#include "optim/sgd_lion_optimizer.h"

namespace megaton::optim {

class DistributedAdamW {
 public:
  // buffers: the ParamAndGradBuffers of every model chunk of this rank (each chunk's
  // dense, then expert; they must outlive the optimizer), whose shard counts must be the
  // data-parallel sizes when `distributed` (--use-distributed-optimizer), else 1. The
  // gradients must have been reduced (DistributedDataParallel::finish_grad_sync: sums
  // over the data-parallel ranks, scaled here by grad_mean_scale()).
  // Dense buffers reduce over the grid's dp_cp group, expert buffers over edp. With
  // `distributed`, the fp32 main params outside this rank's shard are released
  // (Param::main_param becomes undefined in bf16 runs; fp32 runs keep the weight itself).
  // With config.store_param_remainders, a BF16 weight buffer's main params are kept as
  // remainders (Param::main_param_remainder: the model's params when replicated, the shard
  // params when distributed), the weights rounded to match (ops/param_remainder.h).
  //
  // optimizer: the update rule of each param (--optimizer; rule_of): AdamW (config), Muon
  // (optimizer.muon, optim/muon_optimizer.h), SGD or Lion (optim/sgd_lion_optimizer.h), all
  // under this class's one gradient norm, clipping, skip and checkpoint walk. Muon updates
  // whole matrices: with `distributed` each Muon param must lie whole in one shard (the
  // layer-wise layout of ParamAndGradBuffer, Megatron's layer-wise distributed optimizer),
  // and its owner updates it (InternalError otherwise). Main params kept as remainders only
  // in buffers whose params all take AdamW.
  DistributedAdamW(std::vector<ParamAndGradBuffer*> buffers, const dist::Grid& grid,
                   dist::Comm& comm, AdamWConfig config, bool distributed,
                   const OptimizerConfig& optimizer = {});

  // The update rule of a param (Megatron's routing, docs/research/muon.md 3.1):
  //   adam: Adam; sgd: SGD;
  //   muon: Muon where muon_param(p), else --muon-scalar-optimizer (Adam or Lion);
  //   lion: Lion for the 2-D params other than the embeddings and output layer, else Adam.
  enum class Rule { Adam, Muon, Sgd, Lion };
  static Rule rule_of(const OptimizerConfig& optimizer, const Param& p);
  // The checkpoint suffixes of a rule's states, in the order of its state tensors
  // ("optimizer.<name><suffix>"): Adam ".exp_avg", ".exp_avg_sq"; Muon and SGD
  // ".momentum_buffer" (torch's name); Lion ".exp_avg" (Emerging-Optimizers').
  static std::vector<const char*> state_suffixes(Rule rule);
  // Muon's Newton-Schulz FLOPs per step on this rank (0 without Muon).
  double muon_ns_flops() const { return muon_ ? muon_->ns_flops() : 0.0; }

  // L2 norm of the reduced gradients over the whole model, each distinct element counted
  // once: a replicated gradient only on data-parallel rank 0 of its group (replicated
  // update), a shard on its owner (distributed); the last pipeline stage's copy of tied
  // embeddings (Param::shared) never. Sums over the world. NaN/inf when any element is.
  double grad_norm();
  // Number of reduced gradient elements equal to zero, counted like grad_norm (Megatron's
  // count_zeros_fp32, logged with --log-num-zeros-in-grad). Collective over the world.
  int64_t num_zeros_in_grad();
  // L2 norm of the fp32 main params, counted like grad_norm (Megatron's
  // calc_params_l2_norm, logged with --log-params-norm); main params kept as remainders are
  // joined 2^24 elements at a time. Collective over the world.
  double params_norm();

  // AdamW with learning rate lr, gradients times grad_scale (clipping), on the params or
  // (distributed) this rank's shard of every bucket; the other ranks' updated weights
  // come with DistributedDataParallel::start_param_sync. FP8 weights are then
  // requantized (quantize_fp8_weights).
  void step(float lr, float grad_scale);

  // The step decided on the device, with no host synchronization on one GPU (a trainer's
  // steady state): the gradient norm counted as grad_norm() counts it, then
  // ops::adamw_step_control (clipping by max_norm, 0 for none; a non-finite norm skips
  // the update; under check_nan a non-finite norm or `loss` stops every later update
  // too), then the AdamW update as step() would do it and the FP8 weights. lr: the
  // step's learning rate, F32 [1] on the model's device (read there, so a CUDA graph of the
  // step takes each step's value). loss: the step's summed LM loss, F32 [1] on the model's
  // device, or undefined. Multi-rank, the per-rank squared sums travel in one all-gather
  // and are added in rank order, as grad_norm() adds them. Returns the step's record, on the
  // device: grad_norm (I64 [1], fp64 bits), control (F32 [ops::kAdamControlSize], whether it
  // skipped at kAdamSkip) and state (I64 [2]: step count and stopped flag after the step, a copy);
  // and this rank's own squared sum (local_sum_sq, I64 [1] fp64 bits: which ranks hold a NaN).
  struct DeviceStep {
    Tensor grad_norm, control, state, local_sum_sq;
  };
  // inv_loss_scale: 1 / the loss scale the gradients carry (optim::GradScaler::inv_scale;
  // 1 without one): the norm, the clipping and the update see the unscaled gradients, and a
  // non-finite norm (an fp16 overflow) skips the step.
  // per_token_loss_tokens (--calculate-per-token-loss): the main grads are gradients of the
  // per-token losses summed over the step's micro-batches and summed over the data-parallel
  // ranks, and are divided by this many loss tokens (the step's, over all data- and
  // context-parallel ranks; at least 1, as Megatron's finalize_model_grads clamps
  // num_tokens) instead of by the dp_cp size (grad_mean_scale): folded into the same
  // factor as inv_loss_scale, so the norm and the clipping see the divided gradients and no
  // pass over them is added. Unset: the mean loss's gradients (grad_mean_scale).
  DeviceStep step_on_device(const Tensor& lr, double max_norm, const Tensor& loss, bool check_nan,
                            float inv_loss_scale = 1.0f,
                            std::optional<double> per_token_loss_tokens = std::nullopt);

  // --fp8-param-gather: writes this rank's shard of every FP8 weight buffer from the fp32
  // main params, one per-tensor scale per weight as Transformer Engine's current scaling
  // casts master weights to FP8: amax over the whole weight (this rank's pieces, then a
  // max over the data-parallel group of the buffer and the (expert-)tensor-parallel
  // group, so that every shard of a TP-split weight gets the one-rank run's scale), scale
  // = 448 / amax (ops::fp8_update_scale; an all-zero weight keeps its last) into
  // Param::fp8_scales, then the e4m3 cast of the pieces. The FP8 bytes of the other
  // ranks' shards come with DistributedDataParallel::start_param_sync. Called by the
  // constructor, step and load_full_state. Collective over those groups; nothing without
  // FP8 buffers.
  void quantize_fp8_weights();

  // The factor from the reduced main_grads (sums over the data-parallel ranks) to the
  // gradient of the mean loss: 1 / dp_cp size. Applied inside grad_norm and step.
  float grad_mean_scale() const { return 1.0f / float(grid_.dp_cp().size()); }

  int64_t step_count() const { return adam_->step_count(); }
  void set_step_count(int64_t count) { adam_->set_step_count(count); }
  // The weight decay of every rule (AdamW::set_weight_decay).
  void set_weight_decay(float weight_decay);

  // Full fp32 tensors (not sharded over data-parallel ranks) for a checkpoint:
  // "model.<name>" (main params; those kept as remainders joined back into fp32, so a
  // checkpoint is the same with and without remainders) then "optimizer.<name>.exp_avg" /
  // ".exp_avg_sq" in their dtypes (fp16 and fp8 ones followed by their scales,
  // ".exp_avg.scale" / ".exp_avg_sq.scale", F32 [1]: one per whole parameter), of the
  // params this rank writes: those of buffers where it is rank 0 of
  // the data-parallel group (the others return none for them), except Param::shared
  // copies, written by the first pipeline stage. Collective over the data-parallel groups.
  std::vector<std::pair<std::string, Tensor>> full_state();
  // This rank's own part of full_state, with no gathering (the sharded checkpoint: each
  // rank writes what it holds). Entry names are full_state's. For an entry of a model
  // param, `param` is that param and `data` holds the elements [param_offset, param_offset
  // + data.numel()) of this rank's (tensor-parallel) slice of it, flattened in row-major
  // order: the whole slice when the update is replicated (then only data-parallel rank 0 of
  // the buffer's group returns it), or each piece of the param inside this rank's shards
  // (distributed). Main params are fp32 (remainders joined, fp16 dequantized), moments in
  // their dtypes, as full_state writes them; Param::shared copies are left out. Scale
  // entries (".exp_avg.scale", ".main_param.scale": F32 [1], one per whole param) have a
  // null `param` and come from rank 0 of the group. Tensors stay where they live (device
  // or host). Collective over the data-parallel groups (the scales' max).
  struct LocalStateEntry {
    std::string name;
    const Param* param = nullptr;
    Tensor data;
    int64_t param_offset = 0;
  };
  std::vector<LocalStateEntry> local_state();

  // Loads full tensors (from a checkpoint; names as in full_state) into this rank's main
  // params, weights and Adam state. `optimizer_state`: also the Adam moments: a moment
  // stored in another dtype than this run's is converted (unscaled to fp32, then rounded to
  // nearest, with a new scale from the whole parameter's absmax for fp16 and fp8) with one
  // notice. Throws megaton::Error naming `source` and the tensor when one is missing or
  // misshapen. Collective over the (expert-)tensor-parallel groups when converting into
  // fp16 or fp8 moments.
  //
  // `ranges` (optional, both or neither): how to read a moment without find's whole slice
  // (the sharded checkpoint reader). `dtype_of` gives an entry's stored dtype (nullopt when
  // absent) without reading it; `read_range(name, offset, numel)` elements [offset, offset +
  // numel) of the slice find would return, flattened row-major, as a 1-D host tensor of the
  // stored dtype. With them a distributed optimizer reads only its shard's pieces of each
  // moment (a moment converted into fp16 or fp8 is still read whole: its new scale is the
  // whole parameter's absmax).
  struct RangeReads {
    std::function<std::optional<DType>(const std::string&)> dtype_of;
    std::function<Tensor(const std::string&, int64_t, int64_t)> read_range;
  };
  void load_full_state(const std::function<const Tensor*(const std::string&)>& find,
                       const std::string& source, bool optimizer_state,
                       const RangeReads& ranges = {});

 private:
  const dist::Group& group_of(const ParamAndGradBuffer& b) const;
  // Whether this rank counts p's gradient in the grad norm (tensor-parallel replicas once).
  bool counts_in_norm(const Param& p) const;
  // The params the norms and counts run over: each distinct element once (see grad_norm),
  // the model's params (replicated) or the shard params (distributed); their main grads.
  std::vector<const Param*> counted_params() const;
  std::vector<Tensor> counted_grads() const;
  // grad_norm (main_params false) or params_norm (true).
  double norm_over_model(bool main_params);

  // The buffers as references, for range-for loops.
  auto each_buffer() const {
    return std::views::transform(buffers_,
                                 [](ParamAndGradBuffer* b) -> ParamAndGradBuffer& { return *b; });
  }

  std::vector<ParamAndGradBuffer*> buffers_;
  const dist::Grid& grid_;
  dist::Comm& comm_;
  bool distributed_;
  // The params AdamW updates: the model's own (replicated), or one per piece of a param
  // inside this rank's shards (distributed), with views into the buffers.
  std::vector<Param> shard_params_;
  std::vector<BufferPiece> shard_pieces_;  // distributed: the piece of each shard param
  std::vector<size_t> shard_buffer_;       // distributed: its buffer index
  // distributed: per buffer, whether its main params are kept as remainders
  // (AdamWConfig::store_param_remainders with BF16 weights): the shard params then hold
  // main_param_remainder, and every rank rounds the whole weights as the split does.
  std::vector<bool> buffer_remainders_;
  // --fp8-param-gather: the operand lists of quantize_fp8_weights for each FP8 buffer,
  // built once (plan_fp8_weight_casts): views that stay valid for the optimizer's life.
  struct Fp8WeightCast {
    ParamAndGradBuffer* buffer = nullptr;
    Tensor amax;                                     // [weights]: each weight's amax
    std::vector<Tensor> all_amax, scale, scale_inv;  // per weight: amax slot, fp8_scales rows
    std::vector<Tensor> main, piece_amax, out, piece_scale;  // per piece on this rank
    std::vector<Tensor> none;                                // undefined, one per piece
  };
  void plan_fp8_weight_casts();
  std::vector<Fp8WeightCast> fp8_casts_;
  // fp16 and fp8 moments (AdamW::MomentAbsmaxSlots; distrib_optimizer_scales.cpp): per
  // buffer, the absmax of each of its params' new moments, F32 [params, 2] on the device,
  // reduced with a max over the buffer's data-parallel group (distributed) and its
  // (expert-)tensor-parallel group, so every piece of a parameter gets the one-rank scale.
  std::vector<Tensor> moment_absmax_;
  // Each AdamW param's buffer and index among that buffer's params.
  std::vector<std::pair<size_t, size_t>> adam_param_slot_;
  void plan_moment_absmax();
  const dist::Group& tp_group_of(const ParamAndGradBuffer& b) const;
  // full_state's scale entries of buffer bi (written by the group's rank 0; collective over
  // the data-parallel group when distributed).
  void append_moment_scales(size_t bi, std::vector<std::pair<std::string, Tensor>>& out);
  // --main-params-dtype fp16 (distrib_optimizer_scales.cpp): per param of buffer bi, the
  // fp16 main param's scale, or -1 for a param that keeps another main param.
  //   initial_...: from the fp32 main params before they are released: each param's absmax
  //                reduced over the (expert-)tensor-parallel group (collective there).
  //   loaded_...:  a checkpoint's "optimizer.<name>.main_param.scale" where it has one
  //                (its fp32 values are then stored * scale exactly), else from the
  //                checkpoint's values as initial_; one notice on rank 0 when the
  //                checkpoint's main params and this run's differ in dtype.
  std::vector<float> initial_f16_main_param_scales(size_t bi, const AdamWConfig& config);
  std::vector<float> loaded_f16_main_param_scales(
      size_t bi, const std::function<const Tensor*(const std::string&)>& find,
      const std::string& source);
  // full_state's "optimizer.<name>.main_param.scale" entries (F32 [1]) of buffer bi's fp16
  // main params (rank 0 of the group writes; collective over it when distributed).
  void append_main_param_scales(size_t bi, std::vector<std::pair<std::string, Tensor>>& out);
  bool main_params_noticed_ = false;
  // load_full_state's moments: for AdamW param i (a piece of model param p, elements
  // [offset, offset + numel) of its slice; the whole slice when replicated) the checkpoint's
  // moments converted to this run's dtypes, copied into the state, and their scales.
  struct MomentLoad;
  void load_moments(const std::function<const Tensor*(const std::string&)>& find,
                    const std::string& source, const RangeReads& ranges);
  std::unique_ptr<AdamW> adam_;
  // The rules beside AdamW (null when no param takes them), and per target (a buffer param
  // when replicated, a shard param when distributed): its rule, its buffer and index among
  // that buffer's params; adam_target_[j]: the target of AdamW param j.
  OptimizerConfig optimizer_;
  std::unique_ptr<Muon> muon_;
  std::unique_ptr<SgdLion> elementwise_;
  std::vector<Rule> rule_;
  std::vector<std::pair<size_t, size_t>> target_slot_;
  std::vector<size_t> adam_target_;
  std::vector<const Param*> target_model_;  // the model param of target i
  // Each target's optimizer state other than its main param: (suffix, tensor), e.g.
  // (".exp_avg", m), (".momentum_buffer", m); the tensors live in the rules.
  std::vector<std::vector<std::pair<std::string, Tensor*>>> target_states_;
  // Builds the rules from the targets (params of the buffers, or shard params) and their
  // model params; sets rule_, adam_target_ and adam_.
  // offsets[i]: where target i starts in its model param's (TP slice's) elements.
  void make_rules(const std::vector<Param*>& targets, const std::vector<const Param*>& models,
                  const std::vector<int64_t>& offsets, const AdamWConfig& config);
  // load_full_state's states of the non-AdamW targets (F32, by the target's piece).
  void load_rule_states(const std::function<const Tensor*(const std::string&)>& find,
                        const std::string& source, const RangeReads& ranges);
  // The host path's control (step(lr, grad_scale)) for the rules beside AdamW.
  Tensor host_control(float lr, float grad_scale) const;
};

}  // namespace megaton::optim
