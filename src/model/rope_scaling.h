// RoPE frequency scaling: YaRN (Peng et al. 2023, "YaRN: Efficient Context Window
// Extension of Large Language Models"), as Megatron-LM's YarnRotaryEmbedding
// (megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py) and Hugging Face's
// _compute_yarn_parameters (transformers modeling_rope_utils.py) compute it, and the
// softmax scale DeepSeek-V3's multi-latent attention derives from it.
// docs/research/deepseek-v3.md section 2 gives the sources and worked numbers.
#pragma once
#include <cstdint>
#include <vector>

namespace megaton {

// --rope-type yarn's parameters (Megatron's MLATransformerConfig fields; HF's
// rope_scaling dict).
struct YarnConfig {
  double factor = 1.0;                          // --rotary-scaling-factor
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 1.0, mscale_all_dim = 0.0;    // Megatron's defaults since 62f0a9737d
};

// get_mscale(s, m) = 1 for s <= 1, else 0.1 * m * ln(s) + 1 (YaRN's attention temperature).
double yarn_get_mscale(double factor, double mscale = 1.0);

// The rotary dimension index (of `dim` / 2 frequency pairs) whose wavelength makes
// `num_rotations` turns over the original context: dim * ln(L0 / (2 pi r)) / (2 ln base).
double yarn_correction_dim(double num_rotations, int64_t dim, double base,
                           int64_t original_max_position_embeddings);

// [low, high] of the ramp: floor of the correction dim of beta_fast (at least 0) and ceil
// of that of beta_slow (at most dim - 1), as both implementations round by default.
std::pair<int64_t, int64_t> yarn_correction_range(int64_t dim, double base, const YarnConfig& c);

// The dim / 2 inverse frequencies: inv_freq[i] = extra[i] * (1 - ramp[i]) + extra[i] / factor
// * ramp[i], with extra[i] = base^(-2i / dim) and ramp[i] = clamp((i - low) / (high - low),
// 0, 1) (high + 0.001 when equal). factor 1 gives plain RoPE. InternalError for an odd or
// non-positive dim, base <= 1 or factor <= 0.
std::vector<double> yarn_inv_freq(int64_t dim, double base, const YarnConfig& c);

// The factor YaRN multiplies cos and sin by: get_mscale(factor, mscale) /
// get_mscale(factor, mscale_all_dim) when both are non-zero, else get_mscale(factor)
// (Hugging Face's rule, the parity target; Megatron differs only for mscale_all_dim = 0
// with mscale != 1, or mscale = 0).
double yarn_cos_sin_scale(const YarnConfig& c);

// The attention's softmax scale with YaRN: get_mscale(factor, mscale_all_dim)^2 /
// sqrt(head_dim) (Hugging Face DeepseekV3Attention; Megatron's MLA since the fix of
// Megatron-LM issue #1429, which had used mscale). head_dim: q's head dim (qk + rope).
double yarn_softmax_scale(const YarnConfig& c, int64_t head_dim);

}  // namespace megaton
