// Megatron-LM's logging flags that Megaton accepts without effect or refuses, each with
// its reason or the feature it names (issue 19: one rule for every Megatron flag;
// docs/megatron-flags.md lists them all). The implemented ones are in logging_flags.cpp.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> logging_megatron_rules() {
  return {
      unsupported("config-logger-dir", "1", "module config dumps (config logger)"),
      unsupported("save-params-interval", "1",
                  "periodic dumps of parameters, activations and gradients"),
      unsupported("save-activations-interval", "1",
                  "periodic dumps of parameters, activations and gradients"),
      unsupported("save-tokens-per-expert-interval", "1",
                  "periodic dumps of parameters, activations and gradients"),
      unsupported("save-wgrads-interval", "1",
                  "periodic dumps of parameters, activations and gradients"),
      unsupported("save-dgrads-interval", "1",
                  "periodic dumps of parameters, activations and gradients"),
      no_effect("timing-log-option", "1",
                "only shapes Megatron's per-operation timer report, which Megaton does not print"),
      unsupported("log-max-attention-logit", "0", "max attention logit logging"),
      no_effect("no-barrier-with-level-1-timing", "0",
                "only tunes Megatron's level-1 timers, which Megaton does not have"),
      no_effect("wandb-project", "1",
                "W&B needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect("wandb-exp-name", "1",
                "W&B needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect("wandb-save-dir", "1",
                "W&B needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect("wandb-entity", "1",
                "W&B needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect("logging-level", "1", "Python logging level; Megaton's log lines are fixed"),
      unsupported("moe-routing-trace-path", "1", "MoE routing traces"),
      unsupported("moe-routing-trace-max-training-iters", "1", "MoE routing traces"),
      unsupported("moe-routing-trace-capture-logits", "0", "MoE routing traces"),
      unsupported("moe-routing-trace-capture-hidden-states", "0", "MoE routing traces"),
      unsupported("moe-routing-trace-dump-weights", "0", "MoE routing traces"),
      no_effect(
          "otel-enabled", "0",
          "OpenTelemetry needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect(
          "otel-service-name", "1",
          "OpenTelemetry needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect(
          "otel-span-groups", "1",
          "OpenTelemetry needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      unsupported("log-straggler", "0", "straggler detection"),
      unsupported("straggler-ctrlr-port", "1", "straggler detection"),
      unsupported("straggler-minmax-count", "1", "straggler detection"),
      no_effect("disable-straggler-on-startup", "0",
                "only tunes straggler detection, which Megaton does not have"),
      unsupported("run-workload-inspector-server", "0", "workload inspector server"),
      no_effect(
          "no-one-logger", "0",
          "one-logger needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect(
          "one-logger-project", "1",
          "one-logger needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect(
          "one-logger-run-name", "1",
          "one-logger needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect(
          "one-logger-async", "0",
          "one-logger needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect(
          "app-tag-run-name", "1",
          "one-logger needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
      no_effect(
          "app-tag-run-version", "1",
          "one-logger needs a network; metrics go to --tensorboard-dir and --log-metrics-file"),
  };
}

}  // namespace megaton
