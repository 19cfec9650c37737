// A count of host synchronisations through cuda::synchronize(): the waits of Tensor copies
// to or from host memory and of the ops that return a host scalar, which are what a
// training step makes. Not counted: the allocator's own waits when it releases its cache
// (out of memory) or frees a block, the peer-memory setup, and the NCCL communicator's
// waits (dist/cuda/comm_nccl.cpp). The op profile reports it per iteration
// (ops/profiler.cpp).
#pragma once
#include <cstdint>

namespace megaton::cuda {

// Calls of cuda::synchronize() since the process started (CUDA builds only).
uint64_t host_synchronizations();

}  // namespace megaton::cuda
