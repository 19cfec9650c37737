// EnergyMonitor: the GPU's energy counter through NVML (--log-energy), as Megatron's
// megatron/core/energy_monitor.py reads it.
#pragma once
#include <cstdint>
#include <string>

namespace megaton {

// Reads nvmlDeviceGetTotalEnergyConsumption (millijoules since the driver loaded; Volta
// and newer) of one GPU. NVML is the driver's libnvidia-ml.so.1, opened with dlopen at
// run time, so the binary runs (and --log-energy is refused with a reason) where the
// driver has no NVML. Not thread-safe.
class EnergyMonitor {
 public:
  EnergyMonitor() = default;
  ~EnergyMonitor();
  EnergyMonitor(const EnergyMonitor&) = delete;
  EnergyMonitor& operator=(const EnergyMonitor&) = delete;

  // Opens NVML and the GPU with PCI bus id `pci_bus_id` ("0000:1B:00.0", as
  // cudaDeviceGetPCIBusId writes it: NVML's indices need not be CUDA's). Returns "" when the
  // counter is readable, else why not (no libnvidia-ml.so.1, an NVML error, a GPU without
  // the counter); the monitor then stays closed.
  std::string open(const std::string& pci_bus_id);
  bool is_open() const { return device_ != nullptr; }

  // Millijoules the GPU used since the previous lap() (or open()). 0 when closed. An NVML
  // read error repeats the last reading (0 for this lap), as Megatron's monitor does.
  int64_t lap_millijoules();

 private:
  bool read(uint64_t& millijoules) const;
  void* library_ = nullptr;  // dlopen handle
  void* device_ = nullptr;   // nvmlDevice_t
  uint64_t last_ = 0;
  int (*get_energy_)(void*, unsigned long long*) = nullptr;
  int (*shutdown_)() = nullptr;
};

}  // namespace megaton
