// cuda::upload and cuda::fill: host-to-device copies and fills in stream order that never
// wait for the stream (cuda_check.h).
#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/cuda/graph.h"

namespace megaton::cuda {

namespace {
struct UploadChunk {
  unsigned char bytes[kUploadChunk];
};
// Kernel parameters above 4 KB need CUDA 12.1 and a Volta or later GPU (Megaton: sm_90a).
static_assert(sizeof(UploadChunk) <= 32764, "kernel parameters are limited to 32,764 bytes");

__global__ void upload_kernel(const UploadChunk chunk, unsigned char* dst, size_t bytes) {
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = chunk.bytes[i];
}

// Pinned staging blocks for the larger copies: a block is reused once the copy that read
// it has completed (its event), so the host never waits for the stream; in a training
// step the same few sizes recur and the pool stops growing after the first step.
struct StagingBlock {
  void* data = nullptr;
  size_t bytes = 0;
  cudaEvent_t done = nullptr;  // recorded after the last copy out of the block
};
class StagingPool {
 public:
  StagingBlock take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].bytes < bytes) continue;
        const cudaError_t state = cudaEventQuery(free_[i].done);
        if (state == cudaErrorNotReady) continue;
        MEGATON_CUDA_CHECK(state);
        StagingBlock block = free_[i];
        free_.erase(free_.begin() + std::ptrdiff_t(i));
        return block;
      }
    }
    StagingBlock block;
    block.bytes = std::max<size_t>(bytes, 1 << 20);
    MEGATON_CUDA_CHECK(cudaMallocHost(&block.data, block.bytes));
    MEGATON_CUDA_CHECK(cudaEventCreateWithFlags(&block.done, cudaEventDisableTiming));
    return block;
  }
  void give(const StagingBlock& block) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(block);
  }

 private:
  std::mutex mutex_;
  std::vector<StagingBlock> free_;
};
StagingPool& staging_pool() {
  static StagingPool* pool = new StagingPool();  // never destroyed: copies may be in flight
  return *pool;
}

template <typename T>
__global__ void fill_kernel(T* dst, T value, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = value;
}
}  // namespace

void upload(void* device_dst, const void* host_src, size_t bytes) {
  auto* dst = static_cast<unsigned char*>(device_dst);
  const auto* src = static_cast<const unsigned char*>(host_src);
  if (bytes > kUploadMaxBytes && capturing()) {
    // The graph reads the bytes at every replay: a pinned copy of its own.
    void* pinned = nullptr;
    MEGATON_CUDA_CHECK(cudaMallocHost(&pinned, bytes));
    keep_for_capturing_graph(pinned);
    std::memcpy(pinned, src, bytes);
    MEGATON_CUDA_CHECK(cudaMemcpyAsync(dst, pinned, bytes, cudaMemcpyHostToDevice, stream()));
    return;
  }
  if (bytes > kUploadMaxBytes) {
    StagingBlock block = staging_pool().take(bytes);
    std::memcpy(block.data, src, bytes);
    MEGATON_CUDA_CHECK(cudaMemcpyAsync(dst, block.data, bytes, cudaMemcpyHostToDevice, stream()));
    MEGATON_CUDA_CHECK(cudaEventRecord(block.done, stream()));
    staging_pool().give(block);
    return;
  }
  for (size_t at = 0; at < bytes; at += kUploadChunk) {
    const size_t n = std::min(kUploadChunk, bytes - at);
    UploadChunk chunk;
    std::memcpy(chunk.bytes, src + at, n);
    upload_kernel<<<1, 512, 0, stream()>>>(chunk, dst + at, n);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}

void fill(void* device_dst, const void* value, size_t element_bytes, int64_t count) {
  if (count <= 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((count + 255) / 256, 4096));
  switch (element_bytes) {
    case 1:
      fill_kernel<<<blocks, 256, 0, stream()>>>(static_cast<uint8_t*>(device_dst),
                                                *static_cast<const uint8_t*>(value), count);
      break;
    case 2:
      fill_kernel<<<blocks, 256, 0, stream()>>>(static_cast<uint16_t*>(device_dst),
                                                *static_cast<const uint16_t*>(value), count);
      break;
    case 4:
      fill_kernel<<<blocks, 256, 0, stream()>>>(static_cast<uint32_t*>(device_dst),
                                                *static_cast<const uint32_t*>(value), count);
      break;
    case 8:
      fill_kernel<<<blocks, 256, 0, stream()>>>(static_cast<uint64_t*>(device_dst),
                                                *static_cast<const uint64_t*>(value), count);
      break;
    default:
      MEGATON_CHECK(false, "cuda::fill: elements of {} bytes", element_bytes);
  }
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::cuda
