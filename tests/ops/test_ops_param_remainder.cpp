// fp32 main params as bf16 weights plus int16 remainders (ops/param_remainder.h) on the
// CPU: split and join are inverse bijections (a dense random sample of the 2^32 patterns
// and every low half of the edge high halves: ties, signs, zeros, denormals, the largest
// finite values, infinities, NaNs); the weight follows Transformer Engine's rule (written
// here in TE's int16 arithmetic) and differs from round-to-nearest-even only at ties; the
// AdamW update over (weight, remainder) pairs is, bit for bit over many steps, the
// update of an fp32 main param with that weight rounding, for every moment dtype, from
// host scalars and from a device-style control tensor; a NaN is stored as a bf16 NaN
// weight; the doors refuse bad lists before changing anything.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"

namespace megaton {
namespace {

using testing::test_seed;

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// Transformer Engine's split, as its kernel writes it (AdamFunctorMasterParamRemainder):
// the high and low halves as int16, the high one incremented when the low one is negative.
uint16_t te_weight(uint32_t master) {
  int16_t high = int16_t(uint16_t(master >> 16));
  const int16_t low = int16_t(uint16_t(master & 0xFFFFu));
  if (low < 0) high = int16_t(high + 1);
  return uint16_t(high);
}

Tensor from_bits(const std::vector<uint32_t>& bits) {
  Tensor t = Tensor::empty({int64_t(bits.size())});
  std::memcpy(t.raw(), bits.data(), 4 * bits.size());
  return t;
}

// A tensor whose bytes are all 0xA5: every element must be written over.
Tensor poisoned(int64_t n, DType dtype) {
  Tensor t = Tensor::empty({n}, dtype);
  std::memset(t.raw(), 0xA5, t.nbytes());
  return t;
}

const uint16_t* u16(const Tensor& t) { return static_cast<const uint16_t*>(t.raw()); }
const uint32_t* u32(const Tensor& t) { return static_cast<const uint32_t*>(t.raw()); }

::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  const size_t elem = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.raw());
  const auto* pb = static_cast<const unsigned char*>(b.raw());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + i * elem, pb + i * elem, elem) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a.item(i) << " vs "
                                           << b.item(i);
  return ::testing::AssertionSuccess();
}

// Every low half of these high halves (ties included), then random 32-bit patterns.
std::vector<uint32_t> sample_patterns(uint64_t seed, size_t random_count) {
  const uint16_t highs[] = {0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x7F7E,
                            0x7F7F, 0x7F80, 0x7FC0, 0x7FFF, 0x8000, 0x8001, 0x807F,
                            0xBF80, 0xFF7F, 0xFF80, 0xFFC0, 0xFFFF};
  std::vector<uint32_t> out;
  for (uint16_t high : highs)
    for (uint32_t low = 0; low < 0x10000u; ++low) out.push_back((uint32_t(high) << 16) | low);
  std::mt19937_64 gen(seed);
  for (size_t i = 0; i < random_count; ++i) out.push_back(uint32_t(gen()));
  return out;
}

TEST(ParamRemainder, SplitAndJoinAreInverseBijections) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<uint32_t> patterns = sample_patterns(seed, size_t(1) << 22);
  const int64_t n = int64_t(patterns.size());
  const Tensor master = from_bits(patterns);
  Tensor weight = poisoned(n, DType::BF16), remainder = poisoned(n, DType::I16);
  ops::split_param_remainders(master, weight, remainder);
  Tensor joined = poisoned(n, DType::F32);
  ops::join_param_remainders(weight, remainder, joined);
  EXPECT_TRUE(same_bytes(joined, master));
  int64_t ties_differing_from_rne = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = patterns[size_t(i)];
    ASSERT_EQ(u16(weight)[i], te_weight(b)) << "pattern " << std::hex << b;
    ASSERT_EQ(u16(remainder)[i], uint16_t(b & 0xFFFFu)) << "pattern " << std::hex << b;
    const float x = float_of(b);
    if (std::isnan(x)) continue;
    // Round to nearest: the same bf16 but at ties, where TE goes away from zero.
    const uint16_t rne = float_to_bf16(x);
    if ((b & 0xFFFFu) != 0x8000u) {
      ASSERT_EQ(u16(weight)[i], rne) << "pattern " << std::hex << b;
    } else {
      ASSERT_EQ(u16(weight)[i], uint16_t((b >> 16) + 1)) << "pattern " << std::hex << b;
      ties_differing_from_rne += u16(weight)[i] != rne;
    }
  }
  EXPECT_GT(ties_differing_from_rne, 5);  // the even-high ties of the edge list

  // The other direction: every sampled (weight, remainder) pair joins into a main param
  // that splits back into it.
  std::mt19937_64 gen(seed + 1);
  Tensor w = Tensor::empty({n}, DType::BF16), r = Tensor::empty({n}, DType::I16);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = uint32_t(gen());
    static_cast<uint16_t*>(w.raw())[i] = uint16_t(b >> 16);
    static_cast<uint16_t*>(r.raw())[i] = uint16_t(b);
  }
  Tensor main = poisoned(n, DType::F32);
  ops::join_param_remainders(w, r, main);
  Tensor w2 = poisoned(n, DType::BF16), r2 = poisoned(n, DType::I16);
  ops::split_param_remainders(main, w2, r2);
  EXPECT_TRUE(same_bytes(w2, w));
  EXPECT_TRUE(same_bytes(r2, r));

  // Without a remainder tensor only the weight is written, the same one.
  Tensor alone = poisoned(n, DType::BF16), none;
  ops::split_param_remainders(master, alone, none);
  EXPECT_TRUE(same_bytes(alone, weight));
}

// The main params of the update test: every hard case, then normal values.
std::vector<uint32_t> edge_main_params(size_t n, uint64_t seed) {
  std::vector<uint32_t> out = {
      0x3F808000u, 0x3F818000u, 0xBF808000u, 0xBF818000u,  // ties, even and odd, +-
      0x00000000u, 0x80000000u,                             // +0, -0
      0x00000001u, 0x00400000u, 0x807FFFFFu, 0x00008000u,   // denormals (one a tie)
      0x7F7F7FFFu, 0x7F7F8000u, 0x7F7FFFFFu, 0xFF7FFFFFu,   // near the bf16 overflow
      0x7F000000u, 0x3F800000u, 0xBF800000u, 0x3C23D70Au};  // large, +-1, 0.01
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  while (out.size() < n) {
    uint32_t b = bits_of(normal(gen));
    if (out.size() % 7 == 0) b = (b & 0xFFFF0000u) | 0x8000u;  // more ties
    out.push_back(b);
  }
  return out;
}

struct Lists {
  // The remainder run: weights, remainders. The reference: fp32 main params.
  std::vector<Tensor> weights, remainders, masters, grads, m, v, m_ref, v_ref;
  std::vector<float> decays;
  std::vector<ops::MomentRoundingKey> keys;
};

Lists make_lists(uint64_t seed, DType m_dtype, DType v_dtype) {
  const std::vector<int64_t> sizes = {64, 70001, 33, 40000};
  Lists l;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    const uint64_t base = seed + 100 * i;
    Tensor master = from_bits(edge_main_params(size_t(n), base));
    l.masters.push_back(master.clone());
    l.weights.push_back(Tensor::empty({n}, DType::BF16));
    l.remainders.push_back(Tensor::empty({n}, DType::I16));
    ops::split_param_remainders(master, l.weights.back(), l.remainders.back());
    l.grads.push_back(testing::randn({n}, base + 1, 0.3f));
    Tensor m = testing::randn({n}, base + 2, 0.01f);
    Tensor v = testing::randn({n}, base + 3, 1e-3f);
    for (int64_t k = 0; k < n; ++k) v.f32()[k] *= v.f32()[k];
    l.m.push_back(m.to(m_dtype));
    l.v.push_back(v.to(v_dtype));
    l.m_ref.push_back(l.m.back().clone());
    l.v_ref.push_back(l.v.back().clone());
    l.decays.push_back(i % 2 ? 0.1f : 0.0f);  // none on the edge values' tensor
    ops::MomentRoundingKey key;
    key.param_key = 1000 + i;
    key.offset = int64_t(3 * i);  // shard offsets that are not multiples of 4
    l.keys.push_back(key);
  }
  // The near-overflow values get small gradients (their update stays finite).
  for (int k = 10; k < 14; ++k) l.grads[0].f32()[k] = 1e-3f;
  return l;
}

// The fp32-master update with both moments fp32: adamw_precision_update per element (the
// arithmetic the remainder update runs for any moment dtype; ops.h's fp32-state path
// computes in fp64 on the CPU).
void reference_f32_moments(Lists& l, float lr, float b1, float b2, float eps, int64_t step,
                           float scale) {
  const ops::AdamPrecisionConstants c = ops::adam_precision_constants(lr, b1, b2, eps, step, scale);
  for (size_t i = 0; i < l.masters.size(); ++i) {
    const float decay = ops::adam_precision_decay(lr, l.decays[i]);
    for (int64_t k = 0; k < l.masters[i].numel(); ++k)
      ops::adamw_precision_update(l.masters[i].f32()[k], l.grads[i].f32()[k], l.m_ref[i].f32()[k],
                                  l.v_ref[i].f32()[k], decay, c);
  }
}

void expect_pairs_are_the_masters(const Lists& l) {
  for (size_t i = 0; i < l.masters.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    const int64_t n = l.masters[i].numel();
    Tensor joined = poisoned(n, DType::F32);
    ops::join_param_remainders(l.weights[i], l.remainders[i], joined);
    EXPECT_TRUE(same_bytes(joined, l.masters[i]));
    for (int64_t k = 0; k < n; ++k)
      ASSERT_EQ(u16(l.weights[i])[k], te_weight(u32(l.masters[i])[k])) << "element " << k;
    EXPECT_TRUE(same_bytes(l.m[i], l.m_ref[i]));
    EXPECT_TRUE(same_bytes(l.v[i], l.v_ref[i]));
  }
}

class RemainderUpdate : public ::testing::TestWithParam<std::pair<DType, DType>> {};

// 30 steps with changing learning rates, clipping scales and fresh gradients.
TEST_P(RemainderUpdate, IsTheFp32MasterUpdateBitForBit) {
  const auto [m_dtype, v_dtype] = GetParam();
  const uint64_t seed = test_seed() + 7;
  SCOPED_TRACE("seed " + std::to_string(seed));
  Lists l = make_lists(seed, m_dtype, v_dtype);
  const std::vector<uint32_t> start(u32(l.masters[1]), u32(l.masters[1]) + 64);
  const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
  for (int64_t step = 1; step <= 30; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const float lr = 1e-2f / float(1 + step % 5), scale = step % 3 ? 1.0f : 0.37f;
    for (size_t i = 0; i < l.grads.size(); ++i)
      l.grads[i] = testing::randn(l.grads[i].shape(), seed * 31 + uint64_t(step) * 7 + i, 0.3f);
    for (int k = 10; k < 14; ++k) l.grads[0].f32()[k] = 1e-3f;
    ops::multi_tensor_adamw_param_remainder(l.weights, l.remainders, l.grads, l.m, l.v, l.decays,
                                            lr, b1, b2, eps, step, scale, l.keys);
    if (m_dtype == DType::F32 && v_dtype == DType::F32) {
      reference_f32_moments(l, lr, b1, b2, eps, step, scale);
    } else {
      std::vector<Tensor> none(l.masters.size());
      ops::multi_tensor_adamw(l.masters, l.grads, l.m_ref, l.v_ref, none, l.decays, lr, b1, b2,
                              eps, step, scale, l.keys);
    }
    expect_pairs_are_the_masters(l);
    if (HasFailure()) return;
  }
  // The update moved the params (not a test of an op that wrote nothing).
  EXPECT_NE(std::memcmp(start.data(), u32(l.masters[1]), 4 * start.size()), 0);
  // The largest finite main param stays finite although its weight rounds to infinity (as
  // round-to-nearest would round it).
  EXPECT_TRUE(std::isfinite(l.masters[0].f32()[12]));
  EXPECT_EQ(u16(l.weights[0])[12], 0x7F80u);
}

INSTANTIATE_TEST_SUITE_P(
    MomentDtypes, RemainderUpdate,
    ::testing::Values(std::pair{DType::F32, DType::F32}, std::pair{DType::BF16, DType::BF16},
                      std::pair{DType::BF16, DType::F32}, std::pair{DType::F32, DType::BF16}),
    [](const auto& info) {
      return std::string(dtype_name(info.param.first)) + "_" +
             std::string(dtype_name(info.param.second));
    });

// adamw_step_control's control tensor gives the host path's bits; a skipped step changes
// nothing.
TEST(ParamRemainder, ControlPathEqualsHostPathAndSkipsWhenTold) {
  const uint64_t seed = test_seed() + 11;
  SCOPED_TRACE("seed " + std::to_string(seed));
  Lists device = make_lists(seed, DType::BF16, DType::BF16);
  Lists host = make_lists(seed, DType::BF16, DType::BF16);
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, lr = 3e-3f;
  Tensor state = Tensor::zeros({2}, DType::I64);
  Tensor control = Tensor::empty({ops::kAdamControlSize});
  Tensor norm_bits = Tensor::empty({1}, DType::I64);
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor parts = Tensor::empty({1}, DType::I64);
    ops::multi_tensor_sum_of_squares(device.grads, parts);
    ops::adamw_step_control(parts, 1.0, 1.0, 1.0f, Tensor(), false, Tensor::from({1}, {lr}), b1,
                            b2, state, control, norm_bits);
    const float scale = control.f32()[ops::kAdamGradScale];
    EXPECT_LT(scale, 1.0f);  // clipped
    ops::multi_tensor_adamw_param_remainder(device.weights, device.remainders, device.grads,
                                            device.m, device.v, device.decays, b1, b2, eps,
                                            control, device.keys);
    ops::multi_tensor_adamw_param_remainder(host.weights, host.remainders, host.grads, host.m,
                                            host.v, host.decays, lr, b1, b2, eps, step, scale,
                                            host.keys);
    for (size_t i = 0; i < host.weights.size(); ++i) {
      EXPECT_TRUE(same_bytes(device.weights[i], host.weights[i]));
      EXPECT_TRUE(same_bytes(device.remainders[i], host.remainders[i]));
      EXPECT_TRUE(same_bytes(device.m[i], host.m[i]));
    }
  }
  const Tensor w = device.weights[1].clone(), r = device.remainders[1].clone();
  control.f32()[ops::kAdamSkip] = 1.0f;
  ops::multi_tensor_adamw_param_remainder(device.weights, device.remainders, device.grads,
                                          device.m, device.v, device.decays, b1, b2, eps, control,
                                          device.keys);
  EXPECT_TRUE(same_bytes(device.weights[1], w));
  EXPECT_TRUE(same_bytes(device.remainders[1], r));
}

// A NaN update is stored as the quiet NaN 0x7FC00000: a NaN weight, remainder 0.
TEST(ParamRemainder, NanIsStoredAsABf16NanWeight) {
  Lists l = make_lists(test_seed() + 13, DType::F32, DType::F32);
  l.grads[2].f32()[5] = std::numeric_limits<float>::quiet_NaN();
  ops::multi_tensor_adamw_param_remainder(l.weights, l.remainders, l.grads, l.m, l.v, l.decays,
                                          1e-3f, 0.9f, 0.95f, 1e-8f, 1, 1.0f, l.keys);
  EXPECT_EQ(u16(l.weights[2])[5], 0x7FC0u);
  EXPECT_EQ(u16(l.remainders[2])[5], 0u);
  EXPECT_TRUE(std::isfinite(bf16_to_float(u16(l.weights[2])[4])));
}

// Bad lists are refused before any tensor changes.
TEST(ParamRemainder, DoorsRefuseBadListsBeforeUpdating) {
  Lists l = make_lists(test_seed() + 17, DType::F32, DType::F32);
  const Tensor w0 = l.weights[0].clone();
  auto update = [&](Lists& x) {
    ops::multi_tensor_adamw_param_remainder(x.weights, x.remainders, x.grads, x.m, x.v, x.decays,
                                            1e-3f, 0.9f, 0.95f, 1e-8f, 1, 1.0f, x.keys);
  };
  Lists wrong_weight = l;
  wrong_weight.weights[3] = wrong_weight.masters[3];  // F32
  EXPECT_THROW(update(wrong_weight), InternalError);
  Lists wrong_remainder = l;
  wrong_remainder.remainders[2] = wrong_remainder.weights[2];  // BF16
  EXPECT_THROW(update(wrong_remainder), InternalError);
  Lists short_list = l;
  short_list.remainders.pop_back();
  EXPECT_THROW(update(short_list), InternalError);
  Lists wrong_size = l;
  wrong_size.grads[1] = testing::randn({5}, 1);
  EXPECT_THROW(update(wrong_size), InternalError);
  EXPECT_TRUE(same_bytes(l.weights[0], w0));
  Tensor f32_weight = Tensor::empty({4}), rem = Tensor::empty({4}, DType::I16);
  EXPECT_THROW(ops::split_param_remainders(Tensor::empty({4}), f32_weight, rem), InternalError);
  Tensor bf16 = Tensor::empty({4}, DType::BF16), short_rem = Tensor::empty({3}, DType::I16);
  EXPECT_THROW(ops::split_param_remainders(Tensor::empty({4}), bf16, short_rem), InternalError);
}

}  // namespace
}  // namespace megaton
