// Argument checks and scalar helpers shared by the doors of Mamba-2's ops (ops/ssm.h):
// ssm_conv.cpp, ssm.cpp (the SSD scan) and ssm_norm.cpp. Internal to ops/cpu.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace megaton::ops::ssm_detail {

inline const char* device_name(Device d) { return d == Device::CUDA ? "CUDA" : "CPU"; }

inline bool is_activation_dtype(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

// t is allocated, has ref's dtype and device, and the given shape.
inline void check_like(const Tensor& t, const Tensor& ref, const Shape& shape, const char* op,
                       const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} must be allocated", op, name);
  MEGATON_CHECK(t.dtype() == ref.dtype() && t.device() == ref.device(),
                "{}: {} is {} on {}, expected {} on {}", op, name, dtype_name(t.dtype()),
                device_name(t.device()), dtype_name(ref.dtype()), device_name(ref.device()));
  MEGATON_CHECK(t.shape() == shape, "{}: {} is {}, expected {}", op, name, shape_str(t.shape()),
                shape_str(shape));
}

// An F32 tensor of `shape` on `device` (gradient accumulators, rstd, SSD states).
inline void check_f32(const Tensor& t, const Shape& shape, Device device, const char* op,
                      const char* name) {
  MEGATON_CHECK(t.defined() && t.dtype() == DType::F32 && t.device() == device,
                "{}: {} must be an allocated F32 tensor on {}", op, name, device_name(device));
  MEGATON_CHECK(t.shape() == shape, "{}: {} is {}, expected {}", op, name, shape_str(t.shape()),
                shape_str(shape));
}

// A per-channel or per-head vector [n] of any float dtype on `device`.
inline void check_vector(const Tensor& t, int64_t n, Device device, const char* op,
                         const char* name) {
  MEGATON_CHECK(t.defined() && is_floating(t.dtype()) && t.device() == device,
                "{}: {} must be an allocated float tensor on {}", op, name, device_name(device));
  MEGATON_CHECK(t.shape() == Shape{n}, "{}: {} is {}, expected [{}]", op, name,
                shape_str(t.shape()), n);
}

// The CPU backend computes on F32 CPU tensors only.
inline void check_cpu(const Tensor& t, const char* op) {
  MEGATON_CHECK(t.device() == Device::CPU && t.dtype() == DType::F32,
                "{}: the CPU backend takes F32 CPU tensors, got {} on {}", op,
                dtype_name(t.dtype()), device_name(t.device()));
}

// A CPU vector of any float dtype as fp64 values.
inline std::vector<double> read_vector(const Tensor& t) {
  std::vector<double> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[size_t(i)] = t.item(i);
  return v;
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double silu(double x) { return x * sigmoid(x); }
// d silu / dx = s (1 + x (1 - s)), s = sigmoid(x).
inline double silu_grad(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}
// torch.nn.functional.softplus with beta 1 and threshold 20 (mamba_ssm's dt_softplus): the
// identity above the threshold, where log1p(exp(x)) equals x to fp32 precision.
inline double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
inline double softplus_grad(double x) { return x > 20.0 ? 1.0 : sigmoid(x); }

}  // namespace megaton::ops::ssm_detail
