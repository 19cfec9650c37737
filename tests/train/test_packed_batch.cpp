// A micro-batch's packed documents (train/packed_batch.h): the boundaries over the B * S
// rows (every sample boundary one, the eod in the document it ends, no empty document),
// the longest document and the position ids, by hand.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "train/packed_batch.h"

namespace megaton {
namespace {

constexpr int32_t kEod = 9;

// Sample 0: documents of 3, 1 (a lone eod) and 2 tokens, the last cut by the sample's end.
// Sample 1: one document of 5 ending with an eod at the sample's last position (no empty
// document after it), then nothing. Sample 2: no eod at all.
Tensor tokens() {
  return Tensor::from_i32({3, 6}, {4, 1, kEod, kEod, 2, 3,  //
                                   5, 5, 5, 5, 5, kEod,     //
                                   1, 2, 3, 4, 5, 6});
}

TEST(PackedBatch, BoundariesAndPositionsByHand) {
  const PackedBatch p = pack_micro_batch(tokens(), kEod, true);
  EXPECT_EQ(p.cu_seqlens, (std::vector<int32_t>{0, 3, 4, 6, 12, 18}));
  EXPECT_EQ(p.max_seqlen, 6);
  EXPECT_EQ(p.position_ids, (std::vector<int32_t>{0, 1, 2, 0, 0, 1,  //
                                                  0, 1, 2, 3, 4, 5,  //
                                                  0, 1, 2, 3, 4, 5}));
  // Without --reset-position-ids the positions are those of the sample.
  const PackedBatch plain = pack_micro_batch(tokens(), kEod, false);
  EXPECT_EQ(plain.cu_seqlens, p.cu_seqlens);
  for (int64_t t = 0; t < 18; ++t) EXPECT_EQ(plain.position_ids[size_t(t)], t % 6);
}

TEST(PackedBatch, ParamsFollowTheFlags) {
  EXPECT_EQ(packed_seq_params(tokens(), kEod, false, false, Device::CPU), nullptr);
  const auto mask = packed_seq_params(tokens(), kEod, false, true, Device::CPU);
  ASSERT_NE(mask, nullptr);
  EXPECT_TRUE(mask->reset_attention_mask());
  EXPECT_FALSE(mask->position_ids.defined());
  ASSERT_EQ(mask->cu_seqlens.numel(), 6);
  EXPECT_EQ(mask->cu_seqlens.i32()[1], 3);
  EXPECT_EQ(mask->max_seqlen, 6);
  // Position ids only, written into a given buffer (the staged step's).
  Tensor buffer = Tensor::zeros({18}, DType::I32);
  const auto positions = packed_seq_params(tokens(), kEod, true, false, Device::CPU, buffer);
  ASSERT_NE(positions, nullptr);
  EXPECT_FALSE(positions->reset_attention_mask());
  EXPECT_EQ(positions->position_ids.raw(), buffer.raw());
  EXPECT_EQ(buffer.i32()[4], 0);
  EXPECT_EQ(buffer.i32()[5], 1);
  EXPECT_THROW(
      packed_seq_params(tokens(), kEod, true, false, Device::CPU, Tensor::zeros({17}, DType::I32)),
      InternalError);
  EXPECT_THROW(pack_micro_batch(Tensor::zeros({18}, DType::I32), kEod, true), InternalError);
}

}  // namespace
}  // namespace megaton
