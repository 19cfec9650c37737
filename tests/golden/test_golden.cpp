// Golden parity: tiny Llama, Mixtral and Qwen3-MoE models against Hugging Face transformers
// (fp32).
// tools/make_golden.py wrote the weights, inputs, logits, loss and every gradient.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ckpt/hf_import.h"
#include "ckpt/safetensors.h"
#include "common/testing.h"
#include "model/gpt.h"
#include "ops/ops.h"

namespace megaton {
namespace {

struct Golden {
  ckpt::SafetensorsFile file;
  GPTConfig cfg;
  ckpt::HFLayout layout;
};

Golden load_golden(const std::string& name) {
  Golden g;
  g.file = ckpt::load_safetensors(std::string(MEGATON_SOURCE_DIR) + "/tests/golden/" + name);
  auto hf = nlohmann::json::parse(g.file.metadata.at("config"));
  GPTConfig& c = g.cfg;
  c.num_layers = hf.at("num_hidden_layers");
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
  c.norm_epsilon = hf.at("rms_norm_eps");
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

}  // namespace
}  // namespace megaton
