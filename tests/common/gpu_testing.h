// GPU test helpers: skip without a device, move tensors between host and GPU, poison,
// and check outputs. Include only under MEGATON_WITH_CUDA.
#pragma once
#include <cmath>
#include <string>

#include "common/testing.h"
#include "core/cuda/cuda_check.h"

#define MEGATON_SKIP_WITHOUT_GPU()                                      \
  do {                                                                  \
    if (!::megaton::cuda::device_available()) GTEST_SKIP() << "no GPU"; \
  } while (0)

namespace megaton::testing {

// The same values, rounded to bf16 and held in fp32: the CPU reference then sees exactly
// the inputs the GPU sees.
inline Tensor round_to_bf16(const Tensor& x) { return x.to(DType::BF16).to(DType::F32); }
inline Tensor to_device(const Tensor& x, DType dtype) { return x.to(dtype).to(Device::CUDA); }
inline Tensor poisoned_device(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::CUDA);
  poison(t);
  return t;
}
// fp32 host copy (Tensor::item on a device tensor copies the whole tensor per element).
inline Tensor to_host_f32(const Tensor& t) { return t.to(Device::CPU).to(DType::F32); }

// Whether every element was written (outputs start as NaN) and is finite.
inline ::testing::AssertionResult all_finite(const Tensor& host, const char* name) {
  const float* p = host.f32();
  for (int64_t i = 0; i < host.numel(); ++i)
    if (!std::isfinite(p[i]))
      return ::testing::AssertionFailure() << name << " element " << i << " is " << p[i];
  return ::testing::AssertionSuccess();
}

// Exact equality of two fp32 host tensors.
inline ::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  const float *pa = a.f32(), *pb = b.f32();
  for (int64_t i = 0; i < a.numel(); ++i)
    if (!(pa[i] == pb[i]))
      return ::testing::AssertionFailure() << "element " << i << ": " << pa[i] << " vs " << pb[i];
  return ::testing::AssertionSuccess();
}

}  // namespace megaton::testing
