// Parallelism flags: the layout (tp, pp, vpp, ep, etp, cp), sequence parallelism, the
// distributed optimizer and the gradient/parameter communication (Megatron's "distributed"
// group). The layout itself is checked against the world by check_parallel_layout.
#include "core/error.h"
#include "model/context_parallel.h"
#include "model/param_buffer.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

// Megatron-FSDP's flags (Megatron-LM d98e8a6 arguments.py: --use-megatron-fsdp turns the
// distributed optimizer on, as its v1 does; the sharding strategy defaults to
// optim_grads_params).
void parse_megatron_fsdp(const ArgReader& r, ParallelArgs& p) {
  r.get("use-megatron-fsdp", p.use_megatron_fsdp);
  r.get("data-parallel-sharding-strategy", p.data_parallel_sharding_strategy);
  r.get("megatron-fsdp-main-grads-dtype", p.megatron_fsdp_main_grads_dtype);
  r.get("megatron-fsdp-grad-comm-dtype", p.megatron_fsdp_grad_comm_dtype);
  r.get("fsdp-double-buffer", p.fsdp_double_buffer);
  parse_sharding_strategy(p.data_parallel_sharding_strategy);  // a bad value: one line
  for (const char* key : {"megatron-fsdp-main-grads-dtype", "megatron-fsdp-grad-comm-dtype"}) {
    std::string v = "auto";
    r.get(key, v);
    if (v != "auto" && v != "fp32" && v != "bf16")
      fail("{} '{}' is not supported in Megaton (auto, fp32 or bf16)", key, v);
  }
  if (!p.use_megatron_fsdp)
    for (const char* key : {"data-parallel-sharding-strategy", "megatron-fsdp-main-grads-dtype",
                            "megatron-fsdp-grad-comm-dtype", "fsdp-double-buffer"})
      if (r.has(key)) fail("{} needs use-megatron-fsdp", key);
  // Megatron-FSDP shards the optimizer state itself (but with no_shard).
  if (p.use_megatron_fsdp)
    p.use_distributed_optimizer =
        parse_sharding_strategy(p.data_parallel_sharding_strategy) != ShardingStrategy::NoShard;
}

void parse_parallel(const ArgReader& r, TrainArgs& a) {
  ParallelArgs& p = a.parallel;
  r.get("tensor-model-parallel-size", p.tensor_model_parallel_size);
  r.get("pipeline-model-parallel-size", p.pipeline_model_parallel_size);
  r.get("expert-model-parallel-size", p.expert_model_parallel_size);
  r.get("expert-tensor-parallel-size", p.expert_tensor_parallel_size);
  r.get("context-parallel-size", p.context_parallel_size);
  r.get("sequence-parallel", p.sequence_parallel);
  // Megatron's arguments.py asserts sequence parallelism (which it drops at tp 1).
  r.get("tp-comm-overlap", p.tp_comm_overlap);
  if (p.tp_comm_overlap && !(p.sequence_parallel && p.tensor_model_parallel_size > 1))
    fail("tp-comm-overlap needs sequence-parallel with tensor-model-parallel-size > 1");
  // --cp-comm-type: one value, or Megatron's per-layer list (one value per layer; Megaton
  // takes lists whose values are all the same).
  if (r.has("cp-comm-type")) {
    const std::vector<std::string>& types = r.raw.at("cp-comm-type");
    for (const std::string& t : types) {
      parse_cp_comm_type(t);  // a bad value: one line naming it
      if (t != types.front() && parse_cp_comm_type(t) != parse_cp_comm_type(types.front()))
        fail("cp-comm-type: per-layer lists of different types ({} and {}) are not supported",
             types.front(), t);
    }
    p.cp_comm_type = cp_comm_type_name(parse_cp_comm_type(types.front()));
  }
  r.get("num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage);
  r.get("decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers);
  r.get("decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers);
  bool no_overlap_p2p = false;
  r.get("no-overlap-p2p-communication", no_overlap_p2p);
  p.overlap_p2p_comm = !no_overlap_p2p;
  r.get("use-distributed-optimizer", p.use_distributed_optimizer);
  r.get("overlap-grad-reduce", p.overlap_grad_reduce);
  r.get("overlap-param-gather", p.overlap_param_gather);
  r.get("ddp-bucket-size", p.ddp_bucket_size);
  r.get("distributed-timeout-minutes", p.distributed_timeout_minutes);
  parse_megatron_fsdp(r, p);
  // Megatron's TransformerConfig field, used with Megatron-FSDP (the model's initialisation).
  r.get("init-model-with-meta-device", a.model.init_model_with_meta_device);
  if (a.model.init_model_with_meta_device && !p.use_megatron_fsdp)
    fail("init-model-with-meta-device needs use-megatron-fsdp");
  // Megatron's DeepEP and NCCL-EP managers assert TP x EP > 1 when they are built (their tp
  // being the expert tensor-parallel size, which defaults to tensor-model-parallel-size).
  const int64_t etp = p.expert_tensor_parallel_size > 0 ? p.expert_tensor_parallel_size
                                                        : p.tensor_model_parallel_size;
  if (a.model.num_experts > 0 && p.moe_token_dispatcher_type == "flex" &&
      p.moe_flex_dispatcher_backend != "hybridep" && etp * p.expert_model_parallel_size <= 1)
    fail(
        "moe-token-dispatcher-type flex with backend {} needs expert-tensor-parallel-size x "
        "expert-model-parallel-size > 1",
        p.moe_flex_dispatcher_backend);
  if (a.model.num_experts > 0 && a.model.overlap_moe_expert_parallel_comm &&
      p.expert_model_parallel_size <= 1)
    fail(
        "overlap-moe-expert-parallel-comm is only supported with expert model parallelism "
        "(expert-model-parallel-size > 1)");
  // Optional counts: 0 means "not set", so a value given must be positive.
  for (const char* key : {"expert-tensor-parallel-size", "num-layers-per-virtual-pipeline-stage",
                          "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers",
                          "distributed-timeout-minutes", "ddp-bucket-size"}) {
    int64_t v = 0;
    r.get(key, v);
    if (r.has(key) && v <= 0) fail("{} must be positive (got {})", key, v);
  }
  // Megatron's arguments.py: the parameter all-gather exists only with the distributed
  // optimizer, and is overlapped only together with the gradient reduction.
  if (p.overlap_param_gather && !p.use_distributed_optimizer)
    fail("overlap-param-gather needs use-distributed-optimizer");
  if (p.overlap_param_gather && !p.overlap_grad_reduce)
    fail("overlap-param-gather needs overlap-grad-reduce");
  int64_t instances = 1;
  r.get("num-distributed-optimizer-instances", instances);
  if (instances != 1)
    fail(
        "num-distributed-optimizer-instances {} is not supported in Megaton: the distributed "
        "optimizer shards over the whole data-parallel group (partial sharding)",
        instances);
  // Megatron's interleaved schedule runs micro-batches in groups of this size; Megaton's
  // groups are the pipeline size, Megatron's default.
  if (r.has("microbatch-group-size-per-virtual-pipeline-stage")) {
    int64_t group = 0;
    r.get("microbatch-group-size-per-virtual-pipeline-stage", group);
    if (group != p.pipeline_model_parallel_size)
      fail(
          "microbatch-group-size-per-virtual-pipeline-stage {} is not supported in Megaton: "
          "the interleaved schedule groups pipeline-model-parallel-size ({}) micro-batches",
          group, p.pipeline_model_parallel_size);
  }
}

}  // namespace

std::vector<OptionSpec> parallel_megatron_rules();

ArgGroup parallel_flags() {
  ArgGroup g{"parallel", "parallelism", {}, parse_parallel};
  g.flags = {
      flag("tensor-model-parallel-size", "tensor parallel ranks (tp)"),
      flag("pipeline-model-parallel-size", "pipeline stages (pp)"),
      flag("expert-model-parallel-size", "expert parallel ranks (ep)"),
      flag("expert-tensor-parallel-size", "tensor parallel ranks of the experts (default tp)"),
      flag("context-parallel-size",
           "context parallel ranks (cp): each holds 2 of the sequence's 2 cp chunks"),
      values("cp-comm-type",
             "context parallel attention: p2p (K/V ring), all_gather or a2a (heads)"),
      toggle("sequence-parallel", "shard activations along the sequence over tp ranks"),
      toggle("tp-comm-overlap",
             "run the sequence all-gathers and reduce-scatters of the linears beside their "
             "GEMMs (needs --sequence-parallel)"),
      flag("num-layers-per-virtual-pipeline-stage",
           "layers per model chunk (interleaved pipeline)"),
      flag("microbatch-group-size-per-virtual-pipeline-stage",
           "micro-batches per group of the interleaved schedule: the pipeline size only"),
      flag("decoder-first-pipeline-num-layers", "layers of the first pipeline stage"),
      flag("decoder-last-pipeline-num-layers", "layers of the last pipeline stage"),
      toggle("no-overlap-p2p-communication",
             "finish each pipeline send and receive in its tick (default: they run beside the "
             "compute)"),
      toggle("use-distributed-optimizer", "shard optimizer state over data-parallel ranks"),
      flag("num-distributed-optimizer-instances",
           "1 only: the optimizer shards over the whole "
           "data-parallel group"),
      toggle("overlap-grad-reduce", "overlap the gradient reduction with backward"),
      toggle("overlap-param-gather", "overlap the parameter all-gather with forward"),
      flag("ddp-bucket-size",
           "elements per gradient bucket with --overlap-grad-reduce (default "
           "max(40M, 1M x data-parallel size))"),
      flag("distributed-timeout-minutes", "deadline of one collective (default: 5 minutes)"),
      toggle("use-megatron-fsdp",
             "shard weights, gradients and optimizer state over data-parallel ranks (FSDP)"),
      flag("data-parallel-sharding-strategy",
           "what FSDP shards: no_shard, optim, optim_grads or optim_grads_params (default)"),
      flag("megatron-fsdp-main-grads-dtype",
           "dtype of FSDP's gradient shards: auto (the main grads'), fp32 or bf16"),
      flag("megatron-fsdp-grad-comm-dtype",
           "dtype of FSDP's gradient reduce-scatter: auto (the main grads'), fp32 or bf16"),
      toggle("fsdp-double-buffer",
             "FSDP: gathered weights and bucket gradients in two persistent slots per buffer"),
      toggle("init-model-with-meta-device",
             "FSDP: each rank draws only the initial weights and main params it stores"),
  };
  for (OptionSpec& s : parallel_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
