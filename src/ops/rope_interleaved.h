// Multi-latent attention's rotary embedding: interleaved pairs, given frequencies and a
// cos/sin scale (YaRN), as Megatron-LM's _apply_rotary_pos_emb_bshd with
// mla_rotary_interleaved (megatron/core/models/common/embeddings/rope_utils.py) and Hugging
// Face's DeepseekV3 apply_rotary_pos_emb_interleave compute it
// (docs/research/deepseek-v3.md 6.3).
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace megaton::ops {

// For each row of D values (D even) at sequence position s, pair j = (x[2j], x[2j+1]) is
// rotated by angle = float(s + position_offset) * inv_freq[j] (one fp32 multiply; cos and
// sin of that fp32 angle evaluated in double, as ops::rope_forward) and the result is left
// de-interleaved, scaled by `scale`:
//   y[j]         = scale * (x[2j] cos - x[2j+1] sin)
//   y[j + D / 2] = scale * (x[2j+1] cos + x[2j] sin)
// x, y [B, S, heads, D] of one float dtype (CPU: F32; GPU: F32, BF16, F16), y must not
// alias x (the pairs move). inv_freq: D / 2 frequencies (model/rope_scaling.h yarn_inv_freq,
// rounded to fp32), at most 256. InternalError on a shape, dtype, device or size mismatch.
void rope_interleaved_forward(const Tensor& x, Tensor& y, const std::vector<float>& inv_freq,
                              float scale, int64_t position_offset = 0);
// The transpose: dx[2j] = scale * (dy[j] cos + dy[j + D/2] sin),
// dx[2j+1] = scale * (dy[j + D/2] cos - dy[j] sin). dx must not alias dy.
void rope_interleaved_backward(const Tensor& dy, Tensor& dx, const std::vector<float>& inv_freq,
                               float scale, int64_t position_offset = 0);

}  // namespace megaton::ops
