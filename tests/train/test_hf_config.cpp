// hf_import_config / hf_export_config for NemotronH (train/hf_config.h): the golden
// config's flags make the model docs/golden.md describes; every form of the layer types
// gives the same pattern; what Megatron's hybrid model cannot express is refused with one
// line naming the key; what is only approximately the same is a warning; the exported
// config.json reads back to the same flags, and what NemotronH cannot express is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "ckpt/safetensors.h"
#include "core/error.h"
#include "train/checkpoint_args.h"
#include "train/hf_config.h"

namespace megaton {
namespace {

using nlohmann::json;

struct NemotronGolden {
  json config;
  std::string pattern;  // the file's metadata "hybrid_layer_pattern"
};

const NemotronGolden& golden() {
  static const NemotronGolden g = [] {
    const ckpt::SafetensorsFile f = ckpt::load_safetensors(
        std::string(MEGATON_SOURCE_DIR) + "/tests/golden/nemotron_h_tiny.safetensors");
    return NemotronGolden{json::parse(f.metadata.at("config")),
                          f.metadata.at("hybrid_layer_pattern")};
  }();
  return g;
}

// The golden config with `key` set to `value` (null removes it).
json with(const std::string& key, const json& value) {
  json c = golden().config;
  if (value.is_null())
    c.erase(key);
  else
    c[key] = value;
  return c;
}

std::string flag(const HFImport& in, const std::string& key) {
  auto it = in.flags.find(key);
  return it == in.flags.end() ? "(absent)" : it->second.at(0);
}

// The model the flags make, as `megaton convert` makes it (a NullTokenizer of 96 tokens).
GPTConfig model_of(const HFImport& in) {
  RawOptions raw = in.flags;
  raw["tokenizer-type"] = {"NullTokenizer"};
  raw["vocab-size"] = {"95"};
  raw["make-vocab-size-divisible-by"] = {"1"};
  GPTConfig cfg = parse_model_args(raw).model;
  cfg.vocab_size = 96;
  cfg.finalize();
  return cfg;
}

bool warned(const HFImport& in, const std::string& needle) {
  for (const std::string& w : in.warnings)
    if (w.find(needle) != std::string::npos) return true;
  return false;
}

// The error hf_import_config raises for `config`, which must be one line.
std::string refusal(const json& config) {
  try {
    hf_import_config(config, "config.json");
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_EQ(what.rfind("config.json: ", 0), 0u) << what;
    return what;
  }
  ADD_FAILURE() << "no error for " << config.dump();
  return "";
}

TEST(HFConfigNemotronH, GoldenConfigMakesTheGoldenModel) {
  const json& hf = golden().config;
  const HFImport in = hf_import_config(hf, "config.json");
  EXPECT_EQ(in.family, HFFamily::NemotronH);
  EXPECT_EQ(flag(in, "num-layers"), "(absent)");  // the pattern's, as in Megatron
  const GPTConfig c = model_of(in);
  EXPECT_EQ(c.hybrid_layer_pattern, golden().pattern);
  EXPECT_EQ(c.num_layers, int64_t(golden().pattern.size()));
  EXPECT_EQ(c.hidden_size, hf.at("hidden_size"));
  EXPECT_EQ(c.ffn_hidden_size, hf.at("intermediate_size"));
  EXPECT_EQ(c.num_attention_heads, hf.at("num_attention_heads"));
  EXPECT_EQ(c.num_query_groups, hf.at("num_key_value_heads"));
  EXPECT_EQ(c.kv_channels, hf.at("head_dim"));
  EXPECT_EQ(c.max_position_embeddings, hf.at("max_position_embeddings"));
  EXPECT_EQ(c.position_embedding_type, PositionEmbedding::None);
  EXPECT_EQ(c.normalization, Normalization::RMSNorm);
  EXPECT_FLOAT_EQ(c.norm_epsilon, hf.at("layer_norm_epsilon").get<float>());
  EXPECT_TRUE(c.squared_relu);
  EXPECT_FALSE(c.swiglu);
  EXPECT_TRUE(c.disable_bias_linear);
  EXPECT_TRUE(c.untie_embeddings_and_output_weights);
  EXPECT_EQ(c.mamba_num_heads, hf.at("mamba_num_heads"));
  EXPECT_EQ(c.mamba_head_dim, hf.at("mamba_head_dim"));
  EXPECT_EQ(c.mamba_num_groups, hf.at("n_groups"));
  EXPECT_EQ(c.mamba_state_dim, hf.at("ssm_state_size"));
  EXPECT_EQ(c.num_experts, hf.at("n_routed_experts"));
  EXPECT_EQ(c.moe_router_topk, hf.at("num_experts_per_tok"));
  EXPECT_EQ(c.moe_ffn_hidden_size, hf.at("moe_intermediate_size"));
  EXPECT_EQ(c.moe_shared_expert_intermediate_size, hf.at("moe_shared_expert_intermediate_size"));
  EXPECT_EQ(c.moe_router_score_function, "sigmoid");
  EXPECT_TRUE(c.moe_router_enable_expert_bias);
  EXPECT_FLOAT_EQ(c.moe_router_topk_scaling_factor, hf.at("routed_scaling_factor").get<float>());
  EXPECT_EQ(c.moe_router_num_groups, 0);  // n_group 1: no group limit
  EXPECT_EQ(in.vocab_size, hf.at("vocab_size"));
  EXPECT_EQ(in.layout.num_layers, c.num_layers);
  EXPECT_EQ(in.layout.num_query_groups, c.num_query_groups);
  EXPECT_EQ(in.layout.kv_channels, c.kv_channels);
  EXPECT_EQ(in.layout.num_experts, c.num_experts);
  // Megatron does not clamp dt; the gated norm's epsilon is the same at 1e-5.
  EXPECT_TRUE(warned(in, "time_step_min"));
  EXPECT_FALSE(warned(in, "gated norm"));
}

TEST(HFConfigNemotronH, EveryFormOfTheLayerTypesGivesThePattern) {
  const std::string& pattern = golden().pattern;  // M*M-ME
  const auto pattern_of = [](const json& c) {
    return flag(hf_import_config(c, "config.json"), "hybrid-layer-pattern");
  };
  json legacy = json::array();
  for (const char s : pattern)
    legacy.push_back(s == 'M' ? "mamba" : s == '*' ? "attention" : s == '-' ? "mlp" : "moe");
  EXPECT_EQ(pattern_of(with("layers_block_type", legacy)), pattern);
  json old = with("layers_block_type", nullptr);
  old["hybrid_override_pattern"] = pattern;
  EXPECT_EQ(pattern_of(old), pattern);
  json renamed = with("layers_block_type", nullptr);
  renamed["layer_types"] = golden().config.at("layers_block_type");
  EXPECT_EQ(pattern_of(renamed), pattern);
  // transformers reads hybrid_override_pattern only without the list.
  EXPECT_EQ(pattern_of(with("hybrid_override_pattern", "MMMMMM")), pattern);
  const HFImport counted = hf_import_config(with("num_hidden_layers", 4), "config.json");
  EXPECT_EQ(flag(counted, "hybrid-layer-pattern"), pattern);
  EXPECT_TRUE(warned(counted, "num_hidden_layers 4"));
  // Older configs' key names: mamba_n_groups over n_groups, as transformers' __post_init__.
  EXPECT_EQ(flag(hf_import_config(with("mamba_n_groups", 4), "config.json"), "mamba-num-groups"),
            "4");
}

TEST(HFConfigNemotronH, WhatMegatronCannotExpressIsRefusedNamingTheKey) {
  json no_types = with("layers_block_type", nullptr);
  EXPECT_NE(refusal(no_types).find("'layers_block_type'"), std::string::npos);
  EXPECT_NE(
      refusal(with("layers_block_type", {"mamba", "cross_attention"})).find("cross_attention"),
      std::string::npos);
  no_types["hybrid_override_pattern"] = "M*X";
  EXPECT_NE(refusal(no_types).find("'X'"), std::string::npos);
  const std::vector<std::pair<std::string, json>> refused = {
      {"mlp_hidden_act", "silu"},   {"mamba_hidden_act", "gelu"}, {"conv_kernel", 3},
      {"mamba_d_conv", 2},          {"use_conv_bias", false},     {"mamba_conv_bias", false},
      {"use_bias", true},           {"mlp_bias", true},           {"attention_bias", true},
      {"moe_latent_size", 32},      {"head_dim", nullptr},        {"num_key_value_heads", nullptr},
      {"mamba_num_heads", nullptr}, {"ssm_state_size", nullptr}};
  for (const auto& [key, value] : refused) {
    SCOPED_TRACE(key);
    EXPECT_NE(refusal(with(key, value)).find(key), std::string::npos);
  }
  // Megatron renormalises the sigmoid top-k exactly when k > 1.
  EXPECT_NE(refusal(with("norm_topk_prob", false)).find("norm_topk_prob"), std::string::npos);
  EXPECT_NE(refusal(with("num_experts_per_tok", 1)).find("norm_topk_prob"), std::string::npos);
  json top1 = with("num_experts_per_tok", 1);
  top1["norm_topk_prob"] = false;
  EXPECT_EQ(flag(hf_import_config(top1, "config.json"), "moe-router-topk"), "1");
  // Without E layers the MoE keys are not read.
  json dense = with("layers_block_type", {"mamba", "attention", "mlp"});
  dense["moe_latent_size"] = 32;
  EXPECT_EQ(flag(hf_import_config(dense, "config.json"), "num-experts"), "(absent)");
}

TEST(HFConfigNemotronH, ApproximationsAreWarnings) {
  EXPECT_TRUE(
      warned(hf_import_config(with("layer_norm_epsilon", 1e-6), "config.json"), "gated norm"));
  json groups = with("n_group", 2);
  groups["topk_group"] = 2;  // top-2 of 2 groups: transformers' best-2 sum vs Megatron's best 1
  const HFImport grouped = hf_import_config(groups, "config.json");
  EXPECT_EQ(flag(grouped, "moe-router-num-groups"), "2");
  EXPECT_TRUE(warned(grouped, "group"));
  EXPECT_TRUE(
      warned(hf_import_config(with("num_nextn_predict_layers", 1), "config.json"), "mtp.*"));
  // No Mamba layer: no dt clamp to warn of.
  EXPECT_FALSE(warned(hf_import_config(with("layers_block_type", {"attention", "moe"}), "c"),
                      "time_step_min"));
}

TEST(HFConfigNemotronH, ExportedConfigReadsBackToTheSameFlags) {
  const HFImport in = hf_import_config(golden().config, "config.json");
  const GPTConfig c = model_of(in);
  const HFExport out = hf_export_config(c, 96);
  EXPECT_EQ(out.family, HFFamily::NemotronH);
  EXPECT_EQ(out.config.at("architectures")[0], "NemotronHForCausalLM");
  EXPECT_EQ(out.config.at("layers_block_type"), golden().config.at("layers_block_type"));
  EXPECT_FALSE(out.zero_expert_bias);
  const HFImport back = hf_import_config(out.config, "exported");
  EXPECT_EQ(back.flags, in.flags);
  EXPECT_TRUE(std::find(out.carried_keys.begin(), out.carried_keys.end(), "chunk_size") !=
              out.carried_keys.end());

  // Top-1 routing: not renormalised (Megatron's), the expert bias zeros when there is none.
  GPTConfig top1 = c;
  top1.moe_router_topk = 1;
  top1.moe_router_enable_expert_bias = false;
  const HFExport one = hf_export_config(top1, 96);
  EXPECT_EQ(one.config.at("norm_topk_prob"), false);
  EXPECT_TRUE(one.zero_expert_bias);
}

TEST(HFConfigNemotronH, ExportRefusesWhatNemotronHCannotExpress) {
  const GPTConfig base = model_of(hf_import_config(golden().config, "config.json"));
  const auto refused = [&](const std::string& needle, auto&& edit) {
    SCOPED_TRACE(needle);
    GPTConfig c = base;
    edit(c);
    try {
      hf_export_config(c, 96);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("nemotron_h"), std::string::npos) << e.what();
    }
  };
  refused("position-embedding-type",
          [](GPTConfig& c) { c.position_embedding_type = PositionEmbedding::Rope; });
  refused("squared-relu", [](GPTConfig& c) {
    c.squared_relu = false;
    c.swiglu = true;
  });
  refused("qk-layernorm", [](GPTConfig& c) { c.qk_layernorm = true; });
  refused("disable-bias-linear", [](GPTConfig& c) { c.disable_bias_linear = false; });
  refused("score-function", [](GPTConfig& c) {
    c.moe_router_score_function = "softmax";
    c.moe_router_enable_expert_bias = false;
  });
  refused("shared", [](GPTConfig& c) { c.moe_shared_expert_intermediate_size = 0; });
  refused("shared-expert-gate", [](GPTConfig& c) { c.moe_shared_expert_gate = true; });
}

}  // namespace
}  // namespace megaton
