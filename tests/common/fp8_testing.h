// FP8 test helpers: byte-for-byte comparison, poisoned outputs, inputs spanning many
// binades, the special values (NaN, inf, -0, FP8's limits) the casts must handle, and
// the scale rules and amaxes the scale-update tests sweep.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "ops/fp8.h"

namespace megaton::testing {

// Byte-for-byte equality of `got` with `want` (either may be on the GPU; both undefined
// passes): same dtype, same shape, same bytes. Reports the first differing element with
// its bits and value.
inline ::testing::AssertionResult same_bits(const Tensor& got, const Tensor& want,
                                            const std::string& what) {
  if (got.defined() != want.defined())
    return ::testing::AssertionFailure()
           << what << ": defined " << got.defined() << " vs " << want.defined();
  if (!got.defined()) return ::testing::AssertionSuccess();
  const Tensor a_host = got.device() == Device::CPU ? got : got.to(Device::CPU);
  const Tensor b_host = want.device() == Device::CPU ? want : want.to(Device::CPU);
  if (a_host.dtype() != b_host.dtype() || a_host.shape() != b_host.shape())
    return ::testing::AssertionFailure()
           << what << ": " << dtype_name(a_host.dtype()) << " " << shape_str(a_host.shape())
           << " vs " << dtype_name(b_host.dtype()) << " " << shape_str(b_host.shape());
  const size_t size = dtype_size(a_host.dtype());
  const auto* a = static_cast<const uint8_t*>(a_host.raw());
  const auto* b = static_cast<const uint8_t*>(b_host.raw());
  for (int64_t i = 0; i < a_host.numel(); ++i) {
    if (std::memcmp(a + i * size, b + i * size, size) == 0) continue;
    uint32_t bits_a = 0, bits_b = 0;
    std::memcpy(&bits_a, a + i * size, size);
    std::memcpy(&bits_b, b + i * size, size);
    char buffer[160];
    std::snprintf(buffer, sizeof(buffer), "element %lld: got 0x%x (%g) vs want 0x%x (%g)",
                  static_cast<long long>(i), bits_a, double(a_host.item(i)), bits_b,
                  double(b_host.item(i)));
    return ::testing::AssertionFailure()
           << what << " " << shape_str(b_host.shape()) << " " << buffer;
  }
  return ::testing::AssertionSuccess();
}

// A CPU tensor filled with NaN (FP8: the code 0x7F), so that an element an op skips fails
// same_bits. On the GPU: gpu_testing.h's poisoned_device.
inline Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  poison(t);
  return t;
}

// N(0, 1) values times 2^e, e uniform in [-binades / 2, binades / 2]: for a scale set from
// the amax, most values land in FP8's normal range, many in its subnormals, some below
// half its smallest subnormal (to +-0), some saturate.
inline Tensor wide_values(const Shape& shape, uint64_t seed, int binades = 24) {
  Tensor t = randn(shape, seed);
  std::mt19937_64 gen(seed ^ 0x9e3779b97f4a7c15ULL);
  std::uniform_int_distribution<int> exponent(-binades / 2, binades / 2);
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = std::ldexp(p[i], exponent(gen));
  return t;
}

// Special values at spread-out positions of an fp32 tensor: NaN, -NaN, +-inf, +-0, huge,
// FLT_MIN and a subnormal, FLT_MAX, and values at and just past E4M3's and E5M2's max.
inline void insert_specials(Tensor& t) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float specials[] = {nan,    -nan,      INFINITY, -INFINITY,    -0.0f,   0.0f,
                            1e30f,  -1e30f,    FLT_MIN,  -FLT_MIN / 4, FLT_MAX, 448.0f,
                            464.0f, -57344.0f, 61440.0f, 1e-7f};
  const int64_t n = t.numel(), count = sizeof(specials) / sizeof(specials[0]);
  for (int64_t k = 0; k < count && k < n; ++k) t.f32()[(k * 7919) % n] = specials[k];
}

// The largest |x| over the finite elements of an fp32 tensor (0 if none).
inline float max_abs_finite(const Tensor& t) {
  float m = 0.0f;
  for (int64_t i = 0; i < t.numel(); ++i)
    if (std::isfinite(t.f32()[i])) m = std::max(m, std::fabs(t.f32()[i]));
  return m;
}

// Every scale rule with FP8 format in {E4M3, E5M2}, margin in `margins`, amax_epsilon in
// {0, 1e-4} and power_of_2 off and on.
inline std::vector<ops::Fp8ScaleRule> scale_rules(std::initializer_list<float> margins) {
  std::vector<ops::Fp8ScaleRule> out;
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2})
    for (float margin : margins)
      for (float eps : {0.0f, 1e-4f})
        for (bool pow2 : {false, true}) out.push_back({fp8, margin, eps, pow2});
  return out;
}

inline std::string rule_name(const ops::Fp8ScaleRule& r) {
  return std::string(dtype_name(r.fp8)) + " margin " + std::to_string(r.margin) + " eps " +
         std::to_string(r.amax_epsilon) + (r.power_of_2 ? " pow2" : "");
}

// Amaxes for the scale rule: ordinary ones, ones whose scale overflows (to a subnormal
// amax) or underflows, and the ones that keep the previous scale (0, negative, NaN, inf).
inline constexpr float kScaleRuleAmaxes[] = {
    1.0f,     3.7f,  448.0f,  1e-3f, 1e-30f, 1e-38f,
    1e-45f,   3e38f, FLT_MAX, 0.0f,  -1.0f,  std::numeric_limits<float>::quiet_NaN(),
    INFINITY, 5e-5f};

}  // namespace megaton::testing
