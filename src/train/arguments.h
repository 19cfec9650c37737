// TrainArgs: every `megaton train` setting, read from a YAML config and --flags.
#pragma once
#include <array>
#include <map>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "dist/grid.h"
#include "model/config.h"
#include "optim/adamw.h"
#include "optim/optimizer_config.h"
#include "optim/grad_scaler.h"
#include "optim/lr_schedule.h"
#include "train/batch_schedule.h"

namespace megaton {

// Parallel layout and distributed-training flags, Megatron's names and defaults. Parsed
// and checked (check_parallel_layout). Optional
// counts use 0 for "not set".
struct ParallelArgs {
  int64_t tensor_model_parallel_size = 1;
  int64_t pipeline_model_parallel_size = 1;
  int64_t expert_model_parallel_size = 1;
  int64_t expert_tensor_parallel_size = 0;  // 0: tensor_model_parallel_size
  int64_t context_parallel_size = 1;
  // --cp-comm-type: p2p, all_gather or a2a (model/context_parallel.h); one for every layer.
  std::string cp_comm_type = "p2p";
  bool sequence_parallel = false;
  int64_t num_layers_per_virtual_pipeline_stage = 0;  // 0: no interleaved schedule
  int64_t decoder_first_pipeline_num_layers = 0;      // 0: an even share
  int64_t decoder_last_pipeline_num_layers = 0;       // 0: an even share
  bool use_distributed_optimizer = false;
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  // Elements per gradient bucket under overlap_grad_reduce; 0: Megatron's default,
  // max(40M, 1M x data-parallel size). Without the overlap, one bucket per buffer.
  int64_t ddp_bucket_size = 0;
  // allgather, alltoall, or flex (Megatron's DeepEP / HybridEP dispatcher: in Megaton the
  // all-to-all dispatcher with its fastest exchange, announced once at start).
  std::string moe_token_dispatcher_type = "allgather";
  std::string moe_flex_dispatcher_backend = "deepep";  // deepep, hybridep or ncclep (flex)
  // --tp-comm-overlap (needs --sequence-parallel): the linears' sequence all-gathers and
  // reduce-scatters beside their GEMMs (model/tp_comm_overlap.h).
  bool tp_comm_overlap = false;
  // Megatron's overlap_p2p_comm: the pipeline's sends and receives run beside the compute
  // (train/pipeline_schedule.h); on unless --no-overlap-p2p-communication.
  bool overlap_p2p_comm = true;
  // Deadline of one collective in minutes; 0: MEGATON_COMM_TIMEOUT_S seconds, else 300 s.
  int64_t distributed_timeout_minutes = 0;
  // Megatron-FSDP (--use-megatron-fsdp): --data-parallel-sharding-strategy (no_shard, optim,
  // optim_grads, optim_grads_params; Megatron's default the last), and the dtypes of the own
  // gradient shards and of the reduce-scatter ("auto": the run's main grads dtype).
  bool use_megatron_fsdp = false;
  std::string data_parallel_sharding_strategy = "optim_grads_params";
  std::string megatron_fsdp_main_grads_dtype = "auto";
  std::string megatron_fsdp_grad_comm_dtype = "auto";
  // --fsdp-double-buffer: bucket memory from two persistent slots (BufferSharding).
  bool fsdp_double_buffer = false;
};

// The run-length and schedule flags as given; parse_train_args turns them into
// TrainArgs::lr (in samples) and train_iters, as Megatron's get_optimizer_param_scheduler
// and update_train_iters do. Unset values are 0 (counts), -1 (lengths that may be 0) or
// empty.
struct ScheduleFlags {
  int64_t train_samples = 0;               // --train-samples: sample-based training
  int64_t lr_warmup_iters = 0;             // --lr-warmup-iters
  int64_t lr_decay_iters = 0;              // --lr-decay-iters (default: the run)
  int64_t lr_wsd_decay_iters = -1;         // --lr-wsd-decay-iters
  int64_t lr_warmup_samples = 0;           // --lr-warmup-samples
  int64_t lr_decay_samples = 0;            // --lr-decay-samples (default: --train-samples)
  int64_t lr_wsd_decay_samples = -1;       // --lr-wsd-decay-samples
  double lr_warmup_fraction = -1;          // --lr-warmup-fraction of the decay
  double start_weight_decay = -1;          // --start-weight-decay
  double end_weight_decay = -1;            // --end-weight-decay
  std::vector<int64_t> rampup_batch_size;  // --rampup-batch-size start increment samples
  std::string step_batch_size_schedule;    // --step-batch-size-schedule
};

// Megatron's optional logs (train/run_logger.h) and run control; defaults are Megatron's.
struct LoggingFlags {
  std::string tensorboard_dir;             // --tensorboard-dir ("" off)
  int64_t tensorboard_log_interval = 1;    // --tensorboard-log-interval
  int64_t tensorboard_queue_size = 1000;   // --tensorboard-queue-size: events per flush
  bool log_timers_to_tensorboard = false;  // iteration time (and throughput) to TensorBoard
  bool log_validation_ppl_to_tensorboard = false;
  bool log_memory_to_tensorboard = false;
  bool log_world_size_to_tensorboard = false;
  bool log_loss_scale_to_tensorboard = true;  // off: --no-log-loss-scale-to-tensorboard
  bool log_throughput = false;                // the throughput scalar (the line always has it)
  int64_t log_memory_interval = 0;            // --log-memory-interval (0 off)
  bool log_device_memory_used = false;
  bool log_energy = false;    // NVML energy per iteration (GPU)
  bool log_progress = false;  // <save>/progress.txt
  // Run control: --exit-duration-in-mins (0 off), --exit-signal-handler with --exit-signal
  // (default SIGTERM, 15).
  double exit_duration_in_mins = 0;
  bool exit_signal_handler = false;
  int64_t exit_signal = 15;
  // --profile: cudaProfilerStart at --profile-step-start, cudaProfilerStop at
  // --profile-step-end on the --profile-ranks (Nsight Systems' capture range
  // cudaProfilerApi, as Megatron without --use-pytorch-profiler).
  bool profile = false;
  int64_t profile_step_start = 10;
  int64_t profile_step_end = 12;
  std::vector<int64_t> profile_ranks = {0};
};

// Names are Megatron-LM's argument names ('-' -> '_'); defaults are Megatron's unless
// noted.
struct TrainArgs {
  LoggingFlags logging;
  GPTConfig model;
  optim::AdamWConfig adam;
  // --optimizer and the settings of SGD, Lion and Muon (Adam's are `adam`).
  optim::OptimizerConfig optimizer;
  // The learning-rate and weight-decay schedule, its lengths in samples (from schedule).
  optim::LRScheduleConfig lr;
  ScheduleFlags schedule;
  // --loss-scale, --initial-loss-scale, --min-loss-scale, --loss-scale-window,
  // --hysteresis: the loss scaler of --fp16 (dynamic unless --loss-scale) or a static
  // scale of --bf16 runs, as Megatron builds them.
  optim::GradScalerConfig loss_scaler;

  // Megatron flags given that change nothing in Megaton, one line each ("--flag: why"),
  // for rank 0 to print once at start as "no effect in Megaton: ...".
  std::vector<std::string> no_effect;
  // Settings Megatron changes with a warning (e.g. --check-for-nan-in-loss-and-grad off
  // under dynamic loss scaling), one line each, for rank 0 to print at start.
  std::vector<std::string> warnings;

  // Data and tokenizer.
  // --data-path, or the tokens of --data-args-path's file: one prefix, or "w1 p1 w2 p2 ...".
  std::vector<std::string> data_path;
  // --train-data-path, --valid-data-path, --test-data-path, or --per-split-data-args-path's
  // JSON: one blend per split, each dataset used whole (empty: none for that split).
  std::array<std::vector<std::string>, 3> per_split_data_path;
  std::string split = "969,30,1";
  std::string data_cache_path;  // --data-cache-path: "" = beside each .idx
  std::string tokenizer_type;
  std::string tokenizer_model;
  std::string vocab_file;                           // --vocab-file (GPT2BPETokenizer)
  std::string merge_file;                           // --merge-file (GPT2BPETokenizer)
  bool tokenizer_hf_include_special_tokens = true;  // off: --tokenizer-hf-no-include-special-tokens
  int64_t vocab_size = 0;                           // NullTokenizer only
  bool mock_data = false;
  // --eod-mask-loss: the predictions made at an end-of-document input token are left out of
  // the loss (Megatron's loss_mask; train/loss_mask.h).
  bool eod_mask_loss = false;
  // --reset-position-ids, --reset-attention-mask: the documents packed into a sample (ended
  // by eod tokens) get positions restarting at 0 after each eod, and attend within
  // themselves only (Megatron's _get_ltor_masks_and_position_ids; train/packed_batch.h,
  // docs/data.md "Packed sequences").
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  // --calculate-per-token-loss: the step's gradient is that of the summed per-token losses
  // divided by the step's loss tokens over all micro-batches and data-parallel ranks, not
  // the mean over micro-batches of each one's token mean (Megatron's forward_step and
  // finalize_model_grads; docs/launch-scripts.md).
  bool calculate_per_token_loss = false;

  // Batch and iterations.
  int64_t micro_batch_size = 1;
  // Constant, or the ramp's end; with --step-batch-size-schedule its last batch size (then the
  // evaluation batch). 0 before parsing: micro_batch_size.
  int64_t global_batch_size = 0;
  int64_t train_iters = 0;  // --train-iters, or from --train-samples and the batch schedule
  int64_t eval_interval = 1000;
  int64_t eval_iters = 100;
  int64_t log_interval = 100;
  int64_t exit_interval = 0;           // 0: off
  std::string log_metrics_file;        // Megaton: per-iteration JSON lines; "" off
  bool log_params_norm = false;        // --log-params-norm
  bool log_num_zeros_in_grad = false;  // --log-num-zeros-in-grad
  bool moe_per_layer_logging = false;  // --moe-per-layer-logging
  float clip_grad = 1.0f;
  // Megatron's --check-for-nan-in-loss-and-grad (on by default; off with
  // --no-check-for-nan-in-loss-and-grad): a NaN or inf loss or gradient norm stops the run
  // with the iteration and rank named. Off, such iterations are skipped (the update is not
  // applied) and counted in the log line.
  bool check_for_nan_in_loss_and_grad = true;
  uint64_t seed = 1234;
  // --dry-run: print the memory plan (train/memory_plan.h) instead of training.
  bool dry_run = false;
  // Megatron's --deterministic-mode: the ops take their deterministic implementations
  // (ops/determinism.h) and NCCL_ALGO is Ring unless set, so two runs on the same GPUs
  // give the same bits.
  bool deterministic_mode = false;
  // --cuda-graph-impl (none or full_iteration; train/step_graph.h), its warmup steps, and
  // --cuda-graph-modules (kept for the messages: only local, refused, takes them).
  std::string cuda_graph_impl = "none";
  int64_t cuda_graph_warmup_steps = 3;
  std::vector<std::string> cuda_graph_modules;

  // Checkpoints.
  std::string save;
  int64_t save_interval = 0;
  int64_t save_retain_interval = 0;  // --save-retain-interval (0: keep every checkpoint)
  bool async_save = false;           // --async-save (background file writes)
  std::string load;
  bool no_load_optim = false;
  bool exit_on_missing_checkpoint = false;  // --exit-on-missing-checkpoint
  bool no_load_rng = false;
  bool finetune = false;
  // --ckpt-step: the iteration --load reads (0: the tracker's). The model arguments of
  // --use-checkpoint-args (and its -mp- and tokenizer switches) are applied to the raw
  // options before parsing (train/checkpoint_args.h); these record that they were asked.
  int64_t ckpt_step = 0;
  bool use_checkpoint_args = false;

  std::string device;  // "cpu" or "cuda"; empty: cuda when a GPU is visible

  ParallelArgs parallel;

  // Micro-batches per iteration (global / micro; DP = 1).
  int64_t num_micro_batches() const { return global_batch_size / micro_batch_size; }
};

// Whether this binary has the CUDA backend, and whether a GPU is usable now.
bool cuda_built();
bool cuda_available();

// How `megaton train` treats a flag: one rule for each of Megatron-LM's flags (issue 19).
enum class FlagRule : uint8_t {
  Implemented,  // works with Megatron's meaning
  NoEffect,     // what Megaton always does, or what does not apply to a native program:
                // accepted, and listed once at start with the reason
  Unsupported,  // a feature Megaton does not have: refused, one line naming the feature
};

// "implemented", "no effect", "unsupported".
const char* flag_rule_name(FlagRule rule);

// A flag: its name (without dashes), how many values it takes, its rule, and its text (what
// it does; for NoEffect why it changes nothing; for Unsupported the feature's name).
// Declared by the flag groups (train/args/flag_table.h).
struct OptionSpec {
  std::string name;
  std::string help;
  bool is_switch = false;  // `--swiglu`: no value (true/false in YAML)
  int min_values = 1;      // otherwise how many values: `--lr 3e-4` 1..1,
  int max_values = 1;      // `--data-path 0.5 a 0.5 b` 1..kManyValues
  FlagRule rule = FlagRule::Implemented;
  // NoEffect only for these values (e.g. --distributed-backend nccl); another value is
  // refused with `unsupported_value` as the reason. Empty: any value.
  std::vector<std::string> harmless_values;
  std::string unsupported_value;
  std::string group;     // the declaring group's name (set by the registry)
  bool megatron = true;  // false: Megaton's own flag (--config, --dry-run, ...)
};
inline constexpr int kManyValues = 1 << 20;

// Every option `megaton train` understands (for the CLI and for YAML key checking): the
// flags of every group (train/args/flag_table.h), in group order.
const std::vector<OptionSpec>& train_option_specs();
// The spec of flag `name` (no dashes), or nullptr.
const OptionSpec* find_option_spec(const std::string& name);

// Raw values by option name: from YAML (scalars and lists, rendered as strings) then
// overridden by the command line. Switches hold "true"/"false".
using RawOptions = std::map<std::string, std::vector<std::string>>;

// Reads a YAML mapping whose keys are option names ("num-layers" or "num_layers").
// Throws megaton::Error naming the file on a missing/unparsable file and naming the key
// for an unknown key or a nested value.
RawOptions read_yaml_options(const std::string& path);

// Converts raw values into TrainArgs, checking types and ranges. The model's vocab_size
// is left 0 (it comes from the tokenizer). Throws megaton::Error naming the key.
TrainArgs parse_train_args(const RawOptions& raw);

// The batch-size schedule of `args` (BatchSchedule) for micro-batches of
// micro_batch_size x data_parallel_size samples.
BatchScheduleConfig batch_schedule_config(const TrainArgs& args, int64_t data_parallel_size);

// The tokenizer the args name (--tokenizer-type and its files), for data::make_tokenizer.
data::TokenizerOptions tokenizer_options(const TrainArgs& args);

// Megatron's --moe-layer-freq pattern ("[0]*1+[1]*3" -> {0, 1, 1, 1}): lists of integers
// joined by '+' (concatenation) and '*' (repetition), with parentheses. Throws
// megaton::Error naming `key` and the pattern when it is not of that form.
std::vector<int> parse_layer_pattern(const std::string& text, const char* key);

// Checks the parallel layout of `args` on `world_size` ranks against the model before
// anything is built (dist::validate_layout with the model's layers, heads, query groups
// and experts). Returns the resolved layout (its warnings are for rank 0 to print);
// throws megaton::Error naming the clashing numbers.
dist::ValidatedLayout check_parallel_layout(const TrainArgs& args, int64_t world_size);

// Seconds one collective may take: distributed-timeout-minutes x 60 when set, else
// dist::default_timeout_s() (MEGATON_COMM_TIMEOUT_S, else 300).
double comm_timeout_s(const ParallelArgs& parallel);

// The finished args as YAML-like "key: value" JSON object (saved in checkpoints).
std::string args_to_json(const RawOptions& raw);

}  // namespace megaton
