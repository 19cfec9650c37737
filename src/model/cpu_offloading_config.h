// CpuOffloadingConfig: activation offloading to host memory (Megatron's cpu_offloading
// fields), read by GPTConfig and GPTModel. docs/memory.md, "Activation offloading".
#pragma once
#include <cstdint>

namespace megaton {

// Megatron's ModelParallelConfig.cpu_offloading and cpu_offloading_num_layers (CLI:
// --cpu-offloading-num-layers N, which turns cpu_offloading on when N > 0; Megaton also
// takes --cpu-offloading). Megatron's cpu_offloading_activations (true) and
// cpu_offloading_weights (false) are what Megaton does: activations only. Checked by the
// argument parser (train/arguments.cpp) as Megatron's TransformerConfig.__post_init__
// checks them: 0 <= num_layers < num_layers of the model, no pipeline parallelism, no
// activation recomputation.
struct CpuOffloadingConfig {
  bool enabled = false;    // cpu_offloading
  int64_t num_layers = 0;  // cpu_offloading_num_layers: the model chunk's first N layers

  // Whether the training forward offloads layer `index` (0-based within the model chunk).
  bool offloads(int64_t index) const { return enabled && index >= 0 && index < num_layers; }
};

}  // namespace megaton
