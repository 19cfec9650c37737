// Adam moments stored in fp16 and fp8 (E4M3) with a per-tensor scale on the CPU
// (ops/adam_scaled_state_math.h, ops/adam_precision.h): the exact encodings against the
// core conversions on every bit pattern; the stochastic rounding lands on a neighbour and is
// unbiased; the update with its absmax pass against an independent fp64 scalar formula
// (TE FusedAdam's scaling: value = stored * scale, scale = absmax(new) / range); a skipped
// step changes nothing; an all-zero tensor gets scale 0 and recovers; the param-remainder
// update stores the bits of the fp32-param update; missing scales are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "ops/adam_precision.h"
#include "ops/adam_scaled_state_math.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"

namespace megaton {
namespace {

using ops::AdamMomentScales;

TEST(AdamScaledStates, Fp16EncodingsMatchTheCoreConversionsOnEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float core = fp16_to_float(uint16_t(h));
    const float ours = ops::decode_fp16(uint16_t(h));
    if (std::isnan(core)) {
      EXPECT_TRUE(std::isnan(ours)) << h;
      continue;
    }
    ASSERT_EQ(std::memcmp(&core, &ours, 4), 0) << h;
    ASSERT_EQ(ops::encode_exact_fp16(ours), uint16_t(h)) << h;
  }
}

TEST(AdamScaledStates, Fp8E4M3EncodingsMatchTheCoreConversionsOnEveryPattern) {
  for (uint32_t b = 0; b < 256; ++b) {
    const float core = fp8e4m3_to_float(uint8_t(b));
    const float ours = ops::decode_fp8e4m3(uint8_t(b));
    if (std::isnan(core)) {
      EXPECT_TRUE(std::isnan(ours)) << b;
      continue;
    }
    ASSERT_EQ(std::memcmp(&core, &ours, 4), 0) << b;
    ASSERT_EQ(ops::encode_exact_fp8e4m3(ours), uint8_t(b)) << b;
  }
}

// Over all 2^16 random values, x rounds to its two neighbours in the format only, and the
// mean is x within 2^-16 of an ulp (the rounding's resolution).
template <typename Store, typename Decode>
void check_unbiased(float x, Store store, Decode decode, const char* name) {
  SCOPED_TRACE(std::string(name) + " x " + std::to_string(x));
  double sum = 0, lo = INFINITY, hi = -INFINITY;
  for (uint32_t r = 0; r < 65536; ++r) {
    const double y = decode(store(x, 1.0f, r));
    sum += y;
    lo = std::min(lo, y);
    hi = std::max(hi, y);
  }
  EXPECT_LE(lo, x);
  EXPECT_GE(hi, x);
  const double ulp = hi - lo;
  if (ulp > 0) {
    // lo and hi are neighbours: nothing of the format lies strictly between them.
    EXPECT_EQ(decode(store(float(lo), 1.0f, 65535)), lo);
    EXPECT_EQ(decode(store(float(hi), 1.0f, 0)), hi);
  }
  EXPECT_NEAR(sum / 65536.0, x, ulp / 65536.0 + 1e-12 * std::fabs(x));
}

TEST(AdamScaledStates, StochasticRoundingIsUnbiasedToNeighbours) {
  const float values[] = {0.1f, -3.14159f, 1000.3f, 32751.9f, 6.1e-5f, -2.3e-6f, 1.0f + 1e-4f};
  for (float x : values) {
    check_unbiased(x, ops::store_scaled_fp16, ops::decode_fp16, "fp16");
  }
  const float fp8_values[] = {0.1f, -3.14159f, 447.0f, 300.0f, 0.0137f, -0.0009f};
  for (float x : fp8_values) {
    check_unbiased(x, ops::store_scaled_fp8e4m3, ops::decode_fp8e4m3, "fp8");
  }
  // Past the fp8 range (a rounded rscale): clamped to 448, never NaN.
  for (uint32_t r : {0u, 40000u, 65535u})
    EXPECT_EQ(ops::decode_fp8e4m3(ops::store_scaled_fp8e4m3(448.4f, 1.0f, r)), 448.0f);
}

struct Lists {
  std::vector<Tensor> params, grads, m, v, copies;
  std::vector<float> decays;
  std::vector<ops::MomentRoundingKey> keys;
  AdamMomentScales scales;
  Tensor scale_storage, absmax_storage;  // [n, 2]
};

// Moment dtypes per tensor from `dtypes`; moments start at the stored values of random
// ones under a random scale (their "old" state), v positive.
Lists make_lists(uint64_t seed, const std::vector<std::pair<DType, DType>>& dtypes) {
  const Shape shapes[] = {{37, 5}, {1001}, {4, 4, 3}, {40000}, {9}, {33, 3}};
  Lists l;
  const int64_t n = int64_t(dtypes.size());
  l.scale_storage = Tensor::zeros({n, 2});
  l.absmax_storage = Tensor::zeros({n, 2});
  for (int64_t i = 0; i < n; ++i) {
    const Shape& s = shapes[i % 6];
    const uint64_t base = seed + 100 * uint64_t(i);
    l.params.push_back(testing::randn(s, base, 0.5f));
    l.grads.push_back(testing::randn(s, base + 1, 0.3f));
    const auto [md, vd] = dtypes[size_t(i)];
    Tensor m = testing::randn(s, base + 2, 0.01f);
    Tensor v = testing::randn(s, base + 3, 1e-3f);
    for (int64_t k = 0; k < v.numel(); ++k) v.f32()[k] *= v.f32()[k];
    const float old_scale[2] = {0.01f / 300.0f, 1e-5f / 300.0f};
    const DType dt[2] = {md, vd};
    Tensor* states[2] = {&m, &v};
    for (int c = 0; c < 2; ++c) {
      if (dt[c] == DType::F16 || dt[c] == DType::F8E4M3) {
        // Stored = value / scale (to nearest, as a previous step could have left it).
        Tensor stored = Tensor::empty(s, dt[c]);
        for (int64_t k = 0; k < stored.numel(); ++k) {
          const float x = states[c]->f32()[k] / old_scale[c];
          if (dt[c] == DType::F16)
            static_cast<uint16_t*>(stored.raw())[k] = float_to_fp16(x);
          else
            static_cast<uint8_t*>(stored.raw())[k] = float_to_fp8e4m3(x);
        }
        *states[c] = stored;
        l.scale_storage.f32()[2 * i + c] = old_scale[c];
      } else {
        *states[c] = states[c]->to(dt[c]);
      }
    }
    l.m.push_back(m);
    l.v.push_back(v);
    l.copies.push_back(i % 2 ? Tensor() : Tensor::zeros(s, DType::BF16));
    l.decays.push_back(i % 2 ? 0.0f : 0.1f);
    ops::MomentRoundingKey key;
    key.param_key = 1000 + uint64_t(i);
    l.keys.push_back(key);
    l.scales.scale.push_back(l.scale_storage.rows(i, 1).view({2}));
    l.scales.absmax.push_back(l.absmax_storage.rows(i, 1).view({2}));
  }
  return l;
}

double state_value(const Tensor& t, int64_t k, double scale) {
  switch (t.dtype()) {
    case DType::F16:
      return double(fp16_to_float(static_cast<const uint16_t*>(t.raw())[k])) * scale;
    case DType::F8E4M3:
      return double(fp8e4m3_to_float(static_cast<const uint8_t*>(t.raw())[k])) * scale;
    default:
      return t.item(k);
  }
}

// The format's ulp at |x| (fp16: 10 mantissa bits, min exponent -14; e4m3: 3 and -6).
double format_ulp(DType d, double x) {
  const int mant = d == DType::F16 ? 10 : 3, emin = d == DType::F16 ? -14 : -6;
  const int e = x == 0 ? emin : std::max(emin, int(std::floor(std::log2(std::fabs(x)))));
  return std::ldexp(1.0, e - mant);
}

TEST(AdamScaledStates, UpdateMatchesAnFp64ScalarFormula) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::pair<DType, DType>> dtypes = {
      {DType::F16, DType::F16},     {DType::F8E4M3, DType::F8E4M3}, {DType::F16, DType::F32},
      {DType::BF16, DType::F8E4M3}, {DType::F8E4M3, DType::F16},    {DType::F16, DType::BF16}};
  Lists l = make_lists(seed, dtypes);
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, grad_scale = 0.7f;
  const int64_t step = 3;
  // The fp64 reference from the state before the step.
  struct Ref {
    std::vector<double> p, m, v;
    double m_absmax = 0, v_absmax = 0;
  };
  std::vector<Ref> refs(l.params.size());
  const double bc1 = 1 - std::pow(double(b1), step), bc2 = 1 - std::pow(double(b2), step);
  for (size_t i = 0; i < l.params.size(); ++i) {
    Ref& r = refs[i];
    for (int64_t k = 0; k < l.params[i].numel(); ++k) {
      const double g = double(l.grads[i].f32()[k]) * grad_scale;
      const double m = b1 * state_value(l.m[i], k, l.scale_storage.f32()[2 * i]) + (1 - b1) * g;
      const double v =
          b2 * state_value(l.v[i], k, l.scale_storage.f32()[2 * i + 1]) + (1 - b2) * g * g;
      const double p = double(l.params[i].f32()[k]) * (1 - double(lr) * l.decays[i]) -
                       (lr / bc1) * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
      r.p.push_back(p);
      r.m.push_back(m);
      r.v.push_back(v);
      r.m_absmax = std::max(r.m_absmax, std::fabs(m));
      r.v_absmax = std::max(r.v_absmax, std::fabs(v));
    }
  }
  ops::multi_tensor_adamw_moment_absmax(l.grads, l.m, l.v, l.scales, b1, b2, grad_scale, Tensor());
  ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, lr, b1, b2, eps, step,
                          grad_scale, l.keys, l.scales);
  for (size_t i = 0; i < l.params.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    const Ref& r = refs[i];
    const DType dt[2] = {l.m[i].dtype(), l.v[i].dtype()};
    const double absmax[2] = {r.m_absmax, r.v_absmax};
    const double range[2] = {dt[0] == DType::F16 ? 32752.0 : 448.0,
                             dt[1] == DType::F16 ? 32752.0 : 448.0};
    for (int c = 0; c < 2; ++c) {
      if (dt[c] != DType::F16 && dt[c] != DType::F8E4M3) continue;
      const double scale = l.scale_storage.f32()[2 * i + c];
      EXPECT_NEAR(scale, absmax[c] / range[c], 1e-5 * absmax[c] / range[c]) << "column " << c;
      // Each stored value is a neighbour (in the format) of the new value / the new scale.
      const Tensor& state = c == 0 ? l.m[i] : l.v[i];
      const std::vector<double>& want = c == 0 ? r.m : r.v;
      for (int64_t k = 0; k < state.numel(); ++k) {
        const double x = want[size_t(k)] / scale;
        const double stored = state_value(state, k, 1.0);
        ASSERT_LE(std::fabs(stored - x), format_ulp(dt[c], x) * 1.001 + 1e-6 * std::fabs(x))
            << "column " << c << " element " << k << ": " << stored << " for " << x;
      }
    }
    for (int64_t k = 0; k < l.params[i].numel(); ++k)
      ASSERT_NEAR(l.params[i].f32()[k], r.p[size_t(k)], 1e-6 + 1e-5 * std::fabs(r.p[size_t(k)]))
          << "param element " << k;
  }
}

TEST(AdamScaledStates, SkippedStepChangesNothing) {
  Lists l = make_lists(11, {{DType::F16, DType::F8E4M3}, {DType::F8E4M3, DType::F16}});
  Lists fresh = make_lists(11, {{DType::F16, DType::F8E4M3}, {DType::F8E4M3, DType::F16}});
  Tensor control = Tensor::zeros({ops::kAdamControlSize});
  control.f32()[ops::kAdamSkip] = 1.0f;
  control.f32()[ops::kAdamStep] = 4.0f;
  control.f32()[ops::kAdamLr] = 1e-2f;
  control.f32()[ops::kAdamGradScale] = 1.0f;
  l.grads[0].f32()[5] = INFINITY;  // why a step is skipped
  ops::multi_tensor_adamw_moment_absmax(l.grads, l.m, l.v, l.scales, 0.9f, 0.95f, 1.0f, control);
  ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 0.9f, 0.95f, 1e-8f,
                          control, l.keys, l.scales);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(std::memcmp(l.params[i].raw(), fresh.params[i].raw(), l.params[i].nbytes()), 0);
    EXPECT_EQ(std::memcmp(l.m[i].raw(), fresh.m[i].raw(), l.m[i].nbytes()), 0);
    EXPECT_EQ(std::memcmp(l.v[i].raw(), fresh.v[i].raw(), l.v[i].nbytes()), 0);
  }
  EXPECT_EQ(std::memcmp(l.scale_storage.raw(), fresh.scale_storage.raw(), 16), 0);
  // The same control, not skipped, does change them (the test can fail).
  l.grads[0].f32()[5] = 0.1f;
  control.f32()[ops::kAdamSkip] = 0.0f;
  ops::multi_tensor_adamw_moment_absmax(l.grads, l.m, l.v, l.scales, 0.9f, 0.95f, 1.0f, control);
  ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 0.9f, 0.95f, 1e-8f,
                          control, l.keys, l.scales);
  EXPECT_NE(std::memcmp(l.scale_storage.raw(), fresh.scale_storage.raw(), 16), 0);
  EXPECT_NE(std::memcmp(l.m[0].raw(), fresh.m[0].raw(), l.m[0].nbytes()), 0);
}

TEST(AdamScaledStates, ZeroTensorHasScaleZeroAndRecovers) {
  Lists l = make_lists(5, {{DType::F16, DType::F8E4M3}});
  l.m[0].zero();
  l.v[0].zero();
  l.grads[0].zero();
  l.scale_storage.zero();
  ops::multi_tensor_adamw_moment_absmax(l.grads, l.m, l.v, l.scales, 0.9f, 0.95f, 1.0f, Tensor());
  ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 1e-3f, 0.9f, 0.95f,
                          1e-8f, 1, 1.0f, l.keys, l.scales);
  EXPECT_EQ(l.scale_storage.f32()[0], 0.0f);
  EXPECT_EQ(l.scale_storage.f32()[1], 0.0f);
  for (int64_t k = 0; k < l.m[0].numel(); ++k) {
    ASSERT_EQ(l.m[0].item(k), 0.0);
    ASSERT_FALSE(std::isnan(l.params[0].f32()[k]));
  }
  l.grads[0].copy_from(testing::randn(l.grads[0].shape(), 6, 0.2f));
  ops::multi_tensor_adamw_moment_absmax(l.grads, l.m, l.v, l.scales, 0.9f, 0.95f, 1.0f, Tensor());
  ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 1e-3f, 0.9f, 0.95f,
                          1e-8f, 2, 1.0f, l.keys, l.scales);
  EXPECT_GT(l.scale_storage.f32()[0], 0.0f);
  EXPECT_GT(l.scale_storage.f32()[1], 0.0f);
  // The largest |m| is stored at (about) the range.
  double largest = 0;
  for (int64_t k = 0; k < l.m[0].numel(); ++k)
    largest = std::max(largest,
                       std::fabs(double(fp16_to_float(static_cast<uint16_t*>(l.m[0].raw())[k]))));
  EXPECT_NEAR(largest, 32752.0, 32.0);
}

TEST(AdamScaledStates, ParamRemainderUpdateStoresTheFp32ParamUpdatesBits) {
  const uint64_t seed = testing::test_seed() + 3;
  const std::vector<std::pair<DType, DType>> dtypes = {
      {DType::F16, DType::F8E4M3}, {DType::F8E4M3, DType::F16}, {DType::F16, DType::F16}};
  Lists a = make_lists(seed, dtypes), b = make_lists(seed, dtypes);
  // b keeps its main params as (bf16 weight, remainder) pairs of a's fp32 ones.
  std::vector<Tensor> weights, remainders;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    weights.push_back(Tensor::empty(b.params[i].shape(), DType::BF16));
    remainders.push_back(Tensor::empty(b.params[i].shape(), DType::I16));
    ops::split_param_remainders(b.params[i], weights[i], remainders[i]);
    a.copies[i] = Tensor();
  }
  for (int64_t step = 1; step <= 3; ++step) {
    ops::multi_tensor_adamw_moment_absmax(a.grads, a.m, a.v, a.scales, 0.9f, 0.99f, 1.0f, Tensor());
    ops::multi_tensor_adamw(a.params, a.grads, a.m, a.v, a.copies, a.decays, 1e-2f, 0.9f, 0.99f,
                            1e-8f, step, 1.0f, a.keys, a.scales);
    ops::multi_tensor_adamw_moment_absmax(b.grads, b.m, b.v, b.scales, 0.9f, 0.99f, 1.0f, Tensor());
    ops::multi_tensor_adamw_param_remainder(weights, remainders, b.grads, b.m, b.v, b.decays, 1e-2f,
                                            0.9f, 0.99f, 1e-8f, step, 1.0f, b.keys, b.scales);
  }
  for (size_t i = 0; i < dtypes.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    Tensor joined = Tensor::empty(a.params[i].shape());
    ops::join_param_remainders(weights[i], remainders[i], joined);
    EXPECT_EQ(std::memcmp(joined.raw(), a.params[i].raw(), joined.nbytes()), 0);
    EXPECT_EQ(std::memcmp(a.m[i].raw(), b.m[i].raw(), a.m[i].nbytes()), 0);
    EXPECT_EQ(std::memcmp(a.v[i].raw(), b.v[i].raw(), a.v[i].nbytes()), 0);
  }
  EXPECT_EQ(std::memcmp(a.scale_storage.raw(), b.scale_storage.raw(), a.scale_storage.nbytes()), 0);
}

TEST(AdamScaledStates, ScaledMomentsWithoutScalesAreRefused) {
  Lists l = make_lists(2, {{DType::F16, DType::F32}});
  const AdamMomentScales none;
  EXPECT_THROW(ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 1e-3f, 0.9f,
                                       0.95f, 1e-8f, 1, 1.0f, l.keys, none),
               InternalError);
  l.m[0] = Tensor::zeros(l.m[0].shape(), DType::F8E5M2);
  EXPECT_THROW(ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 1e-3f, 0.9f,
                                       0.95f, 1e-8f, 1, 1.0f, l.keys, l.scales),
               InternalError);
}

}  // namespace
}  // namespace megaton
