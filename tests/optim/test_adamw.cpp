// AdamW against a double-precision AdamW written here, gradient clipping, and clipping
// folded into the step (grad_scale).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "common/testing.h"
#include "optim/adamw.h"
#include "optim/clip_grad.h"

using namespace megaton;
using namespace megaton::optim;
using megaton::testing::allclose;
using megaton::testing::randn;
using megaton::testing::test_seed;

namespace {

// Decoupled weight decay Adam in fp64 (torch.optim.AdamW's update order: decay, then
// moments, then the bias-corrected step).
struct ReferenceAdamW {
  double beta1, beta2, eps;
  std::vector<double> p, m, v;
  void step(const std::vector<float>& g, double lr, double wd, int64_t t) {
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    double bc1 = 1.0 - std::pow(beta1, double(t)), bc2 = 1.0 - std::pow(beta2, double(t));
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] -= lr * wd * p[i];
      m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
      v[i] = beta2 * v[i] + (1.0 - beta2) * double(g[i]) * g[i];
      p[i] -= lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
    }
  }
};

Tensor as_tensor(const Shape& shape, const std::vector<double>& values) {
  std::vector<float> f(values.begin(), values.end());
  return Tensor::from(shape, f);
}

std::vector<double> as_double(const Tensor& t) {
  std::vector<double> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = t.item(i);
  return out;
}

struct Model {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
  Param& add(const std::string& name, const Shape& shape, uint64_t seed, bool no_wd) {
    auto p = std::make_unique<Param>();
    p->name = name;
    p->weight = randn(shape, seed, 0.5f);
    p->main_grad = Tensor::zeros(shape);
    p->no_weight_decay = no_wd;
    params.push_back(p.get());
    owned.push_back(std::move(p));
    return *params.back();
  }
};

Model make_model(uint64_t seed) {
  Model m;
  m.add("decoder.layers.0.mlp.linear_fc1.weight", {6, 5}, seed + 1, false);
  m.add("decoder.layers.0.mlp.linear_fc1.bias", {6}, seed + 2, true);
  m.add("decoder.final_layernorm.weight", {5}, seed + 3, true);
  return m;
}

}  // namespace

TEST(AdamW, MatchesFp64ReferenceOverStepsWithWeightDecayExclusion) {
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  AdamWConfig cfg;
  cfg.weight_decay = 0.1f;  // large enough that applying it to an excluded param shows
  Model model = make_model(seed);
  AdamW opt(model.params, cfg);

  std::vector<ReferenceAdamW> ref;
  for (Param* p : model.params)
    ref.push_back({cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, as_double(p->weight), {}, {}});
  const std::vector<double> lrs = {1e-2, 2e-2, 3e-2, 2.5e-2, 1e-2, 5e-3};
  for (size_t t = 0; t < lrs.size(); ++t) {
    for (size_t i = 0; i < model.params.size(); ++i) {
      Param& p = *model.params[i];
      p.main_grad = randn(p.weight.shape(), seed * 100 + t * 10 + i);
      ref[i].step(p.main_grad.to_vector(), float(lrs[t]), p.no_weight_decay ? 0.0 : 0.1f,
                  int64_t(t + 1));
    }
    opt.step(float(lrs[t]));
    EXPECT_EQ(opt.step_count(), int64_t(t + 1));
  }
  auto state = opt.state_tensors();
  ASSERT_EQ(state.size(), 2 * model.params.size());
  for (size_t i = 0; i < model.params.size(); ++i) {
    Param& p = *model.params[i];
    SCOPED_TRACE(p.name);
    EXPECT_TRUE(allclose(p.weight, as_tensor(p.weight.shape(), ref[i].p), 1e-6, 5e-6));
    EXPECT_EQ(state[2 * i].first, p.name + ".exp_avg");
    EXPECT_EQ(state[2 * i + 1].first, p.name + ".exp_avg_sq");
    EXPECT_EQ(state[2 * i].second->shape(), p.weight.shape());
    EXPECT_TRUE(allclose(*state[2 * i].second, as_tensor(p.weight.shape(), ref[i].m), 1e-6, 5e-6));
    EXPECT_TRUE(
        allclose(*state[2 * i + 1].second, as_tensor(p.weight.shape(), ref[i].v), 1e-6, 5e-6));
  }

  // The exclusion is visible: the same run with weight decay on the bias ends elsewhere.
  ReferenceAdamW decayed{
      cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, as_double(randn({6}, seed + 2, 0.5f)), {}, {}};
  for (size_t t = 0; t < lrs.size(); ++t)
    decayed.step(randn({6}, seed * 100 + t * 10 + 1).to_vector(), float(lrs[t]), 0.1f,
                 int64_t(t + 1));
  EXPECT_FALSE(allclose(model.params[1]->weight, as_tensor({6}, decayed.p), 1e-6, 5e-6));
}

TEST(AdamW, DefaultsAreMegatrons) {
  AdamWConfig cfg;
  EXPECT_FLOAT_EQ(cfg.weight_decay, 0.01f);
  EXPECT_FLOAT_EQ(cfg.adam_beta1, 0.9f);
  EXPECT_FLOAT_EQ(cfg.adam_beta2, 0.999f);
  EXPECT_FLOAT_EQ(cfg.adam_eps, 1e-8f);
}

TEST(AdamW, FirstStepMovesEachWeightByAboutLr) {
  // With zero state, step 1 gives m_hat = g and v_hat = g^2: the update is lr * sign(g)
  // (up to eps), whatever the gradient's scale.
  Model model;
  Param& p = model.add("w", {4}, 7, true);
  p.weight = Tensor::from({4}, {1.0f, -2.0f, 0.5f, 3.0f});
  p.main_grad = Tensor::from({4}, {100.0f, -0.01f, 2.0f, -7.0f});
  AdamW opt(model.params);
  opt.step(0.1f);
  EXPECT_TRUE(allclose(p.weight, Tensor::from({4}, {0.9f, -1.9f, 0.4f, 3.1f}), 1e-6, 1e-6));
}

TEST(AdamW, ResumingFromSavedStateMatchesAnUninterruptedRun) {
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Model a = make_model(seed), b = make_model(seed);
  AdamW opt_a(a.params);
  for (int t = 0; t < 3; ++t) {
    for (size_t i = 0; i < a.params.size(); ++i)
      a.params[i]->main_grad = randn(a.params[i]->weight.shape(), seed + 50 + t * 10 + i);
    opt_a.step(1e-2f);
  }
  // "Checkpoint": weights, state and step count into a fresh optimizer.
  for (size_t i = 0; i < a.params.size(); ++i) b.params[i]->weight.copy_from(a.params[i]->weight);
  AdamW opt_b(b.params);
  auto sa = opt_a.state_tensors(), sb = opt_b.state_tensors();
  for (size_t i = 0; i < sa.size(); ++i) {
    ASSERT_EQ(sa[i].first, sb[i].first);
    sb[i].second->copy_from(*sa[i].second);
  }
  opt_b.set_step_count(opt_a.step_count());
  for (size_t i = 0; i < a.params.size(); ++i) {
    a.params[i]->main_grad = randn(a.params[i]->weight.shape(), seed + 99 + i);
    b.params[i]->main_grad = a.params[i]->main_grad.clone();
  }
  opt_a.step(2e-2f);
  opt_b.step(2e-2f);
  EXPECT_EQ(opt_b.step_count(), 4);
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(allclose(b.params[i]->weight, a.params[i]->weight, 0, 0)) << a.params[i]->name;
}

// The trainer's folded clipping, step(lr, clip_coefficient(...)), against the two passes
// it replaces, clip_grad_by_norm then step(lr): bitwise, over steps that clip and one
// that does not, and the main_grads keep their unclipped values.
TEST(AdamW, StepWithGradScaleEqualsClippingThenStepBitwise) {
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  AdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  Model folded = make_model(seed), clipped = make_model(seed);
  AdamW opt_folded(folded.params, cfg), opt_clipped(clipped.params, cfg);
  const double max_norm = 1.0;
  // Gradient std per step: the norm of 41 N(0, std^2) elements is about 6.4 * std, so the
  // first and last steps clip and the middle one does not.
  const float grad_stds[] = {3.0f, 0.05f, 0.7f};
  for (int t = 0; t < 3; ++t) {
    SCOPED_TRACE("step " + std::to_string(t + 1));
    for (size_t i = 0; i < folded.params.size(); ++i) {
      folded.params[i]->main_grad =
          randn(folded.params[i]->weight.shape(), seed + 200 + t * 10 + i, grad_stds[t]);
      clipped.params[i]->main_grad = folded.params[i]->main_grad.clone();
    }
    const double norm = global_grad_norm(folded.params);
    ASSERT_EQ(norm, global_grad_norm(clipped.params));
    const double coeff = clip_coefficient(max_norm, norm);
    EXPECT_EQ(coeff < 1.0, t != 1) << "norm " << norm;
    std::vector<Tensor> grads_before;
    for (Param* p : folded.params) grads_before.push_back(p->main_grad.clone());

    EXPECT_EQ(clip_grad_by_norm(clipped.params, max_norm, norm), coeff);
    opt_clipped.step(1e-2f);
    opt_folded.step(1e-2f, float(coeff));
    for (size_t i = 0; i < folded.params.size(); ++i) {
      SCOPED_TRACE(folded.params[i]->name);
      EXPECT_TRUE(allclose(folded.params[i]->weight, clipped.params[i]->weight, 0, 0));
      EXPECT_TRUE(allclose(folded.params[i]->main_grad, grads_before[i], 0, 0));
    }
    auto state_folded = opt_folded.state_tensors(), state_clipped = opt_clipped.state_tensors();
    for (size_t k = 0; k < state_folded.size(); ++k)
      EXPECT_TRUE(allclose(*state_folded[k].second, *state_clipped[k].second, 0, 0))
          << state_folded[k].first;
  }
  // Clipping changed the trajectory: the same steps without it end elsewhere.
  Model unclipped = make_model(seed);
  AdamW opt_unclipped(unclipped.params, cfg);
  for (int t = 0; t < 3; ++t) {
    for (size_t i = 0; i < unclipped.params.size(); ++i)
      unclipped.params[i]->main_grad =
          randn(unclipped.params[i]->weight.shape(), seed + 200 + t * 10 + i, grad_stds[t]);
    opt_unclipped.step(1e-2f);
  }
  auto m_unclipped = opt_unclipped.state_tensors(), m_folded = opt_folded.state_tensors();
  EXPECT_FALSE(allclose(*m_unclipped[0].second, *m_folded[0].second, 1e-6, 5e-6));
}

TEST(AdamW, RejectsMismatchedMainGradAndDuplicateNames) {
  Model m;
  Param& p = m.add("w", {3, 2}, 1, false);
  p.main_grad = Tensor::zeros({2, 3});
  EXPECT_THROW(AdamW{m.params}, InternalError);
  p.main_grad = Tensor::zeros({3, 2});
  m.add("w", {2}, 2, false);
  EXPECT_THROW(AdamW{m.params}, InternalError);
}

TEST(ClipGrad, GlobalNormOfHandValues) {
  Model m;
  m.add("a", {2}, 1, false).main_grad = Tensor::from({2}, {3.0f, -4.0f});
  m.add("b", {1}, 2, true).main_grad = Tensor::from({1}, {12.0f});
  EXPECT_DOUBLE_EQ(global_grad_norm(m.params), 13.0);  // sqrt(9 + 16 + 144)
}

TEST(ClipGrad, GlobalNormMatchesFp64OverRandomGrads) {
  uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Model m = make_model(seed);
  double sum_sq = 0;
  for (size_t i = 0; i < m.params.size(); ++i) {
    m.params[i]->main_grad = randn(m.params[i]->weight.shape(), seed + 10 + i, 3.0f);
    for (float g : m.params[i]->main_grad.to_vector()) sum_sq += double(g) * g;
  }
  EXPECT_NEAR(global_grad_norm(m.params), std::sqrt(sum_sq), 1e-12 * std::sqrt(sum_sq));
}

TEST(ClipGrad, ScalesByMaxNormOverNormPlusEpsilon) {
  Model m;
  m.add("a", {2}, 1, false).main_grad = Tensor::from({2}, {3.0f, -4.0f});
  m.add("b", {1}, 2, true).main_grad = Tensor::from({1}, {12.0f});
  double coeff = clip_grad_by_norm(m.params, 6.5, 13.0);
  double want = 6.5 / (13.0 + 1e-6);
  EXPECT_DOUBLE_EQ(coeff, want);
  EXPECT_TRUE(allclose(m.params[0]->main_grad,
                       Tensor::from({2}, {float(3.0 * want), float(-4.0 * want)}), 0, 1e-7));
  EXPECT_TRUE(allclose(m.params[1]->main_grad, Tensor::from({1}, {float(12.0 * want)}), 0, 1e-7));
  EXPECT_NEAR(global_grad_norm(m.params), 6.5, 1e-5);
}

TEST(ClipGrad, CoefficientIsMaxNormOverNormPlusEpsilonBelowOneElseOne) {
  EXPECT_DOUBLE_EQ(clip_coefficient(6.5, 13.0), 6.5 / (13.0 + 1e-6));
  // max_norm == norm still clips, very slightly (the 1e-6).
  EXPECT_LT(clip_coefficient(5.0, 5.0), 1.0);
  EXPECT_EQ(clip_coefficient(5.1, 5.0), 1.0);
  EXPECT_EQ(clip_coefficient(1.0, 0.0), 1.0);  // all-zero gradients
  EXPECT_EQ(clip_coefficient(1.0, std::nan("")), 1.0);
  // clip_grad_by_norm applies exactly this coefficient.
  Model m;
  m.add("a", {2}, 1, false).main_grad = Tensor::from({2}, {3.0f, -4.0f});
  EXPECT_EQ(clip_grad_by_norm(m.params, 2.0, 5.0), clip_coefficient(2.0, 5.0));
}

TEST(ClipGrad, LeavesGradientsWhenCoefficientIsAtLeastOne) {
  Model m;
  m.add("a", {2}, 1, false).main_grad = Tensor::from({2}, {3.0f, -4.0f});
  // max_norm >= norm + 1e-6: no change.
  EXPECT_EQ(clip_grad_by_norm(m.params, 5.1, 5.0), 1.0);
  EXPECT_TRUE(allclose(m.params[0]->main_grad, Tensor::from({2}, {3.0f, -4.0f}), 0, 0));
  // max_norm == norm: coefficient 5 / (5 + 1e-6) < 1, so Megatron scales (very slightly).
  double c = clip_grad_by_norm(m.params, 5.0, 5.0);
  EXPECT_LT(c, 1.0);
  EXPECT_DOUBLE_EQ(c, 5.0 / (5.0 + 1e-6));
  // A NaN norm clips nothing.
  Tensor before = m.params[0]->main_grad.clone();
  EXPECT_EQ(clip_grad_by_norm(m.params, 1.0, std::nan("")), 1.0);
  EXPECT_TRUE(allclose(m.params[0]->main_grad, before, 0, 0));
}
