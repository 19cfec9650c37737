// Optimizer flags: --optimizer (AdamW, SGD, Muon, Lion) and the settings of each, the
// learning-rate schedule, gradient clipping, the non-finite check, and the precision-aware
// optimizer's dtypes (Megatron's "learning rate and weight decay", "regularization" and
// optimizer flags).
#include "core/error.h"
#include "core/printable.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

// --use-precision-aware-optimizer and its dtypes, with Megatron's choices (arguments.py)
// and refusals (optim::check_precision_aware_config).
void parse_precision_aware_args(const ArgReader& r, optim::AdamWConfig& c) {
  r.get("use-precision-aware-optimizer", c.use_precision_aware_optimizer);
  c.store_param_remainders = !r.on("no-store-param-remainders");
  const std::pair<const char*, std::vector<std::string>> choices[] = {
      {"main-params-dtype", {"fp32", "fp16"}},
      {"main-grads-dtype", {"fp32", "bf16"}},
      {"exp-avg-dtype", {"fp32", "fp16", "bf16", "fp8"}},
      {"exp-avg-sq-dtype", {"fp32", "fp16", "bf16", "fp8"}}};
  DType* fields[] = {&c.main_params_dtype, &c.main_grads_dtype, &c.exp_avg_dtype,
                     &c.exp_avg_sq_dtype};
  for (size_t i = 0; i < std::size(choices); ++i)
    if (r.has(choices[i].first))
      *fields[i] = optim::precision_aware_dtype(choices[i].first, r.one(choices[i].first),
                                                choices[i].second);
  optim::check_precision_aware_config(c);
}

// The Muon flags (Megatron's _add_regularization_args; docs/research/muon.md section 1.2), read
// whatever the optimizer so that their values are checked.
void parse_muon_args(const ArgReader& r, optim::MuonConfig& m) {
  r.get("muon-momentum", m.momentum);
  check_fraction("muon-momentum", m.momentum);
  r.get("muon-nesterov", m.nesterov);
  if (r.on("muon-no-split-qkv")) m.split_qkv = false;
  // printable(): an accepted name is printable already; a refused one is quoted safely.
  if (r.has("muon-coefficient-type"))
    m.coefficients = ops::parse_ns_coefficients(printable(r.one("muon-coefficient-type")));
  int64_t steps = m.num_ns_steps;
  r.get("muon-num-ns-steps", steps);
  check_at_least("muon-num-ns-steps", double(steps), 1);  // TensorParallelMuon raises below 1
  m.num_ns_steps = int(steps);
  if (r.has("muon-scale-mode"))
    m.scale_mode = ops::parse_muon_scale_mode(printable(r.one("muon-scale-mode")));
  r.get("muon-extra-scale-factor", m.extra_scale_factor);
  // Megatron takes any float; a negative factor would ascend the loss, zero freeze the matrices.
  check_positive("muon-extra-scale-factor", m.extra_scale_factor);
  if (r.has("muon-tp-mode")) m.tp_mode = optim::parse_muon_tp_mode(r.one("muon-tp-mode"));
  if (r.has("muon-fp32-matmul-prec"))
    m.matmul_precision = optim::parse_muon_matmul_precision(r.one("muon-fp32-matmul-prec"));
  if (r.has("muon-scalar-optimizer")) {
    const std::string& name = r.one("muon-scalar-optimizer");
    if (name != "adam" && name != "lion")
      fail("option 'muon-scalar-optimizer' must be one of adam, lion (got '{}')", printable(name));
    m.scalar_optimizer = optim::parse_optimizer_kind(name);
  }
}

// --optimizer and the settings of the rules other than Adam's (Megatron's
// _add_training_args, _add_regularization_args and validate_args). A rule's flags given
// without that rule change nothing: listed in a.no_effect.
void parse_optimizer_kind_args(const ArgReader& r, TrainArgs& a) {
  optim::OptimizerConfig& c = a.optimizer;
  std::string name = "adam";
  r.get("optimizer", name);
  if (name == "dist_muon") {
    // Megatron's deprecated spelling of muon with the (layer-wise) distributed optimizer. The
    // parallel group parses later and writes use_distributed_optimizer only when the flag is
    // given, so its overlap-param-gather check sees it on, as Megatron's does for dist_muon.
    if (r.has("use-distributed-optimizer") && !r.on("use-distributed-optimizer"))
      fail(
          "optimizer dist_muon is muon with use-distributed-optimizer, which is given as "
          "false");
    c.kind = optim::OptimizerKind::Muon;
    a.parallel.use_distributed_optimizer = true;
    a.warnings.push_back(
        "--optimizer dist_muon is deprecated: use --optimizer muon --use-distributed-optimizer");
  } else {
    c.kind = optim::parse_optimizer_kind(name);
  }
  parse_muon_args(r, c.muon);
  r.get("sgd-momentum", c.sgd_momentum);
  check_fraction("sgd-momentum", c.sgd_momentum);
  r.get("lion-beta1", c.lion_beta1);
  r.get("lion-beta2", c.lion_beta2);
  check_fraction("lion-beta1", c.lion_beta1);
  check_fraction("lion-beta2", c.lion_beta2);

  const bool muon = c.kind == optim::OptimizerKind::Muon;
  const bool scalar_lion = muon && c.muon.scalar_optimizer == optim::OptimizerKind::Lion;
  for (const char* key :
       {"muon-momentum", "muon-scale-mode", "muon-fp32-matmul-prec", "muon-coefficient-type",
        "muon-num-ns-steps", "muon-tp-mode", "muon-extra-scale-factor", "muon-scalar-optimizer"})
    if (r.has(key) && !muon)
      a.no_effect.push_back(std::string("--") + key + ": only tunes --optimizer muon");
  for (const char* key : {"muon-nesterov", "muon-no-split-qkv"})
    if (r.on(key) && !muon)
      a.no_effect.push_back(std::string("--") + key + ": only tunes --optimizer muon");
  if (r.has("sgd-momentum") && c.kind != optim::OptimizerKind::Sgd)
    a.no_effect.push_back("--sgd-momentum: only tunes --optimizer sgd");
  // Megatron's top-level Lion takes the Adam betas (_default_adam_based_eopt_config_to_kwargs);
  // --lion-beta1/2 reach only the Lion of --muon-scalar-optimizer lion.
  for (const char* key : {"lion-beta1", "lion-beta2"})
    if (r.has(key) && !scalar_lion)
      a.no_effect.push_back(
          std::string("--") + key +
          (c.kind == optim::OptimizerKind::Lion
               ? ": --optimizer lion takes --adam-beta1 and --adam-beta2 (as Megatron); this "
                 "tunes --muon-scalar-optimizer lion"
               : ": only tunes --optimizer muon --muon-scalar-optimizer lion"));
  // No parameter is left to Adam under SGD, or under Muon with the Lion scalar optimizer.
  if (c.kind == optim::OptimizerKind::Sgd || scalar_lion)
    for (const char* key : {"adam-beta1", "adam-beta2", "adam-eps"})
      if (r.has(key))
        a.no_effect.push_back(
            std::string("--") + key + ": no parameter is trained with Adam " +
            (scalar_lion ? "(--muon-scalar-optimizer lion)" : "(--optimizer sgd)"));
}

void parse_optimizer(const ArgReader& r, TrainArgs& a) {
  parse_optimizer_kind_args(r, a);
  r.get("lr", a.lr.lr);
  r.get("min-lr", a.lr.min_lr);
  std::string style = "linear";
  r.get("lr-decay-style", style);
  a.lr.lr_decay_style = optim::parse_lr_decay_style(style);
  std::string wsd = "exponential";
  r.get("lr-wsd-decay-style", wsd);
  a.lr.lr_wsd_decay_style = optim::parse_wsd_decay_style(wsd);
  ScheduleFlags& f = a.schedule;
  r.get("lr-wsd-decay-iters", f.lr_wsd_decay_iters);
  r.get("lr-warmup-iters", f.lr_warmup_iters);
  r.get("lr-decay-iters", f.lr_decay_iters);
  r.get("lr-wsd-decay-samples", f.lr_wsd_decay_samples);
  r.get("lr-warmup-samples", f.lr_warmup_samples);
  r.get("lr-decay-samples", f.lr_decay_samples);
  r.get("lr-warmup-fraction", f.lr_warmup_fraction);
  r.get("lr-warmup-init", a.lr.lr_warmup_init);
  r.get("weight-decay", a.adam.weight_decay);
  r.get("start-weight-decay", f.start_weight_decay);
  r.get("end-weight-decay", f.end_weight_decay);
  std::string wd_style = "constant";
  r.get("weight-decay-incr-style", wd_style);
  a.lr.weight_decay_incr_style = optim::parse_weight_decay_incr_style(wd_style);
  // Megatron's arguments.py: the constant style takes --weight-decay, the others both ends.
  if (a.lr.weight_decay_incr_style == optim::WeightDecayIncrStyle::Constant) {
    if (r.has("start-weight-decay") || r.has("end-weight-decay"))
      fail(
          "start-weight-decay and end-weight-decay need weight-decay-incr-style linear or "
          "cosine (the constant style takes --weight-decay)");
    a.lr.start_weight_decay = a.lr.end_weight_decay = a.adam.weight_decay;
  } else {
    if (!r.has("start-weight-decay") || !r.has("end-weight-decay"))
      fail("weight-decay-incr-style {} needs start-weight-decay and end-weight-decay", wd_style);
    check_at_least("start-weight-decay", f.start_weight_decay, 0);
    check_at_least("end-weight-decay", f.end_weight_decay, 0);
    a.lr.start_weight_decay = f.start_weight_decay;
    a.lr.end_weight_decay = f.end_weight_decay;
  }
  r.get("adam-beta1", a.adam.adam_beta1);
  r.get("adam-beta2", a.adam.adam_beta2);
  r.get("adam-eps", a.adam.adam_eps);
  parse_precision_aware_args(r, a.adam);
  r.get("clip-grad", a.clip_grad);
  r.get("check-for-nan-in-loss-and-grad", a.check_for_nan_in_loss_and_grad);
  if (r.has("no-check-for-nan-in-loss-and-grad")) {
    const bool off = r.on("no-check-for-nan-in-loss-and-grad");
    if (off && r.has("check-for-nan-in-loss-and-grad") && a.check_for_nan_in_loss_and_grad)
      fail("check-for-nan-in-loss-and-grad and no-check-for-nan-in-loss-and-grad contradict");
    if (off) a.check_for_nan_in_loss_and_grad = false;
  }
  check_at_least("lr", a.lr.lr, 0);
  check_at_least("min-lr", a.lr.min_lr, 0);
  check_at_least("lr-warmup-init", a.lr.lr_warmup_init, 0);
  for (const char* key : {"lr-wsd-decay-iters", "lr-warmup-iters", "lr-decay-iters",
                          "lr-wsd-decay-samples", "lr-warmup-samples", "lr-decay-samples"}) {
    int64_t v = 0;
    r.get(key, v);
    if (r.has(key)) check_at_least(key, double(v), 0);
  }
  if (r.has("lr-warmup-fraction") && !(f.lr_warmup_fraction >= 0 && f.lr_warmup_fraction < 1))
    fail("option 'lr-warmup-fraction' must be in [0, 1) (got {})", f.lr_warmup_fraction);
  check_at_least("weight-decay", a.adam.weight_decay, 0);
  check_fraction("adam-beta1", a.adam.adam_beta1);
  check_fraction("adam-beta2", a.adam.adam_beta2);
  // PyTorch allows eps = 0, but a parameter whose gradient is always zero (an unused
  // padded vocabulary row) then divides 0 by 0.
  check_positive("adam-eps", a.adam.adam_eps);
  check_at_least("clip-grad", a.clip_grad, 0);
}

}  // namespace

std::vector<OptionSpec> optimizer_megatron_rules();

ArgGroup optimizer_flags() {
  ArgGroup g{"optimizer", "optimizer and learning-rate schedule", {}, parse_optimizer};
  g.flags = {
      flag("optimizer",
           "adam (AdamW, the default), sgd (momentum SGD), muon (Muon on the 2-D weights, the "
           "scalar optimizer on the rest), lion (Lion on the 2-D weights, Adam on the rest), "
           "or dist_muon (deprecated: muon with --use-distributed-optimizer)"),
      flag("lr", "peak learning rate"),
      flag("min-lr", "minimum learning rate"),
      flag("lr-decay-style", "constant, linear, cosine, inverse-square-root or WSD"),
      flag("lr-wsd-decay-style", "exponential, linear, cosine or minus_sqrt"),
      flag("lr-wsd-decay-iters", "iterations of the WSD decay phase"),
      flag("lr-wsd-decay-samples", "samples of the WSD decay phase (sample-based runs)"),
      flag("lr-warmup-iters", "linear warmup iterations"),
      flag("lr-warmup-samples", "linear warmup samples (sample-based runs)"),
      flag("lr-warmup-fraction",
           "warmup as a fraction of the decay (instead of iterations or "
           "samples)"),
      flag("lr-warmup-init", "learning rate at the start of warmup"),
      flag("lr-decay-iters", "iterations to decay over (default train-iters)"),
      flag("lr-decay-samples", "samples to decay over (default train-samples)"),
      flag("weight-decay", "AdamW weight decay (the constant weight-decay-incr-style)"),
      flag("start-weight-decay", "weight decay at the start (linear or cosine style)"),
      flag("end-weight-decay", "weight decay at the end of the run (linear or cosine style)"),
      flag("weight-decay-incr-style",
           "constant (default), linear or cosine: from "
           "start-weight-decay to end-weight-decay over the run"),
      flag("adam-beta1", "AdamW beta1"),
      flag("adam-beta2", "AdamW beta2"),
      flag("adam-eps", "AdamW epsilon"),
      toggle("use-precision-aware-optimizer",
             "allow the main params, main grads and Adam moments below fp32 (Megatron / "
             "Transformer Engine FusedAdam)"),
      flag("main-params-dtype",
           "dtype of the main params with the precision-aware optimizer: "
           "fp32 or fp16 (per-tensor scaled)"),
      flag("main-grads-dtype",
           "dtype of the main grads with the precision-aware optimizer: "
           "fp32 or bf16 (bf16 grad buffers under --bf16)"),
      flag("exp-avg-dtype",
           "dtype Adam's first moment is stored in with the precision-aware "
           "optimizer: fp32, bf16, fp16 or fp8 (the update math stays fp32)"),
      flag("exp-avg-sq-dtype",
           "dtype Adam's second moment is stored in with the "
           "precision-aware optimizer: fp32, bf16, fp16 or fp8"),
      own(toggle("no-store-param-remainders",
                 "keep whole fp32 main params beside bf16 weights, not their low 16 bits "
                 "(Megatron's store_param_remainders, on by default: lossless, 2 bytes per "
                 "parameter less)")),
      flag("clip-grad", "clip gradients to this global L2 norm (0: off)"),
      // Megatron has only the no- form; Megaton also takes the positive one.
      own(toggle("check-for-nan-in-loss-and-grad",
                 "stop when the loss or the gradient norm is NaN or inf, naming the iteration "
                 "and rank (the default)")),
      toggle("no-check-for-nan-in-loss-and-grad",
             "skip iterations whose gradient norm is NaN or inf instead of stopping"),
      flag("sgd-momentum", "SGD's momentum (default 0.9; torch SGD: no dampening, no Nesterov)"),
      flag("muon-momentum", "Muon's momentum (an EMA of the gradients; default 0.9)"),
      toggle("muon-nesterov", "Nesterov momentum in Muon (off by default)"),
      toggle("muon-no-split-qkv",
             "orthogonalise the fused QKV weight whole, not its query, key and value pieces "
             "apart"),
      flag("muon-scale-mode",
           "the factor of Muon's update: spectral (sqrt(max(rows, cols)), the default), "
           "unit_rms_norm (sqrt(rows / cols)) or shape_scaling (sqrt(max(1, rows / cols)))"),
      flag("muon-fp32-matmul-prec",
           "Newton-Schulz's GEMMs on the GPU: medium (bf16, the default), high (TF32) or low "
           "(fp32)"),
      flag("muon-coefficient-type",
           "Newton-Schulz coefficients: quintic (default), simple, polar_express, cans, aol "
           "or deepseekv4"),
      flag("muon-num-ns-steps", "Newton-Schulz steps (default 5, at least 1)"),
      flag("muon-tp-mode",
           "Newton-Schulz under tensor parallelism: duplicated (each rank the whole matrix, "
           "the default), blockwise (each slice apart) or distributed (the Gram matrix summed "
           "over the group)"),
      flag("muon-extra-scale-factor", "a further factor of Muon's update (default 1)"),
      flag("muon-scalar-optimizer",
           "the optimizer of the parameters Muon does not take (the 1-D ones, the embeddings, "
           "the output layer, Mamba's in_proj): adam (default) or lion"),
      flag("lion-beta1", "Lion's beta1 under --muon-scalar-optimizer lion (default 0.95)"),
      flag("lion-beta2", "Lion's beta2 under --muon-scalar-optimizer lion (default 0.98)"),
  };
  for (OptionSpec& s : optimizer_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
