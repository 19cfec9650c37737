// The host-synchronization counter (core/cuda/host_sync.h) that the op profile reports:
// a copy to host memory waits for the stream (one count), device copies and memsets do not,
// nor do small host-to-device copies (kernel parameters, cuda::upload) and Readback's
// event waits.
#include <gtest/gtest.h>

#include <cstring>
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

TEST(HostSync, SmallUploadsDoNotWaitLargeOnesDo) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  // Just at the limit and one float past it, with distinct values in every 4 KB.
  const int64_t small = int64_t(cuda::kUploadMaxBytes / sizeof(float)), large = small + 1;
  std::vector<float> values(static_cast<size_t>(large));
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i % 100003) * 0.5f;
  const Tensor host_small = Tensor::from({small}, std::vector<float>(values.begin(), values.end() - 1));
  const Tensor host_large = Tensor::from({large}, values);
  uint64_t before = cuda::host_synchronizations();
  Tensor device_small = host_small.to(Device::CUDA);
  EXPECT_EQ(cuda::host_synchronizations(), before);
  Tensor device_large = host_large.to(Device::CUDA);
  EXPECT_EQ(cuda::host_synchronizations(), before + 1);
  // The uploaded bytes are the host's (read back: two more waits).
  const Tensor back_small = device_small.to(Device::CPU), back_large = device_large.to(Device::CPU);
  EXPECT_EQ(std::memcmp(back_small.raw(), host_small.raw(), host_small.nbytes()), 0);
  EXPECT_EQ(std::memcmp(back_large.raw(), host_large.raw(), host_large.nbytes()), 0);
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
