// Readback: pinned host copies and a CUDA event per read.
#include "core/readback.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/cuda_check.h"
#include "core/cuda/graph.h"
#endif

namespace megaton {

namespace {
std::atomic<uint64_t> g_readback_waits{0};

#ifdef MEGATON_WITH_CUDA
// Pinned blocks are kept for reuse (cudaFreeHost may synchronize the device): a trainer
// makes one read per step of the same size.
struct PinnedPool {
  std::mutex mutex;
  std::vector<std::pair<size_t, void*>> free;  // (bytes, block)
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (size_t i = 0; i < free.size(); ++i)
        if (free[i].first >= bytes) {
          void* block = free[i].second;
          free.erase(free.begin() + std::ptrdiff_t(i));
          return block;
        }
    }
    void* block = nullptr;
    MEGATON_CUDA_CHECK(cudaMallocHost(&block, bytes));
    std::lock_guard<std::mutex> lock(mutex);
    sizes()[block] = bytes;
    return block;
  }
  void give(void* block) {
    std::lock_guard<std::mutex> lock(mutex);
    free.emplace_back(sizes()[block], block);
  }
  std::unordered_map<void*, size_t>& sizes() {
    static std::unordered_map<void*, size_t> by_block;
    return by_block;
  }
};
PinnedPool& pinned_pool() {
  static PinnedPool* pool = new PinnedPool();  // never destroyed: outlives every Readback
  return *pool;
}
#endif
}  // namespace

struct Readback::Impl {
  std::vector<Tensor> host;  // the results, host tensors
#ifdef MEGATON_WITH_CUDA
  void* pinned = nullptr;  // the device bytes land here, then are copied into `host`
  std::vector<size_t> offsets;
  cudaEvent_t done = nullptr;
  bool waited = false;
#endif
};

Readback::Readback(const std::vector<Tensor>& tensors) : impl_(std::make_unique<Impl>()) {
  if (tensors.empty()) return;
  const Device device = tensors[0].device();
  for (const Tensor& t : tensors)
    MEGATON_CHECK(t.defined() && t.device() == device,
                  "Readback: tensors undefined or on two devices");
  if (device == Device::CPU) {
    for (const Tensor& t : tensors) impl_->host.push_back(t.clone());
    return;
  }
#ifdef MEGATON_WITH_CUDA
  // A captured copy would run at every replay into a block the pool has handed on.
  MEGATON_CHECK(!cuda::capturing(), "Readback inside a CUDA graph capture");
  size_t bytes = 0;
  for (const Tensor& t : tensors) {
    impl_->offsets.push_back(bytes);
    bytes += (t.nbytes() + 15) / 16 * 16;
  }
  impl_->pinned = pinned_pool().take(bytes);
  cudaStream_t stream = cuda::stream();
  for (size_t i = 0; i < tensors.size(); ++i) {
    MEGATON_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(impl_->pinned) + impl_->offsets[i],
                                       tensors[i].raw(), tensors[i].nbytes(),
                                       cudaMemcpyDeviceToHost, stream));
    impl_->host.push_back(Tensor::empty(tensors[i].shape(), tensors[i].dtype()));
  }
  // A timing event: gpu_ms_since reads the time between two of them.
  MEGATON_CUDA_CHECK(cudaEventCreateWithFlags(&impl_->done, cudaEventDefault));
  MEGATON_CUDA_CHECK(cudaEventRecord(impl_->done, stream));
#endif
}

Readback::~Readback() {
#ifdef MEGATON_WITH_CUDA
  if (!impl_) return;
  // The copies must finish before their destination is freed.
  if (impl_->done) {
    cudaEventSynchronize(impl_->done);
    cudaEventDestroy(impl_->done);
  }
  if (impl_->pinned) pinned_pool().give(impl_->pinned);
#endif
}

Readback::Readback(Readback&&) noexcept = default;
Readback& Readback::operator=(Readback&& other) noexcept {
  if (this != &other) {
    Readback dying(std::move(*this));  // waits for and frees this one's copies
    impl_ = std::move(other.impl_);
  }
  return *this;
}

void Readback::wait() {
#ifdef MEGATON_WITH_CUDA
  if (!impl_ || !impl_->done || impl_->waited) return;
  if (cudaEventQuery(impl_->done) == cudaErrorNotReady) g_readback_waits.fetch_add(1);
  MEGATON_CUDA_CHECK(cudaEventSynchronize(impl_->done));
  for (size_t i = 0; i < impl_->host.size(); ++i)
    std::memcpy(impl_->host[i].raw(), static_cast<char*>(impl_->pinned) + impl_->offsets[i],
                impl_->host[i].nbytes());
  impl_->waited = true;
#endif
}

double Readback::gpu_ms_since(Readback& earlier) {
#ifdef MEGATON_WITH_CUDA
  if (!impl_ || !impl_->done || !earlier.impl_ || !earlier.impl_->done) return -1.0;
  earlier.wait();
  wait();
  float ms = 0;
  MEGATON_CUDA_CHECK(cudaEventElapsedTime(&ms, earlier.impl_->done, impl_->done));
  return ms;
#else
  (void)earlier;
  return -1.0;
#endif
}

const Tensor& Readback::tensor(size_t i) {
  wait();
  MEGATON_CHECK(impl_ && i < impl_->host.size(), "Readback: no tensor {}", i);
  return impl_->host[i];
}

namespace cuda {
uint64_t readback_waits() { return g_readback_waits.load(); }
}  // namespace cuda

}  // namespace megaton
