// Training flags: batch sizes, iterations, evaluation, seeds, determinism, the device, CUDA
// graphs and the dry run (Megatron's "training" and "validation" groups).
#include <cstdlib>

#include "core/error.h"
#include "core/printable.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

// --cuda-graph-impl and its options, with Megatron's rules (arguments.py): the old
// --cuda-graph-scope is --cuda-graph-modules, except its value full_iteration, which selects
// the implementation; modules are empty with full_iteration; warmup steps are positive.
void parse_cuda_graph_args(const ArgReader& r, TrainArgs& a) {
  r.get("cuda-graph-impl", a.cuda_graph_impl);
  if (r.has("cuda-graph-modules") && r.has("cuda-graph-scope"))
    fail(
        "cuda-graph-scope and cuda-graph-modules cannot be used together (cuda-graph-scope is "
        "the deprecated name)");
  for (const char* key : {"cuda-graph-modules", "cuda-graph-scope"}) {
    if (!r.has(key)) continue;
    for (const std::string& v : r.raw.at(key)) {
      if (std::string(key) == "cuda-graph-scope" && v == "full_iteration") {
        if (a.cuda_graph_impl != "none" && a.cuda_graph_impl != "local" &&
            a.cuda_graph_impl != "full_iteration")
          fail("cuda-graph-scope full_iteration cannot be combined with cuda-graph-impl {}",
               printable(a.cuda_graph_impl));
        a.cuda_graph_impl = "full_iteration";
        continue;
      }
      if (v != "attn" && v != "mlp" && v != "moe" && v != "moe_router" && v != "moe_preprocess" &&
          v != "mamba" && v != "full")
        fail("{}: '{}' is not one of attn, mlp, moe, moe_router, moe_preprocess, mamba", key,
             printable(v));
      if (v != "full") a.cuda_graph_modules.push_back(v);  // "full": the whole layer (empty)
    }
  }
  r.get("cuda-graph-warmup-steps", a.cuda_graph_warmup_steps);
  const std::string& impl = a.cuda_graph_impl;
  if (impl != "none" && impl != "local" && impl != "transformer_engine" && impl != "full_iteration")
    fail("cuda-graph-impl must be none, local, transformer_engine or full_iteration (got '{}')",
         printable(impl));
  if (impl == "transformer_engine")
    fail(
        "cuda-graph-impl transformer_engine captures Transformer Engine's layers, which Megaton "
        "does not use: use cuda-graph-impl full_iteration");
  if (impl == "local")
    fail(
        "cuda-graph-impl local (per-layer CUDA graphs) is not built in Megaton: use "
        "cuda-graph-impl full_iteration, which captures the whole step");
  if (impl == "full_iteration" && !a.cuda_graph_modules.empty())
    fail(
        "cuda-graph-modules must be empty with cuda-graph-impl full_iteration (it captures the "
        "whole step)");
  // Megatron: the modules have no effect with impl none.
  if (impl == "none" && !a.cuda_graph_modules.empty())
    a.no_effect.push_back(
        "--cuda-graph-modules: no CUDA graphs are captured (cuda-graph-impl "
        "none)");
  if (a.cuda_graph_warmup_steps <= 0)
    fail("cuda-graph-warmup-steps must be positive (got {})", a.cuda_graph_warmup_steps);
}

void parse_training(const ArgReader& r, TrainArgs& a) {
  r.get("micro-batch-size", a.micro_batch_size);
  r.get("global-batch-size", a.global_batch_size);
  r.get("train-iters", a.train_iters);
  r.get("train-samples", a.schedule.train_samples);
  if (r.has("rampup-batch-size")) {
    for (size_t i = 0; i < r.raw.at("rampup-batch-size").size(); ++i) {
      RawOptions one = {{"rampup-batch-size", {r.raw.at("rampup-batch-size")[i]}}};
      int64_t v = 0;
      ArgReader{one}.get("rampup-batch-size", v);
      a.schedule.rampup_batch_size.push_back(v);
    }
  }
  r.get("step-batch-size-schedule", a.schedule.step_batch_size_schedule);
  // Megatron's arguments.py.
  if (r.has("step-batch-size-schedule") && r.has("global-batch-size"))
    fail("Cannot specify both --step-batch-size-schedule and --global-batch-size");
  r.get("eval-interval", a.eval_interval);
  r.get("eval-iters", a.eval_iters);
  r.get("exit-interval", a.exit_interval);
  r.get("seed", a.seed);
  r.get("calculate-per-token-loss", a.calculate_per_token_loss);
  a.model.calculate_per_token_loss = a.calculate_per_token_loss;  // MTP's loss weights
  r.get("deterministic-mode", a.deterministic_mode);
  // Megatron asks for NCCL_ALGO to be one of these in deterministic mode (its all-reduce
  // order otherwise depends on the algorithm NCCL picks); the Trainer sets Ring when it is
  // unset, and the others are refused here.
  if (a.deterministic_mode) {
    if (const char* algo = std::getenv("NCCL_ALGO")) {
      const std::string v = algo;
      if (v != "Tree" && v != "Ring" && v != "CollnetDirect" && v != "CollnetChain" && v != "^NVLS")
        fail(
            "deterministic-mode needs NCCL_ALGO unset or one of Tree, Ring, CollnetDirect, "
            "CollnetChain, ^NVLS (got '{}')",
            printable(v));
    }
  }
  parse_cuda_graph_args(r, a);
  // Megatron's CUDA graph of the optimizer step alone: the full-iteration graph holds it.
  if (r.on("optimizer-cuda-graph")) {
    if (a.cuda_graph_impl != "full_iteration")
      fail(
          "optimizer-cuda-graph without cuda-graph-impl full_iteration is not supported in "
          "Megaton (a CUDA graph of the optimizer step alone)");
    a.no_effect.push_back(
        "--optimizer-cuda-graph: the full-iteration CUDA graph already holds "
        "the optimizer step");
  }
  r.get("device", a.device);
  r.get("dry-run", a.dry_run);
  LoggingFlags& l = a.logging;
  r.get("exit-duration-in-mins", l.exit_duration_in_mins);
  if (r.has("exit-duration-in-mins") && !(l.exit_duration_in_mins > 0))
    fail("exit-duration-in-mins must be positive (got {})", l.exit_duration_in_mins);
  r.get("exit-signal-handler", l.exit_signal_handler);
  r.get("exit-signal", l.exit_signal);
  // Megatron's choices: the catchable signals of Python's signal.Signals.
  if (l.exit_signal < 1 || l.exit_signal > 64 || l.exit_signal == 9 || l.exit_signal == 19)
    fail("exit-signal {} is not a signal the handler can catch", l.exit_signal);
  if (r.has("exit-signal") && !l.exit_signal_handler)
    a.no_effect.push_back("--exit-signal: no --exit-signal-handler");
  r.get("profile", l.profile);
  r.get("profile-step-start", l.profile_step_start);
  r.get("profile-step-end", l.profile_step_end);
  if (r.has("profile-ranks")) {
    l.profile_ranks.clear();
    for (const std::string& v : r.raw.at("profile-ranks")) {
      RawOptions one = {{"profile-ranks", {v}}};
      int64_t rank = 0;
      ArgReader{one}.get("profile-ranks", rank);
      l.profile_ranks.push_back(rank);
    }
  }
  if (l.profile && !(l.profile_step_start >= 0 && l.profile_step_end > l.profile_step_start))
    fail("profile-step-end ({}) must be after profile-step-start ({})", l.profile_step_end,
         l.profile_step_start);
  for (const char* key : {"profile-step-start", "profile-step-end", "profile-ranks"})
    if (r.has(key) && !l.profile) a.no_effect.push_back(std::string("--") + key + ": no --profile");
}

}  // namespace

std::vector<OptionSpec> training_megatron_rules();

ArgGroup training_flags() {
  ArgGroup g{"training", "training: batch, iterations, evaluation, run", {}, parse_training};
  g.flags = {
      implemented("help", "0", "print the flags, grouped by domain"),
      flag("micro-batch-size", "samples per micro-batch"),
      flag("global-batch-size", "samples per iteration"),
      flag("train-iters", "iterations to train"),
      flag("train-samples",
           "samples to train (instead of train-iters; the lengths of the "
           "schedules are then samples)"),
      implemented("rampup-batch-size", "3",
                  "start increment samples: the global batch grows "
                  "from start by increment over samples samples "
                  "(Megatron's deprecated ramp; needs train-samples)"),
      flag("step-batch-size-schedule",
           "\"THRESHOLD:BS ...\", thresholds in tokens with "
           "K/M/B/T suffixes: the global batch size from each "
           "threshold on (needs train-samples)"),
      flag("eval-interval", "evaluate every this many iterations"),
      flag("eval-iters", "validation iterations per evaluation"),
      flag("exit-interval", "exit (after saving) when the iteration is a multiple of this"),
      flag("exit-duration-in-mins", "save and exit 0 once the run has trained this many "
                                    "minutes (checked every iteration on every rank)"),
      toggle("exit-signal-handler", "on --exit-signal (SIGTERM): finish the step, save, exit 0 "
                                    "(Slurm preemption)"),
      flag("exit-signal", "the signal number --exit-signal-handler catches (default 15, "
                          "SIGTERM)"),
      toggle("profile", "cudaProfilerStart / Stop around iterations profile-step-start to "
                        "profile-step-end (nsys --capture-range=cudaProfilerApi)"),
      flag("profile-step-start", "the iteration the profiled range starts at (default 10)"),
      flag("profile-step-end", "the iteration the profiled range ends at (default 12)"),
      values("profile-ranks", "the global ranks that profile (default 0)"),
      flag("seed", "random seed"),
      toggle("calculate-per-token-loss",
             "the gradient of the step's summed per-token losses over its loss tokens on all "
             "micro-batches and data-parallel ranks, not the mean of micro-batch means "
             "(Megatron's per-token loss; the logged lm loss is the same)"),
      toggle("deterministic-mode",
             "bitwise-reproducible GPU runs (deterministic embedding and "
             "attention backward; NCCL_ALGO Ring unless set), slower"),
      flag("cuda-graph-impl",
           "none (default) or full_iteration: capture the whole training step "
           "once and replay it (local and transformer_engine are refused)"),
      flag("cuda-graph-warmup-steps", "steps run without a graph before the capture (default 3)"),
      values("cuda-graph-modules",
             "per-layer capture regions of --cuda-graph-impl local "
             "(refused; must be empty with full_iteration)"),
      values("cuda-graph-scope",
             "deprecated name of cuda-graph-modules ('full_iteration' "
             "selects --cuda-graph-impl full_iteration, as in Megatron)"),
      toggle("optimizer-cuda-graph",
             "with --cuda-graph-impl full_iteration: no effect (the "
             "step's graph holds the optimizer); refused otherwise"),
      own(flag("device", "cpu or cuda (default: cuda when a GPU is visible)")),
      own(toggle("dry-run",
                 "print the memory plan of the busiest rank (weights, grads, "
                 "optimizer state, activations, total) and exit 0; builds nothing. "
                 "Plans for the launcher's ranks, else WORLD_SIZE, else 1")),
  };
  for (OptionSpec& s : training_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
