// DType sizes, names and scalar float conversions.
#include "core/dtype.h"

#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace megaton {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: case DType::I16: return 2;
    case DType::F8E4M3: case DType::F8E5M2: return 1;
    case DType::I64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F8E4M3: return "F8_E4M3";
    case DType::F8E5M2: return "F8_E5M2";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::I16: return "I16";
  }
  return "?";
}

DType dtype_from_name(std::string_view name) {
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I32,
                  DType::I64, DType::I16}) {
    if (dtype_name(t) == name) return t;
  }
  fail("unknown dtype '{}' (expected F32, BF16, F16, F8_E4M3, F8_E5M2, I32, I64 or I16)", name);
}

bool is_floating(DType t) { return t != DType::I32 && t != DType::I64 && t != DType::I16; }

static uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

uint16_t float_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);  // keep sign, force a quiet NaN
  u += 0x7FFF + ((u >> 16) & 1);                          // round to nearest even
  return uint16_t(u >> 16);
}
float bf16_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }

// F16C instructions (part of x86-64-v3) convert with round-to-nearest-even.
uint16_t float_to_fp16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
float fp16_to_float(uint16_t h) { return _cvtsh_ss(h); }

namespace {
// Decoded value of every FP8 code; encoding picks the nearest code (ties to the even
// code), which is exactly round-to-nearest-even on the FP8 grid.
struct Fp8Format {
  std::array<float, 256> value{};
  float max_finite = 0;
  int man_bits = 0, bias = 0;
  uint8_t max_code = 0;  // the code of max_finite
  Fp8Format(int exp_bits, int man_bits_, bool ieee_specials) : man_bits(man_bits_) {
    bias = (1 << (exp_bits - 1)) - 1;
    for (int code = 0; code < 256; ++code) {
      int sign = code >> 7, e = (code >> man_bits) & ((1 << exp_bits) - 1),
          m = code & ((1 << man_bits) - 1);
      float v;
      if (e == 0) v = std::ldexp(float(m), 1 - bias - man_bits);
      else v = std::ldexp(1.0f + float(m) / float(1 << man_bits), e - bias);
      if (ieee_specials && e == (1 << exp_bits) - 1) v = m == 0 ? INFINITY : NAN;
      if (!ieee_specials && e == (1 << exp_bits) - 1 && m == (1 << man_bits) - 1) v = NAN;
      value[code] = sign ? -v : v;
      if (std::isfinite(v) && v > max_finite) {
        max_finite = v;
        max_code = uint8_t(code);
      }
    }
  }
  uint8_t encode(float f, uint8_t nan_code) const {
    if (std::isnan(f)) return nan_code;
    uint8_t sign = std::signbit(f) ? 0x80 : 0;
    float a = std::fabs(f);
    if (a >= max_finite) {
      if (std::isinf(f) && nan_code != 0x7F) return sign | 0x7C;  // e5m2 keeps inf
      a = max_finite;                                             // saturate
    }
    if (a >= max_finite) return sign | max_code;
    // Round to nearest even on the grid of a's binade: the quantum is 2^(e - man_bits) for
    // normal values (e = a's exponent) and 2^(1 - bias - man_bits) below the smallest
    // normal; a / quantum is exact (a power-of-two scaling) and nearbyint rounds it to
    // even. Below max_finite the rounding never passes it (max_finite is on the grid).
    const int min_exp = 1 - bias;
    int e = a == 0.0f ? min_exp : std::max(std::ilogb(a), min_exp);
    // a = steps x 2^(e - man_bits): steps in [2^man_bits, 2^(man_bits + 1)] for normal a,
    // in [0, 2^man_bits] below the smallest normal (where e is clamped to min_exp).
    int steps = int(std::nearbyint(std::ldexp(a, man_bits - e)));
    if (steps >> (man_bits + 1)) {  // rounded up into the next binade
      ++e;
      steps >>= 1;
    }
    // With the hidden bit set the value is normal (exponent field e + bias); without it,
    // subnormal (field 0).
    const int exponent_field = (steps >> man_bits) ? e - min_exp + 1 : 0;
    return sign | uint8_t((exponent_field << man_bits) | (steps & ((1 << man_bits) - 1)));
  }
};
const Fp8Format& e4m3() { static Fp8Format f(4, 3, false); return f; }
const Fp8Format& e5m2() { static Fp8Format f(5, 2, true); return f; }
}  // namespace

uint8_t float_to_fp8e4m3(float f) { return e4m3().encode(f, 0x7F); }
float fp8e4m3_to_float(uint8_t v) { return e4m3().value[v]; }
uint8_t float_to_fp8e5m2(float f) { return e5m2().encode(f, 0x7E); }
float fp8e5m2_to_float(uint8_t v) { return e5m2().value[v]; }

}  // namespace megaton
