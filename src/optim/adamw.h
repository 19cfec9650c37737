// AdamW: Megatron's default optimizer over fp32 main parameters and main gradients.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/param.h"
#include "ops/adam_f16_main_param.h"
#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"
#include "optim/optimizer_offload.h"

namespace megaton::optim {

// Megatron's argument defaults (--weight-decay, --adam-beta1, --adam-beta2, --adam-eps).
struct AdamWConfig {
  float weight_decay = 0.01f;
  float adam_beta1 = 0.9f;
  float adam_beta2 = 0.999f;
  float adam_eps = 1e-8f;
  // Megatron's precision-aware optimizer (--use-precision-aware-optimizer, OptimizerConfig
  // fields of the same names; docs/memory.md "Precision-aware optimizer"): the dtypes the
  // Adam moments are stored in, F32, BF16, or F16 / F8E4M3 with a per-tensor scale (the
  // update math stays fp32, ops/adam_precision_math.h, ops/adam_scaled_state_math.h).
  // main_params_dtype F32, or F16: the main param of a param whose compute weight is BF16
  // or F16 beside a separate fp32 main param is then kept in fp16 with a per-tensor scale
  // (Param::main_param_f16 / main_param_scale; Transformer Engine's master_weight_dtype
  // fp16, ops/adam_f16_main_param.h); main_grads_dtype F32 or BF16.
  bool use_precision_aware_optimizer = false;
  DType main_params_dtype = DType::F32;
  DType main_grads_dtype = DType::F32;
  DType exp_avg_dtype = DType::F32;
  DType exp_avg_sq_dtype = DType::F32;
  // Megatron's OptimizerConfig.store_param_remainders (Transformer Engine's FusedAdam
  // option of that name; Megaton's --no-store-param-remainders turns it off): a param whose
  // weight is BF16 beside a separate fp32 main param keeps only the main param's low 16
  // bits (Param::main_param_remainder, 2 bytes instead of 4; the high half is the weight,
  // ops/param_remainder_math.h). Lossless for the main param, so Megaton applies it to every
  // such param, where Megatron does only under the precision-aware optimizer. FP8 weights
  // (--fp8-param-gather) and fp16 ones keep the fp32 main param; with main_params_dtype
  // F16 no param keeps a remainder (TE: remainders are of fp32 masters only).
  bool store_param_remainders = true;
  // Megatron's --optimizer-cpu-offload and --optimizer-offload-fraction (HybridDeviceOptimizer;
  // optim/optimizer_offload.h): the fp32 main params, the moments and the update of the
  // first `optimizer_offload_fraction` of the elements (whole params, in list order) on
  // the host, overlapped with the device's update of the rest.
  bool optimizer_cpu_offload = false;
  double optimizer_offload_fraction = 1.0;
};

// Whether AdamW with `config` keeps p's main param as a remainder: config says so, p's
// weight is BF16, and p has a separate fp32 main param (or already its remainder).
bool stores_param_remainder(const AdamWConfig& config, const Param& p);

// Whether AdamW with `config` keeps p's main param in fp16 with a scale: main_params_dtype
// is F16, p's weight is BF16 or F16 beside a separate fp32 main param on the same device
// (or p already has main_param_f16).
bool stores_f16_main_param(const AdamWConfig& config, const Param& p);

// p's fp32 main param, shaped like p.weight: p.main_param when defined, a new tensor joined
// from p.weight and p.main_param_remainder when that is defined, or dequantized from
// p.main_param_f16 and p.main_param_scale (stored * scale) when that is, else the weight
// itself (an fp32 run's weight is its main param).
Tensor main_param_value(const Param& p);

// --main-params-dtype fp16 needs a compute weight apart from the main param (BF16 or F16
// compute: --bf16 or --fp16 on the GPU; the CPU computes fp32) and no
// --optimizer-cpu-offload. Throws megaton::Error (exit 2) with one line naming the flags.
void check_main_params_dtype(const AdamWConfig& config, DType compute_dtype);

// The DType of a precision-aware dtype flag's value (Megatron's names: fp32, fp16, bf16,
// fp8 = e4m3, as Transformer Engine stores an fp8 state). `key` is the flag, for the
// message. Throws megaton::Error (exit 2) naming key and value when `value` is not one of
// `allowed` (e.g. {"fp32", "bf16"} for --main-grads-dtype).
DType precision_aware_dtype(const std::string& key, const std::string& value,
                            const std::vector<std::string>& allowed);

// The stochastic-rounding key (ops/adam_precision_math.h) of an AdamW param holding the
// elements [offset, offset + n) of model param `p` as this rank holds it: p's
// tensor-parallel slice tp_rank of tp_size along p.tp_split_dim (Param::full_shape, SwiGLU
// halves included; tp_size 1 or tp_split_dim -1: the whole tensor). Keyed by p.name, so
// an element draws the same random bits whichever rank, shard or slice holds it.
ops::MomentRoundingKey moment_rounding_key(const Param& p, int tp_rank, int tp_size,
                                           int64_t offset);

// Whether moments of dtype d are stored with a per-tensor scale (F16, F8E4M3: Transformer
// Engine's FusedAdam; ops/adam_scaled_state_math.h).
bool scaled_moment_dtype(DType d);

// Megatron's rules for the precision-aware flags (OptimizerConfig.__post_init__): a dtype
// other than fp32 needs use_precision_aware_optimizer (fp16 main params: see also
// check_main_params_dtype, which needs the compute dtype). main_grads_dtype bf16
// is accepted (with --bf16, BF16 grad buffers: GPTConfig::main_grads_dtype, model/main_grad.h).
// Throws megaton::Error with one line naming the flag.
void check_precision_aware_config(const AdamWConfig& config);

// Decoupled-weight-decay Adam (Loshchilov & Hutter 2019) as Megatron runs it (Apex/TE
// FusedAdam with adam_w_mode): the update itself is ops::multi_tensor_adamw, or
// ops::multi_tensor_adamw_param_remainder for params whose main param is kept as a
// remainder (store_param_remainders). Holds one
// exp_avg and exp_avg_sq per parameter, shaped like its weight, zero at construction, in
// config.exp_avg_dtype / exp_avg_sq_dtype (fp32 by default; bf16, fp16 or fp8 under the
// precision-aware optimizer, the last two with a scale per param and moment). Params with
// no_weight_decay (biases, norm weights) get weight decay 0. BF16, F16 and F8E4M3 moments
// are stored stochastically rounded, with random bits keyed
// by each param's rounding key (moment_rounding_key(*param, 0, 1, 0), its whole tensor,
// unless set_rounding_keys says otherwise).
class AdamW {
 public:
  // `params` are not owned and must outlive the optimizer. Each needs a defined fp32
  // weight, a separate fp32 main_param, a BF16 weight with its I16
  // main_param_remainder, or a BF16/F16 weight with its F16 main_param_f16 and F32 [1]
  // main_param_scale; a main_grad of the same shape (F32, or BF16 read widened to
  // fp32); and a unique name (state keys derive from it); otherwise InternalError (a bug
  // in the model code, not a user mistake). Where stores_param_remainder(config, *p) and
  // p has no remainder yet, the constructor splits p->main_param into p->weight
  // (rewritten, rounded as ops::split_param_remainders rounds) and a new
  // p->main_param_remainder, and releases p->main_param. Where stores_f16_main_param
  // and p has no main_param_f16 yet, it quantizes p->main_param into a new
  // p->main_param_f16 and p->main_param_scale (scale from its own absmax: one rank;
  // DistributedAdamW converts first with the whole parameter's) and releases p->main_param.
  // state_device: where the step count lives (device_state); the params' device when
  // there are params, else this one (a rank whose shard holds no parameter).
  explicit AdamW(std::vector<Param*> params, AdamWConfig config = {},
                 Device state_device = Device::CPU);
  ~AdamW();

  // One update of every main_param (the weight itself when main_param is undefined; the
  // (weight, remainder) pair when main_param_remainder is defined) from
  // its main_grad times `grad_scale` with learning rate `lr` (from the LR schedule); the
  // compute weight is then rewritten from it when they differ (bf16 runs). grad_scale is
  // the gradient-clipping coefficient (clip_coefficient in optim/clip_grad.h), applied as
  // the gradients are read: the same update as clip_grad_by_norm then step(lr), without
  // the pass over the gradients, which stay unscaled. Increments the step count first, so
  // the first call uses bias-correction step 1. Does not zero main_grad (the trainer does).
  // A non-finite grad_scale throws InternalError.
  void step(float lr, float grad_scale = 1.0f);
  // The same update with the step decided on the device: control is
  // ops::adamw_step_control's (made from device_state()), which holds the step count,
  // the learning rate, the clipping scale and whether to skip (then nothing changes). No
  // host synchronization on the GPU, and no host value that changes from step to step.
  void step(const Tensor& control);

  // Number of updates so far (restored from a checkpoint with set_step_count). Kept on
  // the params' device with the stopped flag (device_state): reading it is a host
  // synchronization on the GPU.
  int64_t step_count() const;
  void set_step_count(int64_t count);
  // I64 [2] {step count, stopped} on the params' device, ops::adamw_step_control's state.
  Tensor& device_state() { return state_; }

  // Optimizer state for checkpointing, in parameter order: for each param
  // "<name>.exp_avg" then "<name>.exp_avg_sq", in their configured dtypes, the weight's
  // shape. The pointers stay
  // valid for the optimizer's life; loading a checkpoint copies into them.
  std::vector<std::pair<std::string, Tensor*>> state_tensors();

  // Where each param's elements sit in the model's parameters (one key per param, in
  // order): the distributed optimizer's shards and tensor-parallel slices
  // (DistributedAdamW), so their bf16 moments round as one rank's would. InternalError on
  // a count mismatch.
  void set_rounding_keys(std::vector<ops::MomentRoundingKey> keys);

  // fp16 and fp8 moments (config.exp_avg_dtype / exp_avg_sq_dtype F16 or F8E4M3) carry one
  // fp32 scale per param and moment (ops::AdamMomentScales), set from the absmax of the new
  // moments each step; so do fp16 main params (Param::main_param_scale, from the absmax of
  // the new main param). Megaton's deviation from Transformer Engine: the absmax is that of
  // the model's whole parameter, not of the piece this optimizer holds, so the owner of a
  // shard or tensor-parallel slice reduces it over the ranks holding the other pieces
  // (docs/memory.md "Scaled optimizer states"). Where each param's absmax goes:
  //   rows:    one F32 [3] view per param, in order (exp_avg's, exp_avg_sq's, the fp16
  //            main param's absmax; unused columns stay 0);
  //   storage: the tensors holding the rows, zeroed before each absmax pass (rows of
  //            params that no list entry writes stay 0, the max's identity);
  //   reduce:  called after the pass, before the update reads the rows (a max over ranks;
  //            empty: nothing to reduce).
  // By default AdamW's own [params, 3] tensor with no reduction (one rank).
  struct MomentAbsmaxSlots {
    std::vector<Tensor> rows;
    std::vector<Tensor> storage;
    std::function<void()> reduce;
  };
  void set_moment_absmax_slots(MomentAbsmaxSlots slots);
  bool scaled_moments() const { return scaled_moments_; }
  // Whether any state has a scale (scaled moments, or a param with an fp16 main param):
  // then the absmax slots are used.
  bool scaled_states() const { return scaled_moments_ || f16_main_params_; }
  // Param i's scales, F32 [2] (exp_avg's, exp_avg_sq's; unused for an unscaled moment;
  // value = stored * scale), a view: writing it sets them (a checkpoint's; DistributedAdamW
  // writes them as "optimizer.<name>.exp_avg.scale"). InternalError without scaled moments.
  Tensor moment_scales(size_t i) const;

  const AdamWConfig& config() const { return config_; }
  // The weight decay of the next steps (params without no_weight_decay): Megatron's
  // scheduler sets it every step (--weight-decay-incr-style, optim::weight_decay).
  void set_weight_decay(float weight_decay) { config_.weight_decay = weight_decay; }
  const std::vector<Param*>& params() const { return params_; }
  // Elements whose state and update are on the host (config.optimizer_cpu_offload; 0
  // without). Their Param::main_param is then a host tensor.
  int64_t offloaded_numel() const { return offload_ ? offload_->numel() : 0; }

 private:
  std::vector<Param*> params_;
  AdamWConfig config_;
  std::vector<Tensor> exp_avg_;
  std::vector<Tensor> exp_avg_sq_;
  Tensor state_;  // I64 [2]: step count, stopped
  std::vector<ops::MomentRoundingKey> rounding_keys_;
  // Scaled moments: the scales ([params, 2] F32), their per-param rows, and where the
  // absmax goes.
  bool scaled_moments_ = false;
  bool f16_main_params_ = false;  // some param has main_param_f16
  Tensor moment_scale_, own_absmax_;
  std::vector<Tensor> scale_rows_;
  MomentAbsmaxSlots absmax_;
  // --optimizer-cpu-offload: which params are on the host, and their half of the step.
  std::vector<uint8_t> offloaded_;
  std::unique_ptr<OptimizerOffload> offload_;
  std::vector<float> weight_decays() const;
  // The lists multi_tensor_adamw (fp32 main params),
  // multi_tensor_adamw_param_remainder (remainders: `masters` holds the BF16 weights,
  // `copies` the remainders) and multi_tensor_adamw_f16_main_param (`masters` the F16 main
  // params, `copies` the weights) take, each with its params' moments and keys.
  struct Lists {
    std::vector<Tensor> masters, grads, copies, exp_avg, exp_avg_sq;
    std::vector<float> weight_decays;
    std::vector<ops::MomentRoundingKey> keys;
    ops::AdamMomentScales scales;  // scaled moments: each entry's scale and absmax rows
    ops::AdamMainParamScales main_scales;  // fp16 main params: scale and absmax
  };
  struct SplitLists {
    Lists fp32, remainder, f16;
  };
  SplitLists lists() const;
  // The absmax pass of scaled moments over the lists and of the fp16 main params, then
  // absmax_.reduce; nothing without scaled states. control: undefined (host path: lr,
  // step, grad_scale) or the step's.
  void absmax_pass(SplitLists& s, float lr, int64_t step, float grad_scale,
                   const Tensor& control);
};

}  // namespace megaton::optim
