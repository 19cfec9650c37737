// Shared pieces of the CPU MoE router ops (moe_router.cpp, moe_router_loss.cpp): door
// checks, the score functions and their derivatives, and the top-k order.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/tensor.h"

namespace megaton::ops::router_math {

// Below this many elements a loop runs on the calling thread: waking an OpenMP team
// costs more than the work.
constexpr int64_t kParallelMin = int64_t(1) << 15;

// t is an allocated CPU tensor of dtype want (the CUDA dispatch has already happened).
inline void check_tensor(const Tensor& t, DType want, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} must be allocated", op, name);
  MEGATON_CHECK(t.device() == Device::CPU, "{}: {} must be on the CPU, as the op's first input", op,
                name);
  MEGATON_CHECK(t.dtype() == want, "{}: {} must be {}, got {}", op, name, dtype_name(want),
                dtype_name(t.dtype()));
}

inline void check_shape(const Tensor& t, const Shape& want, const char* op, const char* name) {
  MEGATON_CHECK(t.shape() == want, "{}: {} has shape {}, expected {}", op, name,
                shape_str(t.shape()), shape_str(want));
}

// logits [T, E] F32 on the CPU, E >= 1.
inline void check_logits(const Tensor& logits, const char* op) {
  check_tensor(logits, DType::F32, op, "logits");
  MEGATON_CHECK(logits.ndim() == 2 && logits.dim(1) >= 1, "{}: logits must be [T, E >= 1], got {}",
                op, shape_str(logits.shape()));
}

// The top-k order: larger first, the lower expert on ties (Megatron's torch.topk leaves
// ties unspecified; a fixed order keeps the CPU and GPU routings equal).
inline bool ranks_before(float a, int32_t a_index, float b, int32_t b_index) {
  return a > b || (a == b && a_index < b_index);
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// torch.nn.functional.softplus (beta 1, threshold 20: x itself above it).
inline double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
inline double sqrt_softplus(double x) { return std::sqrt(softplus(x)); }
// d sqrt(softplus(x)) / dx = softplus'(x) / (2 s), s = sqrt(softplus(x)); softplus' is
// sigmoid(x), or 1 above the threshold (torch's softplus backward). 0 where s underflows
// (the limit as x -> -inf).
inline double sqrt_softplus_grad(double x, double s) {
  if (!(s > 0.0)) return 0.0;
  return (x > 20.0 ? 1.0 : sigmoid(x)) / (2.0 * s);
}

// Softmax of one row in fp64 (max subtracted).
inline void softmax_row_f64(const float* x, int64_t n, double* y) {
  const double row_max = *std::max_element(x, x + n);
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += (y[e] = std::exp(double(x[e]) - row_max));
  for (int64_t e = 0; e < n; ++e) y[e] /= sum;
}

// The same rounded to fp32 (Megatron's torch.softmax(..., dtype=float32)).
inline void softmax_row(const float* x, int64_t n, float* y) {
  const double row_max = *std::max_element(x, x + n);
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += std::exp(double(x[e]) - row_max);
  for (int64_t e = 0; e < n; ++e) y[e] = float(std::exp(double(x[e]) - row_max) / sum);
}

}  // namespace megaton::ops::router_math
