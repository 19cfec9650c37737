// Caching device allocator and the compute stream.
#include "core/cuda/allocator.h"
#include "core/cuda/host_sync.h"
#include "core/cuda/graph.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/tensor.h"

namespace megaton::cuda {

cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t created;
    MEGATON_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return s;
}

namespace {
std::atomic<uint64_t> g_host_synchronizations{0};
}  // namespace

void synchronize() {
  if (capturing())
    throw Error("the step waits for the GPU (a host synchronization), which a CUDA graph "
                "capture cannot hold");
  g_host_synchronizations.fetch_add(1, std::memory_order_relaxed);
  MEGATON_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

uint64_t host_synchronizations() {
  return g_host_synchronizations.load(std::memory_order_relaxed);
}

bool device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

int multiprocessor_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    MEGATON_CUDA_CHECK(cudaGetDevice(&device));
    MEGATON_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  }();
  return count;
}

namespace {
size_t size_class(size_t n) {
  if (n <= (size_t(1) << 20)) return (n + 511) / 512 * 512;
  size_t top = size_t(1) << (63 - __builtin_clzll(n - 1));
  size_t step = top / 8;
  return (n + step - 1) / step * step;
}

}  // namespace

struct GraphPool {
  std::unordered_map<void*, size_t> owned;  // block -> size class
  std::unordered_map<size_t, std::vector<void*>> free_blocks;
  std::vector<std::pair<void*, size_t>> held_back;  // the cache's, freed during the capture
  int64_t bytes = 0;
};

namespace {
struct Cache {
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<void*>> free_blocks;
  DeviceMemoryStats stats;
  GraphPool* active = nullptr;      // the pool being captured into
  std::vector<GraphPool*> pools;    // every live pool (few: one per graph)

  // The pool owning `ptr`, or null.
  GraphPool* owner(void* ptr) {
    for (GraphPool* pool : pools)
      if (pool->owned.count(ptr)) return pool;
    return nullptr;
  }

  void release_cached_locked() {
    MEGATON_CUDA_CHECK(cudaStreamSynchronize(stream()));
    for (auto& [size, blocks] : free_blocks) {
      for (void* p : blocks) {
        MEGATON_CUDA_CHECK(cudaFree(p));
        stats.reserved_bytes -= int64_t(size);
      }
      blocks.clear();
    }
  }
};
Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: tensors may outlive static teardown
  return *c;
}
}  // namespace

void* device_allocate(size_t bytes) {
  size_t size = size_class(bytes ? bytes : 1);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  void* p = nullptr;
  GraphPool* pool = c.active;
  if (pool) {  // during a capture: the pool's own unused block first
    auto own = pool->free_blocks.find(size);
    if (own != pool->free_blocks.end() && !own->second.empty()) {
      p = own->second.back();
      own->second.pop_back();
      return p;  // counted as allocated since it joined the pool
    }
  }
  auto it = c.free_blocks.find(size);
  if (it != c.free_blocks.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
  } else {
    if (cudaMalloc(&p, size) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the out-of-memory error
      // Releasing the cache waits for the stream, which a capture cannot.
      if (!pool) c.release_cached_locked();
      cudaError_t err = pool ? cudaErrorMemoryAllocation : cudaMalloc(&p, size);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        size_t free_bytes = 0, total_bytes = 0;
        const bool known = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
        if (!known) (void)cudaGetLastError();
        throw OutOfMemoryError(fmt::format(
            "out of device memory: a tensor of {} was requested; this process holds {} in "
            "tensors ({} reserved) and {} of the device's {} is free",
            human_bytes_exact(double(size)), human_bytes_exact(double(c.stats.allocated_bytes)),
            human_bytes(double(c.stats.reserved_bytes)),
            known ? human_bytes_exact(double(free_bytes)) : std::string("an unknown amount"),
            known ? human_bytes(double(total_bytes)) : std::string("?")));
      }
      if (err != cudaSuccess)
        throw InternalError(fmt::format(
            "cudaMalloc of {} bytes failed: {} (allocated {} bytes, reserved {} bytes)", size,
            cudaGetErrorString(err), c.stats.allocated_bytes, c.stats.reserved_bytes));
    }
    c.stats.reserved_bytes += int64_t(size);
    ++c.stats.num_cuda_mallocs;
  }
  c.stats.allocated_bytes += int64_t(size);
  if (c.stats.allocated_bytes > c.stats.peak_allocated_bytes)
    c.stats.peak_allocated_bytes = c.stats.allocated_bytes;
  if (pool) {
    pool->owned.emplace(p, size);
    pool->bytes += int64_t(size);
  }
  return p;
}

void device_free(void* ptr, size_t bytes) noexcept {
  if (!ptr) return;
  size_t size = size_class(bytes ? bytes : 1);
  Cache& c = cache();
  try {
    std::lock_guard<std::mutex> lock(c.mutex);
    try {
      if (!c.pools.empty()) {
        if (GraphPool* pool = c.owner(ptr)) {  // stays allocated: the graph writes it
          pool->free_blocks[size].push_back(ptr);
          return;
        }
        if (c.active) {  // the graph may read it: not reused until the pool is released
          c.stats.allocated_bytes -= int64_t(size);
          c.active->held_back.emplace_back(ptr, size);
          return;
        }
      }
      c.stats.allocated_bytes -= int64_t(size);
      c.free_blocks[size].push_back(ptr);
      return;
    } catch (...) {
      c.stats.allocated_bytes -= int64_t(size);
    }
    // The cache's bookkeeping could not grow (std::bad_alloc): the block goes back to the
    // driver instead, after the work queued on it.
    c.stats.reserved_bytes -= int64_t(size);
  } catch (...) {
    // The mutex could not be taken: the statistics stay as they are.
  }
  if (cudaStreamSynchronize(stream()) != cudaSuccess || cudaFree(ptr) != cudaSuccess)
    (void)cudaGetLastError();  // a destructor cannot report it; the block is lost at worst
}

void count_external_device_memory(int64_t delta_bytes) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.stats.allocated_bytes += delta_bytes;
  c.stats.reserved_bytes += delta_bytes;
  if (c.stats.allocated_bytes > c.stats.peak_allocated_bytes)
    c.stats.peak_allocated_bytes = c.stats.allocated_bytes;
}

DeviceMemoryStats device_memory_stats() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  return cache().stats;
}

void reset_peak_device_memory() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  cache().stats.peak_allocated_bytes = cache().stats.allocated_bytes;
}

void empty_device_cache() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  MEGATON_CHECK(!cache().active, "empty_device_cache during a CUDA graph capture");
  cache().release_cached_locked();
}

GraphPool* begin_graph_pool() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  MEGATON_CHECK(!c.active, "begin_graph_pool: a graph pool is active already");
  auto pool = std::make_unique<GraphPool>();
  c.pools.push_back(pool.get());
  c.active = pool.release();
  return c.active;
}

void end_graph_pool() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.active = nullptr;
}

void release_graph_pool(GraphPool* pool) noexcept {
  if (!pool) return;
  Cache& c = cache();
  try {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.active == pool) c.active = nullptr;
    std::erase(c.pools, pool);
    // Blocks still held by live tensors stay counted until those tensors free them (they
    // are then ordinary blocks of the cache); unused ones go to the cache now.
    for (auto& [size, blocks] : pool->free_blocks)
      for (void* p : blocks) {
        c.stats.allocated_bytes -= int64_t(size);
        c.free_blocks[size].push_back(p);
      }
    for (auto& [p, size] : pool->held_back) c.free_blocks[size].push_back(p);
  } catch (...) {
    // std::bad_alloc growing the cache's lists: those blocks stay reserved and unused.
  }
  delete pool;
}

int64_t graph_pool_bytes(const GraphPool* pool) {
  std::lock_guard<std::mutex> lock(cache().mutex);
  return pool ? pool->bytes : 0;
}

}  // namespace megaton::cuda
