// Packed sequences: the documents of one training sample, separated by eod tokens, as
// Megatron's --reset-position-ids / --reset-attention-mask see them
// (megatron/core/datasets/gpt_dataset.py _get_ltor_masks_and_position_ids, Megatron-LM
// d98e8a6; docs/research/deepseek-v3.md 4.1).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace megaton::data {

struct PackedSequence {
  // Per input token: its position, restarting at 0 after each eod with
  // reset_position_ids, else 0 .. S-1.
  std::vector<int32_t> position_ids;
  // The documents' boundaries, cumulative (cuDNN's and Transformer Engine's cu_seqlens):
  // 0, e1 + 1, e2 + 1, ..., S for eods at e1 < e2 < ...: the eod belongs to the document
  // it ends, and no document is empty (an eod at the last position adds no boundary).
  // Under --reset-attention-mask a token attends to the earlier tokens of its own document
  // only (Megatron's attention_mask[(i + 1):, :(i + 1)] = 0 for each eod at i).
  std::vector<int32_t> cu_seqlens;
};

// The documents of the input tokens `tokens` (a sample's first S tokens) whose end is
// marked by `eod`. Megatron's loop, for an eod at index i: position_ids[i + 1:] -=
// i + 1 - prev; prev = i + 1.
PackedSequence packed_sequence(std::span<const int32_t> tokens, int32_t eod,
                               bool reset_position_ids);

// Whether query position i may attend to key position j (j <= i, and with cu_seqlens, j in
// i's document): the causal mask of --reset-attention-mask, for the CPU reference attention
// and tests. cu_seqlens as PackedSequence's; empty: plain causal.
bool attends(std::span<const int32_t> cu_seqlens, int64_t i, int64_t j);

}  // namespace megaton::data
