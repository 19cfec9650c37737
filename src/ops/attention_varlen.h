// Causal attention over packed sequences (THD layout, "variable length"): Megatron's
// --reset-attention-mask, where the documents packed into one sample do not attend to each
// other (Megatron-LM PackedSeqParams with qkv_format "thd"; docs/research/deepseek-v3.md 4).
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace megaton::ops {

// T tokens (a micro-batch's B * S rows, flattened) hold N sequences one after another:
// sequence n is rows [cu_seqlens[n], cu_seqlens[n + 1]). Token t of sequence n attends to
// the tokens of sequence n at or before it, and to nothing else: with one sequence this is
// ops::attention_forward with B = 1, S = T; with N sequences it is that op run on each
// sequence separately (for dropout_p = 0; see dropout below).
//
//   q    [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv]: Hq % Hkv == 0, query head h reads
//        kv head h / (Hq / Hkv) (GQA); Dv may differ from Dqk (MLA: 192 and 128).
//   out  [T, Hq, Dv], overwritten: softmax(q k^T * softmax_scale, causal within the
//        sequence) (dropped out) v. softmax_scale <= 0: 1 / sqrt(Dqk).
//   lse  [T, Hq] F32, overwritten: lse[t, h] = log-sum-exp (natural log) of the scaled scores
//        of query t, head h over the keys it sees (before dropout); saved for backward.
//        Token-major, as the rows of q (cuDNN's ragged Stats layout), unlike the dense op's
//        [B, Hq, S].
//   cu_seqlens [N + 1] I32 on q's device: 0 = c0 <= c1 <= ... <= cN = T. Empty sequences
//        (equal neighbours) are allowed, so a fixed-size cu_seqlens padded with repeats of T
//        serves every micro-batch (what a captured CUDA graph needs: N is frozen in it).
//   max_seqlen >= the longest sequence (>= 1). It bounds the work and the GPU's padded
//        problem size; the GPU cannot check it without a host synchronization.
//
// Dropout with probability dropout_p on the probabilities, keyed by (seed, stream). CPU: the
// mask of ops::attention_forward with B = 1, S = T: probability (h, t, u) of query token t
// and key token u (row indices into the T tokens) is kept when
// Philox(seed).uniform(stream, (h * T + t) * T + u) >= dropout_p, scaled by 1 / (1 - p).
// GPU: cuDNN's own Philox mask (ops/cuda/attention.cpp's file comment): same distribution,
// other bits; forward and backward on the GPU regenerate the same mask. Mixing a CPU forward
// with a GPU backward under dropout is not supported.
//
// Dtypes: CPU: q, k, v, out F32. GPU: q, k, v, out one of BF16 or F16 (cuDNN's fused
// attention), Dqk and Dv multiples of 8 and at most 256 (cuDNN on Hopper), pointers 16-byte
// aligned.
// InternalError on a dtype, device or shape mismatch, N < 1, max_seqlen < 1 when T > 0,
// dropout_p outside [0, 1), and on the CPU on cu_seqlens not as above (c0 != 0, a decrease,
// cN != T, a sequence longer than max_seqlen). The GPU checks cu_seqlens' shape, dtype and
// device only: its values are read on the device, clamped so that no access leaves the T
// rows, and wrong values give wrong results, not an error.
void attention_varlen_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                              Tensor& lse, const Tensor& cu_seqlens, int64_t max_seqlen,
                              float dropout_p = 0.0f, uint64_t seed = 0, uint64_t stream = 0,
                              float softmax_scale = 0.0f);

// The gradients of attention_varlen_forward: from dout [T, Hq, Dv] (same dtype as q) and the
// forward's out and lse (unchanged since), writes dq [T, Hq, Dqk], dk [T, Hkv, Dqk],
// dv [T, Hkv, Dv] (overwritten, every row; with GQA dk, dv sum their query group).
// cu_seqlens, max_seqlen, dropout_p, seed, stream and softmax_scale: the forward's.
// Errors as the forward. GPU: not bitwise reproducible (cuDNN accumulates dq with atomics)
// unless ops::deterministic(), as ops::attention_backward.
void attention_varlen_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse,
                               const Tensor& cu_seqlens, int64_t max_seqlen, Tensor& dq, Tensor& dk,
                               Tensor& dv, float dropout_p = 0.0f, uint64_t seed = 0,
                               uint64_t stream = 0, float softmax_scale = 0.0f);

}  // namespace megaton::ops
