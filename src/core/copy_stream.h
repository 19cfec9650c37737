// HostCopyStream: copies between device tensors and host buffers on a side stream, ordered
// against the compute stream by events (activation offloading, model/activation_offload.h).
#pragma once
#include <cstddef>

#include "core/tensor.h"

namespace megaton {

// Host memory for copies to and from tensors of `device`: pinned (cudaMallocHost) for
// CUDA, so the copies are asynchronous DMA; plain 64-byte-aligned memory for the CPU
// backend. Either way it is outside the host tensor allocator: its bytes are not counted
// in host_allocator_stats(), as a device's offloaded bytes leave the device. Grows, never
// shrinks; reserve() of more than the capacity frees the old block (its contents are
// lost), so the caller first waits for the copies that use it (HostCopyStream::synchronize).
class HostBuffer {
 public:
  explicit HostBuffer(Device device) : device_(device) {}
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;

  // At least `bytes` bytes. Throws OutOfMemoryError naming the bytes when the host (or
  // the CUDA driver, for pinned memory) cannot give them.
  void reserve(size_t bytes);
  std::byte* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  void release() noexcept;
  Device device_;
  std::byte* data_ = nullptr;
  size_t capacity_ = 0;
};

// A point in the side stream's work (a CUDA event; nothing on the CPU backend, whose
// copies are done when they return). Move-only; recorded by HostCopyStream::record.
class CopyEvent {
 public:
  CopyEvent() = default;
  ~CopyEvent();
  CopyEvent(CopyEvent&& other) noexcept : event_(other.event_) { other.event_ = nullptr; }
  CopyEvent& operator=(CopyEvent&& other) noexcept;
  CopyEvent(const CopyEvent&) = delete;
  CopyEvent& operator=(const CopyEvent&) = delete;

 private:
  friend class HostCopyStream;
  void* event_ = nullptr;  // cudaEvent_t, created at the first record
};

// A copy stream beside the compute stream (CUDA: a non-blocking stream of its own; CPU:
// copies run at once, in the caller's thread). The CUDA caching allocator hands blocks
// out in compute-stream order (core/cuda/allocator.h), so a copy on this stream must be
// ordered by the caller: before reading a tensor the compute stream writes, or writing a
// block the compute stream has just handed out, call wait_for_compute(); before a tensor
// this stream reads or writes is freed or read by compute work, record an event after the
// copy and call compute_waits() on it.
class HostCopyStream {
 public:
  // InternalError on a CUDA device in a build without CUDA.
  explicit HostCopyStream(Device device);
  ~HostCopyStream();  // waits for the queued copies
  HostCopyStream(const HostCopyStream&) = delete;
  HostCopyStream& operator=(const HostCopyStream&) = delete;
  Device device() const { return device_; }

  // The side stream waits for the work queued on the compute stream so far.
  // InternalError during a CUDA graph capture (the side stream is not captured).
  void wait_for_compute();
  // Queues a copy of src's bytes (src defined, on device()) to host memory at dst (at least
  // src.nbytes() bytes of a HostBuffer of this device).
  void copy_to_host(std::byte* dst, const Tensor& src);
  // Queues a copy of dst.nbytes() bytes of host memory at src (a HostBuffer's) into dst
  // (defined, on device()).
  void copy_to_device(Tensor& dst, const std::byte* src);
  // Marks in `event` the point the side stream has reached (the copies queued so far).
  void record(CopyEvent& event);
  // Work queued on the compute stream after this call runs after the copies `event`
  // marks. An event never recorded is no wait.
  void compute_waits(const CopyEvent& event);
  // Blocks the host until every queued copy has finished.
  void synchronize();

 private:
  Device device_;
  void* stream_ = nullptr;  // cudaStream_t (CUDA only)
  CopyEvent compute_mark_;  // the compute stream's point in wait_for_compute
};

}  // namespace megaton
