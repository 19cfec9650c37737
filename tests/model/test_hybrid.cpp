// Hybrid models (issue 23): the layer pattern's parsing and refusals, the layers it builds
// and their Megatron names, and generation carrying the Mamba layers' conv and SSM states
// instead of recomputing the prefix.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "model/gpt.h"
#include "model/hybrid_pattern.h"
#include "model/kv_cache.h"
#include "model/mamba_mixer.h"

namespace megaton {
namespace {

GPTConfig hybrid_config(const std::string& pattern) {
  GPTConfig c;
  c.hybrid_layer_pattern = pattern;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.ffn_hidden_size = 24;
  c.seq_length = 12;
  c.vocab_size = 31;
  c.make_vocab_size_divisible_by = 8;
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::None;
  c.disable_bias_linear = true;
  c.untie_embeddings_and_output_weights = true;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.init_method_std = 0.2f;
  c.mamba_head_dim = 4;
  c.mamba_num_groups = 2;
  c.mamba_state_dim = 4;
  c.mamba_chunk_size = 5;  // 12 tokens: chunks of 5, 5, 2
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 8;
  return c;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(HybridPattern, ParsesLayersAndPipelineSegments) {
  const HybridPattern p = parse_hybrid_pattern("M-M*|-ME");
  EXPECT_EQ(p.layers, "M-M*-ME");
  EXPECT_EQ(p.segment_layers, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(parse_hybrid_pattern("M+E").segment_layers, (std::vector<int64_t>{3}));
}

TEST(HybridPattern, RefusesWhatMegatronRefusesOrMegatonLacks) {
  EXPECT_NE(error_of([] { parse_hybrid_pattern("M-X"); }).find("'X' is not a layer symbol"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hybrid_pattern("MG"); }).find("gated delta net"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hybrid_pattern("MD"); }).find("sparse attention"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hybrid_pattern("M||-"); }).find("empty '|' segment"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hybrid_pattern("M-|"); }).find("empty '|' segment"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hybrid_pattern("M*+"); }).find("mixes"), std::string::npos);
  EXPECT_NE(error_of([] { parse_hybrid_pattern("M*/MM"); }).find("multi-token prediction"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hybrid_pattern(""); }).find("empty"), std::string::npos);
}

TEST(HybridConfig, RefusesMismatchedLayersAndSizes) {
  GPTConfig c = hybrid_config("M-M*");
  c.num_layers = 5;
  EXPECT_NE(error_of([&] { c.finalize(); }).find("has 4 layers but num-layers is 5"),
            std::string::npos);
  c = hybrid_config("M-E");
  c.num_experts = 0;
  EXPECT_NE(error_of([&] { c.finalize(); }).find("E (MoE) layers but num-experts"),
            std::string::npos);
  c = hybrid_config("M-");
  c.mamba_num_heads = 6;  // 6 heads in 4 groups
  c.mamba_num_groups = 4;
  EXPECT_NE(error_of([&] { c.finalize(); }).find("not divisible by mamba-num-groups"),
            std::string::npos);
  c = hybrid_config("M-");
  c.mamba_head_dim = 5;  // 2 x 16 = 32 channels
  EXPECT_NE(error_of([&] { c.finalize(); }).find("not divisible by mamba-head-dim"),
            std::string::npos);
  c = hybrid_config("M-");
  c.tensor_model_parallel_size = 4;  // 8 heads, 2 groups
  EXPECT_NE(error_of([&] { c.finalize(); }).find("tensor-model-parallel-size (4)"),
            std::string::npos);
}

// Each symbol builds its one part, under Megatron's HybridModel names.
TEST(HybridModel, LayersAndNamesFollowThePattern) {
  GPTConfig c = hybrid_config("M*-E");
  c.finalize();
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.mamba_num_heads, 8);  // 2 x hidden / head_dim
  GPTModel model(c, 7);
  std::set<std::string> names;
  for (const Param* p : model.params()) names.insert(p->name);
  for (const char* want :
       {"decoder.layers.0.norm.weight", "decoder.layers.0.mixer.in_proj.weight",
        "decoder.layers.0.mixer.conv1d.weight", "decoder.layers.0.mixer.conv1d.bias",
        "decoder.layers.0.mixer.dt_bias", "decoder.layers.0.mixer.A_log",
        "decoder.layers.0.mixer.D", "decoder.layers.0.mixer.norm.weight",
        "decoder.layers.0.mixer.out_proj.weight", "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.2.pre_mlp_layernorm.weight", "decoder.layers.2.mlp.linear_fc1.weight",
        "decoder.layers.3.pre_mlp_layernorm.weight", "decoder.layers.3.mlp.router.weight",
        "decoder.final_norm.weight"})
    EXPECT_TRUE(names.count(want)) << want;
  for (const char* absent :
       {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.layers.2.input_layernorm.weight", "decoder.final_layernorm.weight"})
    EXPECT_FALSE(names.count(absent)) << absent;
  // in_proj [z, x, B, C, dt]: 2 x 32 + 2 x 2 x 4 + 8 rows; conv1d [x, B, C] channels.
  auto* mamba = dynamic_cast<MambaMixer*>(model.layers()[0]->mixer.get());
  ASSERT_NE(mamba, nullptr);
  EXPECT_EQ(mamba->in_proj.weight.weight.shape(), (Shape{88, 16}));
  EXPECT_EQ(mamba->conv1d_weight.weight.shape(), (Shape{48, 1, 4}));
  // Megatron's initial ranges: A in [1, 16], dt = softplus(dt_bias) in [1e-3, 1e-1].
  for (float a : mamba->A_log.weight.to_vector()) {
    EXPECT_GE(a, 0.0f);
    EXPECT_LE(a, std::log(16.0f) + 1e-6f);
  }
  for (float b : mamba->dt_bias.weight.to_vector()) {
    const float dt = std::log1p(std::exp(b));
    EXPECT_GE(dt, 1e-3f * 0.999f);
    EXPECT_LE(dt, 0.1f * 1.001f);
  }
}

// Generation: a prefill and decode steps (each one token against the carried conv and SSM
// states and the attention's KV cache) give the logits of the whole sequence's forward.
TEST(HybridModel, GenerationCarriesTheMambaStates) {
  GPTConfig c = hybrid_config("M*M-");
  c.num_experts = 0;
  c.finalize();
  GPTModel model(c, 11);
  const std::vector<int32_t> tokens = {3, 17, 5, 29, 1, 8, 8, 22, 14, 0, 9, 30};
  const int64_t n = int64_t(tokens.size());
  const Tensor all = model.logits(Tensor::from_i32({1, n}, tokens));  // [n, V]
  const int64_t V = c.padded_vocab_size;
  for (int64_t prompt : {1, 3, 7}) {
    SCOPED_TRACE("prompt " + std::to_string(prompt));
    InferenceContext context(c, n);
    Tensor got = model.prefill(std::span(tokens).subspan(0, size_t(prompt)), context);
    for (int64_t t = prompt - 1; t < n; ++t) {
      if (t >= prompt) got = model.decode_step(tokens[size_t(t)], context);
      const Tensor want = all.rows(t, 1).view({V});
      EXPECT_TRUE(testing::allclose(got, want, 1e-4, 1e-5)) << "token " << t;
    }
  }
}

}  // namespace
}  // namespace megaton
