// The precision-aware AdamW on the CPU (--use-precision-aware-optimizer with bf16 Adam
// moments): each stored moment is the fp32-math update rounded to nearest bf16, the
// params follow an fp64 reference, fp32 moments keep the default path bit for bit, a
// restore of the bf16 state resumes bitwise, and the flag rules refuse what Megatron
// refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/ops.h"
#include "optim/adamw.h"

using namespace megaton;
using namespace megaton::optim;
using megaton::testing::allclose;
using megaton::testing::randn;
using megaton::testing::test_seed;

namespace {

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

// Sizes past the CPU's parallel threshold and odd ones.
Model make_model(uint64_t seed) {
  Model m;
  m.add("decoder.layers.0.mlp.linear_fc1.weight", {300, 113}, seed + 1, false);
  m.add("decoder.layers.0.mlp.linear_fc1.bias", {7}, seed + 2, true);
  m.add("decoder.final_layernorm.weight", {33}, seed + 3, true);
  return m;
}

AdamWConfig bf16_config() {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.use_precision_aware_optimizer = true;
  c.exp_avg_dtype = DType::BF16;
  c.exp_avg_sq_dtype = DType::BF16;
  return c;
}

// Half a bf16 ulp of x (the largest error of a round to nearest), at least half the
// smallest normal's ulp.
double half_bf16_ulp(double x) {
  const double a = std::max(std::fabs(x), 1.1754943508222875e-38);
  return 0.5 * std::ldexp(1.0, std::ilogb(a) - 7);
}

std::vector<double> as_double(const Tensor& t) {
  std::vector<double> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = t.item(i);
  return out;
}

void set_grads(Model& m, uint64_t seed) {
  for (size_t i = 0; i < m.params.size(); ++i)
    m.params[i]->main_grad = randn(m.params[i]->weight.shape(), seed + 7 * i, 0.3f);
}

}  // namespace

// Each step against an fp64 AdamW step from the stored state: the moments are the
// correctly rounded bf16 of the fp64 value (up to the fp32 arithmetic's error), the params
// the fp64 value to fp32 tolerance.
TEST(AdamWPrecision, Bf16MomentsAreTheFp32UpdateRoundedPerElement) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const AdamWConfig cfg = bf16_config();
  Model model = make_model(seed);
  AdamW opt(model.params, cfg);
  auto state = opt.state_tensors();
  for (auto& [name, t] : state) EXPECT_EQ(t->dtype(), DType::BF16) << name;
  const std::vector<float> lrs = {1e-2f, 3e-2f, 2e-2f, 5e-3f};
  int64_t rounded_not_truncated = 0;
  for (size_t t = 0; t < lrs.size(); ++t) {
    set_grads(model, seed * 10 + t);
    std::vector<std::vector<double>> p0, m0, v0;
    for (size_t i = 0; i < model.params.size(); ++i) {
      p0.push_back(as_double(model.params[i]->weight));
      m0.push_back(as_double(*state[2 * i].second));
      v0.push_back(as_double(*state[2 * i + 1].second));
    }
    opt.step(lrs[t]);
    const int64_t step = int64_t(t + 1);
    const double b1 = cfg.adam_beta1, b2 = cfg.adam_beta2;
    const double bc1 = 1 - std::pow(b1, double(step)), bc2 = 1 - std::pow(b2, double(step));
    for (size_t i = 0; i < model.params.size(); ++i) {
      const Param& p = *model.params[i];
      SCOPED_TRACE(p.name + " step " + std::to_string(step));
      const double wd = p.no_weight_decay ? 0.0 : cfg.weight_decay;
      const Tensor& m = *state[2 * i].second;
      const Tensor& v = *state[2 * i + 1].second;
      ASSERT_EQ(m.dtype(), DType::BF16);
      std::vector<double> p_ref(p0[i].size());
      for (size_t k = 0; k < p0[i].size(); ++k) {
        const double g = p.main_grad.item(int64_t(k));
        const double m_ref = b1 * m0[i][k] + (1 - b1) * g;
        const double v_ref = b2 * v0[i][k] + (1 - b2) * g * g;
        const double m_got = m.item(int64_t(k)), v_got = v.item(int64_t(k));
        // Round to nearest: within half an ulp, plus the fp32 arithmetic's error (a few
        // fp32 ulps of the terms summed: b1 m and (1 - b1) g may cancel).
        const double m_terms = std::fabs(b1 * m0[i][k]) + std::fabs((1 - b1) * g);
        const double v_terms = b2 * v0[i][k] + (1 - b2) * g * g;
        ASSERT_LE(std::fabs(m_got - m_ref), half_bf16_ulp(m_ref) + 3e-7 * m_terms)
            << "exp_avg element " << k;
        ASSERT_LE(std::fabs(v_got - v_ref), half_bf16_ulp(v_ref) + 3e-7 * v_terms)
            << "exp_avg_sq element " << k;
        // Truncation would always move toward zero; rounding goes up about half the time.
        if (std::fabs(m_got) > std::fabs(m_ref)) ++rounded_not_truncated;
        // The param from the fp32 moments before rounding (the update uses them).
        p_ref[k] = p0[i][k] * (1 - double(lrs[t]) * wd) -
                   double(lrs[t]) * (m_ref / bc1) / (std::sqrt(v_ref / bc2) + cfg.adam_eps);
      }
      std::vector<float> p_ref_f(p_ref.begin(), p_ref.end());
      EXPECT_TRUE(allclose(p.weight, Tensor::from(p.weight.shape(), p_ref_f), 1e-6, 5e-6));
    }
  }
  EXPECT_GT(rounded_not_truncated, 1000);
}

// One moment in bf16, the other fp32: the fp32 one holds the fp32 update exactly as the
// all-bf16 run computes it before rounding, so rounding it gives that run's bf16 state.
TEST(AdamWPrecision, MixedMomentDtypesAgreeWithTheAllBf16Run) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  AdamWConfig mixed = bf16_config();
  mixed.exp_avg_sq_dtype = DType::F32;
  Model a = make_model(seed), b = make_model(seed);
  AdamW opt_a(a.params, bf16_config()), opt_b(b.params, mixed);
  set_grads(a, seed + 5);
  set_grads(b, seed + 5);
  opt_a.step(1e-2f);
  opt_b.step(1e-2f);
  auto sa = opt_a.state_tensors(), sb = opt_b.state_tensors();
  for (size_t i = 0; i < a.params.size(); ++i) {
    SCOPED_TRACE(a.params[i]->name);
    EXPECT_EQ(sb[2 * i].second->dtype(), DType::BF16);
    EXPECT_EQ(sb[2 * i + 1].second->dtype(), DType::F32);
    EXPECT_TRUE(allclose(a.params[i]->weight, b.params[i]->weight, 0, 0));
    EXPECT_TRUE(allclose(*sa[2 * i].second, *sb[2 * i].second, 0, 0));
    EXPECT_TRUE(allclose(*sa[2 * i + 1].second, sb[2 * i + 1].second->to(DType::BF16), 0, 0));
  }
}

// The switch with fp32 dtypes is the default optimizer, bit for bit.
TEST(AdamWPrecision, Fp32StatesUnderTheSwitchAreTheDefaultPathBitwise) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  AdamWConfig on;
  on.use_precision_aware_optimizer = true;
  Model a = make_model(seed), b = make_model(seed);
  AdamW opt_a(a.params), opt_b(b.params, on);
  for (int t = 0; t < 3; ++t) {
    set_grads(a, seed + 100 * t);
    set_grads(b, seed + 100 * t);
    opt_a.step(2e-2f, 0.7f);
    opt_b.step(2e-2f, 0.7f);
  }
  auto sa = opt_a.state_tensors(), sb = opt_b.state_tensors();
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(allclose(a.params[i]->weight, b.params[i]->weight, 0, 0)) << a.params[i]->name;
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sb[i].second->dtype(), DType::F32);
    EXPECT_TRUE(allclose(*sa[i].second, *sb[i].second, 0, 0)) << sa[i].first;
  }
}

// A bf16 run interrupted after 3 steps and resumed from its saved (bf16) state and step
// count ends bitwise where the uninterrupted run does; with a bf16 compute copy of the
// weights and clipping folded in.
TEST(AdamWPrecision, ResumeFromBf16StateIsBitwise) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto with_copy = [](Model& m) {
    for (Param* p : m.params) {
      p->main_param = p->weight;
      p->weight = p->main_param.to(DType::BF16);
    }
  };
  Model a = make_model(seed), b = make_model(seed);
  with_copy(a);
  with_copy(b);
  AdamW opt_a(a.params, bf16_config());
  for (int t = 0; t < 3; ++t) {
    set_grads(a, seed + 50 + t);
    opt_a.step(1e-2f, 0.9f);
  }
  for (size_t i = 0; i < a.params.size(); ++i) {
    b.params[i]->main_param.copy_from(a.params[i]->main_param);
    ops::cast(b.params[i]->main_param, b.params[i]->weight);
  }
  AdamW opt_b(b.params, bf16_config());
  auto sa = opt_a.state_tensors(), sb = opt_b.state_tensors();
  for (size_t i = 0; i < sa.size(); ++i) sb[i].second->copy_from(*sa[i].second);
  opt_b.set_step_count(opt_a.step_count());
  for (int t = 0; t < 2; ++t) {
    set_grads(a, seed + 900 + t);
    set_grads(b, seed + 900 + t);
    opt_a.step(2e-2f, 0.8f);
    opt_b.step(2e-2f, 0.8f);
  }
  for (size_t i = 0; i < a.params.size(); ++i) {
    SCOPED_TRACE(a.params[i]->name);
    EXPECT_TRUE(allclose(b.params[i]->main_param, a.params[i]->main_param, 0, 0));
    EXPECT_TRUE(allclose(b.params[i]->weight, a.params[i]->weight, 0, 0));
    // The compute copy is the rounded main param.
    EXPECT_TRUE(allclose(a.params[i]->weight, a.params[i]->main_param.to(DType::BF16), 0, 0));
  }
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_TRUE(allclose(*sb[i].second, *sa[i].second, 0, 0)) << sa[i].first;
}

// The step decided on the device (adamw_step_control, then multi_tensor_adamw reading the
// control tensor) gives the host path's bits with bf16 moments too.
TEST(AdamWPrecision, ControlPathEqualsHostPathWithBf16Moments) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Model a = make_model(seed), b = make_model(seed);
  AdamW opt_a(a.params, bf16_config()), opt_b(b.params, bf16_config());
  const float lr = 3e-2f;
  set_grads(a, seed + 3);
  set_grads(b, seed + 3);
  opt_a.step(lr, 1.0f);
  Tensor parts = Tensor::empty({1}, DType::I64), control = Tensor::empty({ops::kAdamControlSize}),
         norm = Tensor::empty({1}, DType::I64);
  std::vector<Tensor> grads;
  for (Param* p : b.params) grads.push_back(p->main_grad);
  ops::multi_tensor_sum_of_squares(grads, parts);
  const AdamWConfig c = bf16_config();
  ops::adamw_step_control(parts, 1.0, 0.0, 1.0f, Tensor(), false, Tensor::from({1}, {lr}),
                          c.adam_beta1, c.adam_beta2, opt_b.device_state(), control, norm);
  opt_b.step(control);
  EXPECT_EQ(opt_b.step_count(), 1);
  auto sa = opt_a.state_tensors(), sb = opt_b.state_tensors();
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(allclose(b.params[i]->weight, a.params[i]->weight, 0, 0)) << a.params[i]->name;
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_TRUE(allclose(*sb[i].second, *sa[i].second, 0, 0)) << sa[i].first;
}

TEST(AdamWPrecision, FlagRulesAreMegatronsAndUnsupportedDtypesAreRefused) {
  EXPECT_EQ(precision_aware_dtype("exp-avg-dtype", "bf16", {"fp32", "fp16", "bf16", "fp8"}),
            DType::BF16);
  EXPECT_EQ(precision_aware_dtype("exp-avg-dtype", "fp32", {"fp32", "bf16"}), DType::F32);
  EXPECT_THROW(precision_aware_dtype("exp-avg-dtype", "int8", {"fp32", "fp16", "bf16", "fp8"}),
               Error);
  EXPECT_THROW(precision_aware_dtype("main-grads-dtype", "fp16", {"fp32", "bf16"}), Error);
  AdamWConfig c;
  EXPECT_NO_THROW(check_precision_aware_config(c));
  c.exp_avg_dtype = DType::BF16;
  EXPECT_THROW(check_precision_aware_config(c), Error);  // no switch
  c.use_precision_aware_optimizer = true;
  EXPECT_NO_THROW(check_precision_aware_config(c));
  for (DType d : {DType::F16, DType::F8E4M3}) {
    AdamWConfig x = c;
    x.exp_avg_sq_dtype = d;
    EXPECT_THROW(check_precision_aware_config(x), Error);
  }
  AdamWConfig grads = c;
  grads.main_grads_dtype = DType::BF16;
  EXPECT_THROW(check_precision_aware_config(grads), Error);
  AdamWConfig params = c;
  params.main_params_dtype = DType::F16;
  EXPECT_THROW(check_precision_aware_config(params), Error);
}
