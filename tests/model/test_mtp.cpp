// Multi-token prediction (model/mtp.h): the shifted inputs by hand, the depths' names and
// shapes, and the last pipeline stage's copy of the embeddings the depths look up.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/testing.h"
#include "model/gpt.h"
#include "model/mtp.h"

namespace megaton {
namespace {

std::vector<int32_t> ints(const Tensor& t) {
  return std::vector<int32_t>(t.i32(), t.i32() + t.numel());
}
std::vector<float> floats(const Tensor& t) {
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

// Two samples of 4 tokens: labels[b, s] = token s + 1; the loss mask leaves out sample 0's
// position 1 and sample 1's position 3.
TEST(MultiTokenPrediction, ShiftedInputsByHand) {
  const Tensor labels = Tensor::from_i32({8}, {1, 2, 3, 4, 5, 6, 7, 8});
  const Tensor mask = Tensor::from({8}, {1, 0, 1, 1, 1, 1, 1, 0});
  MtpShifted k1 = mtp_shift(labels, mask, 2, 4, 1);
  EXPECT_EQ(ints(k1.tokens), (std::vector<int32_t>{1, 2, 3, 0, 5, 6, 7, 0}));
  EXPECT_EQ(ints(k1.labels), (std::vector<int32_t>{2, 3, 4, 0, 6, 7, 8, 0}));
  EXPECT_EQ(floats(k1.mask), (std::vector<float>{0, 1, 1, 0, 1, 1, 0, 0}));
  EXPECT_EQ(k1.num_tokens, 4);
  MtpShifted k2 = mtp_shift(labels, mask, 2, 4, 2);
  EXPECT_EQ(ints(k2.tokens), (std::vector<int32_t>{2, 3, 0, 0, 6, 7, 0, 0}));
  EXPECT_EQ(ints(k2.labels), (std::vector<int32_t>{3, 4, 0, 0, 7, 8, 0, 0}));
  EXPECT_EQ(floats(k2.mask), (std::vector<float>{1, 1, 0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(k2.num_tokens, 3);
  // Without a mask every shifted position counts; depth S leaves none.
  EXPECT_EQ(mtp_shift(labels, Tensor(), 2, 4, 3).num_tokens, 2);
  EXPECT_EQ(mtp_shift(labels, Tensor(), 2, 4, 4).num_tokens, 0);
}

// Packed documents (--reset-attention-mask): each depth shifts within its document
// (Megatron's _roll_tensor_packed_seq), so no row reads the next document's tokens.
// Sample 0 holds documents [0, 3) and [3, 4); sample 1 documents [4, 5) and [5, 8).
TEST(MultiTokenPrediction, ShiftedWithinPackedDocuments) {
  const Tensor labels = Tensor::from_i32({8}, {1, 2, 3, 4, 5, 6, 7, 8});
  const Tensor mask = Tensor::from({8}, {1, 1, 1, 1, 1, 1, 0, 1});
  const std::vector<int32_t> cu{0, 3, 4, 5, 8};
  MtpShifted k1 = mtp_shift(labels, mask, 2, 4, 1, &cu);
  EXPECT_EQ(ints(k1.tokens), (std::vector<int32_t>{1, 2, 0, 0, 0, 6, 7, 0}));
  EXPECT_EQ(ints(k1.labels), (std::vector<int32_t>{2, 3, 0, 0, 0, 7, 8, 0}));
  EXPECT_EQ(floats(k1.mask), (std::vector<float>{1, 1, 0, 0, 0, 0, 1, 0}));
  EXPECT_EQ(k1.num_tokens, 3);
  MtpShifted k2 = mtp_shift(labels, mask, 2, 4, 2, &cu);
  EXPECT_EQ(ints(k2.tokens), (std::vector<int32_t>{2, 0, 0, 0, 0, 7, 0, 0}));
  EXPECT_EQ(ints(k2.labels), (std::vector<int32_t>{3, 0, 0, 0, 0, 8, 0, 0}));
  EXPECT_EQ(k2.num_tokens, 2);
  // No boundaries (an empty list, as --reset-position-ids alone leaves): the samples'.
  const std::vector<int32_t> none;
  EXPECT_EQ(ints(mtp_shift(labels, mask, 2, 4, 1, &none).tokens),
            ints(mtp_shift(labels, mask, 2, 4, 1).tokens));
  // Boundaries that do not cover the rows are an internal error.
  const std::vector<int32_t> short_list{0, 3, 6};
  EXPECT_THROW(mtp_shift(labels, mask, 2, 4, 1, &short_list), InternalError);
}

// Context parallelism: a rank's rows (positions 0, 3 of each 4-token sample, CP 2's rank 0)
// are the rows mtp_shift gives the whole samples at those positions, within documents too
// (document starts [0, 0, 0, 3] and [0, 1, 1, 1]: the boundaries of the test above).
TEST(MultiTokenPrediction, ShiftedRowsOfAContextParallelRank) {
  const Tensor labels = Tensor::from_i32({8}, {1, 2, 3, 4, 5, 6, 7, 8});
  const Tensor mask = Tensor::from({8}, {1, 1, 1, 1, 1, 1, 0, 1});
  const std::vector<int64_t> positions{0, 3};
  MtpShifted rows = mtp_shift_rows(labels, mask, 2, 4, 1, positions, nullptr);
  MtpShifted whole = mtp_shift(labels, mask, 2, 4, 1);
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t src = (i / 2) * 4 + positions[size_t(i % 2)];
    EXPECT_EQ(rows.tokens.i32()[i], whole.tokens.i32()[src]) << i;
    EXPECT_EQ(rows.labels.i32()[i], whole.labels.i32()[src]) << i;
    EXPECT_EQ(rows.mask.f32()[i], whole.mask.f32()[src]) << i;
  }
  EXPECT_EQ(rows.num_tokens, 2);  // rows 0 of each sample; rows 3 shift past the end
  const std::vector<int32_t> starts{0, 0, 0, 3, 0, 1, 1, 1}, cu{0, 3, 4, 5, 8};
  MtpShifted packed = mtp_shift_rows(labels, mask, 2, 4, 1, {0, 1, 2, 3}, &starts);
  EXPECT_EQ(ints(packed.tokens), ints(mtp_shift(labels, mask, 2, 4, 1, &cu).tokens));
  EXPECT_EQ(floats(packed.mask), floats(mtp_shift(labels, mask, 2, 4, 1, &cu).mask));
}

GPTConfig mtp_config() {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.seq_length = 8;
  c.vocab_size = 30;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.normalization = Normalization::RMSNorm;
  c.untie_embeddings_and_output_weights = true;
  c.num_experts = 4;
  c.moe_layer_pattern = {0, 1};
  c.mtp_num_layers = 2;
  c.finalize();
  return c;
}

TEST(MultiTokenPrediction, DepthNamesAndShapes) {
  const GPTConfig c = mtp_config();
  GPTModel model(c, 5);
  ASSERT_EQ(model.mtp_layers().size(), 2u);
  std::vector<std::string> names;
  for (const Param* p : model.params()) names.push_back(p->name);
  auto has = [&](const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  for (const char* n : {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
                        "mtp.layers.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight",
                        "mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight",
                        "mtp.layers.1.transformer_layer.mlp.router.weight"})
    EXPECT_TRUE(has(n)) << n;
  EXPECT_EQ(model.mtp_layers()[0]->eh_proj.weight.weight.shape(), Shape({16, 32}));
  // The depths' layers follow the last decoder layer (MoE here); all_layers lists them.
  EXPECT_NE(model.mtp_layers()[1]->transformer_layer->moe(), nullptr);
  EXPECT_EQ(model.all_layers().size(), 4u);
}

// The last pipeline stage of an untied model keeps a copy of the word embeddings for the
// depths' lookups, marked shared (its gradient is summed with the first stage's).
TEST(MultiTokenPrediction, LastStageHoldsASharedEmbeddingCopy) {
  const GPTConfig c = mtp_config();
  GPTModel last(c, 5, {}, 1, 1, PipelineChunk{1, 1, false, true});
  ASSERT_NE(last.word_embeddings_param(), nullptr);
  EXPECT_TRUE(last.word_embeddings_param()->shared);
  GPTModel first(c, 5, {}, 1, 1, PipelineChunk{0, 1, true, false});
  EXPECT_TRUE(first.mtp_layers().empty());
  EXPECT_TRUE(testing::allclose(last.word_embeddings_param()->weight,
                                first.word_embeddings_param()->weight, 0, 0));
}

}  // namespace
}  // namespace megaton
