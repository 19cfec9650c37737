// The element math of fp16 main params (--main-params-dtype fp16 under the precision-aware
// optimizer): the main (master) param stored in fp16 with a per-tensor fp32 scale, as
// Transformer Engine's FusedAdam keeps it with master_weights and master_weight_dtype
// torch.float16 (transformer_engine/pytorch/optimizers/fused_adam.py: the master is an
// fp16 state scaled like the fp16 moments, `_apply_scale` / `get_unscaled_state`):
//   value  = float(stored) * scale
//   stored = round_to_nearest_even(value * rscale),  rscale = 1 / scale (0 when scale is 0)
//   after each update: scale = absmax(new values) / 32752 (finfo(fp16).max / 2).
// TE rounds the master to nearest (not stochastically, unlike Megaton's scaled moments):
// so does Megaton. Shared by the CPU twin (ops/cpu/adam_f16_main_param.cpp) and the CUDA
// kernels (ops/cuda/adam_f16_main_param.cu) so both store the same bits. docs/memory.md
// "fp16 main params".
#pragma once
#include <cstdint>

#include "ops/adam_scaled_state_math.h"

namespace megaton::ops {

// x (finite) rounded to nearest, ties to even, to a binary float format with
// `mantissa_bits` stored mantissa bits whose smallest normal exponent is `min_exponent`
// (subnormals below it): with q = |x| / ulp(x) in the format, floor(q) or floor(q) + 1
// times ulp, the second when frac(q) > 1/2 or frac(q) == 1/2 and floor(q) is odd. Every
// step is exact in fp32 (the twin of round_stochastic_to_format). The result has x's sign
// and may be one ulp above the format's largest value (encode_exact_fp16 makes it inf, as
// an IEEE cast does from 65520 up).
MEGATON_HOST_DEVICE inline float round_nearest_to_format(float x, int mantissa_bits,
                                                         int min_exponent) {
  const uint32_t bits = scaled_state_float_bits(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
  if (magnitude_bits == 0) return x;
  int exponent = int(magnitude_bits >> 23) - 127;
  if (exponent < min_exponent) exponent = min_exponent;
  const int ulp_exponent = exponent - mantissa_bits;
  const float ulp = scaled_state_bits_float(uint32_t(ulp_exponent + 127) << 23);
  const float inv_ulp = scaled_state_bits_float(uint32_t(127 - ulp_exponent) << 23);
  const float q = scaled_state_mul(scaled_state_bits_float(magnitude_bits), inv_ulp);
  const uint32_t floor_q = uint32_t(q);  // q < 2^24: exact
  const float frac = q - float(floor_q);  // exact
  const bool up = frac > 0.5f || (frac == 0.5f && (floor_q & 1u) != 0);
  const float rounded = scaled_state_mul(float(up ? floor_q + 1u : floor_q), ulp);
  return scaled_state_bits_float(scaled_state_float_bits(rounded) | sign);
}

// IEEE fp16 bits of x rounded to nearest even (a cast: inf from 65520, NaN stays NaN).
MEGATON_HOST_DEVICE inline uint16_t fp16_round_nearest(float x) {
  if ((scaled_state_float_bits(x) & 0x7FFFFFFFu) >= 0x7F800000u) return encode_exact_fp16(x);
  return encode_exact_fp16(round_nearest_to_format(x, 10, -14));
}

// The stored fp16 bits of main-param value `value` under rscale (value * rscale to nearest).
MEGATON_HOST_DEVICE inline uint16_t store_scaled_fp16_nearest(float value, float rscale) {
  return fp16_round_nearest(scaled_state_mul(value, rscale));
}

// The fp32 value of a stored fp16 main param: float(stored) * scale.
MEGATON_HOST_DEVICE inline float load_scaled_fp16(uint16_t stored, float scale) {
  return scaled_state_mul(decode_fp16(stored), scale);
}

// The scale of an fp16 main param whose values have absolute maximum `absmax`.
MEGATON_HOST_DEVICE inline float main_param_scale_from_absmax(float absmax) {
  return state_scale_from_absmax(absmax, kStateF16);
}

}  // namespace megaton::ops
