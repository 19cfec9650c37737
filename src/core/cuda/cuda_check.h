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

// Copies `bytes` of host memory to device memory in stream order without waiting for the
// stream, so the host buffer may be reused or freed as soon as the call returns (a
// pageable cudaMemcpyAsync may instead wait for the stream to drain). Up to
// kUploadMaxBytes the bytes travel as kernel parameters (kUploadChunk per launch); larger
// copies go through a pinned staging block, reused once its copy has completed (an
// event), with an asynchronous cudaMemcpyAsync. Every host-to-device Tensor copy uses it.
constexpr size_t kUploadChunk = 16384;
constexpr size_t kUploadMaxBytes = 64 * 1024;
void upload(void* device_dst, const void* host_src, size_t bytes);
// Writes `count` copies of the element at `value` (element_bytes: 1, 2, 4 or 8; host
// memory) to device memory, in stream order (Tensor::fill on the GPU).
void fill(void* device_dst, const void* value, size_t element_bytes, int64_t count);

// Whether a CUDA device is usable by this process.
bool device_available();

// Streaming multiprocessors of the current device (read once; grid sizes of persistent
// and grid-stride kernels).
int multiprocessor_count();

}  // namespace megaton::cuda
