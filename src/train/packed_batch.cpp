// A micro-batch's packed documents (train/packed_batch.h).
#include "train/packed_batch.h"

#include <algorithm>
#include <span>
#include <utility>

#include "core/error.h"
#include "data/packed_sequence.h"

namespace megaton {

PackedBatch pack_micro_batch(const Tensor& tokens, int32_t eod, bool reset_position_ids) {
  MEGATON_CHECK(tokens.defined() && tokens.ndim() == 2 && tokens.dtype() == DType::I32 &&
                    tokens.device() == Device::CPU,
                "pack_micro_batch: tokens must be [B, S] I32 on the host, got {} {}",
                dtype_name(tokens.dtype()), shape_str(tokens.shape()));
  const int64_t B = tokens.dim(0), S = tokens.dim(1);
  PackedBatch out;
  out.cu_seqlens.push_back(0);
  out.position_ids.reserve(size_t(B * S));
  for (int64_t b = 0; b < B; ++b) {
    const std::span<const int32_t> sample(tokens.i32() + b * S, size_t(S));
    const data::PackedSequence p = data::packed_sequence(sample, eod, reset_position_ids);
    out.position_ids.insert(out.position_ids.end(), p.position_ids.begin(), p.position_ids.end());
    // p.cu_seqlens = 0, ..., S: its inner boundaries and its end, shifted to the sample's rows.
    for (size_t i = 1; i < p.cu_seqlens.size(); ++i) {
      out.cu_seqlens.push_back(int32_t(b * S) + p.cu_seqlens[i]);
      out.max_seqlen = std::max<int64_t>(out.max_seqlen, p.cu_seqlens[i] - p.cu_seqlens[i - 1]);
    }
  }
  return out;
}

std::shared_ptr<const PackedSeqParams> packed_seq_params(const Tensor& tokens, int32_t eod,
                                                         bool reset_position_ids,
                                                         bool reset_attention_mask, Device device,
                                                         Tensor position_ids_buffer,
                                                         bool document_positions) {
  if (!reset_position_ids && !reset_attention_mask) return nullptr;
  const PackedBatch host = pack_micro_batch(tokens, eod, reset_position_ids);
  auto p = std::make_shared<PackedSeqParams>();
  if (reset_attention_mask) {
    p->cu_seqlens = Tensor::from_i32({int64_t(host.cu_seqlens.size())}, host.cu_seqlens).to(device);
    p->cu_seqlens_host = host.cu_seqlens;
    p->max_seqlen = host.max_seqlen;
  }
  if (reset_position_ids) {
    const Tensor ids = Tensor::from_i32({int64_t(host.position_ids.size())}, host.position_ids);
    if (position_ids_buffer.defined()) {
      MEGATON_CHECK(position_ids_buffer.shape() == ids.shape() &&
                        position_ids_buffer.dtype() == DType::I32 &&
                        position_ids_buffer.device() == device,
                    "packed_seq_params: the position ids buffer is {} {}, expected I32 {}",
                    dtype_name(position_ids_buffer.dtype()), shape_str(position_ids_buffer.shape()),
                    shape_str(ids.shape()));
      position_ids_buffer.copy_from(ids);
      p->position_ids = position_ids_buffer;
    } else {
      p->position_ids = ids.to(device);
    }
  }
  if (reset_attention_mask && document_positions) {
    if (reset_position_ids) {
      p->document_positions = p->position_ids;
    } else {
      const std::vector<int32_t>& cu = host.cu_seqlens;
      std::vector<int32_t> pos(static_cast<size_t>(cu.back()));
      for (size_t n = 0; n + 1 < cu.size(); ++n)
        for (int32_t t = cu[n]; t < cu[n + 1]; ++t) pos[size_t(t)] = t - cu[n];
      p->document_positions = Tensor::from_i32({int64_t(pos.size())}, pos).to(device);
    }
  }
  return p;
}

std::shared_ptr<const PackedSeqParams> context_parallel_seq_params(int64_t micro_batch_size,
                                                                   int64_t seq_length,
                                                                   const CpAttention& cp,
                                                                   Device device) {
  const std::vector<int64_t> positions =
      cp_local_positions(seq_length, cp.group->size(), cp.group->rank);
  std::vector<int32_t> ids;
  for (int64_t b = 0; b < micro_batch_size; ++b)
    for (int64_t p : positions) ids.push_back(int32_t(p));
  auto params = std::make_shared<PackedSeqParams>();
  params->position_ids = Tensor::from_i32({int64_t(ids.size())}, ids).to(device);
  params->context_parallel = cp;
  return params;
}

std::shared_ptr<const PackedSeqParams> context_parallel_packed_seq_params(
    const Tensor& tokens, int32_t eod, bool reset_position_ids, bool reset_attention_mask,
    CpAttention cp, Device device) {
  const PackedBatch host = pack_micro_batch(tokens, eod, reset_position_ids);
  const int64_t B = tokens.dim(0), S = tokens.dim(1);
  const std::vector<int64_t> positions = cp_local_positions(S, cp.group->size(), cp.group->rank);
  std::vector<int32_t> ids;
  ids.reserve(size_t(B) * positions.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p : positions) ids.push_back(host.position_ids[size_t(b * S + p)]);
  if (reset_attention_mask)
    cp.document_starts =
        std::make_shared<const std::vector<int32_t>>(cp_document_starts(host.cu_seqlens, B, S));
  auto params = std::make_shared<PackedSeqParams>();
  params->position_ids = Tensor::from_i32({int64_t(ids.size())}, ids).to(device);
  params->context_parallel = std::move(cp);
  return params;
}

}  // namespace megaton
