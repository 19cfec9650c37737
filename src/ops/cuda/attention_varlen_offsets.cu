// cu_seqlens -> cuDNN's ragged offsets and sequence lengths for packed-sequence attention
// (ops/cuda/attention_varlen.h), on the device: one thread per graph batch entry.
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/attention_varlen.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda::detail {
namespace {

constexpr int kThreads = 256;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// Entry b < batch is sequence b when b < num_sequences, else an empty sequence at the end;
// offsets get one more entry (b == batch), the end of the last. Clamped as the header says.
__global__ void varlen_ragged_offsets_kernel(const int32_t* __restrict__ cu_seqlens,
                                             int64_t num_sequences, int64_t batch,
                                             int64_t total_tokens, int64_t max_seqlen,
                                             VarlenRowElements rows, VarlenRaggedOffsets out) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b > batch) return;
  auto clamp = [](int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); };
  const int64_t start = clamp(cu_seqlens[b < num_sequences ? b : num_sequences], 0, total_tokens);
  out.q[b] = start * rows.q;
  out.k[b] = start * rows.k;
  out.v[b] = start * rows.v;
  out.o[b] = start * rows.o;
  out.stats[b] = start * rows.stats;
  if (b < batch) {
    const int64_t length = b < num_sequences ? int64_t(cu_seqlens[b + 1]) - start : 0;
    const int64_t room = total_tokens - start < max_seqlen ? total_tokens - start : max_seqlen;
    out.seq_len[b] = int32_t(clamp(length, 0, room));
  }
}

}  // namespace

int64_t varlen_ragged_offsets_bytes(int64_t batch) {
  return 5 * round_up(batch + 1, 2) * int64_t(sizeof(int64_t)) +
         round_up(batch, 4) * int64_t(sizeof(int32_t));
}

VarlenRaggedOffsets carve_varlen_ragged_offsets(void* buffer, int64_t batch) {
  int64_t* words = static_cast<int64_t*>(buffer);
  const int64_t stride = round_up(batch + 1, 2);  // keeps every array 16-byte aligned
  VarlenRaggedOffsets out;
  out.q = words;
  out.k = words + stride;
  out.v = words + 2 * stride;
  out.o = words + 3 * stride;
  out.stats = words + 4 * stride;
  out.seq_len = reinterpret_cast<int32_t*>(words + 5 * stride);
  return out;
}

void varlen_ragged_offsets(const int32_t* cu_seqlens, int64_t num_sequences, int64_t batch,
                           int64_t total_tokens, int64_t max_seqlen, VarlenRowElements rows,
                           VarlenRaggedOffsets out) {
  const int64_t entries = batch + 1;
  const unsigned blocks = unsigned((entries + kThreads - 1) / kThreads);
  varlen_ragged_offsets_kernel<<<blocks, kThreads, 0, compute_stream()>>>(
      cu_seqlens, num_sequences, batch, total_tokens, max_seqlen, rows, out);
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda::detail
