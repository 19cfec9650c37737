// GPTModel as pipeline model chunks: a model cut into chunks that pass the hidden state
// along (and its gradient back) computes the whole model's losses and gradients, with the
// same parameter names and initial values.
#include <gtest/gtest.h>

#include <map>
#include <span>

#include "common/testing.h"
#include "core/error.h"
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
    aux += out.loss.aux_loss();
    in.hidden = out.hidden;
    if (!chunk->chunk().post_process) {
      EXPECT_EQ(out.hidden.shape(), (Shape{T, cfg.hidden_size}));
      EXPECT_FALSE(out.loss.losses.defined());
    }
  }
  // The same ops on the same values in the same order: equal bits.
  EXPECT_TRUE(testing::allclose(out.loss.losses, want.losses, 0, 0));
  // The aux losses are fp32 sums on the device: per chunk here, over all layers there.
  EXPECT_NEAR(aux, want.aux_loss(), 1e-6 * std::fabs(want.aux_loss()));
  if (moe) {
    EXPECT_GT(aux, 0);
  }

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

// One micro-batch's input to a chunk and the gradient of its output: tokens and labels
// [B, S], the previous chunk's hidden state [T, H] (chunks without pre_process), and
// d loss / d output ([T] per-token losses for a post_process chunk, else [T, H]).
struct MicroBatch {
  ChunkInput in;
  Tensor dout;
  ForwardContext ctx;
};

MicroBatch random_micro_batch(const GPTConfig& cfg, const PipelineChunk& part, int64_t index,
                              uint64_t seed) {
  const int64_t B = 2, S = cfg.seq_length, T = B * S, H = cfg.hidden_size;
  const uint64_t s = seed + 100 * uint64_t(index);
  MicroBatch mb;
  mb.in = {B, S, testing::randint({B, S}, int32_t(cfg.vocab_size), s + 1),
           testing::randint({B, S}, int32_t(cfg.vocab_size), s + 2), Tensor()};
  if (!part.pre_process) mb.in.hidden = testing::randn({T, H}, s + 3);
  mb.dout = part.post_process ? testing::randn({T}, s + 4, 0.5f) : testing::randn({T, H}, s + 5);
  mb.ctx = ForwardContext{true, seed, 3, index};  // the micro-batch keys its dropout masks
  return mb;
}

// What a micro-batch's forward and backward produced on a chunk.
struct MicroBatchResult {
  Tensor output;  // losses [T] (post_process) or hidden [T, H]
  double aux_loss = 0;
  Tensor input_grad;  // undefined for a pre_process chunk
};

// Two micro-batches in flight on one chunk, as on a pipeline stage in 1F1B: forward 0, its
// activations taken; forward 1, taken; then restore 0 and its backward, restore 1 and its
// backward. Outputs, input gradients and every parameter gradient must equal (bit for
// bit: the same ops on the same values) those of forward and backward of each micro-batch
// in turn, with no forward run again: micro-batch 1's forward may overwrite nothing that
// micro-batch 0's backward reads (activations, dropout keys, MoE routing and token
// counts, the embedding's tokens, the loss's labels and logits).
void check_stashed_micro_batches(const GPTConfig& cfg, const PipelineChunk& part) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", layers [" + std::to_string(part.first_layer) +
               ", +" + std::to_string(part.num_layers) + ")");
  const std::vector<MicroBatch> mbs = {random_micro_batch(cfg, part, 0, seed),
                                       random_micro_batch(cfg, part, 1, seed)};
  auto record = [](const ChunkOutput& out, MicroBatchResult& r) {
    r.output = out.hidden.defined() ? out.hidden : out.loss.losses;
    r.aux_loss = out.loss.aux_loss();
  };
  // Counts forwards through the chunk (the hook sees the first unit of each forward).
  auto count_forwards = [](GPTModel& model, int& forwards) {
    const Param* first = model.params().front();
    model.set_param_hooks({[first, &forwards](std::span<Param* const> params) {
                             if (params.front() == first) ++forwards;
                           },
                           nullptr});
  };

  GPTModel one_at_a_time(cfg, seed, ModelParallel{}, 1, 1, part);
  std::vector<MicroBatchResult> want(2);
  for (size_t i = 0; i < 2; ++i) {
    record(one_at_a_time.forward_chunk(mbs[i].in, mbs[i].ctx), want[i]);
    want[i].input_grad = one_at_a_time.backward_chunk(mbs[i].dout, 0.5f);
  }

  GPTModel stashed(cfg, seed, ModelParallel{}, 1, 1, part);
  int forwards = 0;
  count_forwards(stashed, forwards);
  std::vector<MicroBatchResult> got(2);
  std::vector<ChunkActivations> activations;
  for (size_t i = 0; i < 2; ++i) {
    record(stashed.forward_chunk(mbs[i].in, mbs[i].ctx), got[i]);
    EXPECT_TRUE(stashed.holds_activations());
    activations.push_back(stashed.take_activations());
    EXPECT_FALSE(stashed.holds_activations());
    EXPECT_FALSE(activations.back().empty());
  }
  for (size_t i = 0; i < 2; ++i) {
    stashed.restore_activations(std::move(activations[i]));
    EXPECT_TRUE(activations[i].empty());
    got[i].input_grad = stashed.backward_chunk(mbs[i].dout, 0.5f);
    EXPECT_FALSE(stashed.holds_activations());
  }
  EXPECT_EQ(forwards, 2);  // no recomputation

  for (size_t i = 0; i < 2; ++i) {
    SCOPED_TRACE("micro-batch " + std::to_string(i));
    EXPECT_TRUE(testing::allclose(got[i].output, want[i].output, 0, 0));
    EXPECT_EQ(got[i].aux_loss, want[i].aux_loss);
    ASSERT_EQ(got[i].input_grad.defined(), !part.pre_process);
    if (!part.pre_process) {
      EXPECT_TRUE(testing::allclose(got[i].input_grad, want[i].input_grad, 0, 0));
    }
  }
  bool has_moe = false;
  for (auto& layer : stashed.layers()) has_moe |= layer->moe() != nullptr;
  if (has_moe) {
    EXPECT_NE(want[0].aux_loss, want[1].aux_loss);  // the routing differs
  }
  ASSERT_EQ(stashed.params().size(), one_at_a_time.params().size());
  for (size_t p = 0; p < stashed.params().size(); ++p)
    EXPECT_TRUE(testing::allclose(stashed.params()[p]->main_grad,
                                  one_at_a_time.params()[p]->main_grad, 0, 0))
        << stashed.params()[p]->name;
}

TEST(ModelChunks, StashedMicroBatchesMatchOneAtATime) {
  for (bool moe : {true, false}) {
    // MoE: RoPE, SwiGLU, RMSNorm, aux loss; dense: learned positions, LayerNorm, tied.
    const GPTConfig cfg = chunk_config(moe, /*tied=*/!moe, /*learned_positions=*/!moe);
    check_stashed_micro_batches(cfg, PipelineChunk{0, 4, true, true});    // whole model
    check_stashed_micro_batches(cfg, PipelineChunk{0, 1, true, false});   // first stage
    check_stashed_micro_batches(cfg, PipelineChunk{1, 2, false, false});  // middle stage
    check_stashed_micro_batches(cfg, PipelineChunk{3, 1, false, true});   // last stage
  }
}

// --qk-layernorm: the q/k norms' saved inputs and statistics travel with the activations.
TEST(ModelChunks, StashedMicroBatchesWithQkLayernormMatchOneAtATime) {
  for (bool moe : {true, false}) {
    // MoE: RMSNorm q/k norms and RoPE; dense: LayerNorm q/k norms (with bias), no RoPE.
    GPTConfig cfg = chunk_config(moe, /*tied=*/!moe, /*learned_positions=*/!moe);
    cfg.qk_layernorm = true;
    check_stashed_micro_batches(cfg, PipelineChunk{0, 4, true, true});
    check_stashed_micro_batches(cfg, PipelineChunk{1, 2, false, false});
  }
}

TEST(ModelChunks, ActivationsGoBackOnlyWhereTheyCameFrom) {
  const GPTConfig cfg = chunk_config(true, false, false);
  const PipelineChunk part{1, 2, false, false};
  GPTModel chunk(cfg, 7, ModelParallel{}, 1, 1, part), other(cfg, 7, ModelParallel{}, 1, 1, part);
  const MicroBatch mb0 = random_micro_batch(cfg, part, 0, 7);
  const MicroBatch mb1 = random_micro_batch(cfg, part, 1, 7);
  // Nothing to take or to run backward on before a forward.
  EXPECT_THROW(chunk.take_activations(), InternalError);
  EXPECT_THROW(chunk.backward_chunk(mb0.dout, 1.0f), InternalError);
  chunk.forward_chunk(mb0.in, mb0.ctx);
  ChunkActivations first = chunk.take_activations();
  EXPECT_THROW(chunk.backward_chunk(mb0.dout, 1.0f), InternalError);  // taken
  EXPECT_THROW(other.restore_activations(std::move(first)), InternalError);  // another chunk
  chunk.forward_chunk(mb1.in, mb1.ctx);
  // Micro-batch 1 is held: restoring 0 would lose it.
  EXPECT_THROW(chunk.restore_activations(std::move(first)), InternalError);
  ChunkActivations second = chunk.take_activations();
  chunk.restore_activations(std::move(first));
  EXPECT_THROW(chunk.restore_activations(std::move(first)), InternalError);  // empty now
  chunk.backward_chunk(mb0.dout, 1.0f);
  EXPECT_THROW(chunk.backward_chunk(mb0.dout, 1.0f), InternalError);  // ran already
  chunk.restore_activations(std::move(second));
  chunk.backward_chunk(mb1.dout, 1.0f);
}

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
