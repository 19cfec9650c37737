// fp16 main params with a per-tensor scale on the CPU (ops/adam_f16_main_param.h,
// Transformer Engine's FusedAdam master_weight_dtype fp16): the round-to-nearest fp16
// encoding against the core conversion; the update with its absmax pass against an
// independent fp64 scalar formula (value = stored * scale, new scale = absmax(new) / 32752,
// stored = new / scale rounded to nearest, the compute weight the new value to nearest);
// quantize / dequantize round trip; a skipped step changes nothing; an all-zero tensor gets
// scale 0 and recovers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "ops/adam_f16_main_param.h"
#include "ops/adam_f16_main_param_math.h"
#include "ops/adam_precision.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using ops::AdamMainParamScales;
using ops::AdamMomentScales;

TEST(AdamF16MainParam, RoundNearestMatchesTheCoreFp16Cast) {
  // Every fp16 value, the midpoints between neighbours (ties to even) and values a hair
  // either side of them, and random values over the whole range (subnormals, overflow).
  std::vector<float> xs;
  for (uint32_t h = 0; h < 0x7C00u; ++h) {
    const float a = fp16_to_float(uint16_t(h)), b = fp16_to_float(uint16_t(h + 1));
    const float mid = 0.5f * (a + b);
    for (float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e6f)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  const Tensor r = testing::randn({100000}, testing::test_seed(), 1.0f);
  for (int64_t i = 0; i < r.numel(); ++i) xs.push_back(std::ldexp(r.f32()[i], int(i % 44) - 28));
  for (float x : xs) ASSERT_EQ(ops::fp16_round_nearest(x), float_to_fp16(x)) << x;
  EXPECT_EQ(ops::fp16_round_nearest(INFINITY), float_to_fp16(INFINITY));
}

struct Lists {
  std::vector<Tensor> masters, copies, grads, m, v;
  std::vector<float> decays;
  std::vector<ops::MomentRoundingKey> keys;
  AdamMomentScales moment_scales;
  AdamMainParamScales main_scales;
  Tensor moment_scale, moment_absmax, scale, absmax;
  std::vector<std::vector<double>> values;  // the main params' values before the step
};

// F16 main params stored from random values under a random-ish scale (as a previous step
// leaves them: absmax / 32752), copies BF16 or F16, moments per `dtypes` (fp16 ones scaled).
Lists make_lists(uint64_t seed, const std::vector<std::pair<DType, DType>>& dtypes) {
  const Shape shapes[] = {{37, 5}, {1001}, {40000}, {9}};
  Lists l;
  const int64_t n = int64_t(dtypes.size());
  l.moment_scale = Tensor::zeros({n, 2});
  l.moment_absmax = Tensor::zeros({n, 2});
  l.scale = Tensor::zeros({n});
  l.absmax = Tensor::zeros({n});
  for (int64_t i = 0; i < n; ++i) {
    const Shape& s = shapes[i % 4];
    const uint64_t base = seed + 100 * uint64_t(i);
    const Tensor value = testing::randn(s, base, 0.5f);
    float absmax = 0;
    for (int64_t k = 0; k < value.numel(); ++k) absmax = std::max(absmax, std::fabs(value.f32()[k]));
    const float scale = absmax / 32752.0f;
    Tensor stored = Tensor::empty(s, DType::F16);
    std::vector<double> values;
    for (int64_t k = 0; k < value.numel(); ++k) {
      const uint16_t h = float_to_fp16(value.f32()[k] / scale);
      static_cast<uint16_t*>(stored.raw())[k] = h;
      values.push_back(double(fp16_to_float(h)) * double(scale));
    }
    l.values.push_back(values);
    l.scale.f32()[i] = scale;
    l.masters.push_back(stored);
    l.copies.push_back(Tensor::zeros(s, i % 2 ? DType::F16 : DType::BF16));
    l.grads.push_back(testing::randn(s, base + 1, 0.3f));
    Tensor m = testing::randn(s, base + 2, 0.01f);
    Tensor v = testing::randn(s, base + 3, 1e-3f);
    for (int64_t k = 0; k < v.numel(); ++k) v.f32()[k] *= v.f32()[k];
    const auto [md, vd] = dtypes[size_t(i)];
    const float old_scale[2] = {0.01f / 300.0f, 1e-5f / 300.0f};
    const DType dt[2] = {md, vd};
    Tensor* states[2] = {&m, &v};
    for (int c = 0; c < 2; ++c) {
      if (dt[c] == DType::F16) {
        Tensor st = Tensor::empty(s, DType::F16);
        for (int64_t k = 0; k < st.numel(); ++k)
          static_cast<uint16_t*>(st.raw())[k] = float_to_fp16(states[c]->f32()[k] / old_scale[c]);
        *states[c] = st;
        l.moment_scale.f32()[2 * i + c] = old_scale[c];
      } else {
        *states[c] = states[c]->to(dt[c]);
      }
    }
    l.m.push_back(m);
    l.v.push_back(v);
    l.decays.push_back(i % 2 ? 0.0f : 0.1f);
    ops::MomentRoundingKey key;
    key.param_key = 500 + uint64_t(i);
    l.keys.push_back(key);
    l.moment_scales.scale.push_back(l.moment_scale.rows(i, 1).view({2}));
    l.moment_scales.absmax.push_back(l.moment_absmax.rows(i, 1).view({2}));
    l.main_scales.scale.push_back(l.scale.rows(i, 1));
    l.main_scales.absmax.push_back(l.absmax.rows(i, 1));
  }
  return l;
}

double moment_value(const Tensor& t, int64_t k, double scale) {
  if (t.dtype() == DType::F16)
    return double(fp16_to_float(static_cast<const uint16_t*>(t.raw())[k])) * scale;
  return t.item(k);
}

// Both passes (moments' absmax first, as AdamW runs them) with host scalars or control.
void run_step(Lists& l, float lr, float b1, float b2, float eps, int64_t step, float grad_scale,
              const Tensor& control) {
  l.moment_absmax.zero();
  l.absmax.zero();
  ops::multi_tensor_adamw_moment_absmax(l.grads, l.m, l.v, l.moment_scales, b1, b2, grad_scale,
                                        control);
  ops::multi_tensor_adamw_f16_main_param_absmax(l.masters, l.grads, l.m, l.v, l.moment_scales,
                                                l.main_scales, l.decays, lr, b1, b2, eps, step,
                                                grad_scale, control);
  ops::multi_tensor_adamw_f16_main_param(l.masters, l.copies, l.grads, l.m, l.v, l.decays, lr, b1,
                                         b2, eps, step, grad_scale, control, l.keys,
                                         l.moment_scales, l.main_scales);
}

TEST(AdamF16MainParam, UpdateMatchesAnFp64ScalarFormula) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Lists l = make_lists(seed, {{DType::F32, DType::F32},
                              {DType::F16, DType::F16},
                              {DType::BF16, DType::F32},
                              {DType::F16, DType::BF16}});
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, grad_scale = 0.7f;
  const int64_t step = 3;
  const double bc1 = 1 - std::pow(double(b1), step), bc2 = 1 - std::pow(double(b2), step);
  std::vector<std::vector<double>> want(l.masters.size()), terms(l.masters.size());
  std::vector<double> want_absmax(l.masters.size(), 0.0);
  for (size_t i = 0; i < l.masters.size(); ++i) {
    for (int64_t k = 0; k < l.masters[i].numel(); ++k) {
      const double g = double(l.grads[i].f32()[k]) * grad_scale;
      const double m = b1 * moment_value(l.m[i], k, l.moment_scale.f32()[2 * i]) + (1 - b1) * g;
      const double v =
          b2 * moment_value(l.v[i], k, l.moment_scale.f32()[2 * i + 1]) + (1 - b2) * g * g;
      const double p = l.values[i][size_t(k)] * (1 - double(lr) * l.decays[i]) -
                       (lr / bc1) * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
      want[i].push_back(p);
      // The size of the fp32 update's terms: its rounding error is a few ulps of them.
      terms[i].push_back(std::fabs(l.values[i][size_t(k)]) +
                         (lr / bc1) * std::fabs(m) / (std::sqrt(v) / std::sqrt(bc2) + eps));
      want_absmax[i] = std::max(want_absmax[i], std::fabs(p));
    }
  }
  run_step(l, lr, b1, b2, eps, step, grad_scale, Tensor());
  for (size_t i = 0; i < l.masters.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    const double scale = l.scale.f32()[i];
    EXPECT_NEAR(scale, want_absmax[i] / 32752.0, 1e-5 * want_absmax[i] / 32752.0);
    const auto* stored = static_cast<const uint16_t*>(l.masters[i].raw());
    bool top = false;  // the absmax element lands on (about) the top of the range
    for (int64_t k = 0; k < l.masters[i].numel(); ++k) {
      const double p = want[i][size_t(k)], x = p / scale;
      const double got = double(fp16_to_float(stored[k]));
      // Half an fp16 ulp at x (to nearest), plus the fp32 update's own error (4 ulps of
      // its terms, in the scaled unit).
      const int e = std::max(-14, int(std::floor(std::log2(std::max(std::fabs(x), 1e-30)))));
      const double fp32_error = 4 * std::ldexp(terms[i][size_t(k)], -24) / scale;
      ASSERT_LE(std::fabs(got - x), 0.5 * std::ldexp(1.0, e - 10) * (1 + 1e-6) + fp32_error)
          << "element " << k << ": " << got << " for " << x;
      top = top || std::fabs(got) == 32752.0;
      // The compute weight: the new fp32 value to nearest in its dtype.
      const double copy = l.copies[i].item(k);
      const double ulp = std::ldexp(1.0, std::max(l.copies[i].dtype() == DType::F16 ? -14 : -126,
                                                  int(std::floor(std::log2(std::max(std::fabs(p), 1e-30))))) -
                                             (l.copies[i].dtype() == DType::F16 ? 10 : 7));
      ASSERT_LE(std::fabs(copy - p), 0.5 * ulp * (1 + 1e-6) + fp32_error * scale)
          << "copy element " << k;
    }
    EXPECT_TRUE(top);
  }
}

TEST(AdamF16MainParam, ControlStepIsTheHostStep) {
  const uint64_t seed = testing::test_seed() + 1;
  Lists host = make_lists(seed, {{DType::F16, DType::F32}, {DType::BF16, DType::BF16}});
  Lists dev = make_lists(seed, {{DType::F16, DType::F32}, {DType::BF16, DType::BF16}});
  run_step(host, 1e-2f, 0.9f, 0.95f, 1e-8f, 4, 0.5f, Tensor());
  Tensor control = Tensor::zeros({ops::kAdamControlSize});
  control.f32()[ops::kAdamStep] = 4.0f;
  control.f32()[ops::kAdamLr] = 1e-2f;
  control.f32()[ops::kAdamGradScale] = 0.5f;
  run_step(dev, 0.0f, 0.9f, 0.95f, 1e-8f, 1, 1.0f, control);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(std::memcmp(host.masters[i].raw(), dev.masters[i].raw(), host.masters[i].nbytes()), 0);
    EXPECT_EQ(std::memcmp(host.copies[i].raw(), dev.copies[i].raw(), host.copies[i].nbytes()), 0);
    EXPECT_EQ(host.scale.f32()[i], dev.scale.f32()[i]);
  }
}

TEST(AdamF16MainParam, SkippedStepChangesNothing) {
  Lists l = make_lists(11, {{DType::F16, DType::F16}, {DType::F32, DType::BF16}});
  Lists fresh = make_lists(11, {{DType::F16, DType::F16}, {DType::F32, DType::BF16}});
  Tensor control = Tensor::zeros({ops::kAdamControlSize});
  control.f32()[ops::kAdamSkip] = 1.0f;
  control.f32()[ops::kAdamStep] = 4.0f;
  control.f32()[ops::kAdamLr] = 1e-2f;
  control.f32()[ops::kAdamGradScale] = 1.0f;
  l.grads[0].f32()[5] = INFINITY;  // why a step is skipped
  run_step(l, 0.0f, 0.9f, 0.95f, 1e-8f, 1, 1.0f, control);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(std::memcmp(l.masters[i].raw(), fresh.masters[i].raw(), l.masters[i].nbytes()), 0);
    EXPECT_EQ(std::memcmp(l.copies[i].raw(), fresh.copies[i].raw(), l.copies[i].nbytes()), 0);
    EXPECT_EQ(std::memcmp(l.m[i].raw(), fresh.m[i].raw(), l.m[i].nbytes()), 0);
  }
  EXPECT_EQ(std::memcmp(l.scale.raw(), fresh.scale.raw(), 8), 0);
  EXPECT_EQ(std::memcmp(l.moment_scale.raw(), fresh.moment_scale.raw(), 16), 0);
  // The same control, not skipped, does change them (the test can fail).
  l.grads[0].f32()[5] = 0.1f;
  control.f32()[ops::kAdamSkip] = 0.0f;
  run_step(l, 0.0f, 0.9f, 0.95f, 1e-8f, 1, 1.0f, control);
  EXPECT_NE(std::memcmp(l.scale.raw(), fresh.scale.raw(), 8), 0);
  EXPECT_NE(std::memcmp(l.masters[0].raw(), fresh.masters[0].raw(), l.masters[0].nbytes()), 0);
}

TEST(AdamF16MainParam, ZeroTensorHasScaleZeroAndRecovers) {
  Lists l = make_lists(5, {{DType::F32, DType::F32}});
  l.masters[0].zero();
  l.m[0].zero();
  l.v[0].zero();
  l.grads[0].zero();
  run_step(l, 1e-2f, 0.9f, 0.95f, 1e-8f, 1, 1.0f, Tensor());
  EXPECT_EQ(l.scale.f32()[0], 0.0f);
  for (int64_t k = 0; k < l.masters[0].numel(); ++k) {
    ASSERT_EQ(static_cast<const uint16_t*>(l.masters[0].raw())[k], 0) << k;
    ASSERT_EQ(l.copies[0].item(k), 0.0) << k;
  }
  // A gradient moves it: the scale is the new absmax's (lr / bc1 * m / sqrt(v) ~ lr).
  l.grads[0] = testing::randn(l.grads[0].shape(), 6, 0.3f);
  run_step(l, 1e-2f, 0.9f, 0.95f, 1e-8f, 2, 1.0f, Tensor());
  EXPECT_GT(l.scale.f32()[0], 0.0f);
  Tensor value = Tensor::empty({l.masters[0].numel()});
  ops::f16_main_param_dequantize(l.masters[0], l.scale.rows(0, 1), value);
  EXPECT_NEAR(ops::f16_main_param_absmax(value), 32752.0 * l.scale.f32()[0],
              1e-6 * 32752.0 * l.scale.f32()[0]);
  EXPECT_GT(ops::f16_main_param_absmax(value), 1e-3f);
}

// Dequantized values quantize back to the same bits under the same scale (a checkpoint
// stores the fp32 values and the scale), and a new scale from their absmax is the scale.
TEST(AdamF16MainParam, QuantizeDequantizeRoundTrip) {
  const uint64_t seed = testing::test_seed() + 2;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Tensor value = testing::randn({5000}, seed, 3.0f);
  Tensor stored = Tensor::empty({5000}, DType::F16), scale = Tensor::zeros({1});
  ops::f16_main_param_quantize(value, ops::f16_main_param_scale(ops::f16_main_param_absmax(value)),
                               stored, scale);
  Tensor back = Tensor::empty({5000});
  ops::f16_main_param_dequantize(stored, scale, back);
  for (int64_t k = 0; k < 5000; ++k)  // within half an fp16 ulp of the scaled value
    ASSERT_LE(std::fabs(back.f32()[k] - value.f32()[k]),
              (std::fabs(value.f32()[k]) * std::ldexp(1.0, -11) +
               std::ldexp(1.0, -25) * scale.f32()[0]) * (1 + 1e-6) +
                  1e-7 * std::fabs(value.f32()[k]))
        << k;
  Tensor again = Tensor::empty({5000}, DType::F16), scale2 = Tensor::zeros({1});
  ops::f16_main_param_quantize(back, scale.f32()[0], again, scale2);
  EXPECT_EQ(std::memcmp(again.raw(), stored.raw(), stored.nbytes()), 0);
  EXPECT_EQ(scale2.f32()[0], scale.f32()[0]);
}

}  // namespace
}  // namespace megaton
