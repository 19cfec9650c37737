// Test helpers: seeded random tensors, tolerance checks and central finite differences.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "core/tensor.h"
#include "ops/ops.h"

namespace megaton::testing {

// Seed for a test's random inputs; printed by SCOPED_TRACE on failure.
inline uint64_t test_seed() {
  const char* s = std::getenv("MEGATON_TEST_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 1234;
}

inline std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

// An optimizer step's control tensor (ops::adamw_step_control's layout) with the learning
// rate, gradient scale and skip the rule ops read; the other entries hold NaN, so an op that
// reads one shows it. On `device`.
inline Tensor step_control(float lr, float grad_scale, bool skip, Device device = Device::CPU) {
  Tensor c = Tensor::empty({ops::kAdamControlSize});
  c.fill(NAN);
  c.f32()[ops::kAdamLr] = lr;
  c.f32()[ops::kAdamGradScale] = grad_scale;
  c.f32()[ops::kAdamSkip] = skip ? 1.0f : 0.0f;
  return c.to(device);
}

// Byte equality of two host tensors of one dtype and numel, naming the first difference.
inline ::testing::AssertionResult bytes_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.numel() != b.numel())
    return ::testing::AssertionFailure() << "dtype or numel differ";
  const size_t elem = dtype_size(a.dtype());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(static_cast<const char*>(a.raw()) + i * elem,
                    static_cast<const char*>(b.raw()) + i * elem, elem) != 0)
      return ::testing::AssertionFailure()
             << "element " << i << ": " << a.item(i) << " vs " << b.item(i);
  return ::testing::AssertionSuccess();
}

// fp32 tensor with N(0, std) entries from std::mt19937_64(seed).
inline Tensor randn(const Shape& shape, uint64_t seed, float std = 1.0f) {
  Tensor t = Tensor::empty(shape);
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, std);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(gen);
  return t;
}

// int32 tensor with uniform entries in [0, high).
inline Tensor randint(const Shape& shape, int32_t high, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::I32);
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, high - 1);
  for (int64_t i = 0; i < t.numel(); ++i) t.i32()[i] = dist(gen);
  return t;
}

// Fill with NaN so a test can check that a kernel wrote every output element.
inline void poison(Tensor& t) { t.fill(NAN); }

// |a - b| <= atol + rtol * |b| elementwise (b is the reference). Reports the first
// failing index.
inline ::testing::AssertionResult allclose(const Tensor& a, const Tensor& b, double atol,
                                           double rtol) {
  if (a.numel() != b.numel())
    return ::testing::AssertionFailure() << "numel " << a.numel() << " vs " << b.numel();
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = a.item(i), y = b.item(i);
    if (!(std::fabs(x - y) <= atol + rtol * std::fabs(y)))
      return ::testing::AssertionFailure() << "element " << i << ": " << x << " vs reference " << y
                                           << " (atol " << atol << ", rtol " << rtol << ")";
  }
  return ::testing::AssertionSuccess();
}

// ||a - b|| / ||b||.
inline double rel_error(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double d = double(a.item(i)) - b.item(i);
    num += d * d;
    den += double(b.item(i)) * b.item(i);
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// Central finite differences of the scalar loss() with respect to every element of x
// (x is perturbed in place and restored). Returns d loss / d x, same shape as x.
// loss() is evaluated in fp32 ops but summed in fp64 by the caller.
inline Tensor finite_difference(Tensor& x, const std::function<double()>& loss, float eps = 1e-2f) {
  Tensor grad = Tensor::empty(x.shape());
  for (int64_t i = 0; i < x.numel(); ++i) {
    float orig = x.f32()[i];
    x.f32()[i] = orig + eps;
    double lp = loss();
    x.f32()[i] = orig - eps;
    double lm = loss();
    x.f32()[i] = orig;
    grad.f32()[i] = float((lp - lm) / (2.0 * eps));
  }
  return grad;
}

// Sum of w * y over all elements in fp64: a random linear functional that turns an op's
// output into a scalar loss whose gradient with respect to y is w.
inline double dot(const Tensor& w, const Tensor& y) {
  double s = 0;
  for (int64_t i = 0; i < y.numel(); ++i) s += double(w.f32()[i]) * y.f32()[i];
  return s;
}

}  // namespace megaton::testing
