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
      {"mla_up_proj", selective, RecomputeMethod::None, 0, kRecomputeMlaUpProj},
      {"mla_up_proj_core_attn", selective, RecomputeMethod::None, 0,
       kRecomputeMlaUpProj | kRecomputeCoreAttn},
      {"all_selective", selective, RecomputeMethod::None, 0,
       kRecomputeCoreAttn | kRecomputeLayernorm | kRecomputeMlp | kRecomputeMoe |
           kRecomputeSharedExperts | kRecomputeMoeAct | kRecomputeMlaUpProj},
  };
}

// The tiny variants with 4 layers (two model chunks' worth of groups), and for MoE every
// router feature a replay must reproduce: jitter, token dropping (or, without it, the
// dispatcher's device-side counts), the global aux loss's running counts (which a second
// routing would advance), the z-loss. fp8: the linear layers' GEMMs in FP8 by that recipe.
GPTConfig config(const testing::TinyGptVariant& v, const Choice& c, bool capacity = true,
                 const char* fp8 = nullptr) {
  GPTConfig cfg = testing::tiny_gpt_config(v);
  cfg.num_layers = 4;
  if (fp8 != nullptr) {
    cfg.fp8.enabled = true;
    cfg.fp8.recipe = std::string(fp8) == "delayed" ? Fp8Recipe::Delayed : Fp8Recipe::Tensorwise;
    cfg.fp8.amax_history_len = 4;
    cfg.seq_length = 8;  // every FP8 GEMM dimension a multiple of 16: 16 tokens,
    cfg.moe_ffn_hidden_size = 32;  // 32 expert features
  }
  if (v.moe) {
    cfg.moe_layer_pattern = {0, 1, 1, 0};  // dense and MoE layers in one recompute group
    cfg.moe_input_jitter_eps = 0.01f;
    cfg.moe_expert_capacity_factor = capacity ? 1.0f : 0.0f;
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
                  testing::randint({B, S}, int32_t(cfg.vocab_size), s + 2), Tensor(), Tensor()};
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
    if (!layer->moe()) continue;
    r.router_stats.push_back(layer->moe()->router.tokens_per_expert().clone());
    r.router_stats.push_back(layer->moe()->router.metric_sums().clone());
  }
  return r;
}

void expect_bitwise(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                    const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(testing::allclose(got[i], want[i], 0, 0)) << what << " " << i;
}

// Bytes a choice must free at least, for two micro-batches of 2 x seq_length tokens on the
// chunk's layers (fp32 on the CPU): core_attn the attention output [T, heads x d] of every
// layer, mlp fc1's output [T, fc1 outputs] of every dense layer (less, under FP8, the
// input the MLP then keeps beside fc1's FP8 copy). 0 for the others (they are only
// required to keep less).
int64_t least_saving(const GPTConfig& cfg, const PipelineChunk& part, const Choice& c) {
  const int64_t T = 2 * cfg.seq_length, layers = part.num_layers < 0 ? cfg.num_layers : part.num_layers;
  const bool core_attn = c.granularity == RecomputeGranularity::Selective &&
                         (c.modules & kRecomputeCoreAttn) != 0;
  const bool mlp = c.granularity == RecomputeGranularity::Selective &&
                   (c.modules & kRecomputeMlp) != 0;
  int64_t bytes = 0;
  for (int64_t l = part.first_layer; l < part.first_layer + layers; ++l) {
    const int64_t head_out = cfg.multi_latent_attention ? cfg.v_head_dim : cfg.kv_channels;
    if (core_attn) bytes += T * cfg.num_attention_heads * head_out * 4;
    if (mlp && !cfg.is_moe_layer(l)) {
      bytes += T * (cfg.swiglu ? 2 : 1) * cfg.ffn_hidden_size * 4;
      // FP8: the MLP keeps its input x (fp32 here) where fc1 kept its 1-byte FP8 x^T.
      if (cfg.fp8.enabled) bytes -= T * cfg.hidden_size * 3;
    }
  }
  return 2 * bytes;
}

// Every choice against keeping everything, on the whole model and on a last pipeline
// stage (input gradient, no embedding).
void check_choices(const testing::TinyGptVariant& v, bool capacity, const char* fp8,
                   const std::vector<Choice>& list) {
  const std::vector<PipelineChunk> parts = {{}, {1, 3, false, true}};
  for (const PipelineChunk& part : parts) {
    const RunResult want = run(config(v, Choice{"none"}, capacity, fp8), part);
    for (const Choice& c : list) {
      SCOPED_TRACE(c.name + ", layers from " + std::to_string(part.first_layer));
      const GPTConfig cfg = config(v, c, capacity, fp8);
      const RunResult got = run(cfg, part);
      expect_bitwise(got.losses, want.losses, "output");
      expect_bitwise(got.aux, want.aux, "aux loss");
      expect_bitwise(got.input_grads, want.input_grads, "input gradient");
      expect_bitwise(got.grads, want.grads, "parameter gradient");
      expect_bitwise(got.router_stats, want.router_stats, "router statistics");
      // Every choice that applies to the variant keeps less; moe and shared_experts only
      // apply to MoE models (shared_experts with a shared expert).
      const bool applies = !(c.name == "moe" && !v.moe) &&
                           !(c.name == "shared_experts" && !v.shared_expert) &&
                           !(c.name == "mla_up_proj" && !v.mla);
      if (applies) {
        EXPECT_LT(got.held_bytes, want.held_bytes);
        EXPECT_GE(want.held_bytes - got.held_bytes, least_saving(cfg, part, c));
      } else {
        EXPECT_EQ(got.held_bytes, want.held_bytes);
      }
    }
  }
}

class Recompute : public ::testing::TestWithParam<testing::TinyGptVariant> {};

TEST_P(Recompute, EveryChoiceEqualsKeepingEverything) { check_choices(GetParam(), true, nullptr, choices()); }

// Without token dropping the dispatcher keeps the token counts on the device: the recompute
// puts them back (MoELayer::keep_routing) and the re-run makes them again.
TEST_P(Recompute, EveryChoiceWithoutTokenDropping) {
  if (!GetParam().moe) GTEST_SKIP() << "dense";
  check_choices(GetParam(), false, nullptr, choices());
}

// FP8 (on the CPU twins): per-tensor current scaling recomputes the same scales, so every
// choice is exact; the delayed recipe allows the choices that run no forward GEMM again
// (a recomputed input is quantized with the scale kept from the forward).
TEST_P(Recompute, Fp8Recipes) {
  check_choices(GetParam(), true, "tensorwise", choices());
  std::vector<Choice> delayed;
  for (const Choice& c : choices())
    if (c.name == "core_attn" || c.name == "layernorm") delayed.push_back(c);
  check_choices(GetParam(), true, "delayed", delayed);
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

namespace megaton {
namespace {

// A forward-only pass (evaluation) drops each layer's saved state right after its forward:
// the same losses and aux losses as a forward that keeps it, with a lower host peak.
TEST(ForwardOnly, SameLossesLowerPeak) {
  for (const testing::TinyGptVariant& v : testing::tiny_gpt_variants()) {
    SCOPED_TRACE(v.name);
    GPTConfig cfg = testing::tiny_gpt_config(v);
    cfg.num_layers = 4;
    cfg.finalize();
    GPTModel model(cfg, 1234);
    const Tensor tokens = testing::randint({2, cfg.seq_length}, int32_t(cfg.vocab_size), 5);
    const Tensor labels = testing::randint({2, cfg.seq_length}, int32_t(cfg.vocab_size), 6);
    int64_t peak[2] = {0, 0};
    std::vector<MicroBatchLoss> out(2);
    for (int forward_only = 0; forward_only < 2; ++forward_only) {
      ForwardContext ctx{false, 1234, 0, 0};
      ctx.forward_only = forward_only == 1;
      reset_peak_host_memory();
      const int64_t before = host_allocator_stats().allocated_bytes;
      out[forward_only] = model.forward(tokens, labels, ctx);
      peak[forward_only] = host_allocator_stats().peak_allocated_bytes - before;
      model.take_activations();
    }
    EXPECT_TRUE(testing::allclose(out[1].losses, out[0].losses, 0, 0));
    EXPECT_EQ(out[1].aux_loss(), out[0].aux_loss());
    EXPECT_LT(peak[1], peak[0]);
  }
}

}  // namespace
}  // namespace megaton
