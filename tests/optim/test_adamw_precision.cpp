// The precision-aware AdamW on the CPU (--use-precision-aware-optimizer with bf16 Adam
// moments): each stored moment is the fp32-math update stochastically rounded to one of
// its two bf16 neighbours, the rounding is unbiased (a bf16 exp_avg_sq decays as the fp32
// one does), deterministic and independent of how a parameter is sharded or sliced, the
// params follow an fp64 reference, fp32 moments keep the default path bit for bit, a
// restore of the bf16 state resumes bitwise, and the flag rules refuse what Megatron
// refuses.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/adam_precision.h"
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

// One bf16 ulp of x (the largest error of a stochastic rounding: x goes to one of its two
// bf16 neighbours), at least the smallest normal's ulp.
double bf16_ulp(double x) {
  const double a = std::max(std::fabs(x), 1.1754943508222875e-38);
  return std::ldexp(1.0, std::ilogb(a) - 7);
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

// Each step against an fp64 AdamW step from the stored state: the moments are one of the
// two bf16 neighbours of the fp64 value (up to the fp32 arithmetic's error), the params
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
  int64_t rounded_up = 0, rounded_down = 0;
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
        // Stochastic rounding: a bf16 neighbour, within an ulp, plus the fp32 arithmetic's
        // error (a few fp32 ulps of the terms summed: b1 m and (1 - b1) g may cancel).
        const double m_terms = std::fabs(b1 * m0[i][k]) + std::fabs((1 - b1) * g);
        const double v_terms = b2 * v0[i][k] + (1 - b2) * g * g;
        ASSERT_LE(std::fabs(m_got - m_ref), bf16_ulp(m_ref) + 3e-7 * m_terms)
            << "exp_avg element " << k;
        ASSERT_LE(std::fabs(v_got - v_ref), bf16_ulp(v_ref) + 3e-7 * v_terms)
            << "exp_avg_sq element " << k;
        // Truncation would always move toward zero; stochastic rounding goes either way.
        if (std::fabs(m_got) > std::fabs(m_ref))
          ++rounded_up;
        else if (std::fabs(m_got) < std::fabs(m_ref))
          ++rounded_down;
        // The param from the fp32 moments before rounding (the update uses them).
        p_ref[k] = p0[i][k] * (1 - double(lrs[t]) * wd) -
                   double(lrs[t]) * (m_ref / bc1) / (std::sqrt(v_ref / bc2) + cfg.adam_eps);
      }
      std::vector<float> p_ref_f(p_ref.begin(), p_ref.end());
      EXPECT_TRUE(allclose(p.weight, Tensor::from(p.weight.shape(), p_ref_f), 1e-6, 5e-6));
    }
  }
  EXPECT_GT(rounded_up, 1000);
  EXPECT_GT(rounded_down, 1000);
}

// One moment in bf16, the other fp32: the fp32 one holds the fp32 update exactly as the
// all-bf16 run computes it before rounding, so rounding it with the bits of the same
// element and step (the high 16 of the param's stream) gives that run's bf16 state.
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
    const Tensor& v32 = *sb[2 * i + 1].second;
    const Tensor& v16 = *sa[2 * i + 1].second;
    ops::MomentRoundingStream random(moment_rounding_key(*a.params[i], 0, 1, 0), 1);
    for (int64_t k = 0; k < v32.numel(); ++k) {
      const uint16_t rounded = ops::bf16_round_stochastic(v32.f32()[k], random.bits(k) >> 16);
      ASSERT_EQ(rounded, static_cast<const uint16_t*>(v16.raw())[k]) << "exp_avg_sq element " << k;
    }
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
  // The fp32 main params with their bf16 copies (remainders: test_adamw_param_remainder.cpp).
  AdamWConfig config = bf16_config();
  config.store_param_remainders = false;
  AdamW opt_a(a.params, config);
  for (int t = 0; t < 3; ++t) {
    set_grads(a, seed + 50 + t);
    opt_a.step(1e-2f, 0.9f);
  }
  for (size_t i = 0; i < a.params.size(); ++i) {
    b.params[i]->main_param.copy_from(a.params[i]->main_param);
    ops::cast(b.params[i]->main_param, b.params[i]->weight);
  }
  AdamW opt_b(b.params, config);
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

// ---- stochastic rounding ----

namespace {

// The bf16 value of its bits, as a double.
double bf16_value(uint16_t bits) { return bf16_to_float(bits); }

// The fp32 value between two bf16 neighbours: lo (bf16 bits) plus `fraction` of an ulp.
float between(uint16_t lo_bits, double fraction) {
  const double lo = bf16_value(lo_bits), hi = bf16_value(uint16_t(lo_bits + 1));
  return float(lo + fraction * (hi - lo));
}

}  // namespace

// Over many draws the mean of the rounded values is the value itself, for values at
// several places between two neighbours, of both signs and magnitudes; each draw is one
// of the two neighbours; a value already in bf16 never moves; infinities and NaN survive.
TEST(AdamWPrecision, StochasticRoundingIsUnbiased) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t draws = 200000;
  // Element-independent draws: element k of a tensor at one step (the bits of distinct
  // elements are independent draws of Philox).
  ops::MomentRoundingKey key;
  key.param_key = seed;
  const uint16_t neighbours[] = {0x3F80 /* 1 */, 0xBF80 /* -1 */, 0x3A83 /* ~1e-3 */,
                                 0x2F0A /* ~1.3e-10, a small exp_avg_sq */};
  for (uint16_t lo : neighbours) {
    for (double fraction : {0.001, 0.1, 0.37, 0.5, 0.9}) {
      const float x = between(lo, fraction);
      SCOPED_TRACE("x " + std::to_string(x) + " fraction " + std::to_string(fraction));
      const double ulp = std::fabs(bf16_value(uint16_t(lo + 1)) - bf16_value(lo));
      ops::MomentRoundingStream random(key, 7);
      double sum = 0.0;
      for (int64_t k = 0; k < draws; ++k) {
        const uint32_t bits = random.bits(k);
        for (uint32_t r : {bits & 0xFFFFu, bits >> 16}) {
          const uint16_t out = ops::bf16_round_stochastic(x, r);
          ASSERT_TRUE(out == lo || out == uint16_t(lo + 1)) << "draw " << k;
          sum += bf16_value(out);
        }
      }
      const double mean = sum / double(2 * draws);
      // The mean of 2 x 200000 two-valued draws: standard error below 8e-4 ulp.
      EXPECT_NEAR(mean, double(x), 0.005 * ulp);
    }
    const float exact = float(bf16_value(lo));
    for (uint32_t r : {0u, 1u, 0x8000u, 0xFFFFu})
      EXPECT_EQ(ops::bf16_round_stochastic(exact, r), lo);
  }
  for (uint32_t r : {0u, 0xFFFFu}) {
    EXPECT_EQ(ops::bf16_round_stochastic(INFINITY, r), 0x7F80);
    EXPECT_EQ(ops::bf16_round_stochastic(-INFINITY, r), 0xFF80);
    const uint16_t nan = ops::bf16_round_stochastic(std::bit_cast<float>(0x7FFFFFFFu), r);
    EXPECT_TRUE(std::isnan(bf16_value(nan)));
  }
}

// The cause the rounding fixes: with beta2 = 0.999 a bf16 exp_avg_sq rounded to nearest
// stays where it is (bf16(0.999 v) == v), while the stochastically rounded one decays as
// the fp32 one does, in the mean over elements.
TEST(AdamWPrecision, Bf16ExpAvgSqDecaysLikeFp32) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t n = 4096, steps = 400;
  const float g = 1e-3f;  // (1 - b2) g^2 = 1e-9, far below v's ulp: v decays by b2 alone
  auto filled = [n](float value) {
    Tensor t = Tensor::empty({n});
    t.fill(value);
    return t;
  };
  std::vector<Tensor> p32{randn({n}, seed, 0.1f)}, p16{p32[0].clone()};
  std::vector<Tensor> grads{filled(g)};
  std::vector<Tensor> m32{Tensor::zeros({n})}, v32{filled(1.0f)};
  std::vector<Tensor> m16{Tensor::zeros({n}, DType::BF16)}, v16{filled(1.0f).to(DType::BF16)};
  std::vector<Tensor> no_copy{Tensor()};
  const std::vector<ops::MomentRoundingKey> keys(1);
  for (int64_t step = 1; step <= steps; ++step) {
    ops::multi_tensor_adamw(p32, grads, m32, v32, no_copy, {0.0f}, 1e-4f, 0.9f, 0.999f, 1e-8f, step,
                            1.0f);
    ops::multi_tensor_adamw(p16, grads, m16, v16, no_copy, {0.0f}, 1e-4f, 0.9f, 0.999f, 1e-8f, step,
                            1.0f, keys);
  }
  double mean16 = 0.0;
  for (int64_t k = 0; k < n; ++k) mean16 += v16[0].item(k);
  mean16 /= double(n);
  const double fp32 = v32[0].item(0);                       // every element the same
  EXPECT_NEAR(fp32, std::pow(0.999, double(steps)), 1e-3);  // 0.670: it did decay
  // Round to nearest would have left 1.0; the mean's standard error is ~4e-5.
  EXPECT_NEAR(mean16, fp32, 2e-3 * fp32);
}

// The same inputs give the same bits; another step draws other bits.
TEST(AdamWPrecision, StochasticRoundingIsDeterministicPerStep) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto one_step = [&](int64_t step) {
    Model m = make_model(seed);
    set_grads(m, seed + 1);
    AdamW opt(m.params, bf16_config());
    opt.set_step_count(step - 1);
    opt.step(1e-2f);
    std::vector<Tensor> out;
    for (auto& [name, t] : opt.state_tensors()) out.push_back(t->clone());
    return out;
  };
  const std::vector<Tensor> a = one_step(5), b = one_step(5), c = one_step(6);
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(allclose(a[i], b[i], 0, 0)) << "state " << i;
    differs = differs || !allclose(a[i], c[i], 0, 0);
  }
  // Step 6's moments differ only where the rounding went the other way (the bias
  // corrections do not enter the moments): the bits depend on the step.
  EXPECT_TRUE(differs);
}

namespace {

// One update of `param`'s elements listed as pieces, each piece a tensor with its rounding
// key: returns the pieces' moments and params joined in the order given by `where`
// (where[k][e] = index in the full tensor of element e of piece k).
struct PieceResult {
  std::vector<float> param;
  std::vector<uint16_t> exp_avg, exp_avg_sq;
};

PieceResult update_pieces(const Tensor& full_param, const Tensor& full_grad,
                          const std::vector<std::vector<int64_t>>& where,
                          const std::vector<ops::MomentRoundingKey>& keys, int64_t step) {
  std::vector<Tensor> params, grads, m, v, copies;
  std::vector<float> decays;
  for (const std::vector<int64_t>& idx : where) {
    Tensor p = Tensor::empty({int64_t(idx.size())}), g = Tensor::empty({int64_t(idx.size())});
    for (size_t e = 0; e < idx.size(); ++e) {
      p.f32()[e] = full_param.f32()[idx[e]];
      g.f32()[e] = full_grad.f32()[idx[e]];
    }
    params.push_back(p);
    grads.push_back(g);
    m.push_back(Tensor::zeros({int64_t(idx.size())}, DType::BF16));
    v.push_back(Tensor::zeros({int64_t(idx.size())}, DType::BF16));
    copies.push_back(Tensor());
    decays.push_back(0.1f);
  }
  for (int64_t s = step; s < step + 2; ++s)
    ops::multi_tensor_adamw(params, grads, m, v, copies, decays, 1e-2f, 0.9f, 0.999f, 1e-8f, s,
                            0.8f, keys);
  PieceResult out;
  const int64_t n = full_param.numel();
  out.param.assign(n, 0.0f);
  out.exp_avg.assign(n, 0);
  out.exp_avg_sq.assign(n, 0);
  for (size_t k = 0; k < where.size(); ++k)
    for (size_t e = 0; e < where[k].size(); ++e) {
      out.param[where[k][e]] = params[k].f32()[e];
      out.exp_avg[where[k][e]] = static_cast<const uint16_t*>(m[k].raw())[e];
      out.exp_avg_sq[where[k][e]] = static_cast<const uint16_t*>(v[k].raw())[e];
    }
  return out;
}

void expect_same_result(const PieceResult& got, const PieceResult& want) {
  EXPECT_EQ(got.exp_avg, want.exp_avg);
  EXPECT_EQ(got.exp_avg_sq, want.exp_avg_sq);
  EXPECT_EQ(got.param, want.param);
}

}  // namespace

// A parameter updated whole, or as distributed-optimizer shards (offsets not multiples of
// 4, so the shards' Philox groups straddle them), or as tensor-parallel slices (rows, the
// two halves of a SwiGLU fc1, columns) with their keys from moment_rounding_key: each
// element gets the whole tensor's bits, so the same params and moments.
TEST(AdamWPrecision, StochasticRoundingIsLayoutIndependent) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = 12, cols = 10, n = rows * cols;
  const Tensor param = randn({n}, seed, 0.5f), grad = randn({n}, seed + 1, 0.3f);
  Param p;
  p.name = "decoder.layers.1.mlp.linear_fc1.weight";
  p.full_shape = {rows, cols};
  std::vector<int64_t> all(n);
  for (int64_t e = 0; e < n; ++e) all[e] = e;
  const PieceResult whole = update_pieces(param, grad, {all}, {moment_rounding_key(p, 0, 1, 0)}, 3);

  {  // distributed-optimizer shards of the whole tensor: [0, 37), [37, 90), [90, 120)
    SCOPED_TRACE("shards");
    const int64_t bounds[] = {0, 37, 90, n};
    std::vector<std::vector<int64_t>> where;
    std::vector<ops::MomentRoundingKey> keys;
    for (int s = 0; s < 3; ++s) {
      where.emplace_back(all.begin() + bounds[s], all.begin() + bounds[s + 1]);
      keys.push_back(moment_rounding_key(p, 0, 1, bounds[s]));
    }
    expect_same_result(update_pieces(param, grad, where, keys, 3), whole);
  }
  // Tensor-parallel slices over 2 ranks (tensor_parallel_ckpt.cpp's layouts), each also cut
  // into two distributed-optimizer shards at local element 13.
  struct Split {
    const char* name;
    int dim;
    bool swiglu;
  };
  for (const Split& split :
       {Split{"rows", 0, false}, Split{"swiglu halves", 0, true}, Split{"columns", 1, false}}) {
    SCOPED_TRACE(split.name);
    Param sliced = p;
    sliced.tp_split_dim = split.dim;
    if (split.swiglu) sliced.tp_blocks = swiglu_blocks(sliced.full_shape[0]);
    std::vector<std::vector<int64_t>> where;
    std::vector<ops::MomentRoundingKey> keys;
    for (int rank = 0; rank < 2; ++rank) {
      std::vector<int64_t> local;  // full index of each local element, row-major
      if (split.dim == 1) {
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = rank * cols / 2; c < (rank + 1) * cols / 2; ++c)
            local.push_back(r * cols + c);
      } else {
        const int64_t parts = split.swiglu ? 2 : 1, chunk = rows / (2 * parts);
        for (int64_t half = 0; half < parts; ++half)
          for (int64_t r = half * rows / parts + rank * chunk;
               r < half * rows / parts + (rank + 1) * chunk; ++r)
            for (int64_t c = 0; c < cols; ++c) local.push_back(r * cols + c);
      }
      ASSERT_EQ(int64_t(local.size()), n / 2);
      where.emplace_back(local.begin(), local.begin() + 13);
      keys.push_back(moment_rounding_key(sliced, rank, 2, 0));
      where.emplace_back(local.begin() + 13, local.end());
      keys.push_back(moment_rounding_key(sliced, rank, 2, 13));
    }
    expect_same_result(update_pieces(param, grad, where, keys, 3), whole);
  }
  {  // another parameter's name draws other bits
    Param other = p;
    other.name = "decoder.layers.2.mlp.linear_fc1.weight";
    const PieceResult renamed =
        update_pieces(param, grad, {all}, {moment_rounding_key(other, 0, 1, 0)}, 3);
    EXPECT_NE(renamed.exp_avg_sq, whole.exp_avg_sq);
  }
}

TEST(AdamWPrecision, FlagRulesAreMegatronsAndFp16MainParamsNeedSeparateWeights) {
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
  // fp16 and fp8 moments (scaled states) with the switch, refused without it.
  for (DType d : {DType::F16, DType::F8E4M3}) {
    AdamWConfig x = c;
    x.exp_avg_sq_dtype = d;
    EXPECT_NO_THROW(check_precision_aware_config(x));
    x.exp_avg_dtype = d;
    x.use_precision_aware_optimizer = false;
    EXPECT_THROW(check_precision_aware_config(x), Error);
  }
  // bf16 main grads (bf16 grad buffers) with the switch.
  AdamWConfig grads = c;
  grads.main_grads_dtype = DType::BF16;
  EXPECT_NO_THROW(check_precision_aware_config(grads));
  // fp16 main params: with the switch; then only beside bf16 / fp16 weights and without
  // the host update (check_main_params_dtype, which knows the compute dtype).
  AdamWConfig params = c;
  params.main_params_dtype = DType::F16;
  EXPECT_NO_THROW(check_precision_aware_config(params));
  EXPECT_NO_THROW(check_main_params_dtype(params, DType::BF16));
  EXPECT_NO_THROW(check_main_params_dtype(params, DType::F16));
  EXPECT_THROW(check_main_params_dtype(params, DType::F32), Error);
  params.optimizer_cpu_offload = true;
  EXPECT_THROW(check_main_params_dtype(params, DType::BF16), Error);
  params.use_precision_aware_optimizer = false;
  params.optimizer_cpu_offload = false;
  EXPECT_THROW(check_precision_aware_config(params), Error);
}
