// The data movement of multi-latent attention (DeepSeek-V2/V3; Megatron-LM's
// MLASelfAttention in megatron/core/transformer/multi_latent_attention.py): column blocks
// of row-major activations split and joined, and the assembly of the attention's query,
// key and value from the up projections with the decoupled, interleaved RoPE
// (docs/research/deepseek-v3.md 1.3-1.4; model/mla.h uses them).
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace megaton::ops {

// x [R, C] -> parts[i] [R, C_i] with sum C_i = C: columns [c_0 + ... + c_{i-1}, + C_i) of
// every row, in order. parts are allocated by the caller, one dtype with x (CPU: F32; GPU:
// F32, BF16, F16). InternalError on a shape, dtype or device mismatch.
void split_columns(const Tensor& x, std::vector<Tensor>& parts);
// The inverse: y [R, sum C_i] from parts[i] [R, C_i] side by side.
void concat_columns(const std::vector<Tensor>& parts, Tensor& y);

// MLA's query, key and value for the core attention (one micro-batch, this rank's heads):
//   q     [B, S, n, qk + rope]  linear_q_up_proj's (or linear_q_proj's) output, per head
//                               [q_nope | q_pe]
//   kv    [B, S, n, qk + v]     linear_kv_up_proj's output, per head [k_nope | value]
//   k_pe  [B, S, rope]          the last `rope` columns of linear_kv_down_proj's output,
//                               all S positions (one key RoPE part shared by every head)
// ->
//   query [B, S, n, qk + rope] = [q_nope | rope(q_pe)]
//   key   [B, S, n, qk + rope] = [k_nope | rope(k_pe)]   (the same rope(k_pe) for each head)
//   value [B, S, n, v]
// where qk = qk_head_dim, rope = k_pe.dim(2) and v = kv.dim(3) - qk; rope(x) is
// ops::rope_interleaved_forward's rotation of the interleaved pairs by position
// p + position_offset with frequencies inv_freq (rope / 2 of them) and cos/sin scale
// rope_scale (YaRN's mscale factor, model/rope_scaling.h), left de-interleaved; p is the
// row's position s within its sequence, or with position_ids (optional; packed sequences,
// Megatron's --reset-position-ids: I32 [B*S] on q's device, >= 0) position_ids[b * S + s].
// One float dtype for every tensor (CPU F32; GPU F32, BF16, F16), all contiguous; outputs
// must not alias inputs. InternalError on a shape, dtype or device mismatch (position_ids
// included), a negative position_offset, or (CPU) a negative position id; the GPU does not
// read the ids on the host (a negative one gives a wrong rotation, never a bad access).
void mla_qkv_rope(const Tensor& q, const Tensor& kv, const Tensor& k_pe, int64_t qk_head_dim,
                  const std::vector<float>& inv_freq, float rope_scale, Tensor& query, Tensor& key,
                  Tensor& value, int64_t position_offset = 0,
                  const Tensor& position_ids = Tensor());
// Its transpose: dquery, dkey [B, S, n, qk + rope], dvalue [B, S, n, v] -> dq [B, S, n,
// qk + rope], dkv [B, S, n, qk + v] (overwritten) and dk_pe [B, S, rope], overwritten with
// the sum over the n heads of each head's inverse-rotated key gradient (accumulated in
// fp32, rounded once). Positions (position_offset, position_ids) and errors: the forward's.
void mla_qkv_rope_backward(const Tensor& dquery, const Tensor& dkey, const Tensor& dvalue,
                           int64_t qk_head_dim, const std::vector<float>& inv_freq,
                           float rope_scale, Tensor& dq, Tensor& dkv, Tensor& dk_pe,
                           int64_t position_offset = 0, const Tensor& position_ids = Tensor());

}  // namespace megaton::ops
