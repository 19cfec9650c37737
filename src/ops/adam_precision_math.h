// The element update of the precision-aware AdamW (moments stored in bf16), shared by the
// CPU twin (ops/cpu/multi_tensor.cpp) and the CUDA kernel (ops/cuda/multi_tensor_adamw.cu)
// so that both compute the same bits.
//
// multi_tensor_adamw (ops.h, and ops/adam_precision.h with rounding keys) dispatches on the
// moments' dtypes: with exp_avg and exp_avg_sq both F32 it runs the fp32-state update
// ops.h documents (unchanged); with either one BF16 (--use-precision-aware-optimizer
// --exp-avg-dtype / --exp-avg-sq-dtype bf16) every element is updated by
// adamw_precision_update below: the stored moment is widened to fp32, the update computed
// in fp32 (as Transformer Engine's FusedAdam does for bf16 states: its multi_tensor_adam
// kernel reads and writes the bf16 moments, fp32 arithmetic in registers), and the new
// moment stored in bf16 by stochastic rounding (bf16_round_stochastic), where TE rounds to
// nearest even. An F32 moment in such a list is read and written as fp32 by the same
// formula.
//
// Why not round to nearest: bf16 keeps 8 significant bits, so one ulp is 2^-8 to 2^-7 of
// the value, and with beta2 = 0.999 round-to-nearest gives bf16(0.999 v) == v: a stored
// exp_avg_sq never decays and every (1 - b2) g^2 below half an ulp of v is rounded away,
// so v stays near its largest past value and the updates shrink (docs/memory.md
// "Precision-aware optimizer" has the measurement). Stochastic rounding is unbiased,
// E[round(x)] = x, so the EMA keeps its expected value through every store.
//
// The random bits are a pure function of (parameter, element of the full parameter,
// step): MomentRoundingKey says which parameter a listed tensor is and where its elements
// sit in it, so a distributed-optimizer shard or a tensor-parallel slice draws the bits
// that the one-rank run draws for the same elements, and the CPU and the GPU draw the same.
//
// Each operation is one IEEE fp32 operation rounded on its own: products that feed a sum
// are written as explicit fused multiply-adds (std::fma / __fmaf_rn, both correctly
// rounded) and nothing else is left for a compiler to contract, so the host (GCC, FMA
// contraction on by default) and the GPU (nvcc --fmad) cannot differ. The formula is the
// fp32-state GPU kernel's (Megaton's form of torch.optim.AdamW):
//   g = grad * grad_scale
//   m = fma(b1, m, (1 - b1) * g)
//   v = fma(b2, v, ((1 - b2) * g) * g)
//   p = fma(-step_size, m / fma(sqrt(v), inv_sqrt_bc2, eps), p * decay)
// with step_size = float(lr / (1 - b1^step)), inv_sqrt_bc2 = float(1 / sqrt(1 - b2^step))
// (fp64, powers by squaring: adam_control_math.h) and decay = float(1 - lr * wd) (fp64).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/rng.h"
#include "ops/adam_control_math.h"

namespace megaton::ops {

// The step's constants of adamw_precision_update (one set for the whole list).
struct AdamPrecisionConstants {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float step_size, inv_sqrt_bc2, grad_scale;
};

// The constants for step `step` (>= 1) with learning rate lr, computed on the host in
// fp64 as the fp32-state GPU path computes them (launch_adamw), and as
// adamw_step_control writes them (control[kAdamStepSize], control[kAdamInvSqrtBc2]).
inline AdamPrecisionConstants adam_precision_constants(float lr, float beta1, float beta2,
                                                       float eps, int64_t step,
                                                       float grad_scale) {
  const double bias_correction1 = 1.0 - power_by_squaring(double(beta1), step);
  const double bias_correction2 = 1.0 - power_by_squaring(double(beta2), step);
  return {beta1,
          1.0f - beta1,
          beta2,
          1.0f - beta2,
          eps,
          float(double(lr) / bias_correction1),
          float(1.0 / std::sqrt(bias_correction2)),
          grad_scale};
}

// float(1 - lr * wd), each fp64 operation rounded on its own (the GPU's adamw_decay).
MEGATON_HOST_DEVICE inline float adam_precision_decay(float lr, float weight_decay) {
#ifdef __CUDA_ARCH__
  return float(__dsub_rn(1.0, __dmul_rn(double(lr), double(weight_decay))));
#else
  const volatile double product = double(lr) * double(weight_decay);  // not fused
  return float(1.0 - product);
#endif
}

// One element's moments m and v (widened to fp32) updated in place from the stored
// gradient `grad`: the first half of adamw_precision_update, alone for the absmax pass of
// scaled (fp16, fp8) moments (ops/adam_scaled_state_math.h), which must see the bits the
// update stores. Only beta1, beta2, their complements and grad_scale of c are read.
MEGATON_HOST_DEVICE inline void adamw_precision_moments(float grad, float& m, float& v,
                                                        const AdamPrecisionConstants& c) {
#ifdef __CUDA_ARCH__
  const float g = __fmul_rn(grad, c.grad_scale);
  m = __fmaf_rn(c.beta1, m, __fmul_rn(c.one_minus_beta1, g));
  v = __fmaf_rn(c.beta2, v, __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
#else
  const float g = grad * c.grad_scale;
  m = std::fma(c.beta1, m, c.one_minus_beta1 * g);
  v = std::fma(c.beta2, v, (c.one_minus_beta2 * g) * g);
#endif
}

// One element: p (fp32 main param), m and v (the moments widened to fp32) updated in
// place from the stored gradient `grad`.
MEGATON_HOST_DEVICE inline void adamw_precision_update(float& p, float grad, float& m, float& v,
                                                       float decay,
                                                       const AdamPrecisionConstants& c) {
  adamw_precision_moments(grad, m, v, c);
#ifdef __CUDA_ARCH__
  const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_sqrt_bc2, c.eps);
  p = __fmaf_rn(-c.step_size, __fdiv_rn(m, denom), __fmul_rn(p, decay));
#else
  const float denom = std::fma(std::sqrt(v), c.inv_sqrt_bc2, c.eps);
  p = std::fma(-c.step_size, m / denom, p * decay);
#endif
}

// ---- stochastic rounding of the bf16 moments ----

// Which parameter a listed tensor is, and where its elements sit in it, for the random
// bits of its moments' stochastic rounding. Element i of the tensor (0-based, row-major) is
// element l = offset + i of the parameter as this rank holds it (a distributed-optimizer
// shard starts at offset > 0), and that is element
//   full(l) = base + l                                   (run == 0)
//   full(l) = (l / run) * stride + base + l % run        (run > 0)
// of the full, unsliced parameter (row-major in Param::full_shape): run == 0 for a whole
// parameter or a slice of contiguous rows (tensor parallelism along dim 0: base = first
// row x columns), run > 0 for a slice of columns (dim 1: run = the slice's width, stride =
// the full width, base = its first column) or the two halves of a SwiGLU fc1 (run = the
// rows of one half's slice x columns, stride = a full half). All values >= 0.
struct MomentRoundingKey {
  uint64_t param_key = 0;  // the parameter's name hashed (moment_rounding_param_key)
  int64_t offset = 0;
  int64_t run = 0;
  int64_t stride = 0;
  int64_t base = 0;
};

// The param_key of a parameter named `name` (its checkpoint key, the same on every rank and
// in every layout): 64-bit FNV-1a of its bytes (Fowler, Noll, Vo; offset basis
// 14695981039346656037, prime 1099511628211).
inline uint64_t moment_rounding_param_key(const char* name, size_t size) {
  uint64_t hash = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i) {
    hash ^= uint8_t(name[i]);
    hash *= 1099511628211ull;
  }
  return hash;
}

// full(offset + index) of MomentRoundingKey: the element's index in the full parameter.
MEGATON_HOST_DEVICE inline uint64_t moment_rounding_index(const MomentRoundingKey& key,
                                                          int64_t index) {
  const int64_t l = key.offset + index;
  if (key.run == 0) return uint64_t(key.base + l);
  return uint64_t((l / key.run) * key.stride + key.base + l % key.run);
}

// The 32 random bits of element `index` of a listed tensor at Adam step `step` (1-based):
// word full % 4 of Philox4x32-10 (core/rng.h) keyed by param_key at counter
// (full / 4, step), full = moment_rounding_index(key, index). The low 16 bits round the
// element's exp_avg, the high 16 its exp_avg_sq. Four neighbouring elements of the full
// parameter share one Philox call; the stream keeps the last call's words, so a loop over
// consecutive elements calls Philox once per four of them on the CPU and the GPU alike.
struct MomentRoundingStream {
  Philox philox;
  uint64_t step;
  MomentRoundingKey key;
  uint64_t group = ~uint64_t(0);  // full / 4 of the words below
  // Philox's four words, as scalars: an array indexed by full % 4 would live in a GPU
  // thread's local memory.
  uint32_t word0 = 0, word1 = 0, word2 = 0, word3 = 0;

  MEGATON_HOST_DEVICE MomentRoundingStream(const MomentRoundingKey& k, uint64_t s)
      : philox(k.param_key), step(s), key(k) {}

  MEGATON_HOST_DEVICE uint32_t bits(int64_t index) {
    const uint64_t full = moment_rounding_index(key, index);
    if (full >> 2 != group) {
      group = full >> 2;
      uint32_t out[4];
      philox.generate(group, step, out);
      word0 = out[0];
      word1 = out[1];
      word2 = out[2];
      word3 = out[3];
    }
    const uint32_t lane = uint32_t(full & 3);
    return lane == 0 ? word0 : lane == 1 ? word1 : lane == 2 ? word2 : word3;
  }
};

// x (fp32) stochastically rounded to bf16 with the uniform 16-bit value `random16`
// (0 <= random16 < 2^16): the bits of x plus random16, truncated to their high half. With
// f the low 16 bits of x, the sum carries into the high half (x moves one bf16 ulp away
// from zero) exactly when random16 >= 2^16 - f, with probability f / 2^16, so the result
// is x's bf16 neighbour toward zero or away from it with the probabilities that make its
// expectation x (unbiased); a value that is already bf16 (f = 0) never moves. This is
// torchao's _fp32_to_bf16_sr (torchao/optim/quant_utils.py: keep x's high half, add one
// ulp when rand_16bit < f: the same outcome for each value of the random bits) and the
// rounding of Zamirai et al., "Revisiting BFloat16 Training" (2020). Infinities stay
// infinite (their low half is 0); a NaN becomes bf16's quiet NaN of its sign (the carry
// could otherwise turn it into an infinity or zero); the largest finite values round up to
// infinity with probability f / 2^16, as round-to-nearest would past the halfway point.
MEGATON_HOST_DEVICE inline uint16_t bf16_round_stochastic(float x, uint32_t random16) {
#ifdef __CUDA_ARCH__
  const uint32_t bits = __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
#endif
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x7FC0u);
  return uint16_t((bits + (random16 & 0xFFFFu)) >> 16);
}

}  // namespace megaton::ops
