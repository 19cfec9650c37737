// The element math of Adam states stored in fp16 or fp8 (E4M3) with a per-tensor fp32
// scale (--exp-avg-dtype / --exp-avg-sq-dtype fp16|fp8 under the precision-aware
// optimizer), shared by the CPU twins (ops/cpu/multi_tensor.cpp, ops/cpu/param_remainder.cpp)
// and the CUDA kernels (ops/cuda/multi_tensor_adamw.cu, ops/cuda/param_remainder.cu) so that
// both store the same bits. docs/memory.md "Scaled optimizer states".
//
// The scaling is Transformer Engine's FusedAdam (transformer_engine/pytorch/optimizers/
// fused_adam.py, `_apply_scale`, `get_unscaled_state`, `dtype_to_range_map`):
//   value  = float(stored) * scale
//   stored = cast(value * rscale),  rscale = 1 / scale (0 when scale is 0)
//   after each update: scale = absmax(new values) / range,
//   range = finfo(fp16).max / 2 = 32752 for fp16, 448 for fp8 E4M3.
// TE rounds the cast to nearest; Megaton rounds the fp16 and fp8 moments stochastically,
// as it rounds bf16 moments (ops/adam_precision_math.h explains why: an EMA with beta2 near
// 1 stalls under round-to-nearest), with the same random bits (MomentRoundingStream).
// BF16 and F32 states are unscaled: their scale is unused.
//
// Every function here is one IEEE operation at a time (explicit __fmul_rn / __fdiv_rn on
// the GPU), and the encodings are of values the format holds exactly, so the host and the
// device give the same bits.
#pragma once
#include <cstdint>
#include <cstring>

#include "ops/adam_control_math.h"
#include "ops/adam_precision_math.h"

namespace megaton::ops {

// How an Adam state is stored (one per tensor and state).
enum AdamStateKind : uint8_t {
  kStateF32 = 0,
  kStateBF16 = 1,
  kStateF16 = 2,     // scaled, range kF16StateRange
  kStateF8E4M3 = 3,  // scaled, range kF8E4M3StateRange
};

// Transformer Engine's dtype_to_range_map: the value absmax maps to.
constexpr float kF16StateRange = 65504.0f / 2.0f;  // 32752
constexpr float kF8E4M3StateRange = 448.0f;

MEGATON_HOST_DEVICE constexpr bool state_kind_scaled(uint8_t kind) {
  return kind == kStateF16 || kind == kStateF8E4M3;
}

MEGATON_HOST_DEVICE constexpr float state_kind_range(uint8_t kind) {
  return kind == kStateF16 ? kF16StateRange : kind == kStateF8E4M3 ? kF8E4M3StateRange : 0.0f;
}

MEGATON_HOST_DEVICE inline uint32_t scaled_state_float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

MEGATON_HOST_DEVICE inline float scaled_state_bits_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

MEGATON_HOST_DEVICE inline float scaled_state_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The scale of a state of `kind` whose new values have absolute maximum `absmax` (>= 0):
// absmax / range (TE: torch.div(absmax, max_range, out=scale)).
MEGATON_HOST_DEVICE inline float state_scale_from_absmax(float absmax, uint8_t kind) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(absmax, state_kind_range(kind));
#else
  return absmax / state_kind_range(kind);
#endif
}

// 1 / scale, 0 when scale is 0 (TE: torch.where(scale > 0, scale.reciprocal(), 0.0)).
MEGATON_HOST_DEVICE inline float state_rscale(float scale) {
  if (!(scale > 0.0f)) return 0.0f;
#ifdef __CUDA_ARCH__
  return __fdiv_rn(1.0f, scale);
#else
  return 1.0f / scale;
#endif
}

// x (finite) stochastically rounded to a binary float format with `mantissa_bits` stored
// mantissa bits whose smallest normal exponent is `min_exponent` (subnormals below it), by
// the 16 random bits `random16`: with q = |x| / ulp(x) in the format, the result is
// floor(q) * ulp or (floor(q) + 1) * ulp, the second when random16 < frac(q) * 2^16, so
// the expectation is x up to 2^-16 of an ulp (unbiased as bf16_round_stochastic). Every
// step is exact in fp32 (ulp is a power of two, q < 2^(mantissa_bits + 1)). The result has
// x's sign and is a value the format holds (or one ulp above its largest: the caller clamps).
MEGATON_HOST_DEVICE inline float round_stochastic_to_format(float x, int mantissa_bits,
                                                            int min_exponent, uint32_t random16) {
  const uint32_t bits = scaled_state_float_bits(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
  if (magnitude_bits == 0) return x;
  int exponent = int(magnitude_bits >> 23) - 127;  // fp32 subnormals: below any min_exponent
  if (exponent < min_exponent) exponent = min_exponent;
  const int ulp_exponent = exponent - mantissa_bits;  // >= -126 for fp16 and e4m3
  const float ulp = scaled_state_bits_float(uint32_t(ulp_exponent + 127) << 23);
  const float inv_ulp = scaled_state_bits_float(uint32_t(127 - ulp_exponent) << 23);
  const float q = scaled_state_mul(scaled_state_bits_float(magnitude_bits), inv_ulp);
  const float floor_q = float(uint32_t(q));  // q < 2^24: exact
  const float frac = q - floor_q;            // exact
  const bool up = float(random16 & 0xFFFFu) < scaled_state_mul(frac, 65536.0f);
  const float rounded = scaled_state_mul(up ? floor_q + 1.0f : floor_q, ulp);
  return scaled_state_bits_float(scaled_state_float_bits(rounded) | sign);
}

// fp16 bits of a value fp16 holds exactly (or +-inf, NaN).
MEGATON_HOST_DEVICE inline uint16_t encode_exact_fp16(float x) {
  const uint32_t bits = scaled_state_float_bits(x);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
  if (magnitude_bits > 0x7F800000u) return uint16_t(sign | 0x7E00u);   // NaN
  if (magnitude_bits >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520: inf
  const int exponent = int(magnitude_bits >> 23) - 127;
  if (exponent >= -14)
    return uint16_t(sign | (uint32_t(exponent + 15) << 10) | ((magnitude_bits >> 13) & 0x3FFu));
  // Subnormal: |x| / 2^-24 is the integer mantissa.
  const float units = scaled_state_mul(scaled_state_bits_float(magnitude_bits), 16777216.0f);
  return uint16_t(sign | uint32_t(units));
}

MEGATON_HOST_DEVICE inline float decode_fp16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) {
    const float units = scaled_state_mul(float(mantissa), 5.9604644775390625e-8f);  // 2^-24
    return scaled_state_bits_float(scaled_state_float_bits(units) | sign);
  }
  if (exponent == 31) return scaled_state_bits_float(sign | 0x7F800000u | (mantissa << 13));
  return scaled_state_bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// E4M3 (OCP FP8, as Transformer Engine stores fp8 states: no infinities, NaN 0x7F/0xFF,
// largest 448) bits of a value it holds exactly; NaN and infinities become 0x7F (NaN).
MEGATON_HOST_DEVICE inline uint8_t encode_exact_fp8e4m3(float x) {
  const uint32_t bits = scaled_state_float_bits(x);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  const uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
  if (magnitude_bits >= 0x7F800000u) return 0x7Fu;
  const int exponent = int(magnitude_bits >> 23) - 127;
  if (exponent >= -6)
    return uint8_t(sign | (uint32_t(exponent + 7) << 3) | ((magnitude_bits >> 20) & 0x7u));
  const float units = scaled_state_mul(scaled_state_bits_float(magnitude_bits), 512.0f);  // 2^9
  return uint8_t(sign | uint32_t(units));
}

MEGATON_HOST_DEVICE inline float decode_fp8e4m3(uint8_t v) {
  const uint32_t sign = uint32_t(v & 0x80u) << 24;
  const uint32_t exponent = (v >> 3) & 0xFu, mantissa = v & 0x7u;
  if (exponent == 15 && mantissa == 7) return scaled_state_bits_float(0x7FC00000u);
  if (exponent == 0) {
    const float units = scaled_state_mul(float(mantissa), 0.001953125f);  // 2^-9
    return scaled_state_bits_float(scaled_state_float_bits(units) | sign);
  }
  return scaled_state_bits_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// The stored fp16 bits of `value` under rscale: value * rscale stochastically rounded.
MEGATON_HOST_DEVICE inline uint16_t store_scaled_fp16(float value, float rscale,
                                                      uint32_t random16) {
  const float x = scaled_state_mul(value, rscale);
  if ((scaled_state_float_bits(x) & 0x7FFFFFFFu) >= 0x7F800000u) return encode_exact_fp16(x);
  return encode_exact_fp16(round_stochastic_to_format(x, 10, -14, random16));
}

// The stored E4M3 bits of `value` under rscale: value * rscale stochastically rounded,
// clamped to +-448 (rscale's rounding may put the absmax a hair above the range; TE's cast
// saturates too).
MEGATON_HOST_DEVICE inline uint8_t store_scaled_fp8e4m3(float value, float rscale,
                                                        uint32_t random16) {
  const float x = scaled_state_mul(value, rscale);
  if ((scaled_state_float_bits(x) & 0x7FFFFFFFu) >= 0x7F800000u) return encode_exact_fp8e4m3(x);
  float r = round_stochastic_to_format(x, 3, -6, random16);
  if (r > 448.0f) r = 448.0f;
  if (r < -448.0f) r = -448.0f;
  return encode_exact_fp8e4m3(r);
}

// |x|'s bits, for a max that is the same in any order on every device (a NaN wins).
MEGATON_HOST_DEVICE inline uint32_t absmax_bits(float x) {
  return scaled_state_float_bits(x) & 0x7FFFFFFFu;
}

// An Adam state's storage for the element loops: the data, how it is stored, the scale
// its stored values carry (load) and the reciprocal of the scale to store the new values
// with (store). For F32 and BF16 states the scales are unused.
struct AdamStateRef {
  void* data = nullptr;
  uint8_t kind = kStateF32;
  float scale = 1.0f;       // the old scale: value = stored * scale
  float new_rscale = 1.0f;  // 1 / the new scale (0 when it is 0)

  MEGATON_HOST_DEVICE float load(int64_t i) const {
    switch (kind) {
      case kStateF32:
        return static_cast<const float*>(data)[i];
      case kStateBF16:
        return scaled_state_bits_float(uint32_t(static_cast<const uint16_t*>(data)[i]) << 16);
      case kStateF16:
        return scaled_state_mul(decode_fp16(static_cast<const uint16_t*>(data)[i]), scale);
      default:
        return scaled_state_mul(decode_fp8e4m3(static_cast<const uint8_t*>(data)[i]), scale);
    }
  }

  // Stores `value` with the 16 random bits `random16` (F32 exactly, the others rounded
  // stochastically: bf16_round_stochastic, store_scaled_fp16, store_scaled_fp8e4m3).
  MEGATON_HOST_DEVICE void store(int64_t i, float value, uint32_t random16) const {
    switch (kind) {
      case kStateF32:
        static_cast<float*>(data)[i] = value;
        break;
      case kStateBF16:
        static_cast<uint16_t*>(data)[i] = bf16_round_stochastic(value, random16);
        break;
      case kStateF16:
        static_cast<uint16_t*>(data)[i] = store_scaled_fp16(value, new_rscale, random16);
        break;
      default:
        static_cast<uint8_t*>(data)[i] = store_scaled_fp8e4m3(value, new_rscale, random16);
    }
  }
};

}  // namespace megaton::ops
