// Activation recomputation (GPTConfig::recompute, docs/memory.md): every choice gives,
// bit for bit, the losses, aux losses, input gradients, parameter gradients and router
// statistics of the run that keeps every activation, with two micro-batches in flight on
// a chunk as in a pipeline stage (forward 0, forward 1, backward 0, backward 1), and holds
// less memory between forward and backward.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/testing.h"
#include "model/gpt.h"
#include "model/tiny_gpt_testing.h"

namespace megaton {
namespace {

struct Choice {
  std::string name;
  RecomputeGranularity granularity = RecomputeGranularity::None;
  RecomputeMethod method = RecomputeMethod::None;
  int64_t num_layers = 0;
  uint32_t modules = 0;
};

std::vector<Choice> choices() {
  const auto full = RecomputeGranularity::Full, selective = RecomputeGranularity::Selective;
  return {
      {"full_uniform_1", full, RecomputeMethod::Uniform, 1},
      {"full_uniform_2", full, RecomputeMethod::Uniform, 2},
      {"full_uniform_3", full, RecomputeMethod::Uniform, 3},  // the last group is shorter
      {"full_block_1", full, RecomputeMethod::Block, 1},
      {"full_block_3", full, RecomputeMethod::Block, 3},
      {"core_attn", selective, RecomputeMethod::None, 0, kRecomputeCoreAttn},
      {"layernorm", selective, RecomputeMethod::None, 0, kRecomputeLayernorm},
      {"mlp", selective, RecomputeMethod::None, 0, kRecomputeMlp},
      {"moe", selective, RecomputeMethod::None, 0, kRecomputeMoe},
      {"shared_experts", selective, RecomputeMethod::None, 0, kRecomputeSharedExperts},
      {"mlp_layernorm", selective, RecomputeMethod::None, 0, kRecomputeMlp | kRecomputeLayernorm},
      {"all_selective", selective, RecomputeMethod::None, 0,
       kRecomputeCoreAttn | kRecomputeLayernorm | kRecomputeMlp | kRecomputeMoe |
           kRecomputeSharedExperts | kRecomputeMoeAct},
  };
}

// The tiny variants with 4 layers (two model chunks' worth of groups), and for MoE every
// router feature a replay must reproduce: jitter, token dropping, the global aux loss's
// running counts (which a second routing would advance), the z-loss.
GPTConfig config(const testing::TinyGptVariant& v, const Choice& c) {
  GPTConfig cfg = testing::tiny_gpt_config(v);
  cfg.num_layers = 4;
  if (v.moe) {
    cfg.moe_layer_pattern = {0, 1, 1, 0};  // dense and MoE layers in one recompute group
    cfg.moe_input_jitter_eps = 0.01f;
    cfg.moe_expert_capacity_factor = 1.0f;
    cfg.moe_router_load_balancing_type = {"aux_loss", "global_aux_loss"};
    cfg.moe_aux_loss_coeffs = {0.01f, 0.02f};
    cfg.moe_z_loss_coeff = 0.001f;
  }
  cfg.recompute.granularity = c.granularity;
  cfg.recompute.method = c.method;
  cfg.recompute.num_layers = c.num_layers;
  cfg.recompute.modules = c.modules;
  cfg.finalize();
  return cfg;
}

struct RunResult {
  std::vector<Tensor> losses, aux, input_grads;
  std::vector<Tensor> grads;         // every parameter's main_grad
  std::vector<Tensor> router_stats;  // per MoE layer: tokens per expert, metric sums
  int64_t held_bytes = 0;            // host bytes held by the two stashed forwards
};

// Two micro-batches through a chunk of layers [first, first + n) (the whole model when
// first == 0 and n == 4), in flight together.
RunResult run(const GPTConfig& cfg, const PipelineChunk& part) {
  const uint64_t seed = 1234;
  GPTModel model(cfg, seed, ModelParallel{}, 1, 1, part);
  testing::randomize_params(model, seed + 7);
  const int64_t B = 2, S = cfg.seq_length, T = B * S, H = cfg.hidden_size;
  std::vector<ChunkInput> in;
  std::vector<Tensor> dout;
  for (int64_t m = 0; m < 2; ++m) {
    const uint64_t s = seed + 100 * uint64_t(m);
    ChunkInput ci{B, S, testing::randint({B, S}, int32_t(cfg.vocab_size), s + 1),
                  testing::randint({B, S}, int32_t(cfg.vocab_size), s + 2), Tensor()};
    if (!part.pre_process) ci.hidden = testing::randn({T, H}, s + 3);
    in.push_back(ci);
    dout.push_back(part.post_process ? testing::randn({T}, s + 4, 0.5f)
                                     : testing::randn({T, H}, s + 5));
  }
  RunResult r;
  std::vector<ChunkActivations> stash;
  const int64_t before = host_allocator_stats().allocated_bytes;
  for (int64_t m = 0; m < 2; ++m) {
    ChunkOutput out = model.forward_chunk(in[m], ForwardContext{true, seed, 3, m});
    r.losses.push_back((out.hidden.defined() ? out.hidden : out.loss.losses).clone());
    if (out.loss.aux_losses.defined()) r.aux.push_back(out.loss.aux_losses.clone());
    stash.push_back(model.take_activations());
  }
  r.held_bytes = host_allocator_stats().allocated_bytes - before;
  for (int64_t m = 0; m < 2; ++m) {
    model.restore_activations(std::move(stash[m]));
    Tensor dx = model.backward_chunk(dout[m], 0.5f);
    if (dx.defined()) r.input_grads.push_back(dx);
  }
  for (Param* p : model.params()) r.grads.push_back(p->main_grad.clone());
  for (auto& layer : model.layers()) {
    if (!layer->moe) continue;
    r.router_stats.push_back(layer->moe->router.tokens_per_expert().clone());
    r.router_stats.push_back(layer->moe->router.metric_sums().clone());
  }
  return r;
}

void expect_bitwise(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                    const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(testing::allclose(got[i], want[i], 0, 0)) << what << " " << i;
}

class Recompute : public ::testing::TestWithParam<testing::TinyGptVariant> {};

TEST_P(Recompute, EveryChoiceEqualsKeepingEverything) {
  const testing::TinyGptVariant& v = GetParam();
  const std::vector<PipelineChunk> parts = {
      {},                      // the whole model
      {1, 3, false, true},     // a last stage: input gradient, no embedding
  };
  for (const PipelineChunk& part : parts) {
    const RunResult want = run(config(v, Choice{"none"}), part);
    for (const Choice& c : choices()) {
      SCOPED_TRACE(c.name + ", layers from " + std::to_string(part.first_layer));
      const RunResult got = run(config(v, c), part);
      expect_bitwise(got.losses, want.losses, "output");
      expect_bitwise(got.aux, want.aux, "aux loss");
      expect_bitwise(got.input_grads, want.input_grads, "input gradient");
      expect_bitwise(got.grads, want.grads, "parameter gradient");
      expect_bitwise(got.router_stats, want.router_stats, "router statistics");
      // Every choice that applies to the variant keeps less; moe and shared_experts only
      // apply to MoE models (shared_experts with a shared expert).
      const bool applies = !(c.name == "moe" && !v.moe) &&
                           !(c.name == "shared_experts" && !v.shared_expert);
      if (applies) {
        EXPECT_LT(got.held_bytes, want.held_bytes);
      } else {
        EXPECT_EQ(got.held_bytes, want.held_bytes);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, Recompute, ::testing::ValuesIn(testing::tiny_gpt_variants()),
                         [](const auto& info) { return info.param.name; });

// The layers a full recompute covers, as Megatron's recompute.py divides a chunk.
TEST(RecomputeConfig, FullGroups) {
  RecomputeConfig rc;
  rc.granularity = RecomputeGranularity::Full;
  rc.method = RecomputeMethod::Uniform;
  rc.num_layers = 2;
  const std::vector<int64_t> start = {0, 0, 2, 2, 4}, end = {2, 2, 4, 4, 5};
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(rc.full_group_start(i, 5), start[size_t(i)]) << i;
    EXPECT_EQ(rc.full_group_end(i, 5), end[size_t(i)]) << i;
  }
  rc.method = RecomputeMethod::Block;
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(rc.full_group_start(i, 5), i < 2 ? i : -1) << i;
    EXPECT_EQ(rc.full_group_end(i, 5), i < 2 ? i + 1 : -1) << i;
  }
  rc.granularity = RecomputeGranularity::Selective;
  EXPECT_EQ(rc.full_group_start(0, 5), -1);
  EXPECT_TRUE(rc.selective(kRecomputeCoreAttn));
  EXPECT_FALSE(rc.selective(kRecomputeMlp));
  EXPECT_EQ(recompute_module_bit("shared_experts"), kRecomputeSharedExperts);
  EXPECT_EQ(recompute_module_bit("attn"), 0u);
  EXPECT_EQ(recompute_module_names(kRecomputeMlp | kRecomputeCoreAttn), "core_attn,mlp");
}

}  // namespace
}  // namespace megaton
