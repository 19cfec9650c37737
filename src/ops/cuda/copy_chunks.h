// Many independent byte copies in one kernel launch (moe_sort_chunks; the token exchange's
// reads from other GPUs' memory in dist/cuda/peer_memory.h). CUDA builds only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <span>

namespace megaton::ops::cuda {

// One copy of `bytes` bytes from src to dst (device pointers, this GPU's memory or a peer
// GPU's mapped into this process).
struct ByteCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t bytes = 0;
};

// Enqueues the copies on `stream`: one launch per 128 copies (their pointers travel as a
// kernel parameter), about `blocks_per_sm` blocks of 512 threads per SM over a launch,
// 16-byte words when every copy's pointers and size allow, else bytes. Empty copies are
// skipped. The destinations must not overlap each other or any source. Throws
// InternalError on a failed launch.
void copy_chunks(std::span<const ByteCopy> copies, cudaStream_t stream, int blocks_per_sm = 4);

}  // namespace megaton::ops::cuda
