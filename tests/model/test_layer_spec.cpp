// Layer composition by spec (model/layer_spec.h): the spec a config chooses per layer, and
// a layer built from an explicit spec whatever the config's default.
#include <gtest/gtest.h>

#include <algorithm>

#include "model/gpt.h"
#include "model/layer_spec.h"
#include "ops/ops.h"
#include "tiny_gpt_testing.h"

namespace megaton {
namespace {

std::vector<std::string> param_names(TransformerLayer& layer) {
  std::vector<Param*> params;
  layer.collect_params(params);
  std::vector<std::string> names;
  for (const Param* p : params) names.push_back(p->name);
  return names;
}

bool has(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

TEST(LayerSpec, DecoderSpecFollowsTheMoELayerPattern) {
  GPTConfig c = testing::tiny_gpt_config({.name = "moe", .moe = true});
  EXPECT_EQ(decoder_layer_spec(c, 0).mlp, MlpKind::MoE);
  EXPECT_EQ(decoder_layer_spec(c, 1).mlp, MlpKind::MoE);
  c.moe_layer_pattern = {0, 1};  // Megatron's --moe-layer-freq "[0]*1+[1]*1"
  EXPECT_EQ(decoder_layer_spec(c, 0).mlp, MlpKind::Dense);
  EXPECT_EQ(decoder_layer_spec(c, 1).mlp, MlpKind::MoE);
  EXPECT_EQ(decoder_layer_spec(c, 1).mixer, MixerKind::SelfAttention);
  const GPTConfig dense = testing::tiny_gpt_config({.name = "dense"});
  EXPECT_EQ(decoder_layer_spec(dense, 0).mlp, MlpKind::Dense);
  EXPECT_STREQ(mlp_kind_name(MlpKind::MoE), "moe");
  EXPECT_STREQ(mixer_kind_name(MixerKind::SelfAttention), "self_attention");
}

TEST(LayerSpec, LayerBuiltFromItsSpec) {
  const GPTConfig c =
      testing::tiny_gpt_config({.name = "moe", .moe = true, .shared_expert = true});
  // The config's spec: an MoE layer, its router and shared expert under "...mlp.".
  TransformerLayer moe(c, 1, 7);
  EXPECT_EQ(moe.spec().mlp, MlpKind::MoE);
  ASSERT_NE(moe.moe(), nullptr);
  EXPECT_EQ(moe.moe()->layer_number(), 1);
  const auto moe_names = param_names(moe);
  EXPECT_TRUE(has(moe_names, "decoder.layers.1.mlp.router.weight"));
  EXPECT_TRUE(has(moe_names, "decoder.layers.1.self_attention.linear_qkv.weight"));
  EXPECT_EQ(moe.linears().size(), 4u);  // QKV, projection, the shared expert's fc1, fc2
  // A dense spec on the same config: a dense MLP, no MoE layer.
  TransformerLayer dense(c, LayerSpec{MixerKind::SelfAttention, MlpKind::Dense}, 1, 7, {});
  EXPECT_EQ(dense.moe(), nullptr);
  const auto dense_names = param_names(dense);
  EXPECT_TRUE(has(dense_names, "decoder.layers.1.mlp.linear_fc1.weight"));
  EXPECT_FALSE(has(dense_names, "decoder.layers.1.mlp.router.weight"));
  // The names in Megatron's order: input norm, mixer, pre-MLP norm, MLP.
  ASSERT_GE(dense_names.size(), 4u);
  EXPECT_EQ(dense_names.front(), "decoder.layers.1.input_layernorm.weight");
  EXPECT_EQ(dense_names.back().rfind("decoder.layers.1.mlp.", 0), 0u) << dense_names.back();
  // Both run forward and backward on the same input.
  const Tensor x = testing::randn({2 * c.seq_length, c.hidden_size}, 3);
  for (TransformerLayer* layer : {&moe, &dense}) {
    std::vector<Param*> params;  // a layer outside a GPTModel has no gradient buffer
    layer->collect_params(params);
    for (Param* p : params) p->main_grad = Tensor::zeros(p->weight.shape(), DType::F32);
    Tensor y = layer->forward(x, 2, c.seq_length, ForwardContext{true, 1, 0, 0});
    EXPECT_EQ(y.shape(), x.shape());
    Tensor dx = layer->backward(y);
    EXPECT_EQ(dx.shape(), x.shape());
    double grad_sum = 0;  // every parameter kind got a gradient
    for (Param* p : params) grad_sum += ops::sum_of_squares(p->main_grad);
    EXPECT_GT(grad_sum, 0);
  }
}

}  // namespace
}  // namespace megaton
