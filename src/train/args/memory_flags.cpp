// Memory flags: activation recomputation, activation offloading and optimizer offloading
// (docs/memory.md; Megatron's recompute, cpu-offloading and optimizer-offload flags).
#include "core/error.h"
#include "core/printable.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

// The largest count of transformer layers on one pipeline stage (uneven first and last
// stages included): the bound of --recompute-num-layers.
int64_t max_stage_layers(const TrainArgs& a) {
  const ParallelArgs& p = a.parallel;
  const int64_t pp = std::max<int64_t>(p.pipeline_model_parallel_size, 1);
  int64_t rest = a.model.num_layers, stages = pp, most = 0;
  for (int64_t uneven : {p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers}) {
    if (uneven <= 0 || stages <= 1) continue;
    most = std::max(most, uneven);
    rest -= uneven;
    --stages;
  }
  return std::max(most, stages > 0 ? (rest + stages - 1) / stages : 0);
}

// The recompute flags (Megatron's TransformerConfig.__post_init__ and arguments.py). After
// the FP8 and pipeline flags: both constrain them. What Megatron ignores (a method, count
// or modules that the granularity does not read) is listed as having no effect, not
// refused, so launch scripts that carry them run.
void parse_recompute_args(const ArgReader& r, TrainArgs& a) {
  RecomputeConfig& rc = a.model.recompute;
  std::string granularity, method;
  r.get("recompute-granularity", granularity);
  r.get("recompute-method", method);
  bool activations = false, moe_layer = false;
  r.get("recompute-activations", activations);
  r.get("moe-layer-recompute", moe_layer);
  if (activations) {  // Megatron's arguments.py: replaces the granularity
    if (!granularity.empty() && granularity != "selective")
      a.no_effect.push_back("--recompute-granularity " + granularity +
                            ": --recompute-activations sets selective, as in Megatron");
    granularity = "selective";
  }
  if (granularity == "full")
    rc.granularity = RecomputeGranularity::Full;
  else if (granularity == "selective")
    rc.granularity = RecomputeGranularity::Selective;
  else if (!granularity.empty())
    fail("recompute-granularity must be full or selective (got '{}')", printable(granularity));
  if (method == "uniform")
    rc.method = RecomputeMethod::Uniform;
  else if (method == "block")
    rc.method = RecomputeMethod::Block;
  else if (!method.empty())
    fail("recompute-method must be uniform or block (got '{}')", printable(method));
  r.get("recompute-num-layers", rc.num_layers);
  if (r.has("recompute-modules")) {
    rc.modules = 0;
    for (const std::string& name : r.raw.at("recompute-modules")) {
      const uint32_t bit = recompute_module_bit(name);
      if (bit == 0)
        fail(
            "recompute-modules: '{}' is not one of core_attn, moe_act, layernorm, mlp, moe, "
            "shared_experts, mla_up_proj",
            printable(name));
      if (bit == kRecomputeMlaUpProj && !a.model.multi_latent_attention)
        fail("recompute-modules: mla_up_proj needs multi-latent-attention");
      rc.modules |= bit;
    }
  }
  if (moe_layer) {  // Megatron: deprecated, selective with moe added to the modules
    if (rc.granularity == RecomputeGranularity::Full)
      fail("moe-layer-recompute cannot be combined with recompute-granularity full");
    rc.granularity = RecomputeGranularity::Selective;
    rc.modules |= kRecomputeMoe;  // to the default core_attn, or to the modules given
    a.no_effect.push_back(
        "--moe-layer-recompute: deprecated, read as --recompute-granularity "
        "selective --recompute-modules " +
        recompute_module_names(rc.modules));
  }
  switch (rc.granularity) {
    case RecomputeGranularity::None:
      for (const char* key : {"recompute-method", "recompute-num-layers", "recompute-modules"})
        if (r.has(key))
          a.no_effect.push_back(std::string("--") + key + ": no recompute-granularity given");
      rc = RecomputeConfig{};
      break;
    case RecomputeGranularity::Full: {
      if (rc.method == RecomputeMethod::None)
        fail("recompute-granularity full needs recompute-method uniform or block");
      const int64_t most = max_stage_layers(a);
      if (!r.has("recompute-num-layers") || rc.num_layers < 1 || rc.num_layers > most)
        fail(
            "recompute-granularity full needs recompute-num-layers between 1 and the layers of "
            "a pipeline stage ({}){}",
            most,
            r.has("recompute-num-layers") ? " (got " + std::to_string(rc.num_layers) + ")" : "");
      if (r.has("recompute-modules"))
        a.no_effect.push_back(
            "--recompute-modules: recompute-granularity full recomputes whole "
            "layers");
      break;
    }
    case RecomputeGranularity::Selective:
      // Megatron's arguments.py and TransformerConfig refuse both with selective.
      if (rc.method != RecomputeMethod::None)
        fail("recompute-method applies to recompute-granularity full, not selective");
      if (r.has("recompute-num-layers"))
        fail("recompute-num-layers applies to recompute-granularity full, not selective");
      if (rc.selective(kRecomputeMoeAct))
        a.no_effect.push_back(
            "--recompute-modules moe_act: Megaton always recomputes the "
            "experts' activation, in the pass of its backward");
      // Megatron's TransformerConfig refuses the pair.
      if (rc.selective(kRecomputeSharedExperts) && a.model.moe_shared_expert_overlap &&
          a.model.moe_shared_expert_intermediate_size > 0)
        fail("shared_experts recompute cannot work with --moe-shared-expert-overlap");
      if (a.model.num_experts == 0 &&
          (rc.modules & (kRecomputeMoe | kRecomputeSharedExperts | kRecomputeMoeAct)) != 0)
        a.no_effect.push_back(
            "--recompute-modules moe, moe_act, shared_experts: the model has "
            "no MoE layer");
      break;
  }
  // A forward re-run quantizes its FP8 GEMM inputs again: the delayed recipe would roll
  // its amax history twice per step (the re-run would not be the first forward's bits).
  const uint32_t rerun = kRecomputeMlp | kRecomputeMoe | kRecomputeSharedExperts;
  if (a.model.fp8.enabled && a.model.fp8.recipe == Fp8Recipe::Delayed &&
      (rc.granularity == RecomputeGranularity::Full ||
       (rc.granularity == RecomputeGranularity::Selective && (rc.modules & rerun) != 0)))
    fail(
        "recompute-granularity full and recompute-modules mlp, moe, shared_experts are not "
        "supported with fp8-recipe delayed (a re-run forward would update the amax history "
        "again): use fp8-recipe tensorwise or blockwise");
  // --overlap-moe-expert-parallel-comm: Megatron's TransformerConfig refuses the full and the
  // moe recompute. Megaton's two chunks per layer run each expert GEMM twice per
  // micro-batch, which would roll the delayed recipe's amax history twice.
  if (a.model.overlap_moe_expert_parallel_comm && a.model.num_experts > 0) {
    if (rc.granularity == RecomputeGranularity::Full)
      fail("disable full recomputation when enabling overlap-moe-expert-parallel-comm");
    if (rc.granularity == RecomputeGranularity::Selective && rc.selective(kRecomputeMoe))
      fail("disable moe in recompute-modules when enabling overlap-moe-expert-parallel-comm");
    if (a.model.fp8.enabled && a.model.fp8.recipe == Fp8Recipe::Delayed)
      fail(
          "overlap-moe-expert-parallel-comm with fp8-recipe delayed is not supported (each "
          "expert GEMM runs once per chunk): use fp8-recipe tensorwise or blockwise");
  }
}

// --cpu-offloading, --cpu-offloading-num-layers (Megatron's arguments.py: a count > 0 turns
// cpu_offloading on; TransformerConfig.__post_init__'s checks and messages). After the
// recompute, pipeline and CUDA graph flags.
void parse_cpu_offloading_args(const ArgReader& r, TrainArgs& a) {
  CpuOffloadingConfig& c = a.model.cpu_offloading;
  r.get("cpu-offloading", c.enabled);
  r.get("cpu-offloading-num-layers", c.num_layers);
  if (c.num_layers > 0) c.enabled = true;
  if (!c.enabled) {
    c = CpuOffloadingConfig{};
    return;
  }
  if (c.num_layers < 0 || c.num_layers >= a.model.num_layers)
    fail(
        "CPU offloading can be done only for layers less than num-layers ({}): "
        "cpu-offloading-num-layers is {}",
        a.model.num_layers, c.num_layers);
  if (a.parallel.pipeline_model_parallel_size > 1)
    fail(
        "Currently there is no support for Pipeline parallelism with CPU offloading "
        "(pipeline-model-parallel-size {})",
        a.parallel.pipeline_model_parallel_size);
  if (a.model.recompute.granularity != RecomputeGranularity::None)
    fail(
        "CPU offloading does not work when activation recomputation is enabled "
        "(recompute-granularity)");
  if (a.cuda_graph_impl != "none")
    fail(
        "cpu-offloading with cuda-graph-impl {} is not supported in Megaton yet (the copy "
        "stream is not captured)",
        a.cuda_graph_impl);
  if (c.num_layers == 0)
    a.no_effect.push_back(
        "--cpu-offloading: cpu-offloading-num-layers is 0, no layer is "
        "offloaded");
}
// --optimizer-cpu-offload and its options (Megatron's arguments.py: the offload needs the
// precision-aware optimizer; with FP8 param gather, Megatron needs the delayed recipe,
// which Megaton does not offload yet). After the precision-aware, FP8 and CUDA graph flags.
void parse_optimizer_offload_args(const ArgReader& r, TrainArgs& a) {
  optim::AdamWConfig& c = a.adam;
  r.get("optimizer-cpu-offload", c.optimizer_cpu_offload);
  r.get("optimizer-offload-fraction", c.optimizer_offload_fraction);
  if (!c.optimizer_cpu_offload) {
    if (r.has("optimizer-offload-fraction"))
      a.no_effect.push_back("--optimizer-offload-fraction: no --optimizer-cpu-offload");
    return;
  }
  if (!(c.optimizer_offload_fraction >= 0 && c.optimizer_offload_fraction <= 1))
    fail("optimizer-offload-fraction must be in [0, 1] (got {})", c.optimizer_offload_fraction);
  if (!c.use_precision_aware_optimizer)
    fail(
        "The optimizer cpu offload must be used in conjunction with "
        "`--use-precision-aware-optimizer`, as Megatron's hybrid device optimizer reuses "
        "its code path");
  if (a.model.fp8.param_gather)
    fail(
        "optimizer-cpu-offload with fp8-param-gather is not supported in Megaton yet (the "
        "FP8 weights are quantized from device main params)");
  if (a.cuda_graph_impl != "none")
    fail(
        "optimizer-cpu-offload with cuda-graph-impl {} is not supported in Megaton yet (the "
        "host update waits for the device each step)",
        a.cuda_graph_impl);
}

void parse_memory(const ArgReader& r, TrainArgs& a) {
  parse_recompute_args(r, a);
  parse_cpu_offloading_args(r, a);
  parse_optimizer_offload_args(r, a);
}

}  // namespace

std::vector<OptionSpec> memory_megatron_rules();

ArgGroup memory_flags() {
  ArgGroup g{"memory", "memory: recomputation and offloading", {}, parse_memory};
  g.flags = {
      flag("recompute-granularity",
           "full (whole layers, by recompute-method) or selective (the "
           "recompute-modules); default: keep every activation"),
      flag("recompute-method",
           "uniform (groups of recompute-num-layers layers) or block (the "
           "first recompute-num-layers layers of each model chunk)"),
      flag("recompute-num-layers",
           "layers per recompute group (uniform) or recomputed per model "
           "chunk (block)"),
      values("recompute-modules",
             "core_attn (default), moe_act, layernorm, mlp, moe, "
             "shared_experts (selective granularity)"),
      toggle("recompute-activations", "Megatron's older name of recompute-granularity selective"),
      toggle("moe-layer-recompute", "deprecated: recompute-modules moe (selective)"),
      own(toggle("cpu-offloading",
                 "offload the saved activations of the first "
                 "cpu-offloading-num-layers layers to host memory")),
      flag("cpu-offloading-num-layers",
           "layers whose activations are offloaded (0 .. "
           "num-layers - 1; > 0 turns cpu-offloading on)"),
      toggle("optimizer-cpu-offload",
             "keep the fp32 main params and Adam moments of "
             "optimizer-offload-fraction of the elements in host "
             "memory and update them there (needs "
             "use-precision-aware-optimizer)"),
      flag("optimizer-offload-fraction",
           "fraction of the optimizer's elements offloaded, whole "
           "params in order (default 1.0)"),
  };
  for (OptionSpec& s : memory_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
