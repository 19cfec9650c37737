// Packed sequences (data/packed_sequence.h).
#include "data/packed_sequence.h"

#include <algorithm>

namespace megaton::data {

PackedSequence packed_sequence(std::span<const int32_t> tokens, int32_t eod,
                               bool reset_position_ids) {
  const int32_t S = int32_t(tokens.size());
  PackedSequence out;
  out.position_ids.resize(size_t(S));
  out.cu_seqlens.push_back(0);
  int32_t start = 0;  // the current document's first index (Megatron's prev_index)
  for (int32_t i = 0; i < S; ++i) {
    out.position_ids[size_t(i)] = reset_position_ids ? i - start : i;
    if (tokens[size_t(i)] == eod) {
      start = i + 1;
      if (start < S) out.cu_seqlens.push_back(start);
    }
  }
  if (S > 0) out.cu_seqlens.push_back(S);
  return out;
}

bool attends(std::span<const int32_t> cu_seqlens, int64_t i, int64_t j) {
  if (j > i) return false;
  if (cu_seqlens.empty()) return true;
  // The document of i starts at the last boundary <= i.
  const auto after = std::upper_bound(cu_seqlens.begin(), cu_seqlens.end(), int32_t(i));
  return j >= int64_t(*(after - 1));
}

}  // namespace megaton::data
