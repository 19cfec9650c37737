// Attention of one block of queries against one block of keys, with the log-sum-exp that
// lets partial results be merged: the building block of context parallelism
// (model/context_parallel.h), where a rank's queries meet the keys of other ranks' chunks
// (Transformer Engine's AttnFuncWithCPAndKVP2P / ...KVAllGather; docs/research/
// context-parallel.md section 2).
//
// One sample, token-major: q [Sq, Hq, Dqk], k [Skv, Hkv, Dqk], v [Skv, Hkv, Dv], out
// [Sq, Hq, Dv], lse [Sq, Hq] F32. Hq % Hkv == 0: query head h reads kv head h / (Hq / Hkv)
// (GQA). Scores s = q k^T * softmax_scale (<= 0: 1 / sqrt(Dqk)). Mask: with `causal`, query
// row i (at position q_offset + i) sees key row j (at position kv_offset + j) when
// kv_offset + j <= q_offset + i (the diagonal aligned by positions: TE's
// causal_bottom_right when q_offset - kv_offset = Skv - Sq); without it every key. No
// dropout.
//
// Devices. CPU: F32 throughout (the reference, ops/cpu/attention_block.cpp). GPU (cuDNN's
// fused attention, ops/cuda/attention_block.cpp): q, k, v, out BF16 or F16 alike, lse F32;
// the backward's dq, dk, dv may be F32 (accumulators) or q's dtype; the causal mask must be
// one cuDNN runs: every key visible, none, or the diagonal at the block's top-left (Sq =
// Skv, equal offsets) or bottom-right (q_offset - kv_offset = Skv - Sq > 0), else
// InternalError. attention_lse_merge on the GPU: out and out_b F32, BF16 or F16 (each its
// own), lse F32; arithmetic in fp32.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace megaton::ops {

// out, lse overwritten: lse[i, h] = log sum_j exp(s_ij) over the keys query i sees (natural
// log), out[i, h] = sum_j exp(s_ij - lse[i, h]) v_j. A query that sees no key gets
// lse = -inf and out = 0 (it adds nothing when merged).
// InternalError on a dtype, device or shape mismatch.
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t q_offset,
                             int64_t kv_offset, bool causal, Tensor& out, Tensor& lse,
                             float softmax_scale = 0.0f);

// The block's share of the gradients, ADDED to dq [Sq, Hq, Dqk], dk [Skv, Hkv, Dqk] and dv
// [Skv, Hkv, Dv]: given dout and the MERGED out and lse of the queries' whole attention
// (over every block of keys), p_ij = exp(s_ij - lse_i) is the block's true probability and
// D_i = dout_i . out_i the row's whole softmax correction, so summing this over the blocks
// gives the whole attention's gradients (FlashAttention-2's backward, Dao 2023, Alg. 2).
// The mask and offsets are the forward's. Errors as the forward.
void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, int64_t q_offset,
                              int64_t kv_offset, bool causal, Tensor& dq, Tensor& dk, Tensor& dv,
                              float softmax_scale = 0.0f);

// Many blocks in one call (packed documents under context parallelism: one block per
// document piece of a tile). Piece i: query rows [q_first, q_first + q_count) of q
// [Tq, Hq, D] against key rows [kv_first, kv_first + kv_count) of k [Tkv, Hkv, D], v
// [Tkv, Hkv, Dv]; with `causal` query i of the piece sees key rows j <= i + kv_count -
// q_count (the diagonal at the bottom right: the piece's keys end with its queries; needs
// kv_count >= q_count), else all of them. The pieces' query rows do not overlap; counts >= 1.
struct AttentionPiece {
  int64_t q_first, q_count, kv_first, kv_count;
};
// out [Tq, Hq, Dv] and lse [Tq, Hq] F32 (token-major) of the pieces' rows overwritten, as
// attention_block_forward gives them for each piece; other rows untouched. CPU: a loop of
// attention_block_forward. GPU: one cuDNN call with ragged (THD) tensors, per-piece lengths
// and the padding mask (graphs cached per bucket, as ops/attention_varlen.h's). Errors as
// attention_block_forward, and InternalError on pieces that do not fit.
void attention_pieces_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::vector<AttentionPiece>& pieces, bool causal, Tensor& out,
                              Tensor& lse, float softmax_scale = 0.0f);
// The pieces' gradients ADDED into dq, dk, dv (attention_block_backward for each piece; out
// and lse the queries' merged results).
void attention_pieces_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse,
                               const std::vector<AttentionPiece>& pieces, bool causal, Tensor& dq,
                               Tensor& dk, Tensor& dv, float softmax_scale = 0.0f);

// Merges a block's result into a running one, row by row (TE's flash_attn_fwd_out_correction
// with the lse update of cp.py): lse' = log(exp(lse) + exp(lse_b)), out' = out exp(lse -
// lse') + out_b exp(lse_b - lse'). out, out_b [S, H, Dv]; lse, lse_b [S, H] F32; a row with
// lse = -inf takes the other's values. out and lse updated in place.
void attention_lse_merge(Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b);

}  // namespace megaton::ops
