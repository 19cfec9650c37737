// The element math of fp32 main params stored as bf16 weights plus int16 remainders
// (Transformer Engine's store_param_remainders), shared by the CPU twin
// (ops/cpu/param_remainder.cpp) and the CUDA kernels (ops/cuda/param_remainder.cu) so that
// both compute the same bits.
//
// An fp32 main param is 32 bits, hi16 then lo16. Its bf16 weight is hi16 rounded by the
// top bit of lo16, and its remainder is lo16 itself (Transformer Engine
// `transformer_engine/pytorch/csrc/extensions/multi_tensor/multi_tensor_adam.cu`,
// `AdamFunctorMasterParamRemainder`: "Split into BF16 params (rounded-to-nearest) and
// remainders", `if (local_p_rem < 0) local_p++`, and back, "Undo rounding",
// `if (local_p_rem < 0) local_p--`, both in int16 arithmetic):
//
//   weight    = (hi16 + (lo16 >> 15)) mod 2^16       (lo16 >= 0x8000: int16(lo16) < 0)
//   remainder = lo16
//   hi16      = (weight - (remainder >> 15)) mod 2^16
//
// The weight is the main param rounded to the nearest bf16 with ties (lo16 == 0x8000) away
// from zero: incrementing hi16 raises the magnitude for either sign. Round-to-nearest-even
// (ops::cast, float_to_bf16) differs only at those ties, where it keeps an even hi16; it
// could not be undone (a tie and the value one bf16 ulp below would share a weight),
// this rounding can: split and join are inverse bijections on all 2^32 bit patterns, so
// the stored pair is the fp32 main param exactly, in 2 bytes beside the weight instead of 4.
// The wrap mod 2^16 is TE's int16 overflow: hi16 0x7FFF or 0xFFFF (NaNs) with lo16 >=
// 0x8000 give the weights 0x8000 (-0) and 0x0000 (+0); a finite value rounds to infinity
// exactly where round-to-nearest does (above the largest bf16).
#pragma once
#include <cstdint>
#include <cstring>

#include "ops/adam_precision_math.h"

namespace megaton::ops {

MEGATON_HOST_DEVICE inline uint32_t param_remainder_float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

MEGATON_HOST_DEVICE inline float param_remainder_bits_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

// The bf16 weight bits of the fp32 main param with bits `master` (see above).
MEGATON_HOST_DEVICE inline uint16_t param_remainder_weight(uint32_t master) {
  return uint16_t((master >> 16) + ((master >> 15) & 1u));
}

// The remainder of the fp32 main param with bits `master`: its low 16 bits.
MEGATON_HOST_DEVICE inline uint16_t param_remainder_low(uint32_t master) {
  return uint16_t(master & 0xFFFFu);
}

// The fp32 main param bits of a (weight, remainder) pair: the inverse of the two above.
MEGATON_HOST_DEVICE inline uint32_t param_remainder_join(uint16_t weight, uint16_t remainder) {
  const uint16_t high = uint16_t(weight - (remainder >> 15));
  return (uint32_t(high) << 16) | remainder;
}

// The fp32 main param of a (weight, remainder) pair.
MEGATON_HOST_DEVICE inline float param_remainder_value(uint16_t weight, uint16_t remainder) {
  return param_remainder_bits_float(param_remainder_join(weight, remainder));
}

// An updated fp32 main param split into its pair, a NaN as the quiet NaN 0x7FC00000 (see
// adamw_param_remainder_update).
MEGATON_HOST_DEVICE inline void param_remainder_store(float p, uint16_t& weight,
                                                      uint16_t& remainder) {
  uint32_t bits = param_remainder_float_bits(p);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) bits = 0x7FC00000u;
  weight = param_remainder_weight(bits);
  remainder = param_remainder_low(bits);
}

// One element of AdamW over a (weight, remainder) pair: the fp32 main param rebuilt, the
// precision-aware update (adamw_precision_update: the same fp32 arithmetic, moments m and
// v widened to fp32 and updated in place), the result split back. A NaN result is stored
// as the quiet NaN 0x7FC00000 (weight 0x7FC0, remainder 0), so the bf16 weight shows it
// (the GPU's own NaN, 0x7FFFFFFF, would split into weight 0x8000 = -0 by TE's wrap) and the
// CPU and the GPU store the same bits; TE stores the NaN's bits as they come.
MEGATON_HOST_DEVICE inline void adamw_param_remainder_update(uint16_t& weight,
                                                             uint16_t& remainder, float grad,
                                                             float& m, float& v, float decay,
                                                             const AdamPrecisionConstants& c) {
  float p = param_remainder_value(weight, remainder);
  adamw_precision_update(p, grad, m, v, decay, c);
  param_remainder_store(p, weight, remainder);
}

}  // namespace megaton::ops
