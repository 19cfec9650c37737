// Packed sequences (data/packed_sequence.h) against Megatron's
// _get_ltor_masks_and_position_ids, written out here as its loop on dense tensors.
#include <gtest/gtest.h>

#include <vector>

#include "data/packed_sequence.h"

namespace megaton::data {
namespace {

constexpr int32_t kEod = 9;

// Megatron's function on one sample: position ids and the boolean "may attend" mask.
struct MegatronMasks {
  std::vector<int32_t> position_ids;
  std::vector<std::vector<bool>> attend;  // [query][key]
};

MegatronMasks megatron(const std::vector<int32_t>& data, bool reset_position_ids,
                       bool reset_attention_mask) {
  const int64_t S = int64_t(data.size());
  MegatronMasks m;
  m.attend.assign(size_t(S), std::vector<bool>(size_t(S), false));
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j <= i; ++j) m.attend[size_t(i)][size_t(j)] = true;  // tril
  for (int64_t i = 0; i < S; ++i) m.position_ids.push_back(int32_t(i));
  int64_t prev = 0;
  for (int64_t i = 0; i < S; ++i) {
    if (data[size_t(i)] != kEod) continue;
    if (reset_attention_mask)
      for (int64_t r = i + 1; r < S; ++r)
        for (int64_t c = 0; c <= i; ++c) m.attend[size_t(r)][size_t(c)] = false;
    if (reset_position_ids) {
      for (int64_t r = i + 1; r < S; ++r) m.position_ids[size_t(r)] -= int32_t(i + 1 - prev);
      prev = i + 1;
    }
  }
  return m;
}

TEST(PackedSequence, MatchesMegatronsMasksAndPositions) {
  const std::vector<std::vector<int32_t>> samples = {
      {5, kEod, 7, 8, kEod, 3},        // three documents
      {1, 2, 3, 4},                    // one, no eod
      {kEod, kEod, 4, 5},              // an eod-only document first
      {1, 2, kEod},                    // an eod at the end: no empty document
      {kEod},                          // one token
  };
  for (const auto& sample : samples) {
    const MegatronMasks ref = megatron(sample, true, true);
    const PackedSequence packed = packed_sequence(sample, kEod, true);
    EXPECT_EQ(packed.position_ids, ref.position_ids);
    EXPECT_EQ(packed_sequence(sample, kEod, false).position_ids,
              megatron(sample, false, true).position_ids);
    EXPECT_EQ(packed.cu_seqlens.front(), 0);
    EXPECT_EQ(packed.cu_seqlens.back(), int32_t(sample.size()));
    for (size_t d = 1; d < packed.cu_seqlens.size(); ++d)
      EXPECT_LT(packed.cu_seqlens[d - 1], packed.cu_seqlens[d]);  // no empty document
    for (int64_t i = 0; i < int64_t(sample.size()); ++i)
      for (int64_t j = 0; j < int64_t(sample.size()); ++j) {
        EXPECT_EQ(attends(packed.cu_seqlens, i, j), bool(ref.attend[size_t(i)][size_t(j)]))
            << i << " " << j;
        EXPECT_EQ(attends({}, i, j), j <= i);
      }
  }
  EXPECT_EQ(packed_sequence(std::vector<int32_t>{5, kEod, 7, 8, kEod, 3}, kEod, true).cu_seqlens,
            (std::vector<int32_t>{0, 2, 5, 6}));
  EXPECT_EQ(packed_sequence(std::vector<int32_t>{5, kEod, 7, 8, kEod, 3}, kEod, true).position_ids,
            (std::vector<int32_t>{0, 1, 0, 1, 2, 0}));
}

}  // namespace
}  // namespace megaton::data
