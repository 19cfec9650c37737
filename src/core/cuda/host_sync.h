// A count of host synchronisations: every wait of the host for megaton::cuda::stream()
// (cuda::synchronize(), which Tensor copies to or from host memory and the ops that return
// a host scalar go through). The op profile reports it per iteration (ops/profiler.h).
#pragma once
#include <cstdint>

namespace megaton::cuda {

// Calls of cuda::synchronize() since the process started (CUDA builds only).
uint64_t host_synchronizations();

}  // namespace megaton::cuda
