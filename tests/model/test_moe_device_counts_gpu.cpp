// MoELayer with device-resident expert counts (the grouped GEMMs' device-count CUTLASS
// path) equals the host-count path bit for bit on the GPU, in bf16
// (moe_device_counts_testing.h).
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"
#include "moe_device_counts_testing.h"

namespace megaton {
namespace {

class MoEDeviceCountsGpu : public ::testing::TestWithParam<testing::DeviceCountsCase> {};

TEST_P(MoEDeviceCountsGpu, EqualHostCounts) {
  MEGATON_SKIP_WITHOUT_GPU();
  testing::check_device_counts_equal_host_counts(GetParam(), Device::CUDA, true);
}

INSTANTIATE_TEST_SUITE_P(Dispatchers, MoEDeviceCountsGpu,
                         ::testing::ValuesIn(testing::device_counts_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace megaton

#else  // !MEGATON_WITH_CUDA

TEST(MoEDeviceCountsGpu, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
