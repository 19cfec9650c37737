// Caching device allocator: cudaMalloc only when no cached block fits (CUDA builds only).
#pragma once
#include <cstddef>
#include <cstdint>

namespace megaton::cuda {

// A block of at least `bytes` bytes of device memory, 256-byte aligned. Sizes are rounded
// to size classes (512-byte multiples up to 1 MiB, then 8 classes per power of two) and
// freed blocks are kept per class, so the steady-state training step, which repeats the
// same shapes, never calls cudaMalloc. On cudaMalloc failure the cache is released to the
// driver and the allocation retried once; a second out-of-memory failure throws
// megaton::OutOfMemoryError naming the bytes requested, the bytes this process holds and
// the device's free bytes (cudaMemGetInfo); any other CUDA error throws InternalError.
void* device_allocate(size_t bytes);
// Returns a block from device_allocate (with the same `bytes`) to the cache. Blocks are
// used in stream order on the single compute stream, so reuse needs no event. Never
// throws (it runs in ~Storage): a block the cache cannot take is freed to the driver.
void device_free(void* ptr, size_t bytes) noexcept;

struct DeviceMemoryStats {
  int64_t allocated_bytes = 0;       // held by live tensors (rounded sizes)
  int64_t peak_allocated_bytes = 0;  // max of allocated_bytes since start or reset
  int64_t reserved_bytes = 0;        // obtained from cudaMalloc (live + cached)
  int64_t num_cuda_mallocs = 0;      // cudaMalloc calls so far
};
DeviceMemoryStats device_memory_stats();
// Counts device memory obtained outside this allocator (+bytes when allocated, -bytes when
// freed: the peer-memory buffers of dist/cuda/peer_memory.h) in allocated, peak and
// reserved bytes, so the logged peak memory includes it.
void count_external_device_memory(int64_t delta_bytes);
void reset_peak_device_memory();
// Frees every cached (unused) block back to the driver.
void empty_device_cache();

}  // namespace megaton::cuda
