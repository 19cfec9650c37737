// The CUDA side of ops/attention_varlen.h (packed-sequence causal attention): the doors'
// targets, defined in attention_varlen.cpp (cuDNN graphs), and the kernel that turns
// cu_seqlens into cuDNN's ragged description, defined in attention_varlen_offsets.cu.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace megaton::ops::cuda {

void attention_varlen_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                              Tensor& lse, const Tensor& cu_seqlens, int64_t max_seqlen,
                              float dropout_p, uint64_t seed, uint64_t stream, float softmax_scale);
void attention_varlen_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& out, const Tensor& lse,
                               const Tensor& cu_seqlens, int64_t max_seqlen, Tensor& dq, Tensor& dk,
                               Tensor& dv, float dropout_p, uint64_t seed, uint64_t stream,
                               float softmax_scale);

namespace detail {

// cuDNN's ragged description of N packed sequences, padded to `batch` >= N entries (the
// graph's batch dim; entries N.. are empty sequences at row T). Device arrays:
//   seq_len [batch] I32: entry b's length (cuDNN's seq_len_q = seq_len_kv);
//   q, k, v, o, stats [batch + 1] I64: element offsets of entry b's first row in q, k, v,
//   out (and dq, dk, dv, dout) and lse: start_b * (heads * head dim), start_b * Hq for lse.
struct VarlenRaggedOffsets {
  int32_t* seq_len;
  int64_t *q, *k, *v, *o, *stats;
};

// Elements per token row of each tensor: the offsets' multipliers.
struct VarlenRowElements {
  int64_t q, k, v, o, stats;
};

// Device bytes that varlen_ragged_offsets needs for `batch` entries (16-byte aligned
// arrays); carve(buffer, batch) lays them out in such a buffer.
int64_t varlen_ragged_offsets_bytes(int64_t batch);
VarlenRaggedOffsets carve_varlen_ragged_offsets(void* buffer, int64_t batch);

// Fills `out` from cu_seqlens [num_sequences + 1] (device I32) with one kernel on the
// compute stream: no host synchronization, so it can be captured in a CUDA graph. Values are
// clamped so that every entry lies within [0, total_tokens) and is at most max_seqlen long:
// a malformed cu_seqlens gives wrong results, never an access outside the T rows.
void varlen_ragged_offsets(const int32_t* cu_seqlens, int64_t num_sequences, int64_t batch,
                           int64_t total_tokens, int64_t max_seqlen, VarlenRowElements rows,
                           VarlenRaggedOffsets out);

}  // namespace detail
}  // namespace megaton::ops::cuda
