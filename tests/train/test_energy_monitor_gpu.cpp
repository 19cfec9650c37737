// EnergyMonitor on a GPU: NVML's counter found by the CUDA device's PCI bus id, and a busy
// second of GEMMs reads as a plausible energy and power.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <chrono>

#include "common/gpu_testing.h"
#include "ops/ops.h"
#include "train/energy_monitor.h"

namespace megaton {
namespace {

TEST(EnergyMonitorGpu, BusyGemmsUseEnergy) {
  MEGATON_SKIP_WITHOUT_GPU();
  char bus_id[64] = {};
  MEGATON_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), 0));
  EnergyMonitor monitor;
  const std::string why = monitor.open(bus_id);
  ASSERT_EQ(why, "") << "bus id " << bus_id;
  ASSERT_TRUE(monitor.is_open());
  EXPECT_EQ(EnergyMonitor().lap_millijoules(), 0) << "a closed monitor reads 0";

  Tensor a32 = Tensor::empty({8192, 8192}, DType::F32, Device::CUDA);
  ops::fill_uniform(a32, -1.0f, 1.0f, 1, 0);
  const Tensor a = a32.to(DType::BF16);
  Tensor c = Tensor::empty({8192, 8192}, DType::BF16, Device::CUDA);
  monitor.lap_millijoules();  // start the lap here
  const auto start = std::chrono::steady_clock::now();
  double seconds = 0;
  while (seconds < 1.5) {  // NVML's counter updates every ~100 ms or so
    for (int i = 0; i < 20; ++i) ops::gemm(a, false, a, true, c);
    MEGATON_CUDA_CHECK(cudaDeviceSynchronize());
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const double joules = double(monitor.lap_millijoules()) / 1000.0;
  const double watts = joules / seconds;
  std::printf("%.1f J over %.2f s: %.0f W\n", joules, seconds, watts);
  // An H100/H200 running bf16 GEMMs draws a few hundred watts (TDP 700 W).
  EXPECT_GT(watts, 50.0);
  EXPECT_LT(watts, 1200.0);
}

TEST(EnergyMonitorGpu, UnknownBusIdSaysWhy) {
  MEGATON_SKIP_WITHOUT_GPU();
  EnergyMonitor monitor;
  const std::string why = monitor.open("0000:FF:1F.7");
  EXPECT_NE(why, "");
  EXPECT_FALSE(monitor.is_open());
  EXPECT_EQ(monitor.lap_millijoules(), 0);
}

}  // namespace
}  // namespace megaton
#endif  // MEGATON_WITH_CUDA
