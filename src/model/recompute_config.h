// RecomputeConfig: activation recomputation (Megatron's --recompute-* flags), read by
// GPTConfig and the layers. docs/memory.md describes what each choice keeps.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

namespace megaton {

// Megatron's --recompute-granularity.
enum class RecomputeGranularity {
  None,       // every activation a backward needs is kept (Megatron's default)
  Full,       // whole transformer layers: only their inputs are kept (recompute_method)
  Selective,  // the submodules of recompute_modules
};
// Megatron's --recompute-method (full granularity only).
enum class RecomputeMethod {
  None,
  Uniform,  // the chunk's layers in groups of recompute_num_layers, each group's input kept
  Block,    // the first recompute_num_layers layers of each model chunk, one by one
};

// Megatron's --recompute-modules names, as bits of RecomputeConfig::modules.
enum RecomputeModule : uint32_t {
  kRecomputeCoreAttn = 1u << 0,       // "core_attn": the attention output and log-sum-exp
  kRecomputeMoeAct = 1u << 1,         // "moe_act": the experts' activation function
  kRecomputeLayernorm = 1u << 2,      // "layernorm": input_layernorm / pre_mlp_layernorm outputs
  kRecomputeMlp = 1u << 3,            // "mlp": the dense MLP (fc1's output)
  kRecomputeMoe = 1u << 4,            // "moe": the whole MoE layer but its routing
  kRecomputeSharedExperts = 1u << 5,  // "shared_experts": the shared expert MLP (fc1's output)
  kRecomputeMlaUpProj = 1u << 6,      // "mla_up_proj": refused until MLA exists
};
// The module bit of a Megatron name; 0 for a name Megatron does not have.
uint32_t recompute_module_bit(const std::string& name);
// The names of the bits set in `modules`, comma-separated, in the enum's order.
std::string recompute_module_names(uint32_t modules);

// The flags, Megatron's names and defaults (TransformerConfig's recompute_* fields).
// Validated by the argument parser (train/arguments.cpp), which refuses what Megatron's
// TransformerConfig.__post_init__ refuses.
struct RecomputeConfig {
  RecomputeGranularity granularity = RecomputeGranularity::None;
  RecomputeMethod method = RecomputeMethod::None;
  int64_t num_layers = 0;  // --recompute-num-layers (full granularity; 0: not given)
  // --recompute-modules (selective granularity; Megatron's default: core_attn).
  uint32_t modules = kRecomputeCoreAttn;

  // Whether the selective module `bit` is recomputed.
  bool selective(uint32_t bit) const {
    return granularity == RecomputeGranularity::Selective && (modules & bit) != 0;
  }
  // Full granularity: whether layer `index` (0-based within a model chunk of
  // `chunk_layers` layers) is recomputed, and the first layer of the group whose input is
  // kept for it (uniform: groups of num_layers from the chunk's first layer, the last one
  // possibly shorter; block: the layer itself). -1 when the layer is not recomputed.
  // Megatron's transformer_block / recompute.py checkpointed_forward.
  int64_t full_group_start(int64_t index, int64_t chunk_layers) const {
    if (granularity != RecomputeGranularity::Full || index < 0 || index >= chunk_layers)
      return -1;
    if (method == RecomputeMethod::Uniform) return index - index % num_layers;
    return index < num_layers ? index : -1;  // block
  }
  // Full granularity: one past the last layer of the group that layer `index` belongs to
  // (full_group_start(index) >= 0).
  int64_t full_group_end(int64_t index, int64_t chunk_layers) const {
    const int64_t start = full_group_start(index, chunk_layers);
    if (start < 0) return -1;
    if (method == RecomputeMethod::Uniform) return std::min(start + num_layers, chunk_layers);
    return start + 1;
  }
};

}  // namespace megaton
