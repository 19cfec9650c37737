// Whole-model gradients against central finite differences, for the configurations the
// Hugging Face golden files do not cover (LayerNorm, learned positions, GeLU, squared ReLU,
// biases, tied embeddings) and for the MoE aux-loss gradient injected into the router.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "model/gpt.h"
#include "model/layers.h"
#include "ops/ops.h"

namespace megaton {
namespace {

struct Case {
  const char* name;
  GPTConfig cfg;
};

GPTConfig base_config() {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = 6;
  c.vocab_size = 23;
  c.make_vocab_size_divisible_by = 8;  // padded to 24: padding rows take part as in Megatron
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.init_method_std = 0.3f;            // large enough that every path carries gradient
  return c;
}

// Objective = sum_t w_t * loss_t + aux losses; backward(w, 1) must be its gradient.
// training: with the config's dropout (its masks are fixed by the context's seed and
// stream, so the objective stays a deterministic function of the weights).
double objective(GPTModel& model, const Tensor& tokens, const Tensor& labels, const Tensor& w,
                 bool training = false) {
  ForwardContext ctx{training, 1, 0, 0};
  MicroBatchLoss out = model.forward(tokens, labels, ctx);
  double objective = testing::dot(w, out.losses) + out.aux_loss();
  // Multi-token prediction's depths join with weight mtp_loss_scaling_factor / D each (the
  // backward's aux scale is 1 here).
  if (out.mtp_losses.defined())
    objective += double(model.config().mtp_loss_scaling_factor) /
                 double(model.config().mtp_num_layers) * ops::sum(out.mtp_losses);
  return objective;
}

// Every MoE layer's routing of the last forward: the chosen experts of each token (and
// with token dropping which copies were kept). The objective is not differentiable where a
// perturbation changes them, so finite differences across such a step are meaningless.
std::vector<float> routing_of(GPTModel& model) {
  std::vector<float> out;
  for (auto& layer : model.layers()) {
    if (!layer->moe()) continue;
    MoELayer::Activations saved = layer->moe()->take_saved();
    for (const Tensor* t : {&saved.router.indices, &saved.router.keep}) {
      if (!t->defined()) continue;
      std::vector<float> v = t->dtype() == DType::I32 ? t->to(DType::F32).to_vector()
                                                      : t->to_vector();
      out.insert(out.end(), v.begin(), v.end());
    }
    layer->moe()->restore_saved(std::move(saved));
  }
  return out;
}

// prepare (optional): changes the model's parameters before the check.
void check_gradients(GPTConfig cfg, bool training = false,
                     const std::function<void(GPTModel&)>& prepare = {}) {
  cfg.finalize();
  uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPTModel model(cfg, seed);
  if (prepare) prepare(model);
  const int64_t B = 2, S = cfg.seq_length;
  Tensor tokens = testing::randint({B, S}, int32_t(cfg.vocab_size), seed + 1);
  Tensor labels = testing::randint({B, S}, int32_t(cfg.vocab_size), seed + 2);
  Tensor w = testing::randn({B * S}, seed + 3, 0.5f);

  objective(model, tokens, labels, w, training);
  const std::vector<float> routing = routing_of(model);
  model.backward(w, 1.0f);

  std::mt19937_64 pick(seed + 4);
  int checked = 0, skipped = 0;
  for (Param* p : model.params()) {
    // Finite differences of up to 12 random elements per parameter.
    int64_t n = p->weight.numel();
    for (int s = 0; s < std::min<int64_t>(12, n); ++s) {
      int64_t i = int64_t(pick() % uint64_t(n));
      float orig = p->weight.f32()[i];
      const float eps = 3e-3f;
      p->weight.f32()[i] = orig + eps;
      double up = objective(model, tokens, labels, w, training);
      bool same_routing = routing_of(model) == routing;
      p->weight.f32()[i] = orig - eps;
      double down = objective(model, tokens, labels, w, training);
      same_routing = same_routing && routing_of(model) == routing;
      p->weight.f32()[i] = orig;
      if (!same_routing) {  // a top-k choice or a drop flipped inside [orig - eps, orig + eps]
        ++skipped;
        continue;
      }
      ++checked;
      double fd = (up - down) / (2 * eps);
      double analytic = p->main_grad.f32()[i];
      // fp32 forward, eps 3e-3: truncation error O(eps^2 * f''') and rounding error
      // O(1e-7 * |f| / eps) are both around 1e-4 here. With eps 1e-2 a word-embedding
      // element of seed 6 (a row many tokens share) was off by 0.07 from truncation alone;
      // eps 3e-3 passes seeds 1-20.
      EXPECT_NEAR(analytic, fd, 2e-3 + 2e-2 * std::fabs(fd)) << p->name << "[" << i << "]";
    }
  }
  // Routing flips are rare; a test that skipped most elements would check nothing.
  EXPECT_GE(checked, 2 * skipped) << checked << " elements checked, " << skipped
                                  << " skipped for a routing change";
}

TEST(ModelGradients, LayerNormLearnedPositionsGeluBiasesTied) {
  GPTConfig c = base_config();
  c.normalization = Normalization::LayerNorm;
  c.position_embedding_type = PositionEmbedding::LearnedAbsolute;
  c.max_position_embeddings = 8;
  c.disable_bias_linear = false;
  c.untie_embeddings_and_output_weights = false;
  check_gradients(c);
}

// The fused bias-dropout-add at both residual connections (the branch biases skipped by
// their Linears and added there), with hidden dropout on, RMSNorm and LayerNorm.
TEST(ModelGradients, BiasDropoutAddWithHiddenDropout) {
  for (Normalization norm : {Normalization::RMSNorm, Normalization::LayerNorm}) {
    GPTConfig c = base_config();
    c.normalization = norm;
    c.disable_bias_linear = false;
    c.hidden_dropout = 0.3f;
    check_gradients(c, /*training=*/true);
  }
  GPTConfig no_bias = base_config();  // dropout alone: the other fused path
  no_bias.hidden_dropout = 0.3f;
  check_gradients(no_bias, /*training=*/true);
}

TEST(ModelGradients, MoEWithAuxLossPreSoftmaxAndDenseLayers) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.swiglu = true;
  c.disable_bias_linear = true;
  c.untie_embeddings_and_output_weights = true;
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 12;
  c.moe_router_topk = 2;
  c.moe_layer_freq = 2;  // layer 0 MoE, layer 1 dense
  c.moe_router_pre_softmax = true;
  c.moe_aux_loss_coeff = 0.5f;  // large, so a wrong aux gradient would show
  check_gradients(c);
}

TEST(ModelGradients, MoEBiasesGelu) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.num_experts = 3;
  c.moe_ffn_hidden_size = 10;
  c.moe_router_topk = 1;
  c.moe_router_pre_softmax = true;  // Megatron requires it with top-1 softmax
  c.moe_aux_loss_coeff = 0.1f;
  check_gradients(c);
}

// Nonzero biases (they start at zero): the experts scale the fc2 bias by the routing
// probability (Megatron's _apply_bias), so the router's gradient takes <dy, b2> too.
TEST(ModelGradients, MoENonzeroBiasesSwiglu) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.disable_bias_linear = false;
  c.swiglu = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 8;
  c.moe_router_topk = 2;
  c.moe_aux_loss_coeff = 0.1f;
  check_gradients(c, false, [](GPTModel& model) {
    uint64_t stream = 0;
    for (Param* p : model.params())
      if (p->is_expert && p->weight.ndim() == 1) ops::fill_normal(p->weight, 77, stream++);
  });
}

// Megatron's other router options through the whole model: sigmoid scores with group-limited
// routing and a scaling factor, seq_aux_loss and global_aux_loss with their own
// coefficients, the z-loss, and a shared expert; the injected losses' gradients must
// match finite differences of loss + injected losses.
TEST(ModelGradients, MoERouterOptionsAndSharedExpert) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.swiglu = true;
  c.disable_bias_linear = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 10;
  c.moe_router_topk = 2;
  c.moe_router_score_function = "sigmoid";
  c.moe_router_num_groups = 2;
  c.moe_router_group_topk = 1;
  c.moe_router_topk_scaling_factor = 2.5f;
  c.moe_router_load_balancing_type = {"seq_aux_loss", "global_aux_loss"};
  c.moe_aux_loss_coeffs = {0.3f, 0.2f};
  c.moe_z_loss_coeff = 0.05f;
  c.moe_shared_expert_intermediate_size = 6;
  check_gradients(c);
}

// Qwen2-MoE-style shared expert: sigmoid-gated (--moe-shared-expert-gate), with GeLU and
// biases in the routed experts.
TEST(ModelGradients, MoEGatedSharedExpert) {
  GPTConfig c = base_config();
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 10;
  c.moe_router_topk = 2;
  c.moe_aux_loss_coeff = 0.1f;
  c.moe_shared_expert_intermediate_size = 6;
  c.moe_shared_expert_gate = true;
  check_gradients(c);
}

// --squared-relu (Nemotron-H's relu2 MLPs): relu(x)^2, not gated, in the dense MLP (with
// nonzero biases, so the kink is not at the bias-free point), the routed experts (the
// row-weighted activation and the probabilities' gradient through it) and the shared expert.
TEST(ModelGradients, SquaredReluDenseMoEAndSharedExpert) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.squared_relu = true;
  c.disable_bias_linear = false;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 10;
  c.moe_router_topk = 2;
  c.moe_layer_freq = 2;  // layer 0 MoE, layer 1 dense
  c.moe_aux_loss_coeff = 0.1f;
  c.moe_shared_expert_intermediate_size = 6;
  check_gradients(c, false, [](GPTModel& model) {
    uint64_t stream = 0;
    for (Param* p : model.params())
      if (p->name.find("linear_fc") != std::string::npos &&
          p->name.find("bias") != std::string::npos)
        ops::fill_normal(p->weight, 78, stream++);
  });
}

// --qk-layernorm (Qwen3's q_norm / k_norm): RMSNorm over each query and key head before
// RoPE, with GQA and a head dimension other than hidden / heads (query width 24 vs hidden
// 16) and an MoE layer.
TEST(ModelGradients, QkLayernormRMSNormRopeGqaMoE) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.swiglu = true;
  c.disable_bias_linear = true;
  c.untie_embeddings_and_output_weights = true;
  c.group_query_attention = true;
  c.num_query_groups = 2;
  c.kv_channels = 6;
  c.qk_layernorm = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 12;
  c.moe_router_topk = 2;
  c.moe_layer_freq = 2;
  check_gradients(c);
}

// Multi-latent attention (model/mla.h) with q LoRA, its latent RMSNorms (qk_layernorm),
// YaRN (factor 4 over an original context of 2 positions, mscale != mscale_all_dim) and a
// value head unlike the query/key head, before an MoE layer with a sigmoid router.
TEST(ModelGradients, MultiLatentAttentionQLoraYarnMoE) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.swiglu = true;
  c.disable_bias_linear = true;
  c.untie_embeddings_and_output_weights = true;
  c.qk_layernorm = true;
  c.multi_latent_attention = true;
  c.q_lora_rank = 6;
  c.kv_lora_rank = 5;
  c.qk_head_dim = 3;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 2;
  c.rope_type = RopeType::Yarn;
  c.yarn.factor = 4;
  c.yarn.original_max_position_embeddings = 2;
  c.yarn.mscale = 1.0;
  c.yarn.mscale_all_dim = 0.5;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 12;
  c.moe_router_topk = 2;
  c.moe_router_score_function = "sigmoid";
  c.moe_layer_freq = 2;
  check_gradients(c);
}

// MLA without q LoRA (linear_q_proj) or latent norms, plain RoPE, LayerNorm and biases.
TEST(ModelGradients, MultiLatentAttentionWithoutQLoraRope) {
  GPTConfig c = base_config();
  c.position_embedding_type = PositionEmbedding::Rope;
  c.multi_latent_attention = true;
  c.kv_lora_rank = 6;
  c.qk_head_dim = 4;
  c.qk_pos_emb_head_dim = 2;
  c.v_head_dim = 5;
  check_gradients(c);
}

// Multi-token prediction (model/mtp.h), two depths after a dense and an MoE layer (the
// depths' layers are MoE: the last decoder layer's spec), tied embeddings shared by the
// depths' lookups and output layer.
TEST(ModelGradients, MultiTokenPredictionTwoDepthsMoE) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.swiglu = true;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 12;
  c.moe_router_topk = 2;
  c.moe_layer_pattern = {0, 1};
  c.moe_aux_loss_coeff = 0.01f;
  c.mtp_num_layers = 2;
  c.mtp_loss_scaling_factor = 0.7f;
  check_gradients(c);
}

// MTP with multi-latent attention (DeepSeek-V3's combination), untied output layer.
TEST(ModelGradients, MultiTokenPredictionWithMla) {
  GPTConfig c = base_config();
  c.position_embedding_type = PositionEmbedding::Rope;
  c.untie_embeddings_and_output_weights = true;
  c.multi_latent_attention = true;
  c.q_lora_rank = 6;
  c.kv_lora_rank = 5;
  c.qk_head_dim = 3;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 2;
  c.qk_layernorm = true;
  c.mtp_num_layers = 1;
  c.mtp_loss_scaling_factor = 0.5f;
  check_gradients(c);
}

// The LayerNorm form of the q/k norms (weight and bias), with learned positions (no RoPE)
// and linear biases.
TEST(ModelGradients, QkLayernormLayerNormLearnedPositions) {
  GPTConfig c = base_config();
  c.normalization = Normalization::LayerNorm;
  c.position_embedding_type = PositionEmbedding::LearnedAbsolute;
  c.max_position_embeddings = 8;
  c.disable_bias_linear = false;
  c.kv_channels = 8;  // LayerNorm over 4 values is too curved for the step of 1e-2
  c.qk_layernorm = true;
  check_gradients(c);
}

// Token dropping: capacity ceil(12 x 2 / 4 x 0.5) = 3 of about 6 copies per expert, the
// dropped copies sent to no expert, each expert's input padded with zero rows to its
// capacity. The position policy keeps the kept set fixed under the steps (it depends on the
// top-k choices only, like every MoE case here), so the objective is smooth.
TEST(ModelGradients, MoETokenDroppingPaddedToCapacity) {
  GPTConfig c = base_config();
  c.normalization = Normalization::RMSNorm;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.swiglu = true;
  c.disable_bias_linear = false;
  c.num_experts = 4;
  c.moe_ffn_hidden_size = 10;
  c.moe_router_topk = 2;
  c.moe_aux_loss_coeff = 0.1f;
  c.moe_expert_capacity_factor = 0.5f;
  c.moe_token_drop_policy = "position";
  c.moe_pad_expert_input_to_capacity = true;
  check_gradients(c);
}

// Partial RoPE (--rotary-percent 0.5): RoPE on the first 4 of each head's 8 channels, the
// other 4 passed through, in the fused split (and, with --qk-layernorm, the fused split +
// norm) forward and backward.
TEST(ModelGradients, PartialRopeWithAndWithoutQkLayernorm) {
  for (bool qk_layernorm : {false, true}) {
    SCOPED_TRACE(qk_layernorm ? "qk-layernorm" : "no qk-layernorm");
    GPTConfig c = base_config();
    c.normalization = Normalization::RMSNorm;
    c.position_embedding_type = PositionEmbedding::Rope;
    c.rotary_percent = 0.5;
    c.swiglu = true;
    c.disable_bias_linear = true;
    c.group_query_attention = true;
    c.num_query_groups = 2;
    c.kv_channels = 8;
    c.qk_layernorm = qk_layernorm;
    check_gradients(c);
  }
}

// Megatron's rotary dim: int(kv_channels * rotary_percent) below 1, kv_channels at 1; under
// RoPE it must be even and positive; refused with MLA; ignored with learned positions.
TEST(ModelConfig, RotaryPercent) {
  GPTConfig c = base_config();
  c.position_embedding_type = PositionEmbedding::Rope;
  c.kv_channels = 64;
  c.rotary_percent = 0.25;
  ASSERT_NO_THROW(c.finalize());
  EXPECT_EQ(c.rotary_dim(), 16);
  c.rotary_percent = 1.0;
  EXPECT_EQ(c.rotary_dim(), 64);
  c.rotary_percent = 0.29;  // 64 x 0.29 = 18.56: truncated to 18, as Python's int()
  EXPECT_EQ(c.rotary_dim(), 18);
  auto finalized = [](GPTConfig cfg) {
    cfg.finalize();
    return cfg;
  };
  GPTConfig bad = c;
  for (double percent : {0.3 /* 19 */, 0.0, -0.5, 1.5, 0.01 /* 0 */}) {
    bad.rotary_percent = percent;
    EXPECT_THROW(finalized(bad), Error) << percent;
  }
  // Learned positions: a value in range is ignored (Megatron builds no rotary table then).
  GPTConfig learned = base_config();
  learned.kv_channels = 64;
  learned.rotary_percent = 0.3;
  EXPECT_NO_THROW(finalized(learned));
  // Multi-latent attention: refused below 1.
  GPTConfig mla = base_config();
  mla.position_embedding_type = PositionEmbedding::Rope;
  mla.multi_latent_attention = true;
  mla.qk_head_dim = 8;
  mla.qk_pos_emb_head_dim = 4;
  mla.v_head_dim = 8;
  mla.kv_lora_rank = 8;
  EXPECT_NO_THROW(finalized(mla));
  mla.rotary_percent = 0.5;
  EXPECT_THROW(finalized(mla), Error);
}

// The rotary dim reaches the model: with the same weights, rotating half of each head
// gives other logits than rotating all of it, and rotary_percent 1 is the default.
TEST(ModelConfig, RotaryPercentChangesTheModel) {
  auto logits = [](double percent) {
    GPTConfig c = base_config();
    c.position_embedding_type = PositionEmbedding::Rope;
    c.kv_channels = 8;
    c.rotary_percent = percent;
    c.finalize();
    GPTModel model(c, testing::test_seed());
    return model.logits(testing::randint({2, c.seq_length}, int32_t(c.vocab_size), 7));
  };
  const Tensor full = logits(1.0);
  EXPECT_TRUE(testing::allclose(logits(1.0), full, 0, 0));
  EXPECT_FALSE(testing::allclose(logits(0.5), full, 1e-4, 0));
}

// The squared-ReLU MLP is linear_fc2(relu(linear_fc1(x))^2), fc1 [ffn, hidden] (not gated).
TEST(ModelConfig, SquaredReluMlpIsFc2OfReluSquared) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t tokens = 5, hidden = 8, ffn = 12;
  MLP mlp("mlp", hidden, ffn, MlpActivation::SquaredRelu, /*bias=*/false, 0.5f, 0.5f, seed,
          Placement{});
  ASSERT_EQ(mlp.linear_fc1.weight.weight.shape(), (Shape{ffn, hidden}));
  const Tensor x = testing::randn({tokens, hidden}, seed + 1);
  Tensor h = Tensor::empty({tokens, ffn}), y_ref = Tensor::empty({tokens, hidden});
  ops::gemm(x, false, mlp.linear_fc1.weight.weight, true, h);
  for (int64_t i = 0; i < h.numel(); ++i) h.f32()[i] = std::pow(std::max(h.f32()[i], 0.0f), 2.0f);
  ops::gemm(h, false, mlp.linear_fc2.weight.weight, true, y_ref);
  EXPECT_TRUE(testing::allclose(mlp.forward_inference(x), y_ref, 1e-6, 5e-6));
  // Megatron asserts `not args.swiglu` under --squared-relu: one line naming both flags.
  GPTConfig both = base_config();
  both.squared_relu = both.swiglu = true;
  try {
    both.finalize();
    ADD_FAILURE() << "squared_relu with swiglu was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("squared-relu"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("swiglu"), std::string::npos) << e.what();
  }
  GPTConfig alone = base_config();
  alone.squared_relu = true;
  EXPECT_NO_THROW(alone.finalize());
  EXPECT_EQ(mlp_activation_of(alone), MlpActivation::SquaredRelu);
}

TEST(ModelConfig, PadsVocabularyAndRejectsBadShapes) {
  GPTConfig c = base_config();
  c.finalize();
  EXPECT_EQ(c.padded_vocab_size, 24);
  EXPECT_EQ(c.kv_channels, 4);
  EXPECT_EQ(c.ffn_hidden_size, 64);
  GPTConfig bad = base_config();
  bad.num_attention_heads = 3;
  EXPECT_THROW(bad.finalize(), Error);
  bad = base_config();
  bad.num_experts = 2;
  bad.moe_router_topk = 3;
  EXPECT_THROW(bad.finalize(), Error);
  bad = base_config();
  bad.group_query_attention = true;
  bad.num_query_groups = 3;
  EXPECT_THROW(bad.finalize(), Error);
}

}  // namespace
}  // namespace megaton
