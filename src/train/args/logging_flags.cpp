// Logging flags: the log line's interval and extra fields, the metrics file (Megatron's
// "logging" group).
#include "core/error.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

void parse_logging(const ArgReader& r, TrainArgs& a) {
  r.get("log-interval", a.log_interval);
  r.get("log-metrics-file", a.log_metrics_file);
  r.get("log-params-norm", a.log_params_norm);
  r.get("log-num-zeros-in-grad", a.log_num_zeros_in_grad);
  LoggingFlags& l = a.logging;
  r.get("tensorboard-dir", l.tensorboard_dir);
  r.get("tensorboard-log-interval", l.tensorboard_log_interval);
  r.get("tensorboard-queue-size", l.tensorboard_queue_size);
  r.get("log-timers-to-tensorboard", l.log_timers_to_tensorboard);
  r.get("log-validation-ppl-to-tensorboard", l.log_validation_ppl_to_tensorboard);
  r.get("log-memory-to-tensorboard", l.log_memory_to_tensorboard);
  r.get("log-world-size-to-tensorboard", l.log_world_size_to_tensorboard);
  l.log_loss_scale_to_tensorboard = !r.on("no-log-loss-scale-to-tensorboard") &&
                                    !r.on("disable-log-loss-scale-to-tensorboard");
  r.get("log-throughput", l.log_throughput);
  r.get("log-memory-interval", l.log_memory_interval);
  r.get("log-device-memory-used", l.log_device_memory_used);
  r.get("log-energy", l.log_energy);
  r.get("log-progress", l.log_progress);
  for (const char* key : {"tensorboard-log-interval", "tensorboard-queue-size", "log-memory-interval"}) {
    int64_t v = 0;
    r.get(key, v);
    if (r.has(key) && v <= 0) fail("{} must be positive (got {})", key, v);
  }
  // Megatron's logging flags that only shape TensorBoard's scalars need a TensorBoard.
  for (const char* key : {"tensorboard-log-interval", "tensorboard-queue-size",
                          "log-timers-to-tensorboard", "log-validation-ppl-to-tensorboard",
                          "log-memory-to-tensorboard", "log-world-size-to-tensorboard"})
    if (r.has(key) && l.tensorboard_dir.empty() && !(find_option_spec(key)->is_switch && !r.on(key)))
      a.no_effect.push_back(std::string("--") + key + ": no --tensorboard-dir");
  if (l.log_progress && a.save.empty())
    a.no_effect.push_back("--log-progress: progress.txt is written in the --save directory");
  int64_t timing = 0;
  r.get("timing-log-level", timing);
  if (timing != 0)
    fail(
        "timing-log-level {} is not supported in Megaton: the log line has the iteration "
        "time only (Megatron's level 0)",
        timing);
}

}  // namespace

std::vector<OptionSpec> logging_megatron_rules();

ArgGroup logging_flags() {
  ArgGroup g{"logging", "logging", {}, parse_logging};
  g.flags = {
      flag("log-interval", "log every this many iterations"),
      own(flag("log-metrics-file",
               "append one JSON line per iteration (iteration, lm_loss, "
               "grad_norm, load_balancing_loss, lr) in full precision to "
               "this file")),
      toggle("log-params-norm", "log the L2 norm of the parameters"),
      toggle("log-num-zeros-in-grad", "log the number of zero gradient elements"),
      flag("timing-log-level",
           "0 only: the iteration time (per-operation timers are not "
           "supported)"),
      flag("tensorboard-dir", "write TensorBoard event files here, with Megatron's scalar names"),
      flag("tensorboard-log-interval", "TensorBoard scalars every this many iterations (default 1)"),
      flag("tensorboard-queue-size", "TensorBoard events held before a flush (default 1000)"),
      toggle("log-timers-to-tensorboard", "iteration time (and with log-throughput the "
                                          "throughput) to TensorBoard"),
      toggle("log-validation-ppl-to-tensorboard", "validation perplexity to TensorBoard"),
      toggle("log-memory-to-tensorboard", "memory scalars to TensorBoard"),
      toggle("log-world-size-to-tensorboard", "world size to TensorBoard"),
      toggle("no-log-loss-scale-to-tensorboard", "no loss-scale scalar in TensorBoard"),
      toggle("disable-log-loss-scale-to-tensorboard", "Megatron's other spelling of "
                                                      "--no-log-loss-scale-to-tensorboard"),
      toggle("log-throughput", "the throughput scalar in TensorBoard (the log line always has "
                               "TFLOP/s per GPU)"),
      flag("log-memory-interval", "print a memory report every this many iterations"),
      toggle("log-device-memory-used", "add the device memory in use (all processes, as "
                                       "nvidia-smi counts) to the memory report"),
      toggle("log-energy", "GPU energy per iteration and average power per GPU (NVML)"),
      toggle("log-progress", "append start, checkpoints and throughput to <save>/progress.txt"),
  };
  for (OptionSpec& s : logging_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
