// The packed documents of a micro-batch (Megatron's --reset-position-ids and
// --reset-attention-mask): from its tokens to the PackedSeqParams the layers read
// (model/packed_seq_params.h; docs/data.md "Packed sequences").
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "model/packed_seq_params.h"

namespace megaton {

// A micro-batch's packing on the host.
//   cu_seqlens: the documents' boundaries over the B * S rows (PackedSeqParams::cu_seqlens):
//     each sample's data::packed_sequence boundaries shifted by b * S, so every sample
//     boundary is one; the eod belongs to the document it ends.
//   max_seqlen: the longest document.
//   position_ids [B * S]: restarting at 0 after each eod with reset_position_ids, else s.
struct PackedBatch {
  std::vector<int32_t> cu_seqlens;
  int64_t max_seqlen = 0;
  std::vector<int32_t> position_ids;
};

// tokens: [B, S] I32 on the host (the micro-batch's input tokens); eod: the tokenizer's
// end-of-document id. InternalError when tokens is not a 2-d I32 host tensor.
PackedBatch pack_micro_batch(const Tensor& tokens, int32_t eod, bool reset_position_ids);

// The PackedSeqParams of tokens for the layers: cu_seqlens and max_seqlen with
// reset_attention_mask, position_ids with reset_position_ids, on `device`; null when
// neither flag is set (the layers then run unpacked). position_ids_buffer (optional, I32
// [B * S] on `device`): written in place and used as the position ids (a buffer a captured
// CUDA graph reads). document_positions: with reset_attention_mask, also each row's
// position within its document (PackedSeqParams::document_positions; the Mamba layers').
// InternalError as pack_micro_batch, or on a buffer of another shape.
std::shared_ptr<const PackedSeqParams> packed_seq_params(const Tensor& tokens, int32_t eod,
                                                         bool reset_position_ids,
                                                         bool reset_attention_mask, Device device,
                                                         Tensor position_ids_buffer = Tensor(),
                                                         bool document_positions = false);

// Context parallelism: the PackedSeqParams every micro-batch of micro_batch_size samples of
// seq_length tokens shares on CP rank cp.group->rank: position_ids (I32 [B * S / cp] on
// `device`) the global positions of the rank's two chunks of each sample
// (cp_local_positions), and `cp` for the core attention. InternalError as
// cp_local_positions.
std::shared_ptr<const PackedSeqParams> context_parallel_seq_params(int64_t micro_batch_size,
                                                                   int64_t seq_length,
                                                                   const CpAttention& cp,
                                                                   Device device);

// Context parallelism with packed documents: from the micro-batch's WHOLE tokens [B, S]
// (host I32, before the CP split), this rank's PackedSeqParams: position_ids (I32 [B * S /
// cp] on `device`) its rows' positions, restarting after each eod with reset_position_ids
// and global otherwise; `cp` with document_starts (cp_document_starts of the documents)
// under reset_attention_mask. cu_seqlens stays undefined (the CP attention masks the
// documents itself). InternalError as pack_micro_batch and cp_local_positions.
std::shared_ptr<const PackedSeqParams> context_parallel_packed_seq_params(
    const Tensor& tokens, int32_t eod, bool reset_position_ids, bool reset_attention_mask,
    CpAttention cp, Device device);

}  // namespace megaton
