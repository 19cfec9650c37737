// Helpers of the CPU doors of the Muon, SGD and Lion element-wise ops (muon_update.cpp,
// sgd_lion.cpp): argument descriptions for their errors, and the fp32 arithmetic that
// gives the GPU kernels' bits.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace megaton::ops::cpu_optimizer {

inline const char* device_name(Device d) { return d == Device::CUDA ? "CUDA" : "CPU"; }

// "F32 [3, 4] on CPU", or "undefined".
inline std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined";
  return fmt::format("{} {} on {}", dtype_name(t.dtype()), shape_str(t.shape()),
                     device_name(t.device()));
}

// a * b rounded to fp32 on its own: GCC contracts a product feeding a sum into an FMA
// (-ffp-contract=fast, x86-64-v3 has FMA), which the GPU kernels, written with __fmul_rn,
// do not.
inline float product(float a, float b) {
  const volatile float p = a * b;
  return p;
}

// Element i of an F32 or BF16 tensor, as fp32.
inline float load(const Tensor& t, int64_t i) {
  return t.dtype() == DType::BF16 ? bf16_to_float(t.data<uint16_t>()[i]) : t.f32()[i];
}

// InternalError naming `op` unless control is adamw_step_control's F32 [kAdamControlSize]
// on `device`.
inline void check_control(const Tensor& control, Device device, const char* op) {
  MEGATON_CHECK(control.defined() && control.dtype() == DType::F32 &&
                    control.numel() == kAdamControlSize && control.device() == device,
                "{}: control is {}, expected F32 [{}] on {}", op, describe(control),
                kAdamControlSize, device_name(device));
}

}  // namespace megaton::ops::cpu_optimizer
