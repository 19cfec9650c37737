// The host-synchronization counter (core/cuda/host_sync.h) that the op profile reports:
// a copy to host memory waits for the stream (one count), device copies and memsets do not,
// nor do host-to-device copies (cuda::upload), fills and Readback's event waits.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#ifdef MEGATON_WITH_CUDA
#include "core/cuda/cuda_check.h"
#include "core/cuda/host_sync.h"
#include "core/readback.h"
#include "core/tensor.h"

namespace megaton {
namespace {

TEST(HostSync, CountsHostWaitsOnly) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  Tensor y = Tensor::zeros({1024}).to(Device::CUDA);  // this copy waits: before the count
  const uint64_t before = cuda::host_synchronizations();
  Tensor z = y.clone();  // device to device
  z.zero();  // a memset on the stream
  EXPECT_EQ(cuda::host_synchronizations(), before);
  const Tensor host = z.to(Device::CPU);
  EXPECT_EQ(cuda::host_synchronizations(), before + 1);
  EXPECT_EQ(host.numel(), 1024);
}

TEST(HostSync, UploadsDoNotWait) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  // At the kernel-parameter limit, one float past it (pinned staging) and 4 MB; then the
  // large one again with other values while the first copy may still be queued (the
  // staging block is not reused before its copy is done).
  const int64_t small = int64_t(cuda::kUploadMaxBytes / sizeof(float));
  for (int64_t n : {small, small + 1, int64_t(1) << 20}) {
    SCOPED_TRACE("elements " + std::to_string(n));
    std::vector<float> values(static_cast<size_t>(n));
    for (size_t i = 0; i < values.size(); ++i) values[i] = float(i % 100003) * 0.5f;
    Tensor host = Tensor::from({n}, values);
    const uint64_t before = cuda::host_synchronizations();
    Tensor first = host.to(Device::CUDA);
    for (float& v : values) v = -v;
    std::memcpy(host.raw(), values.data(), host.nbytes());  // reused at once
    Tensor second = host.to(Device::CUDA);
    Tensor filled = Tensor::empty({n}, DType::F32, Device::CUDA);
    filled.fill(2.5f);
    EXPECT_EQ(cuda::host_synchronizations(), before);
    const Tensor back_first = first.to(Device::CPU), back_second = second.to(Device::CPU);
    const Tensor back_filled = filled.to(Device::CPU);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(back_first.f32()[i], -values[size_t(i)]) << i;
      ASSERT_EQ(back_second.f32()[i], values[size_t(i)]) << i;
      ASSERT_EQ(back_filled.f32()[i], 2.5f) << i;
    }
  }
}

TEST(HostSync, ReadbackWaitsForItsCopiesOnly) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  Tensor a = Tensor::from({3}, {1.5f, -2.0f, 4.25f}).to(Device::CUDA);
  Tensor b = Tensor::zeros({2}, DType::I64, Device::CUDA);
  const uint64_t before = cuda::host_synchronizations();
  Readback read({a, b});
  a.zero();  // queued after the copy: the read sees the values before it
  EXPECT_EQ(read.tensor(0).f32()[0], 1.5f);
  EXPECT_EQ(read.tensor(0).f32()[2], 4.25f);
  EXPECT_EQ(read.tensor(1).i64()[1], 0);
  EXPECT_EQ(read.tensor(1).device(), Device::CPU);
  EXPECT_EQ(cuda::host_synchronizations(), before);
}

}  // namespace
}  // namespace megaton

#else  // !MEGATON_WITH_CUDA

TEST(HostSync, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
