// DType sizes and names; fp32 <-> bf16 / fp16 / fp8 (e4m3, e5m2) conversions: known bit
// patterns, saturation, NaN, subnormals, round-to-nearest-even ties, and round trips.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace megaton {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::F8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::F8E5M2), 1u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  // The safetensors dtype strings.
  EXPECT_EQ(dtype_name(DType::BF16), "BF16");
  EXPECT_EQ(dtype_name(DType::F8E4M3), "F8_E4M3");
  EXPECT_EQ(dtype_name(DType::F8E5M2), "F8_E5M2");
  for (DType t :
       {DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I32, DType::I64})
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  EXPECT_THROW(dtype_from_name("FP32"), Error);  // a user-visible name: megaton::Error
  EXPECT_TRUE(is_floating(DType::F8E5M2));
  EXPECT_FALSE(is_floating(DType::I64));
}

// ---------------------------------------------------------------- known bit patterns

TEST(BF16, KnownBitPatterns) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16(kInf), 0x7F80);
  EXPECT_EQ(float_to_bf16(-kInf), 0xFF80);
  EXPECT_EQ(bf16_to_float(0x7F7F), 0x1.FEp127f);  // max finite
  // Above max finite by half an ulp or more rounds to inf (IEEE overflow under RNE).
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(float_to_bf16(0x1.FEp127f), 0x7F7F);
  // Subnormals: bf16 has fp32's exponent range, so fp32 subnormals map bit for bit.
  EXPECT_EQ(float_to_bf16(0x1p-133f), 0x0001);
  EXPECT_EQ(bf16_to_float(0x0001), 0x1p-133f);
  EXPECT_EQ(float_to_bf16(0x1p-134f), 0x0000);  // tie with 0: to the even code
  // Ties: 1 + 2^-8 lies halfway between 1 (0x3F80) and 1 + 2^-7 (0x3F81): even wins.
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);
  EXPECT_EQ(float_to_bf16(std::nextafter(1.0f + 0x1p-8f, 2.0f)), 0x3F81);
}

TEST(BF16, NaNStaysNaNWithItsSign) {
  uint16_t pos = float_to_bf16(kNaN), neg = float_to_bf16(-kNaN);
  EXPECT_TRUE(std::isnan(bf16_to_float(pos)));
  EXPECT_TRUE(std::isnan(bf16_to_float(neg)));
  EXPECT_EQ(neg & 0x8000, 0x8000);
  // A NaN whose payload is only in the low 16 bits must not truncate to inf.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7F800001u)))));
}

TEST(FP16, KnownBitPatterns) {
  EXPECT_EQ(float_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_fp16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7BFF);  // max finite
  EXPECT_EQ(float_to_fp16(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7C00);  // tie with "65536": even code, i.e. inf
  EXPECT_EQ(float_to_fp16(kInf), 0x7C00);
  EXPECT_EQ(float_to_fp16(-kInf), 0xFC00);
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(kNaN))));
  EXPECT_EQ(float_to_fp16(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_fp16(0x1p-14f), 0x0400);  // smallest normal
  EXPECT_EQ(float_to_fp16(0x1p-25f), 0x0000);  // tie with 0
  EXPECT_EQ(float_to_fp16(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(float_to_fp16(1.0f + 0x1p-11f), 0x3C00);
  EXPECT_EQ(float_to_fp16(1.0f + 3 * 0x1p-11f), 0x3C02);
}

TEST(FP8E4M3, KnownBitPatterns) {
  EXPECT_EQ(float_to_fp8e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_fp8e4m3(-2.0f), 0xC0);
  EXPECT_EQ(float_to_fp8e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_fp8e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_fp8e4m3(448.0f), 0x7E);  // max finite
  EXPECT_EQ(fp8e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8e4m3_to_float(0x78), 256.0f);   // e = 15 is a normal binade in e4m3
  EXPECT_EQ(float_to_fp8e4m3(0x1p-9f), 0x01);  // smallest subnormal
  EXPECT_EQ(float_to_fp8e4m3(0x1p-6f), 0x08);  // smallest normal
  EXPECT_EQ(fp8e4m3_to_float(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(float_to_fp8e4m3(0x1p-10f), 0x00);  // tie with 0
  EXPECT_EQ(float_to_fp8e4m3(-0x1p-11f), 0x80);
  EXPECT_EQ(float_to_fp8e4m3(3 * 0x1p-10f), 0x02);
  EXPECT_EQ(float_to_fp8e4m3(1.0625f), 0x38);  // halfway 1 / 1.125
  EXPECT_EQ(float_to_fp8e4m3(1.1875f), 0x3A);  // halfway 1.125 / 1.25
}

TEST(FP8E4M3, SaturatesAndHasNoInf) {
  EXPECT_EQ(float_to_fp8e4m3(449.0f), 0x7E);
  EXPECT_EQ(float_to_fp8e4m3(480.0f), 0x7E);
  EXPECT_EQ(float_to_fp8e4m3(1e30f), 0x7E);
  EXPECT_EQ(float_to_fp8e4m3(kInf), 0x7E);
  EXPECT_EQ(float_to_fp8e4m3(-kInf), 0xFE);
  EXPECT_EQ(float_to_fp8e4m3(-1000.0f), 0xFE);
  EXPECT_EQ(float_to_fp8e4m3(kNaN), 0x7F);
  EXPECT_TRUE(std::isnan(fp8e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_float(0xFF)));
  for (int code = 0; code < 256; ++code)
    EXPECT_FALSE(std::isinf(fp8e4m3_to_float(uint8_t(code)))) << "code " << code;
}

TEST(FP8E5M2, KnownBitPatterns) {
  EXPECT_EQ(float_to_fp8e5m2(1.0f), 0x3C);
  EXPECT_EQ(float_to_fp8e5m2(-2.0f), 0xC0);
  EXPECT_EQ(float_to_fp8e5m2(-0.0f), 0x80);
  EXPECT_EQ(float_to_fp8e5m2(57344.0f), 0x7B);  // max finite
  EXPECT_EQ(fp8e5m2_to_float(0x7B), 57344.0f);
  EXPECT_EQ(float_to_fp8e5m2(0x1p-16f), 0x01);  // smallest subnormal
  EXPECT_EQ(float_to_fp8e5m2(0x1p-14f), 0x04);  // smallest normal
  EXPECT_EQ(float_to_fp8e5m2(0x1p-17f), 0x00);  // tie with 0
  EXPECT_EQ(float_to_fp8e5m2(1.125f), 0x3C);    // halfway 1 / 1.25
  EXPECT_EQ(float_to_fp8e5m2(1.375f), 0x3E);    // halfway 1.25 / 1.5
}

TEST(FP8E5M2, SaturatesFiniteKeepsInfAndNaN) {
  EXPECT_EQ(float_to_fp8e5m2(60000.0f), 0x7B);
  EXPECT_EQ(float_to_fp8e5m2(1e30f), 0x7B);
  EXPECT_EQ(float_to_fp8e5m2(-1e30f), 0xFB);
  EXPECT_EQ(float_to_fp8e5m2(kInf), 0x7C);
  EXPECT_EQ(float_to_fp8e5m2(-kInf), 0xFC);
  EXPECT_EQ(fp8e5m2_to_float(0x7C), kInf);
  EXPECT_EQ(fp8e5m2_to_float(0xFC), -kInf);
  EXPECT_TRUE(std::isnan(fp8e5m2_to_float(float_to_fp8e5m2(kNaN))));
  for (int code : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF})
    EXPECT_TRUE(std::isnan(fp8e5m2_to_float(uint8_t(code)))) << "code " << code;
}

// ------------------------------------------------- every code: round trip and ties

struct Format {
  const char* name;
  int bits;
  std::function<uint32_t(float)> encode;
  std::function<float(uint32_t)> decode;
};

std::vector<Format> formats() {
  return {
      {"bf16", 16, [](float f) { return uint32_t(float_to_bf16(f)); },
       [](uint32_t c) { return bf16_to_float(uint16_t(c)); }},
      {"fp16", 16, [](float f) { return uint32_t(float_to_fp16(f)); },
       [](uint32_t c) { return fp16_to_float(uint16_t(c)); }},
      {"e4m3", 8, [](float f) { return uint32_t(float_to_fp8e4m3(f)); },
       [](uint32_t c) { return fp8e4m3_to_float(uint8_t(c)); }},
      {"e5m2", 8, [](float f) { return uint32_t(float_to_fp8e5m2(f)); },
       [](uint32_t c) { return fp8e5m2_to_float(uint8_t(c)); }},
  };
}

// Every code of each format (all 65536 for the 16-bit ones) decodes and encodes back to
// itself; NaN codes come back as NaN.
TEST(Conversions, EveryCodeRoundTrips) {
  for (const Format& fmt : formats()) {
    SCOPED_TRACE(fmt.name);
    for (uint32_t code = 0; code < (1u << fmt.bits); ++code) {
      float v = fmt.decode(code);
      uint32_t back = fmt.encode(v);
      if (std::isnan(v)) {
        ASSERT_TRUE(std::isnan(fmt.decode(back))) << "NaN code " << code;
      } else {
        ASSERT_EQ(back, code) << "code " << code << " value " << v;
      }
    }
  }
}

// Decoded values are monotonic in the code (positive half), and for each pair of
// neighbouring finite codes the midpoint rounds to the even code, a value just above it to
// the upper code and one just below to the lower code. All midpoints of these formats are
// exact in fp32 (at most 12 significant bits). Negative values mirror the positive ones.
TEST(Conversions, RoundToNearestEvenAtEveryMidpoint) {
  for (const Format& fmt : formats()) {
    SCOPED_TRACE(fmt.name);
    uint32_t sign = 1u << (fmt.bits - 1);
    for (uint32_t code = 0; code + 1 < sign; ++code) {
      float lo = fmt.decode(code), hi = fmt.decode(code + 1);
      if (!std::isfinite(hi)) break;  // past max finite
      ASSERT_LT(lo, hi) << "code " << code;
      float mid = lo + 0.5f * (hi - lo);  // (lo + hi) / 2 overflows at bf16 max
      ASSERT_EQ(double(mid), 0.5 * (double(lo) + hi)) << "midpoint not exact, code " << code;
      uint32_t even = (code % 2 == 0) ? code : code + 1;
      ASSERT_EQ(fmt.encode(mid), even) << "tie between codes " << code << " and " << code + 1;
      ASSERT_EQ(fmt.encode(std::nextafter(mid, kInf)), code + 1) << "code " << code;
      ASSERT_EQ(fmt.encode(std::nextafter(mid, -kInf)), code) << "code " << code;
      ASSERT_EQ(fmt.encode(-mid), even | sign) << "code " << code;
    }
  }
}

}  // namespace
}  // namespace megaton
