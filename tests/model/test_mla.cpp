// Multi-latent attention (model/mla.h) against the formulas written out in double from
// Hugging Face's DeepseekV3Attention (q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_
// mqa -> [c_kv | k_pe], kv_a_layernorm -> kv_b_proj; interleaved RoPE with YaRN's cos/sin
// scale; softmax scale (qk + rope)^-1/2 x mscale(factor, mscale_all_dim)^2), and the
// layer's spec, names and shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/ops.h"
#include "model/layer_spec.h"
#include "model/mla.h"
#include "model/rope_scaling.h"

namespace megaton {
namespace {

GPTConfig mla_config(bool q_lora) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 3;
  c.seq_length = 7;
  c.vocab_size = 20;
  c.normalization = Normalization::RMSNorm;
  c.norm_epsilon = 1e-6f;
  c.position_embedding_type = PositionEmbedding::Rope;
  c.qk_layernorm = q_lora;
  c.multi_latent_attention = true;
  c.q_lora_rank = q_lora ? 10 : 0;
  c.kv_lora_rank = 8;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 5;
  c.rope_type = RopeType::Yarn;
  c.yarn.factor = 8;
  c.yarn.original_max_position_embeddings = 3;
  c.yarn.mscale = 0.8;
  c.yarn.mscale_all_dim = 0.6;
  c.disable_bias_linear = !q_lora;  // with q LoRA: linear_proj's bias too
  c.hidden_dropout = c.attention_dropout = 0;
  c.finalize();
  return c;
}

// y = x W^T for x [R, in] and W [out, in], in double.
std::vector<double> linear(const std::vector<double>& x, const Tensor& w) {
  const int64_t out = w.dim(0), in = w.dim(1), rows = int64_t(x.size()) / in;
  std::vector<double> y(size_t(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) y[size_t(r * out + o)] += x[size_t(r * in + i)] * w.f32()[o * in + i];
  return y;
}

std::vector<double> rmsnorm(const std::vector<double>& x, const Tensor& w, double eps) {
  const int64_t d = w.numel(), rows = int64_t(x.size()) / d;
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += x[size_t(r * d + i)] * x[size_t(r * d + i)];
    const double inv = 1.0 / std::sqrt(ss / double(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[size_t(r * d + i)] = x[size_t(r * d + i)] * inv * w.f32()[i];
  }
  return y;
}

// HF's apply_rotary_pos_emb_interleave on one head's rope part at position s.
std::vector<double> rope(const double* x, int64_t dim, int64_t s, const std::vector<double>& f,
                         double scale) {
  std::vector<double> y(static_cast<size_t>(dim));
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const double angle = double(float(s) * float(f[size_t(j)])), a = x[2 * j], e = x[2 * j + 1];
    y[size_t(j)] = scale * (a * std::cos(angle) - e * std::sin(angle));
    y[size_t(j + half)] = scale * (e * std::cos(angle) + a * std::sin(angle));
  }
  return y;
}

// The reference output [B*S, H] of one MLA layer with the module's weights.
std::vector<double> reference(MLASelfAttention& m, const GPTConfig& c, const Tensor& x,
                              int64_t B, int64_t S) {
  const int64_t n = c.num_attention_heads, qk = c.qk_head_dim, dr = c.qk_pos_emb_head_dim,
                v = c.v_head_dim, dq = qk + dr;
  std::vector<double> xin(x.f32(), x.f32() + x.numel());
  std::vector<double> q;
  if (m.linear_q_proj) {
    q = linear(xin, m.linear_q_proj->weight.weight);
  } else {
    q = linear(xin, m.linear_q_down_proj->weight.weight);
    if (m.q_layernorm) q = rmsnorm(q, m.q_layernorm->weight.weight, c.norm_epsilon);
    q = linear(q, m.linear_q_up_proj->weight.weight);
  }
  const std::vector<double> kvd = linear(xin, m.linear_kv_down_proj.weight.weight);
  const int64_t r = c.kv_lora_rank;
  std::vector<double> ckv, kpe;
  for (int64_t t = 0; t < B * S; ++t)
    for (int64_t i = 0; i < r + dr; ++i)
      (i < r ? ckv : kpe).push_back(kvd[size_t(t * (r + dr) + i)]);
  if (m.kv_layernorm) ckv = rmsnorm(ckv, m.kv_layernorm->weight.weight, c.norm_epsilon);
  const std::vector<double> kv = linear(ckv, m.linear_kv_up_proj.weight.weight);
  const std::vector<double> f = yarn_inv_freq(dr, c.rotary_base, c.yarn);
  const double cs = yarn_cos_sin_scale(c.yarn), scale = yarn_softmax_scale(c.yarn, dq);
  std::vector<double> out(size_t(B * S * n * v), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < n; ++h)
      for (int64_t i = 0; i < S; ++i) {
        const int64_t ti = b * S + i;
        std::vector<double> qi(q.begin() + (ti * n + h) * dq, q.begin() + (ti * n + h) * dq + qk);
        const std::vector<double> qr = rope(q.data() + (ti * n + h) * dq + qk, dr, i, f, cs);
        qi.insert(qi.end(), qr.begin(), qr.end());
        std::vector<double> scores;
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t tj = b * S + j;
          const std::vector<double> kr = rope(kpe.data() + tj * dr, dr, j, f, cs);
          double sdot = 0;
          for (int64_t e = 0; e < qk; ++e) sdot += qi[size_t(e)] * kv[size_t((tj * n + h) * (qk + v) + e)];
          for (int64_t e = 0; e < dr; ++e) sdot += qi[size_t(qk + e)] * kr[size_t(e)];
          scores.push_back(sdot * scale);
          mx = std::max(mx, scores.back());
        }
        double z = 0;
        for (double& s : scores) z += (s = std::exp(s - mx));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t e = 0; e < v; ++e)
            out[size_t((ti * n + h) * v + e)] +=
                scores[size_t(j)] / z * kv[size_t(((b * S + j) * n + h) * (qk + v) + qk + e)];
      }
  std::vector<double> y = linear(out, m.linear_proj.weight.weight);
  if (m.linear_proj.bias.weight.defined())
    for (int64_t t = 0; t < B * S; ++t)
      for (int64_t o = 0; o < c.hidden_size; ++o)
        y[size_t(t * c.hidden_size + o)] += m.linear_proj.bias.weight.f32()[o];
  return y;
}

void randomize(MLASelfAttention& m, uint64_t seed) {
  std::vector<Param*> params;
  m.collect_params(params);
  for (Param* p : params) {
    const Tensor noise = testing::randn(p->weight.shape(), seed++, 0.3f);
    ops::add_(p->weight, noise);
  }
}

TEST(MultiLatentAttention, ForwardMatchesTheFormulas) {
  for (bool q_lora : {true, false}) {
    SCOPED_TRACE(q_lora ? "q LoRA" : "linear_q_proj");
    const GPTConfig c = mla_config(q_lora);
    MLASelfAttention m("decoder.layers.0.self_attention", c, 0, 11);
    randomize(m, testing::test_seed());
    const int64_t B = 2, S = c.seq_length;
    const Tensor x = testing::randn({B * S, c.hidden_size}, testing::test_seed() + 99);
    // Standalone, linear_proj adds its own bias (a layer leaves it to its residual add).
    const Tensor y = m.forward(x, B, S, ForwardContext{false, 1, 0, 0});
    const std::vector<double> want = reference(m, c, x, B, S);
    ASSERT_EQ(int64_t(want.size()), y.numel());
    double num = 0, den = 0;
    for (int64_t i = 0; i < y.numel(); ++i) {
      num += (y.f32()[i] - want[size_t(i)]) * (y.f32()[i] - want[size_t(i)]);
      den += want[size_t(i)] * want[size_t(i)];
    }
    EXPECT_LE(std::sqrt(num / den), 2e-6);
  }
}

TEST(MultiLatentAttention, SpecNamesAndShapes) {
  const GPTConfig c = mla_config(true);
  EXPECT_EQ(decoder_layer_spec(c, 0).mixer, MixerKind::MLA);
  EXPECT_STREQ(mixer_kind_name(MixerKind::MLA), "mla");
  MLASelfAttention m("decoder.layers.1.self_attention", c, 1, 3);
  std::vector<Param*> params;
  m.collect_params(params);
  std::vector<std::pair<std::string, Shape>> want = {
      {"linear_q_down_proj.weight", {10, 16}}, {"q_layernorm.weight", {10}},
      {"linear_q_up_proj.weight", {3 * 10, 10}}, {"linear_kv_down_proj.weight", {8 + 4, 16}},
      {"kv_layernorm.weight", {8}}, {"linear_kv_up_proj.weight", {3 * 11, 8}},
      {"linear_proj.weight", {16, 3 * 5}}, {"linear_proj.bias", {16}}};
  ASSERT_EQ(params.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(params[i]->name, "decoder.layers.1.self_attention." + want[i].first);
    EXPECT_EQ(params[i]->weight.shape(), want[i].second) << params[i]->name;
  }
  const GPTConfig no_lora = mla_config(false);
  MLASelfAttention plain("a", no_lora, 0, 3);
  ASSERT_TRUE(plain.linear_q_proj);
  EXPECT_EQ(plain.linear_q_proj->weight.weight.shape(), Shape({3 * 10, 16}));
  EXPECT_FALSE(plain.q_layernorm || plain.kv_layernorm);
}

// finalize()'s error for c, or "" when it passes.
std::string finalize_error(GPTConfig c) {
  try {
    c.finalize();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MultiLatentAttention, ConfigChecks) {
  GPTConfig c = mla_config(true);
  c.group_query_attention = true;
  EXPECT_NE(finalize_error(c).find("group-query-attention"), std::string::npos);
  c = mla_config(true);
  c.qk_pos_emb_head_dim = 3;
  EXPECT_NE(finalize_error(c).find("qk-pos-emb-head-dim (3) must be even"), std::string::npos);
  c = mla_config(true);
  c.multi_latent_attention = false;
  c.rope_type = RopeType::Rope;
  c.yarn = {};
  c.kv_channels = 4;
  EXPECT_NE(finalize_error(c).find("need multi-latent-attention"), std::string::npos);
  c = mla_config(true);
  c.rope_type = RopeType::Rope;  // a YaRN factor without YaRN
  EXPECT_NE(finalize_error(c).find("rotary-scaling-factor (8) applies to rope-type yarn"),
            std::string::npos);
  c = mla_config(true);
  c.multi_latent_attention = false;  // YaRN without MLA
  EXPECT_NE(finalize_error(c).find("rope-type yarn needs multi-latent-attention"),
            std::string::npos);
  EXPECT_EQ(finalize_error(mla_config(false)), "");
}

}  // namespace
}  // namespace megaton
