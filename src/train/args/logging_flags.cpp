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
  };
  for (OptionSpec& s : logging_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
