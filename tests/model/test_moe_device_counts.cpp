// MoELayer with device-resident expert counts equals the host-count path bit for bit, on
// the CPU (moe_device_counts_testing.h).
#include "moe_device_counts_testing.h"

namespace megaton {
namespace {

class MoEDeviceCounts : public ::testing::TestWithParam<testing::DeviceCountsCase> {};

TEST_P(MoEDeviceCounts, EqualHostCounts) {
  testing::check_device_counts_equal_host_counts(GetParam(), Device::CPU, false);
}

INSTANTIATE_TEST_SUITE_P(Dispatchers, MoEDeviceCounts,
                         ::testing::ValuesIn(testing::device_counts_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace megaton
