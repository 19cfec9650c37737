// Door checks shared by the single- and multi-tensor CPU FP8 ops (fp8.cpp, fp8_multi.cpp).
#pragma once
#include <cmath>
#include <string_view>

#include "core/tensor.h"
#include "ops/fp8.h"

namespace megaton::ops::fp8_checks {

inline bool is_fp8(DType t) { return t == DType::F8E4M3 || t == DType::F8E5M2; }

// x is defined and F32 or BF16 (what the FP8 ops quantize from).
inline void check_input(const Tensor& x, const char* op, std::string_view name) {
  MEGATON_CHECK(x.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16,
                "{}: {} must be F32 or BF16, got {}", op, name, dtype_name(x.dtype()));
}

// rule.fp8 an FP8 dtype, margin and amax_epsilon finite and >= 0 (fp8.h, Fp8ScaleRule).
inline void check_rule(const Fp8ScaleRule& rule, const char* op) {
  MEGATON_CHECK(is_fp8(rule.fp8), "{}: rule.fp8 must be F8E4M3 or F8E5M2, got {}", op,
                dtype_name(rule.fp8));
  MEGATON_CHECK(std::isfinite(rule.margin) && rule.margin >= 0.0f,
                "{}: rule.margin must be finite and >= 0, got {}", op, rule.margin);
  MEGATON_CHECK(std::isfinite(rule.amax_epsilon) && rule.amax_epsilon >= 0.0f,
                "{}: rule.amax_epsilon must be finite and >= 0, got {}", op, rule.amax_epsilon);
}

}  // namespace megaton::ops::fp8_checks
