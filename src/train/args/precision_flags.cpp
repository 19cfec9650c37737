// Precision flags: bf16 and fp16 compute, the loss scaler, FP8 GEMMs, and the main
// gradients' dtype (Megatron's "mixed precision" group and the FP8 transformer config).
#include "core/error.h"
#include "core/printable.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

// The FP8 flags (Megatron's arguments.py and TransformerConfig checks). Every --fp8-*
// flag other than the format is refused without --fp8-format, rather than ignored.
void parse_fp8_args(const ArgReader& r, GPTConfig& m) {
  Fp8Config& f = m.fp8;
  const char* dependents[] = {"fp8-recipe",
                              "fp8-margin",
                              "fp8-amax-history-len",
                              "fp8-amax-compute-algo",
                              "no-fp8-wgrad",
                              "fp8-param-gather",
                              "first-last-layers-bf16",
                              "num-layers-at-start-in-bf16",
                              "num-layers-at-end-in-bf16",
                              "disable-fp8-wgrad",
                              "moe-router-padding-for-fp8"};
  if (!r.has("fp8-format")) {
    for (const char* key : dependents) {
      if (!r.has(key)) continue;
      bool on = true;  // a switch set to false asks for nothing
      if (find_option_spec(key)->is_switch) r.get(key, on);
      if (on) fail("option '{}' needs --fp8-format (e4m3 or hybrid)", key);
    }
    return;
  }
  std::string format;
  r.get("fp8-format", format);
  if (format == "e4m3")
    f.hybrid = false;
  else if (format == "hybrid")
    f.hybrid = true;
  else
    fail("option 'fp8-format' must be e4m3 or hybrid (got '{}')", printable(format));
  f.enabled = true;
  std::string recipe = "delayed";
  r.get("fp8-recipe", recipe);
  if (recipe == "delayed")
    f.recipe = Fp8Recipe::Delayed;
  else if (recipe == "tensorwise")
    f.recipe = Fp8Recipe::Tensorwise;
  else if (recipe == "blockwise")
    f.recipe = Fp8Recipe::Blockwise;
  else if (recipe == "mxfp8" || recipe == "nvfp4")
    fail(
        "option 'fp8-recipe' {} needs Blackwell's block-scaled tensor cores; on Hopper use "
        "delayed, tensorwise or blockwise",
        recipe);
  else
    fail("option 'fp8-recipe' must be delayed, tensorwise or blockwise (got '{}')",
         printable(recipe));
  r.get("fp8-margin", f.margin);
  check_at_least("fp8-margin", double(f.margin), 0);
  r.get("fp8-amax-history-len", f.amax_history_len);
  check_at_least("fp8-amax-history-len", double(f.amax_history_len), 1);
  if (f.amax_history_len > 1024)
    fail("option 'fp8-amax-history-len' must be at most 1024 (got {})", f.amax_history_len);
  std::string algo = "most_recent";
  r.get("fp8-amax-compute-algo", algo);
  if (algo == "max")
    f.amax_compute_max = true;
  else if (algo != "most_recent")
    fail("option 'fp8-amax-compute-algo' must be max or most_recent (got '{}')", printable(algo));
  f.wgrad = !r.on("no-fp8-wgrad") && !r.on("disable-fp8-wgrad");  // Megatron's two spellings
  r.get("first-last-layers-bf16", f.first_last_layers_bf16);
  r.get("num-layers-at-start-in-bf16", f.num_layers_at_start_in_bf16);
  r.get("num-layers-at-end-in-bf16", f.num_layers_at_end_in_bf16);
  check_at_least("num-layers-at-start-in-bf16", double(f.num_layers_at_start_in_bf16), 0);
  check_at_least("num-layers-at-end-in-bf16", double(f.num_layers_at_end_in_bf16), 0);
  // Megatron's TransformerConfig: delayed scaling keeps amax histories across layers that
  // the bf16 ones would leave stale ("Delayed scaling does not support first / last layer
  // in BF16").
  if (f.first_last_layers_bf16 && f.recipe == Fp8Recipe::Delayed)
    fail(
        "first-last-layers-bf16 needs --fp8-recipe tensorwise or blockwise (delayed scaling "
        "does not support first / last layers in bf16, as in Megatron)");
  if (f.first_last_layers_bf16 &&
      f.num_layers_at_start_in_bf16 + f.num_layers_at_end_in_bf16 > m.num_layers)
    fail("num-layers-at-start-in-bf16 ({}) + num-layers-at-end-in-bf16 ({}) exceed num-layers ({})",
         f.num_layers_at_start_in_bf16, f.num_layers_at_end_in_bf16, m.num_layers);
  r.get("fp8-param-gather", f.param_gather);
  if (f.param_gather && f.recipe == Fp8Recipe::Blockwise)
    fail(
        "fp8-param-gather is not available with --fp8-recipe blockwise in Megaton (its "
        "weights would need 128x128-block FP8 copies); use tensorwise or delayed");
}

// --fp16 and the loss scaler's flags, with Megatron's rules (arguments.py,
// validate_args): fp16 and bf16 exclude each other; under dynamic loss scaling the
// non-finite check is turned off with a warning (inf/NaN gradients are the scaler's
// signal). A static --loss-scale also applies to bf16 runs (Megatron's ConstantGradScaler);
// fp32 runs take no scaler. The values are checked when the scaler is built
// (optim::GradScaler).
void parse_mixed_precision_args(const ArgReader& r, TrainArgs& a) {
  r.get("bf16", a.model.bf16);
  r.get("fp16", a.model.fp16);
  if (a.model.fp16 && a.model.bf16) fail("fp16 and bf16 exclude each other: give one");
  optim::GradScalerConfig& c = a.loss_scaler;
  r.get("loss-scale", c.loss_scale);
  r.get("initial-loss-scale", c.initial_loss_scale);
  r.get("min-loss-scale", c.min_loss_scale);
  r.get("loss-scale-window", c.loss_scale_window);
  r.get("hysteresis", c.hysteresis);
  if (r.has("loss-scale") && !(c.loss_scale > 0))
    fail("loss-scale must be positive (got {})", c.loss_scale);
  const bool half = a.model.fp16 || a.model.bf16;
  if (!half && r.has("loss-scale"))
    a.no_effect.push_back("--loss-scale: fp32 training scales no loss (give --fp16 or --bf16)");
  const bool dynamic = a.model.fp16 && c.loss_scale == 0;
  for (const char* key :
       {"initial-loss-scale", "min-loss-scale", "loss-scale-window", "hysteresis"})
    if (r.has(key) && !dynamic)
      a.no_effect.push_back(std::string("--") + key +
                            ": dynamic loss scaling is --fp16 without "
                            "--loss-scale");
  optim::GradScaler check(c, dynamic);  // DynamicGradScaler's assertions, as errors now
  if (a.model.fp16 && a.model.fp8.enabled)
    fail("fp16 with fp8-format is not supported in Megaton yet: FP8 runs compute in bf16");
  if (dynamic && a.check_for_nan_in_loss_and_grad) {
    a.check_for_nan_in_loss_and_grad = false;
    a.warnings.push_back(
        "check-for-nan-in-loss-and-grad is off under dynamic loss scaling: "
        "inf/NaN gradients make the scaler skip the step and lower the scale "
        "(as Megatron)");
  }
  if (dynamic && a.cuda_graph_impl == "full_iteration")
    fail(
        "cuda-graph-impl full_iteration with --fp16 dynamic loss scaling is not supported in "
        "Megaton yet (the scale changes between steps); give a static --loss-scale");
}

// The main grads' dtype (GPTConfig::main_grads_dtype), as Megatron's arguments.py
// resolves accumulate_allreduce_grads_in_fp32 under --bf16 (its grad buffers are fp32 when
// that is set, else the params' bf16; param_and_grad_buffer.py grad_dtype): set, together
// with --main-grads-dtype bf16, is refused; --grad-reduce-in-bf16 clears it; otherwise it
// is set when the main grads dtype is fp32. Without --bf16 Megaton keeps fp32 main grads
// (fp32 runs: the params' dtype, as Megatron; --fp16: fp32 where Megatron's default is
// fp16 grads), so the two bf16 ways are noted as having no effect.
void parse_main_grads_dtype(const ArgReader& r, TrainArgs& a) {
  bool grad_reduce_in_bf16 = false, accumulate_allreduce_grads_in_fp32 = false;
  r.get("grad-reduce-in-bf16", grad_reduce_in_bf16);
  r.get("accumulate-allreduce-grads-in-fp32", accumulate_allreduce_grads_in_fp32);
  const bool bf16_main_grads = a.adam.main_grads_dtype == DType::BF16;
  if (!a.model.bf16) {
    if (grad_reduce_in_bf16)
      a.no_effect.push_back("--grad-reduce-in-bf16: bf16 grad buffers are for --bf16 runs");
    if (bf16_main_grads)
      a.no_effect.push_back("--main-grads-dtype bf16: bf16 grad buffers are for --bf16 runs");
    a.model.main_grads_dtype = DType::F32;
    return;
  }
  // Megatron's assertion and message (arguments.py, validate_args under args.bf16).
  if (accumulate_allreduce_grads_in_fp32 && bf16_main_grads)
    fail("--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set");
  if (grad_reduce_in_bf16)
    accumulate_allreduce_grads_in_fp32 = false;
  else if (!bf16_main_grads)
    accumulate_allreduce_grads_in_fp32 = true;
  a.model.main_grads_dtype = accumulate_allreduce_grads_in_fp32 ? DType::F32 : DType::BF16;
}

void parse_precision(const ArgReader& r, TrainArgs& a) {
  parse_fp8_args(r, a.model);
  parse_mixed_precision_args(r, a);
  parse_main_grads_dtype(r, a);
}

}  // namespace

std::vector<OptionSpec> precision_megatron_rules();

ArgGroup precision_flags() {
  ArgGroup g{"precision", "precision", {}, parse_precision};
  g.flags = {
      toggle("bf16", "bf16 compute with fp32 main params and grads (GPU; the CPU computes "
                     "fp32); bf16 grads with grad-reduce-in-bf16 or main-grads-dtype bf16"),
      toggle("fp16",
             "fp16 compute with fp32 main params and grads and a loss scale (GPU; the "
             "CPU computes fp32 and still scales the loss)"),
      flag("loss-scale", "static loss scale (fp16 or bf16); default: dynamic under --fp16"),
      flag("initial-loss-scale", "first dynamic loss scale (default 2^32)"),
      flag("min-loss-scale", "lowest dynamic loss scale (default 1)"),
      flag("loss-scale-window",
           "clean iterations before the dynamic loss scale doubles "
           "(default 1000)"),
      flag("hysteresis",
           "iterations with inf/NaN gradients before the dynamic loss scale "
           "halves (default 2)"),
      toggle("grad-reduce-in-bf16",
             "with --bf16: bf16 grad buffers, accumulated and reduced "
             "over data-parallel ranks in bf16 (Megatron's)"),
      toggle("accumulate-allreduce-grads-in-fp32",
             "fp32 grad buffers (the --bf16 default unless --grad-reduce-in-bf16 or "
             "--main-grads-dtype bf16; Megatron's)"),
      flag("fp8-format",
           "e4m3 or hybrid (e4m3 forward, e5m2 gradients): the transformer "
           "layers' linear GEMMs in FP8 (default: off)"),
      flag("fp8-recipe",
           "delayed (default), tensorwise (per-tensor current scaling) or "
           "blockwise (1x128 / 128x128 blocks)"),
      flag("fp8-margin", "the delayed recipe's scales are divided by 2^margin (default 0)"),
      flag("fp8-amax-history-len", "amaxes kept per tensor by the delayed recipe (default 1)"),
      flag("fp8-amax-compute-algo", "max or most_recent (default): the delayed recipe's amax"),
      toggle("no-fp8-wgrad", "weight-gradient GEMMs in bf16 in FP8 runs"),
      toggle("disable-fp8-wgrad", "Megatron's other spelling of --no-fp8-wgrad"),
      toggle("fp8-param-gather", "all-gather the FP8 copy of the weights (distributed optimizer)"),
      toggle("first-last-layers-bf16", "keep the first and last transformer layers in bf16"),
      flag("num-layers-at-start-in-bf16", "layers kept in bf16 at the start (default 1)"),
      flag("num-layers-at-end-in-bf16", "layers kept in bf16 at the end (default 1)"),
  };
  for (OptionSpec& s : precision_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
