// Megatron-LM's optimizer flags that Megaton accepts without effect or refuses, each with
// its reason or the feature it names (issue 19: one rule for every Megatron flag;
// docs/megatron-flags.md lists them all). The implemented ones are in optimizer_flags.cpp.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> optimizer_megatron_rules() {
  return {
      unsupported("qk-clip", "0", "QK-clip of the query and key weights"),
      unsupported("qk-clip-alpha", "1", "QK-clip of the query and key weights"),
      unsupported("qk-clip-threshold", "1", "QK-clip of the query and key weights"),
      unsupported("apply-wd-to-qk-layernorm", "0", "weight decay on the QK layernorm weights"),
      unsupported("muon-use-syrk", "0",
                  "Muon's SYRK Newton-Schulz kernels (Megatron raises on it too with the "
                  "Emerging-Optimizers 0.3.0 it pins: it needs 0.4.0)"),
      unsupported("no-weight-decay-cond-type", "1", "weight decay on the QK layernorm weights"),
      unsupported("dump-param-to-param-group-map", "1", "parameter-group map files"),
      no_effect("override-opt_param-scheduler", "0",
                "Megaton always takes the schedule from the flags, not the checkpoint"),
      no_effect("override-opt-param-scheduler", "0",
                "Megaton always takes the schedule from the flags, not the checkpoint"),
      unsupported("use-checkpoint-opt_param-scheduler", "0",
                  "learning-rate schedule taken from the checkpoint"),
      unsupported("use-checkpoint-opt-param-scheduler", "0",
                  "learning-rate schedule taken from the checkpoint"),
      unsupported("warmup", "1",
                  "the removed --warmup (Megatron refuses it too: use --lr-warmup-fraction)"),
      unsupported("decoupled-lr", "1",
                  "a separate learning rate for the embedding and output layer"),
      unsupported("decoupled-min-lr", "1",
                  "a separate learning rate for the embedding and output layer"),
      unsupported("freeze-all-layers", "0", "frozen layers"),
      no_effect("no-use-layer-wise-param-layout", "0",
                "Megaton has only the layout path (the layer-wise parameter layout)"),
  };
}

}  // namespace megaton
