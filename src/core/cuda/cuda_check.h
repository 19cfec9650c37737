// Checked CUDA runtime calls and the process's compute stream (CUDA builds only).
#pragma once
#include <cuda_runtime.h>

#include "core/error.h"

// MEGATON_CUDA_CHECK(cudaMemcpyAsync(...)): throws InternalError naming the call, the file
// and line, and CUDA's error string.
#define MEGATON_CUDA_CHECK(call)                                                          \
  do {                                                                                    \
    cudaError_t megaton_err_ = (call);                                                    \
    if (megaton_err_ != cudaSuccess) {                                                    \
      throw ::megaton::InternalError(::fmt::format("{}:{}: {} failed: {} ({})", __FILE__, \
                                                   __LINE__, #call,                       \
                                                   cudaGetErrorString(megaton_err_),      \
                                                   int(megaton_err_)));                   \
    }                                                                                     \
  } while (0)

// After a kernel launch: checks the launch itself (bad configuration), not its completion.
#define MEGATON_CUDA_CHECK_LAUNCH() MEGATON_CUDA_CHECK(cudaGetLastError())

namespace megaton::cuda {

// The stream every Megaton kernel, copy and library call runs on (created on first use,
// non-blocking with respect to the legacy default stream). One stream keeps the order of
// a training step obvious; overlap comes later from explicit side streams.
cudaStream_t stream();

// Blocks until everything queued on stream() has finished.
void synchronize();

// Whether a CUDA device is usable by this process.
bool device_available();

// Streaming multiprocessors of the current device (read once; grid sizes of persistent
// and grid-stride kernels).
int multiprocessor_count();

}  // namespace megaton::cuda
