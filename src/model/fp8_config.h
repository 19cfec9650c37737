// Fp8Config: the FP8 training flags (Megatron's --fp8-*), read by GPTConfig and the layers.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace megaton {

// Megatron's --fp8-recipe.
enum class Fp8Recipe {
  Delayed,     // "delayed" (Megatron's default): the scale comes from an amax history
  Tensorwise,  // "tensorwise": per-tensor current scaling (the amax of this very tensor)
  Blockwise,   // "blockwise": 1x128 blocks for activations and gradients, 128x128 for
               // weights, each with its own power-of-two scale (DeepSeek-V3)
};
const char* fp8_recipe_name(Fp8Recipe recipe);

// The FP8 flags, Megatron's names and defaults (arguments.py _add_training_args and
// TransformerConfig). enabled is --fp8-format given; everything else is read only then.
struct Fp8Config {
  bool enabled = false;
  bool hybrid = false;                    // --fp8-format hybrid: e4m3 forward, e5m2 gradients
  Fp8Recipe recipe = Fp8Recipe::Delayed;  // --fp8-recipe
  int64_t margin = 0;                     // --fp8-margin: delayed scales divided by 2^margin
  int64_t amax_history_len = 1;           // --fp8-amax-history-len (delayed)
  bool amax_compute_max = false;          // --fp8-amax-compute-algo max (else most_recent)
  bool wgrad = true;                      // --no-fp8-wgrad: weight gradients in bf16
  // --first-last-layers-bf16: the first num_layers_at_start_in_bf16 and the last
  // num_layers_at_end_in_bf16 transformer layers keep bf16 GEMMs.
  bool first_last_layers_bf16 = false;
  int64_t num_layers_at_start_in_bf16 = 1;
  int64_t num_layers_at_end_in_bf16 = 1;
  // --fp8-param-gather (distributed optimizer, per-tensor recipes): the FP8 layers'
  // weights are kept and all-gathered in FP8 (Param::fp8_param), quantized once per step
  // after the update instead of from a bf16 copy at each use.
  bool param_gather = false;

  DType forward_dtype() const { return DType::F8E4M3; }
  DType gradient_dtype() const { return hybrid ? DType::F8E5M2 : DType::F8E4M3; }
  // Whether transformer layer `layer` (0-based, of `num_layers`) runs its GEMMs in FP8.
  bool layer_in_fp8(int64_t layer, int64_t num_layers) const;
  // Every dimension an FP8 GEMM of this recipe sees must be a multiple of this: 16
  // (cuBLASLt FP8), 128 for blockwise (its blocks along K).
  int64_t dimension_multiple() const { return recipe == Fp8Recipe::Blockwise ? 128 : 16; }
};

}  // namespace megaton
