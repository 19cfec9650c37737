// Element access to the tensors of the precision-aware AdamW on the CPU (MomentRef,
// GradRef), shared by multi_tensor_adamw (ops/cpu/multi_tensor.cpp) and
// multi_tensor_adamw_param_remainder (ops/cpu/param_remainder.cpp).
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "core/tensor.h"
#include "ops/adam_precision_math.h"

namespace megaton::ops::cpu_adam {

// A moment: F32, or BF16 read widened to fp32 and written stochastically rounded
// (bf16_round_stochastic) with the given 16 random bits.
struct MomentRef {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  explicit MomentRef(Tensor& t)
      : f32(t.dtype() == DType::F32 ? t.f32() : nullptr),
        bf16(t.dtype() == DType::BF16 ? static_cast<uint16_t*>(t.raw()) : nullptr) {}
  float load(int64_t i) const { return f32 ? f32[i] : bf16_to_float(bf16[i]); }
  void store(int64_t i, float v, uint32_t random16) const {
    if (f32)
      f32[i] = v;
    else
      bf16[i] = bf16_round_stochastic(v, random16);
  }
};

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

}  // namespace megaton::ops::cpu_adam
