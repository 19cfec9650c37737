// Readback: device values copied to the host without waiting for the stream to drain.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace megaton {

// Copies the bytes of a few small tensors (a training step's loss, gradient norm, skip
// flag ...) into pinned host memory in stream order and marks that point of the stream.
// wait() blocks only until the stream has got there: the work queued after it (the next
// step) keeps the GPU busy meanwhile. A cuda::synchronize() would instead wait for
// everything queued, leaving the GPU idle until the host queues more, so a trainer that
// reads step i's values after queuing step i + 1 has no host synchronization in its
// steady state. Host tensors are copied at construction (wait() returns at once).
//
// Not thread-safe; one object per read. Tensors must be defined and on one device (any
// dtype); their values are taken as they are when the stream reaches the copy.
class Readback {
 public:
  explicit Readback(const std::vector<Tensor>& tensors);
  ~Readback();
  Readback(const Readback&) = delete;
  Readback& operator=(const Readback&) = delete;
  Readback(Readback&&) noexcept;
  Readback& operator=(Readback&&) noexcept;

  // Blocks until the copies are done (counted by cuda::readback_waits(), not as a host
  // synchronization). Idempotent.
  void wait();
  // Tensor i's bytes on the host, as a host tensor of its shape and dtype (waits first).
  const Tensor& tensor(size_t i);
  // Milliseconds on the GPU between `earlier`'s copies completing and this one's (both
  // waited for first), or -1 when either has no GPU event (CPU tensors, none given). The
  // trainer's step time: unlike the host's clock it does not depend on how far ahead of
  // the GPU the host was when it read the values.
  double gpu_ms_since(Readback& earlier);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace cuda {
// Readback::wait calls that had to wait for the GPU since the process started (CUDA
// builds; 0 otherwise).
uint64_t readback_waits();
}  // namespace cuda

}  // namespace megaton
