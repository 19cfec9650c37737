// EnergyMonitor: NVML's total energy counter through dlopen.
#include "train/energy_monitor.h"

#include <dlfcn.h>

#include <fmt/format.h>

namespace megaton {

namespace {
// NVML's C API (nvml.h): every call returns nvmlReturn_t, 0 = NVML_SUCCESS. The versioned
// names are the ones the driver exports for these signatures.
using InitFn = int (*)();
using ByPciFn = int (*)(const char*, void**);
using EnergyFn = int (*)(void*, unsigned long long*);
using ErrorStringFn = const char* (*)(int);
}  // namespace

EnergyMonitor::~EnergyMonitor() {
  if (shutdown_) shutdown_();
  if (library_) dlclose(library_);
}

std::string EnergyMonitor::open(const std::string& pci_bus_id) {
  library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!library_) return "the NVIDIA driver's libnvidia-ml.so.1 cannot be loaded";
  const auto init = reinterpret_cast<InitFn>(dlsym(library_, "nvmlInit_v2"));
  const auto by_pci = reinterpret_cast<ByPciFn>(dlsym(library_, "nvmlDeviceGetHandleByPciBusId_v2"));
  const auto energy =
      reinterpret_cast<EnergyFn>(dlsym(library_, "nvmlDeviceGetTotalEnergyConsumption"));
  const auto shutdown = reinterpret_cast<int (*)()>(dlsym(library_, "nvmlShutdown"));
  const auto error_string = reinterpret_cast<ErrorStringFn>(dlsym(library_, "nvmlErrorString"));
  const auto message = [&](const char* call, int rc) {
    return fmt::format("{} failed: {}", call, error_string ? error_string(rc) : std::to_string(rc));
  };
  if (!init || !by_pci || !energy || !shutdown) return "libnvidia-ml.so.1 lacks the NVML calls needed";
  if (int rc = init(); rc != 0) return message("nvmlInit", rc);
  shutdown_ = shutdown;
  void* device = nullptr;
  if (int rc = by_pci(pci_bus_id.c_str(), &device); rc != 0)
    return message("nvmlDeviceGetHandleByPciBusId", rc);
  unsigned long long mj = 0;
  if (int rc = energy(device, &mj); rc != 0)
    return message("nvmlDeviceGetTotalEnergyConsumption", rc);
  get_energy_ = energy;
  device_ = device;
  last_ = mj;
  return "";
}

bool EnergyMonitor::read(uint64_t& millijoules) const {
  unsigned long long mj = 0;
  if (!device_ || get_energy_(device_, &mj) != 0) return false;
  millijoules = mj;
  return true;
}

int64_t EnergyMonitor::lap_millijoules() {
  uint64_t now = last_;
  if (!read(now)) return 0;
  const int64_t lap = int64_t(now - last_);
  last_ = now;
  return lap;
}

}  // namespace megaton
