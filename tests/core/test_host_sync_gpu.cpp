// The host-synchronization counter (core/cuda/host_sync.h) that the op profile reports:
// a copy to host memory waits for the stream (one count), device copies and memsets do not.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include "core/cuda/cuda_check.h"
#include "core/cuda/host_sync.h"
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

}  // namespace
}  // namespace megaton

#else  // !MEGATON_WITH_CUDA

TEST(HostSync, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
