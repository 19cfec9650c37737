// Golden parity: tiny Llama, Mixtral, Qwen3-MoE, DeepSeek-V3 and NemotronH models against
// Hugging Face transformers (fp32).
// tools/make_golden.py (tools/make_deepseek_v3_golden.py for DeepSeek-V3) wrote the weights,
// inputs, logits, loss and every gradient.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ckpt/hf_import.h"
#include "ckpt/safetensors.h"
#include "common/testing.h"
#include "model/gpt.h"
#include "model/rope_scaling.h"
#include "ops/ops.h"

namespace megaton {
namespace {

struct Golden {
  ckpt::SafetensorsFile file;
  GPTConfig cfg;
  ckpt::HFLayout layout;
};

// DeepseekV3Config -> Megatron's flags: multi-latent attention (with its latent norms, which
// Megatron creates under --qk-layernorm), YaRN, the group-limited sigmoid router with expert
// bias and scaling, shared experts, first_k_dense_replace dense layers.
void set_deepseek_v3(const nlohmann::json& hf, GPTConfig& c) {
  c.multi_latent_attention = true;
  c.group_query_attention = false;  // MLA has no query groups (num_key_value_heads = heads)
  EXPECT_EQ(hf.at("num_key_value_heads"), hf.at("num_attention_heads"));
  c.num_query_groups = 0;
  c.kv_channels = 0;  // HF's head_dim is qk_rope_head_dim; MLA's head dims are its own
  c.q_lora_rank = hf.at("q_lora_rank").is_null() ? 0 : hf["q_lora_rank"].get<int64_t>();
  c.kv_lora_rank = hf.at("kv_lora_rank");
  c.qk_head_dim = hf.at("qk_nope_head_dim");
  c.qk_pos_emb_head_dim = hf.at("qk_rope_head_dim");
  c.v_head_dim = hf.at("v_head_dim");
  c.qk_layernorm = true;  // q_a_layernorm / kv_a_layernorm
  // HF's q_a_layernorm / kv_a_layernorm always use eps 1e-6, Megatron's latent norms
  // --norm-epsilon: the same only when rms_norm_eps is 1e-6.
  EXPECT_EQ(hf.at("rms_norm_eps").get<double>(), 1e-6);
  // Megatron's MLA always rotates interleaved pairs (HF's rope_interleave true).
  EXPECT_TRUE(hf.value("rope_interleave", true));
  const nlohmann::json& rope = hf.at("rope_parameters");
  if (rope.at("rope_type") == "yarn") {
    c.rope_type = RopeType::Yarn;
    c.yarn.factor = rope.at("factor");
    c.yarn.original_max_position_embeddings = rope.at("original_max_position_embeddings");
    c.yarn.beta_fast = rope.value("beta_fast", 32.0);
    c.yarn.beta_slow = rope.value("beta_slow", 1.0);
    c.yarn.mscale = rope.value("mscale", 1.0);
    c.yarn.mscale_all_dim = rope.value("mscale_all_dim", 0.0);
    EXPECT_TRUE(rope.value("truncate", true));  // the rounded correction range
  } else {
    EXPECT_EQ(rope.at("rope_type"), "default");
  }

  c.num_experts = hf.at("n_routed_experts");
  c.moe_router_topk = hf.at("num_experts_per_tok");
  c.moe_ffn_hidden_size = hf.at("moe_intermediate_size");
  c.moe_shared_expert_intermediate_size =
      hf.at("n_shared_experts").get<int64_t>() * c.moe_ffn_hidden_size;
  const int64_t dense = hf.at("first_k_dense_replace");
  for (int64_t i = 0; i < c.num_layers; ++i) c.moe_layer_pattern.push_back(i >= dense ? 1 : 0);
  c.moe_router_score_function = "sigmoid";
  c.moe_router_enable_expert_bias = true;  // e_score_correction_bias, for the choice only
  c.moe_router_num_groups = hf.at("n_group");
  c.moe_router_group_topk = hf.at("topk_group");
  // HF scores a group by the sum of its best 2 selection scores, Megatron by its best
  // topk / group_topk (tests/golden/test_router_hf.cpp): the golden has topk = 2 topk_group.
  EXPECT_EQ(c.moe_router_topk, 2 * c.moe_router_group_topk);
  c.moe_router_topk_scaling_factor = hf.at("routed_scaling_factor");
  // Megatron normalises sigmoid probabilities whenever top-k > 1 (HF's norm_topk_prob).
  EXPECT_TRUE(hf.at("norm_topk_prob").get<bool>());
  c.moe_aux_loss_coeff = 0.0f;  // HF DeepseekV3ForCausalLM adds no auxiliary loss
}

// NemotronHConfig -> Megatron's hybrid flags (docs/golden.md "nemotron_h_tiny"): the layer
// pattern, no position embedding, squared-ReLU MLPs and experts, the Mamba-2 sizes, a
// sigmoid router with expert bias, scaling and one shared expert.
void set_nemotron_h(const nlohmann::json& hf, const std::string& pattern, GPTConfig& c) {
  c.hybrid_layer_pattern = pattern;
  c.num_layers = 0;  // the pattern's
  c.norm_epsilon = hf.at("layer_norm_epsilon");
  // Megatron's gated norm has eps 1e-5 whatever --norm-epsilon; HF uses layer_norm_epsilon.
  EXPECT_EQ(hf.at("layer_norm_epsilon").get<double>(), 1e-5);
  c.position_embedding_type = PositionEmbedding::None;
  EXPECT_EQ(hf.at("mlp_hidden_act"), "relu2");
  c.swiglu = false;
  c.squared_relu = true;
  EXPECT_EQ(hf.at("mamba_hidden_act"), "silu");
  EXPECT_TRUE(hf.at("use_conv_bias").get<bool>());
  EXPECT_FALSE(hf.at("use_bias").get<bool>());
  c.mamba_state_dim = hf.at("ssm_state_size");
  c.mamba_head_dim = hf.at("mamba_head_dim");
  c.mamba_num_groups = hf.at("n_groups");
  c.mamba_num_heads = hf.at("mamba_num_heads");
  c.mamba_conv_kernel = hf.at("conv_kernel");
  c.mamba_chunk_size = hf.at("chunk_size");  // 8: the 20 tokens cross chunks
  c.num_experts = hf.at("n_routed_experts");
  c.moe_router_topk = hf.at("num_experts_per_tok");
  c.moe_ffn_hidden_size = hf.at("moe_intermediate_size");
  c.moe_shared_expert_intermediate_size = hf.at("moe_shared_expert_intermediate_size");
  c.moe_router_score_function = "sigmoid";
  c.moe_router_enable_expert_bias = true;
  EXPECT_EQ(hf.at("n_group"), 1);  // no group-limited routing
  c.moe_router_topk_scaling_factor = hf.at("routed_scaling_factor");
  EXPECT_TRUE(hf.at("norm_topk_prob").get<bool>());
  c.moe_aux_loss_coeff = 0.0f;
}

Golden load_golden(const std::string& name) {
  Golden g;
  g.file = ckpt::load_safetensors(std::string(MEGATON_SOURCE_DIR) + "/tests/golden/" + name);
  auto hf = nlohmann::json::parse(g.file.metadata.at("config"));
  GPTConfig& c = g.cfg;
  c.num_layers = hf.value("num_hidden_layers", int64_t(0));
  c.hidden_size = hf.at("hidden_size");
  c.ffn_hidden_size = hf.at("intermediate_size");
  c.num_attention_heads = hf.at("num_attention_heads");
  c.group_query_attention = true;
  c.num_query_groups = hf.at("num_key_value_heads");
  c.kv_channels = hf.contains("head_dim") && !hf["head_dim"].is_null()
                      ? hf["head_dim"].get<int64_t>()
                      : c.hidden_size / c.num_attention_heads;
  c.vocab_size = hf.at("vocab_size");
  c.make_vocab_size_divisible_by = 1;  // HF does not pad; keep the logits comparable
  c.seq_length = g.file.tensors.at("input.tokens").dim(1);
  c.max_position_embeddings = hf.at("max_position_embeddings");
  c.normalization = Normalization::RMSNorm;
  c.norm_epsilon = hf.value("rms_norm_eps", 1e-6);
  c.swiglu = true;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.rotary_base = 10000.0f;
  if (hf.contains("rope_theta") && !hf["rope_theta"].is_null()) c.rotary_base = hf["rope_theta"];
  if (hf.contains("rope_parameters") && hf["rope_parameters"].contains("rope_theta"))
    c.rotary_base = hf["rope_parameters"]["rope_theta"];
  c.untie_embeddings_and_output_weights = !hf.value("tie_word_embeddings", false);
  c.disable_bias_linear = true;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  // Qwen3's q_norm / k_norm: RMSNorm over each query and key head before RoPE.
  const std::string model_type = hf.value("model_type", "");
  c.qk_layernorm = model_type == "qwen3" || model_type == "qwen3_moe";
  if (hf.contains("num_local_experts")) {
    c.num_experts = hf.at("num_local_experts");
    c.moe_router_topk = hf.at("num_experts_per_tok");
    c.moe_ffn_hidden_size = hf.value("moe_intermediate_size", c.ffn_hidden_size);
    c.moe_aux_loss_coeff = 0.0f;  // HF's aux loss differs from Megatron's (tested apart)
    // Megatron's default softmax router (top-k logits, softmax over those k) is Mixtral's
    // and Qwen3-MoE's with norm_topk_prob (softmax over all, top-k, renormalised).
    EXPECT_TRUE(hf.value("norm_topk_prob", true)) << name;
    EXPECT_EQ(hf.value("decoder_sparse_step", 1), 1) << name << ": every layer MoE";
    EXPECT_TRUE(hf.value("mlp_only_layers", nlohmann::json::array()).empty()) << name;
  }
  if (model_type == "deepseek_v3") set_deepseek_v3(hf, c);
  if (model_type == "nemotron_h") set_nemotron_h(hf, g.file.metadata.at("hybrid_layer_pattern"), c);
  EXPECT_FALSE(hf.value("attention_bias", false)) << name;
  c.finalize();
  g.layout = {c.num_layers, c.num_attention_heads, c.num_query_groups, c.kv_channels,
              c.num_experts};
  return g;
}

void check_parity(const std::string& file) {
  Golden g = load_golden(file);
  GPTModel model(g.cfg, /*seed=*/1);
  auto weights = ckpt::hf_to_megaton(g.file.tensors, g.layout);
  auto grads = ckpt::hf_to_megaton(g.file.tensors, g.layout, "grad.");
  // Expert biases (DeepSeek-V3's e_score_correction_bias) are router state, not parameters.
  for (size_t i = 0; i < model.layers().size(); ++i) {
    MoELayer* moe = model.layers()[i]->moe();
    if (!moe || !moe->router.expert_bias.defined()) continue;
    const std::string name = "decoder.layers." + std::to_string(i) + ".mlp.router.expert_bias";
    ASSERT_TRUE(weights.count(name)) << name;
    ASSERT_EQ(weights[name].shape(), moe->router.expert_bias.shape()) << name;
    moe->router.expert_bias.copy_from(weights[name]);
    weights.erase(name);
    EXPECT_FALSE(grads.count(name)) << name << " has no gradient";
  }
  ASSERT_EQ(weights.size(), model.params().size());
  for (Param* p : model.params()) {
    ASSERT_TRUE(weights.count(p->name)) << p->name;
    ASSERT_EQ(weights[p->name].shape(), p->weight.shape()) << p->name;
    p->weight.copy_from(weights[p->name]);
  }
  const Tensor& tokens = g.file.tensors.at("input.tokens");
  const Tensor& labels = g.file.tensors.at("input.labels");
  int64_t T = tokens.numel();

  Tensor logits = model.logits(tokens);
  Tensor ref_logits = g.file.tensors.at("output.logits");
  double logits_error = testing::rel_error(logits, ref_logits);
  EXPECT_LE(logits_error, 1e-4) << file << " logits";

  ForwardContext ctx{false, 1, 0, 0};
  MicroBatchLoss out = model.forward(tokens, labels, ctx);
  double loss = ops::sum(out.losses) / double(T);
  double ref_loss = g.file.tensors.at("output.loss").item(0);
  EXPECT_LE(std::fabs(loss - ref_loss) / std::fabs(ref_loss), 1e-5)
      << file << " loss " << loss << " vs " << ref_loss;

  Tensor dlosses = Tensor::empty({T});
  dlosses.fill(1.0f / float(T));
  model.backward(dlosses, 1.0f);
  double worst_grad_error = 0;
  std::string worst_grad;
  for (Param* p : model.params()) {
    ASSERT_TRUE(grads.count(p->name)) << p->name;
    double e = testing::rel_error(p->main_grad, grads[p->name]);
    if (e >= worst_grad_error) worst_grad = p->name;
    worst_grad_error = std::max(worst_grad_error, e);
    EXPECT_LE(e, 1e-4) << file << " grad " << p->name;
  }
  std::printf(
      "%s: logits rel error %.2e, loss rel error %.2e, worst gradient rel error %.2e "
      "(%s)\n",
      file.c_str(), logits_error, std::fabs(loss - ref_loss) / std::fabs(ref_loss),
      worst_grad_error, worst_grad.c_str());
}

TEST(Golden, LlamaMatchesHuggingFace) { check_parity("llama_tiny.safetensors"); }
TEST(Golden, MixtralMatchesHuggingFace) { check_parity("mixtral_tiny.safetensors"); }
// --qk-layernorm (q_norm / k_norm), head_dim 32 != hidden / heads, GQA, all layers MoE.
TEST(Golden, Qwen3MoeMatchesHuggingFace) { check_parity("qwen3_moe_tiny.safetensors"); }
// Multi-latent attention with q LoRA, YaRN with mscale != mscale_all_dim, v head dim !=
// qk head dim, a dense first layer, 16 experts in 4 groups (2 kept, top-4) with sigmoid
// scores, expert bias and scaling 2.5, one shared expert.
TEST(Golden, DeepseekV3MatchesHuggingFace) { check_parity("deepseek_v3_tiny.safetensors"); }
// NemotronH: Mamba-2, attention without RoPE, squared-ReLU MLP, MoE (docs/golden.md).
TEST(Golden, NemotronHMatchesHuggingFace) { check_parity("nemotron_h_tiny.safetensors"); }

// That model's YaRN numbers (the file's "yarn" metadata, in float64; the generator checked
// them against transformers': its float32 inverse frequencies to 1e-6, its cos/sin factor and
// softmax scale to 1e-12): the rope part's inverse frequencies, the cos/sin factor, the
// softmax scale.
TEST(Golden, DeepseekV3YarnMatchesHuggingFace) {
  Golden g = load_golden("deepseek_v3_tiny.safetensors");
  auto hf = nlohmann::json::parse(g.file.metadata.at("yarn"));
  const GPTConfig& c = g.cfg;
  std::vector<double> inv_freq = yarn_inv_freq(c.qk_pos_emb_head_dim, c.rotary_base, c.yarn);
  std::vector<double> want = hf.at("inv_freq");
  ASSERT_EQ(inv_freq.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(inv_freq[i], want[i], 1e-12 * want[i]) << "inv_freq[" << i << "]";
  EXPECT_NEAR(yarn_cos_sin_scale(c.yarn), hf.at("cos_sin_scale").get<double>(), 1e-12);
  EXPECT_NEAR(yarn_softmax_scale(c.yarn, c.qk_head_dim + c.qk_pos_emb_head_dim),
              hf.at("softmax_scale").get<double>(), 1e-12);
}

}  // namespace
}  // namespace megaton
