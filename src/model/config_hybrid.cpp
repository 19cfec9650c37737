// GPTConfig's checks of hybrid models: the layer pattern and the Mamba-2 mixer's sizes
// (Megatron's arguments.py hybrid-pattern handling and MambaMixer.__init__'s asserts).
#include <utility>

#include "core/error.h"
#include "model/config.h"

namespace megaton {

void GPTConfig::finalize_hybrid() {
  if (!is_hybrid()) {
    hybrid_layers.clear();
    hybrid_segment_layers.clear();
    return;
  }
  const HybridPattern parsed = parse_hybrid_pattern(hybrid_layer_pattern);
  hybrid_layers = parsed.layers;
  hybrid_segment_layers = parsed.segment_layers;
  const int64_t n = int64_t(hybrid_layers.size());
  // Megatron derives num_layers from the pattern and warns when they differ; a
  // disagreement is more likely a mistake, so Megaton refuses it.
  if (num_layers == 0) num_layers = n;
  if (num_layers != n)
    fail("hybrid-layer-pattern '{}' has {} layers but num-layers is {}", hybrid_layer_pattern, n,
         num_layers);
  if (has_hybrid_symbol(kHybridMoe) && num_experts == 0)
    fail("hybrid-layer-pattern '{}' has E (MoE) layers but num-experts is not set",
         hybrid_layer_pattern);
  // Megatron infers MLA from '+' (and refuses * with it, parse_hybrid_pattern).
  if (has_hybrid_symbol(kHybridMla)) multi_latent_attention = true;
  if (multi_latent_attention && has_hybrid_symbol(kHybridAttention))
    fail(
        "hybrid-layer-pattern '{}' has * (attention) layers, which multi-latent-attention "
        "replaces; write them as +",
        hybrid_layer_pattern);
  if (mtp_num_layers > 0)
    fail("mtp-num-layers with hybrid-layer-pattern is not supported in Megaton yet");
  if (!has_hybrid_symbol(kHybridMamba)) return;
  for (auto [key, value] : {std::pair{"mamba-state-dim", mamba_state_dim},
                            {"mamba-head-dim", mamba_head_dim},
                            {"mamba-num-groups", mamba_num_groups}})
    if (value <= 0) fail("{} must be positive (got {})", key, value);
  if (mamba_num_heads < 0) fail("mamba-num-heads must be positive (got {})", mamba_num_heads);
  if (mamba_num_heads == 0) {
    if ((2 * hidden_size) % mamba_head_dim != 0)
      fail("2 x hidden-size ({}) is not divisible by mamba-head-dim ({}); set mamba-num-heads",
           2 * hidden_size, mamba_head_dim);
    mamba_num_heads = 2 * hidden_size / mamba_head_dim;
  }
  if (mamba_num_heads % mamba_num_groups != 0)
    fail("mamba-num-heads ({}) is not divisible by mamba-num-groups ({})", mamba_num_heads,
         mamba_num_groups);
  const int64_t tp = tensor_model_parallel_size;
  if (mamba_num_heads % tp != 0 || mamba_num_groups % tp != 0)
    fail(
        "mamba-num-heads ({}) and mamba-num-groups ({}) must be divisible by "
        "tensor-model-parallel-size ({})",
        mamba_num_heads, mamba_num_groups, tp);
  if (mamba_conv_kernel < 1 || mamba_chunk_size < 1)
    fail("the Mamba convolution ({} taps) and SSD chunk ({} tokens) must be positive",
         mamba_conv_kernel, mamba_chunk_size);
}

}  // namespace megaton
