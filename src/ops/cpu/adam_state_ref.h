// The element loops of the precision-aware AdamW on the CPU, shared by multi_tensor_adamw
// (ops/cpu/multi_tensor.cpp: fp32 main params) and multi_tensor_adamw_param_remainder
// (ops/cpu/param_remainder.cpp: (bf16 weight, int16 remainder) pairs): the update of one
// tensor over any main-param storage (MainParam below) with F32, BF16, F16 or F8E4M3
// moments (AdamStateRef, ops/adam_scaled_state_math.h), the absmax pass of scaled moments,
// and the scales' bookkeeping.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"
#include "ops/adam_scaled_state_math.h"
#include "ops/param_remainder_math.h"

namespace megaton::ops::cpu_adam {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;

// A main grad: F32, or BF16 (--main-grads-dtype bf16) widened to fp32 as it is read (exact:
// every bf16 is an fp32), so the update of a BF16 grad is the update of its fp32 value.
struct GradRef {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  explicit GradRef(const Tensor& t)
      : f32(t.dtype() == DType::F32 ? t.f32() : nullptr),
        bf16(t.dtype() == DType::BF16 ? static_cast<const uint16_t*>(t.raw()) : nullptr) {}
  float load(int64_t i) const { return f32 ? f32[i] : bf16_to_float(bf16[i]); }
};

// Main params as the loop sees them: load(i) the fp32 value, store(i, p) the updated one.
struct F32MainParam {
  float* p;
  float load(int64_t i) const { return p[i]; }
  void store(int64_t i, float x) const { p[i] = x; }
};
struct RemainderMainParam {
  uint16_t* weight;     // BF16 bits
  uint16_t* remainder;  // I16
  float load(int64_t i) const { return param_remainder_value(weight[i], remainder[i]); }
  void store(int64_t i, float x) const { param_remainder_store(x, weight[i], remainder[i]); }
};

// Moment `column` (0 exp_avg, 1 exp_avg_sq) of list tensor i: its storage, and for a
// scaled one the old scale (scales.scale[i]) and the new one's reciprocal (from
// scales.absmax[i], after the caller's reduction). Checked before (check_moment_scales).
inline AdamStateRef state_ref(const Tensor& t, const AdamMomentScales& scales, size_t i,
                              int column) {
  AdamStateRef ref;
  ref.data = t.raw();
  ref.kind = adam_state_kind(t.dtype(), "multi_tensor_adamw");
  if (state_kind_scaled(ref.kind)) {
    ref.scale = scales.scale[i].f32()[column];
    ref.new_rscale =
        state_rscale(state_scale_from_absmax(scales.absmax[i].f32()[column], ref.kind));
  }
  return ref;
}

// One tensor's precision-aware update (adamw_precision_update), the gradient scaled as it
// is read; the moments' random bits from `key` at `step` (MomentRoundingStream).
template <typename MainParam>
void adamw_state_loop(const MainParam& main, const GradRef& grad, const AdamStateRef& m,
                      const AdamStateRef& v, int64_t n, float decay,
                      const AdamPrecisionConstants& c, const MomentRoundingKey& key, int64_t step) {
#pragma omp parallel if (n >= kParallelMin)
  {
    // One stream per thread: it calls Philox once per four consecutive elements.
    MomentRoundingStream random(key, uint64_t(step));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      float p = main.load(i), mi = m.load(i), vi = v.load(i);
      adamw_precision_update(p, grad.load(i), mi, vi, decay, c);
      const uint32_t bits = random.bits(i);
      main.store(i, p);
      m.store(i, mi, bits & 0xFFFFu);
      v.store(i, vi, bits >> 16);
    }
  }
}

// The absmax pass of one tensor: the bits of max |new m| and max |new v| (absmax_bits).
inline void moment_absmax_loop(const GradRef& grad, const AdamStateRef& m, const AdamStateRef& v,
                               int64_t n, const AdamPrecisionConstants& c, uint32_t& m_bits,
                               uint32_t& v_bits) {
  uint32_t m_max = 0, v_max = 0;
#pragma omp parallel for reduction(max : m_max, v_max) schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    float mi = m.load(i), vi = v.load(i);
    adamw_precision_moments(grad.load(i), mi, vi, c);
    m_max = std::max(m_max, absmax_bits(mi));
    v_max = std::max(v_max, absmax_bits(vi));
  }
  m_bits = m_max;
  v_bits = v_max;
}

// After every tensor is updated: scales.scale[i] = absmax / range for the scaled moments.
inline void commit_moment_scales(const std::vector<Tensor>& exp_avg,
                                 const std::vector<Tensor>& exp_avg_sq,
                                 const AdamMomentScales& scales) {
  if (scales.empty()) return;
  for (size_t i = 0; i < exp_avg.size(); ++i) {
    const uint8_t kinds[2] = {adam_state_kind(exp_avg[i].dtype(), "multi_tensor_adamw"),
                              adam_state_kind(exp_avg_sq[i].dtype(), "multi_tensor_adamw")};
    for (int column = 0; column < 2; ++column)
      if (state_kind_scaled(kinds[column]))
        scales.scale[i].f32()[column] =
            state_scale_from_absmax(scales.absmax[i].f32()[column], kinds[column]);
  }
}

}  // namespace megaton::ops::cpu_adam
