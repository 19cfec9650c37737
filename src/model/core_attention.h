// The core attention of SelfAttention and MLASelfAttention: causal within each sample, or
// within each packed document under --reset-attention-mask (Megatron's core_attention with
// an attention mask, or its THD path with PackedSeqParams).
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "model/packed_seq_params.h"

namespace megaton {

// The log-sum-exp's shape, F32: [B, Hq, S] (ops::attention_forward), or [B*S, Hq]
// (ops::attention_varlen_forward) when packed is non-null with cu_seqlens defined, and
// under context parallelism (cp_attention_forward, packed->has_context_parallel()).
Shape core_attention_lse_shape(const PackedSeqParams* packed, int64_t batch, int64_t seq,
                               int64_t heads);

// q [B, S, Hq, Dqk], k [B, S, Hkv, Dqk], v [B, S, Hkv, Dv] (contiguous) -> out [B, S, Hq, Dv]
// and lse (core_attention_lse_shape), both overwritten: ops::attention_forward, or with
// packed documents (packed non-null, cu_seqlens defined) ops::attention_varlen_forward on
// the same memory viewed as [B*S, heads, D] rows, with packed's cu_seqlens and max_seqlen,
// or under context parallelism (S: this rank's two chunks) cp_attention_forward across
// packed's CP group (collective; no dropout).
// dropout_p, seed, stream, softmax_scale (<= 0: 1 / sqrt(Dqk)) as those ops take them;
// their dtypes, devices and errors (InternalError).
void core_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                            Tensor& lse, const PackedSeqParams* packed, float dropout_p,
                            uint64_t seed, uint64_t stream, float softmax_scale = 0.0f);

// The gradients of core_attention_forward with the same arguments: dout [B, S, Hq, Dv] ->
// dq, dk, dv (q's, k's and v's shapes, overwritten).
void core_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const PackedSeqParams* packed,
                             Tensor& dq, Tensor& dk, Tensor& dv, float dropout_p, uint64_t seed,
                             uint64_t stream, float softmax_scale = 0.0f);

}  // namespace megaton
