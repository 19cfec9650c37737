// Megatron-LM's memory (recomputation, offloading) flags that Megaton accepts without effect or
// refuses, each with its reason or the feature it names (issue 19: one rule for every Megatron
// flag; docs/megatron-flags.md lists them all). The implemented ones are in memory_flags.cpp.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> memory_megatron_rules() {
  return {
      no_effect("cpu-offloading-retain-pinned-cpu-buffers", "0",
                "Megaton always keeps the pinned host buffers for the next step"),
      no_effect("use-torch-optimizer-for-cpu-offload", "0",
                "the host update is always Megaton's own AdamW"),
      no_effect("overlap-cpu-optimizer-d2h-h2d", "0",
                "the offloaded copies always overlap the device step"),
      no_effect("no-pin-cpu-grads", "0", "the host buffers are always pinned in Megaton"),
      no_effect("no-pin-cpu-params", "0", "the host buffers are always pinned in Megaton"),
      no_effect("distrib-optim-fully-reshardable-mem-efficient", "0",
                "torch_dist checkpoint option; Megaton writes its own safetensors checkpoints"),
  };
}

}  // namespace megaton
