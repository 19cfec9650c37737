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

// ---- graph memory pools (core/cuda/graph.h) ----
// A CUDA graph replays the device addresses it was captured with, so the blocks it uses
// must stay its own for as long as it lives. While a pool is active (its graph is being
// captured), every allocation comes from it: a block it owns and no longer uses, else a
// cached block taken over from the cache, else cudaMalloc. A block the pool owns is never
// handed out again except by the same pool during a capture, and stays counted as
// allocated (the graph writes it on every replay) until the pool is released. A block of
// the cache freed during a capture (a tensor from before the capture dropped inside it)
// is held back until the pool is released, since the graph may read it. Pools nest never:
// one active at a time. No cudaFree during a capture: out of memory there throws at once.
struct GraphPool;
// Starts a new pool and makes it active. InternalError if one is active already.
GraphPool* begin_graph_pool();
// Deactivates the active pool (it keeps its blocks).
void end_graph_pool();
// Returns every block of `pool` to the cache and forgets it; the graph that used it must
// be destroyed and its replays complete in stream order. Never throws.
void release_graph_pool(GraphPool* pool) noexcept;
// Bytes owned by `pool`.
int64_t graph_pool_bytes(const GraphPool* pool);

}  // namespace megaton::cuda
