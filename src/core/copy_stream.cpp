// HostCopyStream and HostBuffer: the CUDA side stream and pinned memory, or host memcpy.
#include "core/copy_stream.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/error.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/cuda_check.h"
#include "core/cuda/graph.h"
#endif

namespace megaton {

// ---- HostBuffer ----

HostBuffer::~HostBuffer() { release(); }

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : device_(other.device_),
      data_(std::exchange(other.data_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void HostBuffer::release() noexcept {
  if (!data_) return;
#ifdef MEGATON_WITH_CUDA
  if (device_ == Device::CUDA) {
    if (cudaFreeHost(data_) != cudaSuccess) (void)cudaGetLastError();
    data_ = nullptr;
    capacity_ = 0;
    return;
  }
#endif
  std::free(data_);
  data_ = nullptr;
  capacity_ = 0;
}

void HostBuffer::reserve(size_t bytes) {
  if (bytes <= capacity_) return;
  release();
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = nullptr;
#ifdef MEGATON_WITH_CUDA
  if (device_ == Device::CUDA) {
    const cudaError_t err = cudaMallocHost(&p, rounded);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw OutOfMemoryError(fmt::format(
          "out of pinned host memory for offloaded activations: {} requested ({})",
          human_bytes_exact(double(rounded)), cudaGetErrorString(err)));
    }
  }
#endif
  if (device_ == Device::CPU) p = std::aligned_alloc(64, rounded);
  if (!p)
    throw OutOfMemoryError(fmt::format("out of host memory for offloaded activations: {} requested",
                                       human_bytes_exact(double(rounded))));
  data_ = static_cast<std::byte*>(p);
  capacity_ = rounded;
}

// ---- CopyEvent ----

CopyEvent::~CopyEvent() {
#ifdef MEGATON_WITH_CUDA
  if (event_ && cudaEventDestroy(static_cast<cudaEvent_t>(event_)) != cudaSuccess)
    (void)cudaGetLastError();
#endif
}

CopyEvent& CopyEvent::operator=(CopyEvent&& other) noexcept {
  if (this != &other) {
    CopyEvent dying(std::move(*this));
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

// ---- HostCopyStream ----

HostCopyStream::HostCopyStream(Device device) : device_(device) {
  if (device != Device::CUDA) return;
#ifdef MEGATON_WITH_CUDA
  cudaStream_t s = nullptr;
  MEGATON_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
#else
  MEGATON_CHECK(false, "HostCopyStream on a CUDA device in a build without CUDA");
#endif
}

HostCopyStream::~HostCopyStream() {
#ifdef MEGATON_WITH_CUDA
  if (!stream_) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  if (cudaStreamSynchronize(s) != cudaSuccess || cudaStreamDestroy(s) != cudaSuccess)
    (void)cudaGetLastError();  // a destructor cannot report it
#endif
}

void HostCopyStream::wait_for_compute() {
#ifdef MEGATON_WITH_CUDA
  if (!stream_) return;
  MEGATON_CHECK(!cuda::capturing(), "HostCopyStream: copies during a CUDA graph capture");
  // One event, recorded again at each call: a wait takes the event as it is when queued.
  if (!compute_mark_.event_) {
    cudaEvent_t e = nullptr;
    MEGATON_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    compute_mark_.event_ = e;
  }
  cudaEvent_t e = static_cast<cudaEvent_t>(compute_mark_.event_);
  MEGATON_CUDA_CHECK(cudaEventRecord(e, cuda::stream()));
  MEGATON_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), e, 0));
#endif
}

void HostCopyStream::copy_to_host(std::byte* dst, const Tensor& src) {
  MEGATON_CHECK(src.defined() && src.device() == device_,
                "HostCopyStream::copy_to_host: the source is undefined or on another device");
  if (src.nbytes() == 0) return;
#ifdef MEGATON_WITH_CUDA
  if (stream_) {
    MEGATON_CUDA_CHECK(cudaMemcpyAsync(dst, src.raw(), src.nbytes(), cudaMemcpyDeviceToHost,
                                       static_cast<cudaStream_t>(stream_)));
    return;
  }
#endif
  std::memcpy(dst, src.raw(), src.nbytes());
}

void HostCopyStream::copy_to_device(Tensor& dst, const std::byte* src) {
  MEGATON_CHECK(dst.defined() && dst.device() == device_,
                "HostCopyStream::copy_to_device: the destination is undefined or on another "
                "device");
  if (dst.nbytes() == 0) return;
#ifdef MEGATON_WITH_CUDA
  if (stream_) {
    MEGATON_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src, dst.nbytes(), cudaMemcpyHostToDevice,
                                       static_cast<cudaStream_t>(stream_)));
    return;
  }
#endif
  std::memcpy(dst.raw(), src, dst.nbytes());
}

void HostCopyStream::record(CopyEvent& event) {
#ifdef MEGATON_WITH_CUDA
  if (!stream_) return;
  if (!event.event_) {
    cudaEvent_t e = nullptr;
    MEGATON_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    event.event_ = e;
  }
  MEGATON_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event.event_), static_cast<cudaStream_t>(stream_)));
#else
  (void)event;
#endif
}

void HostCopyStream::compute_waits(const CopyEvent& event) {
#ifdef MEGATON_WITH_CUDA
  if (!stream_ || !event.event_) return;
  MEGATON_CUDA_CHECK(
      cudaStreamWaitEvent(cuda::stream(), static_cast<cudaEvent_t>(event.event_), 0));
#else
  (void)event;
#endif
}

void HostCopyStream::synchronize() {
#ifdef MEGATON_WITH_CUDA
  if (!stream_) return;
  MEGATON_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
#endif
}

}  // namespace megaton
