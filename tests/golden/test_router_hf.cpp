// TopKRouter against Hugging Face transformers' routers of a DeepSeek-V3- and a
// Qwen3-MoE-style model (tools/make_router_hf_golden.py ran DeepseekV3TopkRouter and
// Qwen3MoeTopKRouter in fp32 on random hidden states and recorded the chosen experts,
// their weights and, by torch autograd, the gradients of sum(weights * upstream) with
// respect to the hidden states and the router weight).
//
// Each HF config is translated into Megatron's flags here, which is what the test checks:
//   DeepSeek-V3: sigmoid scores, e_score_correction_bias = the expert bias,
//     n_group / topk_group = --moe-router-num-groups / --moe-router-group-topk,
//     routed_scaling_factor = --moe-router-topk-scaling-factor, norm_topk_prob = Megatron's
//     normalisation of sigmoid probabilities (always on for top-k > 1);
//   Qwen3-MoE: softmax over all experts, top-k, renormalised = Megatron's softmax without
//     pre-softmax (top-k of the logits, softmax over the k).
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/safetensors.h"
#include "model/router.h"

namespace megaton {
namespace {

const ckpt::SafetensorsFile& golden() {
  static const ckpt::SafetensorsFile f = ckpt::load_safetensors(
      std::string(MEGATON_SOURCE_DIR) + "/tests/golden/router_hf_golden.safetensors");
  return f;
}
const Tensor& tensor(const std::string& name) {
  auto it = golden().tensors.find(name);
  if (it == golden().tensors.end()) throw std::runtime_error("golden tensor missing: " + name);
  return it->second;
}
nlohmann::json case_of(const std::string& name) {
  return nlohmann::json::parse(golden().metadata.at("cases")).at(name);
}

GPTConfig base_config(int64_t hidden, int64_t tokens) {
  GPTConfig cfg;
  cfg.num_layers = 1;
  cfg.hidden_size = hidden;
  cfg.num_attention_heads = 1;
  cfg.seq_length = tokens;
  cfg.vocab_size = 64;
  cfg.moe_router_load_balancing_type = {"none"};
  cfg.moe_aux_loss_coeff = 0.0f;
  cfg.moe_router_pre_softmax = false;
  return cfg;
}

GPTConfig deepseek_v3_config(const nlohmann::json& hf, int64_t tokens) {
  // Megatron normalises sigmoid probabilities whenever top-k > 1; it has no flag to not.
  EXPECT_TRUE(hf.at("norm_topk_prob").get<bool>());
  GPTConfig cfg = base_config(hf.at("hidden_size"), tokens);
  cfg.num_experts = hf.at("n_routed_experts");
  cfg.moe_router_topk = hf.at("num_experts_per_tok");
  cfg.moe_router_score_function = "sigmoid";
  cfg.moe_router_enable_expert_bias = true;
  cfg.moe_router_num_groups = hf.at("n_group");
  cfg.moe_router_group_topk = hf.at("topk_group");
  // HF scores a group by the sum of its best 2 selection scores, Megatron by its best
  // topk / group_topk: the generator chose topk / topk_group = 2.
  EXPECT_EQ(cfg.moe_router_topk, 2 * cfg.moe_router_group_topk);
  cfg.moe_router_topk_scaling_factor = hf.at("routed_scaling_factor");
  cfg.finalize();
  return cfg;
}

GPTConfig qwen3_moe_config(const nlohmann::json& hf, int64_t tokens) {
  // Renormalised top-k of the softmax = softmax over the top-k logits (no pre-softmax).
  EXPECT_TRUE(hf.at("norm_topk_prob").get<bool>());
  GPTConfig cfg = base_config(hf.at("hidden_size"), tokens);
  cfg.num_experts = hf.at("num_local_experts");  // config.num_experts, as serialised
  cfg.moe_router_topk = hf.at("num_experts_per_tok");
  cfg.moe_router_score_function = "softmax";
  cfg.finalize();
  return cfg;
}

void expect_close(const Tensor& got, const Tensor& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  int bad = 0;
  double worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.f32()[i], w = want.f32()[i];
    worst = std::max(worst, std::abs(g - w));
    if (!(std::abs(g - w) <= atol + rtol * std::abs(w)) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: " << g << " vs HF " << w;
  }
  std::printf("  %-20s worst |megaton - hf| %.2e\n", what.c_str(), worst);
}

void check_case(const std::string& name, const GPTConfig& cfg) {
  SCOPED_TRACE(name + " (generator seed " + case_of(name).at("seed").dump() + ")");
  const Tensor& x = tensor(name + ".hidden_states");
  const int64_t T = x.dim(0), H = x.dim(1), E = cfg.num_experts, k = cfg.moe_router_topk;
  ASSERT_EQ(H, cfg.hidden_size);

  TopKRouter router("decoder.layers.0.mlp", cfg, 1, {}, 0);
  router.weight.weight.copy_from(tensor(name + ".router_weight"));  // [E, H], as HF's
  router.weight.main_grad = Tensor::zeros({E, H});
  if (cfg.moe_router_enable_expert_bias)
    router.expert_bias.copy_from(tensor(name + ".e_score_correction_bias"));
  router.start_step();
  ForwardContext ctx;
  ctx.training = true;
  TopKRouter::Output out = router.forward(x, ctx, 0);
  ASSERT_EQ(out.indices.dim(0), T);
  ASSERT_EQ(out.indices.dim(1), k);

  // Experts as sets per row (both order the k slots freely); weights by expert.
  const Tensor& want_indices = tensor(name + ".topk_indices");
  const Tensor& want_weights = tensor(name + ".topk_weights");
  const Tensor& upstream = tensor(name + ".upstream");  // [T, E]
  Tensor want_probs = Tensor::empty({T, k});
  Tensor dprobs = Tensor::empty({T, k});
  for (int64_t t = 0; t < T; ++t) {
    std::set<int32_t> got_set, want_set;
    for (int64_t j = 0; j < k; ++j) {
      got_set.insert(out.indices.i32()[t * k + j]);
      want_set.insert(want_indices.i32()[t * k + j]);
    }
    ASSERT_EQ(got_set, want_set) << "experts of token " << t;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = out.indices.i32()[t * k + j];
      const int32_t* hf =
          std::find(want_indices.i32() + t * k, want_indices.i32() + (t + 1) * k, e);
      want_probs.f32()[t * k + j] = want_weights.f32()[hf - want_indices.i32()];
      dprobs.f32()[t * k + j] = upstream.f32()[t * E + e];
    }
  }
  expect_close(out.probs, want_probs, 1e-6, 1e-5, "probabilities");

  Tensor dx = Tensor::zeros({T, H});
  router.backward(dprobs, 1.0f, dx);
  expect_close(dx, tensor(name + ".grad_hidden_states"), 1e-6, 1e-5, "d hidden_states");
  expect_close(router.weight.main_grad, tensor(name + ".grad_router_weight"), 1e-6, 1e-5,
               "d router weight");
}

TEST(RouterHF, DeepSeekV3RouterMatchesTransformers) {
  const nlohmann::json c = case_of("deepseek_v3");
  const int64_t T = tensor("deepseek_v3.hidden_states").dim(0);
  check_case("deepseek_v3", deepseek_v3_config(c.at("config"), T));
}

TEST(RouterHF, Qwen3MoeRouterMatchesTransformers) {
  const nlohmann::json c = case_of("qwen3_moe");
  const int64_t T = tensor("qwen3_moe.hidden_states").dim(0);
  check_case("qwen3_moe", qwen3_moe_config(c.at("config"), T));
}

}  // namespace
}  // namespace megaton
