// GPTModel as pipeline model chunks: a model cut into chunks that pass the hidden state
// along (and its gradient back) computes the whole model's losses and gradients, with the
// same parameter names and initial values.
#include <gtest/gtest.h>

#include <map>

#include "common/testing.h"
#include "model/gpt.h"
#include "ops/ops.h"

namespace megaton {
namespace {

GPTConfig chunk_config(bool moe, bool tied, bool learned_positions) {
  GPTConfig c;
  c.num_layers = 4;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = 6;
  c.vocab_size = 23;
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = c.attention_dropout = 0.1f;  // masks keyed by global layer index
  c.init_method_std = 0.3f;
  c.untie_embeddings_and_output_weights = !tied;
  if (learned_positions) {
    c.position_embedding_type = PositionEmbedding::LearnedAbsolute;
    c.max_position_embeddings = 8;
  } else {
    c.position_embedding_type = PositionEmbedding::Rope;
  }
  if (moe) {
    c.num_experts = 4;
    c.moe_router_topk = 2;
    c.moe_ffn_hidden_size = 12;
    c.moe_aux_loss_coeff = 1e-2f;
    c.moe_layer_freq = 2;  // layers 0 and 2 MoE, 1 and 3 dense
    c.swiglu = true;
    c.normalization = Normalization::RMSNorm;
  }
  c.finalize();
  return c;
}

std::map<std::string, Param*> by_name(GPTModel& m) {
  std::map<std::string, Param*> out;
  for (Param* p : m.params()) out[p->name] = p;
  return out;
}

// Chunks of layers [0, 1), [1, 3), [3, 4): first (embedding), middle, last (loss).
void check_chunks_match_whole_model(bool moe, bool tied, bool learned_positions) {
  const GPTConfig cfg = chunk_config(moe, tied, learned_positions);
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t B = 2, S = cfg.seq_length, T = B * S;
  Tensor tokens = testing::randint({B, S}, int32_t(cfg.vocab_size), seed + 1);
  Tensor labels = testing::randint({B, S}, int32_t(cfg.vocab_size), seed + 2);
  Tensor dlosses = testing::randn({T}, seed + 3, 0.5f);
  const ForwardContext ctx{true, seed, 3, 5};

  GPTModel whole(cfg, seed);
  MicroBatchLoss want = whole.forward(tokens, labels, ctx);
  whole.backward(dlosses, 0.5f);

  std::vector<std::unique_ptr<GPTModel>> chunks;
  chunks.push_back(std::make_unique<GPTModel>(cfg, seed, ModelParallel{}, 1, 1,
                                              PipelineChunk{0, 1, true, false}));
  chunks.push_back(std::make_unique<GPTModel>(cfg, seed, ModelParallel{}, 1, 1,
                                              PipelineChunk{1, 2, false, false}));
  chunks.push_back(std::make_unique<GPTModel>(cfg, seed, ModelParallel{}, 1, 1,
                                              PipelineChunk{3, 1, false, true}));
  ChunkInput in{B, S, tokens, labels, Tensor()};
  double aux = 0;
  ChunkOutput out;
  for (auto& chunk : chunks) {
    out = chunk->forward_chunk(in, ctx);
    aux += out.loss.aux_loss;
    in.hidden = out.hidden;
    if (!chunk->chunk().post_process) {
      EXPECT_EQ(out.hidden.shape(), (Shape{T, cfg.hidden_size}));
      EXPECT_FALSE(out.loss.losses.defined());
    }
  }
  // The same ops on the same values in the same order: equal bits.
  EXPECT_TRUE(testing::allclose(out.loss.losses, want.losses, 0, 0));
  EXPECT_EQ(aux, want.aux_loss);
  if (moe) EXPECT_GT(aux, 0);

  Tensor grad = dlosses;
  for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
    grad = (*it)->backward_chunk(grad, 0.5f);
    EXPECT_EQ(grad.defined(), !(*it)->chunk().pre_process);
  }

  // Every parameter of the whole model is in exactly one chunk, with the whole model's
  // initial values and gradient; tied embeddings: the last chunk's copy is `shared`, and
  // the two copies' gradients add up to the whole model's.
  std::map<std::string, Param*> whole_params = by_name(whole);
  std::map<std::string, int> seen;
  Tensor embedding_grad_sum = Tensor::zeros(whole_params["embedding.word_embeddings.weight"]
                                                ->main_grad.shape());
  for (auto& chunk : chunks) {
    for (Param* p : chunk->params()) {
      ++seen[p->name];
      ASSERT_TRUE(whole_params.count(p->name)) << p->name;
      const Param* w = whole_params[p->name];
      EXPECT_EQ(p->shared, tied && chunk->chunk().post_process &&
                               p->name == "embedding.word_embeddings.weight")
          << p->name;
      if (p->name == "embedding.word_embeddings.weight") {
        ops::add_(embedding_grad_sum, p->main_grad);
        continue;
      }
      EXPECT_TRUE(testing::allclose(p->main_grad, w->main_grad, 0, 0)) << p->name;
    }
  }
  for (const auto& [name, param] : whole_params) {
    const int copies = tied && name == "embedding.word_embeddings.weight" ? 2 : 1;
    EXPECT_EQ(seen[name], copies) << name;
  }
  EXPECT_EQ(seen.size(), whole_params.size());
  // One addition in another order: equal to rounding.
  EXPECT_TRUE(testing::allclose(embedding_grad_sum,
                                whole_params["embedding.word_embeddings.weight"]->main_grad, 1e-6,
                                1e-5));
  // Initial values: a fresh chunk holds the whole model's fresh weights.
  GPTModel fresh_whole(cfg, seed);
  GPTModel fresh_middle(cfg, seed, ModelParallel{}, 1, 1, PipelineChunk{1, 2, false, false});
  std::map<std::string, Param*> fresh = by_name(fresh_whole);
  for (Param* p : fresh_middle.params())
    EXPECT_TRUE(testing::allclose(p->weight, fresh[p->name]->weight, 0, 0)) << p->name;
}

TEST(ModelChunks, MoeUntiedRopeMatchesWholeModel) { check_chunks_match_whole_model(true, false, false); }
TEST(ModelChunks, DenseTiedLearnedPositionsMatchesWholeModel) {
  check_chunks_match_whole_model(false, true, true);
}
TEST(ModelChunks, MoeTiedMatchesWholeModel) { check_chunks_match_whole_model(true, true, false); }

TEST(ModelChunks, MiddleChunkHoldsOnlyItsLayers) {
  const GPTConfig cfg = chunk_config(true, true, true);
  GPTModel middle(cfg, 7, ModelParallel{}, 1, 1, PipelineChunk{1, 2, false, false});
  EXPECT_EQ(middle.word_embeddings_param(), nullptr);
  ASSERT_EQ(middle.layers().size(), 2u);
  for (const Param* p : middle.params())
    EXPECT_TRUE(p->name.starts_with("decoder.layers.1.") || p->name.starts_with("decoder.layers.2."))
        << p->name;
  // Only the layer range inside the model is accepted.
  EXPECT_THROW(GPTModel(cfg, 7, ModelParallel{}, 1, 1, PipelineChunk{3, 2, false, true}),
               InternalError);
  // A chunk is not a whole model.
  Tensor tokens = testing::randint({1, cfg.seq_length}, int32_t(cfg.vocab_size), 1);
  EXPECT_THROW(middle.forward(tokens, tokens, ForwardContext{}), InternalError);
}

}  // namespace
}  // namespace megaton
