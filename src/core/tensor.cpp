// Tensor storage (with the caching host allocator), views, copies and conversions; the
// host-memory readers are in core/host_memory.cpp.
#include "core/tensor.h"

#ifdef MEGATON_WITH_CUDA
#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/graph.h"
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>

namespace megaton {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

namespace {

std::atomic<int> injected_allocation_failures{0};
std::atomic<int> injected_cache_insert_failures{0};

// Consumes one injected failure of `counter`; false when none is pending.
bool take_injected_failure(std::atomic<int>& counter) {
  int n = counter.load(std::memory_order_relaxed);
  while (n > 0)
    if (counter.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) return true;
  return false;
}

// Caching host allocator: freed blocks are kept per exact (64-byte rounded) size and
// handed out again. A training step allocates the same shapes every iteration, so after
// the first step no allocation reaches the OS (no mmap/munmap, no page faults).
class HostBlockCache {
 public:
  // A block of `bytes` (a size class), from the cache or the OS. When the OS refuses, the
  // cache is returned to it and the request retried once; a second refusal, or a request
  // of kHostLargeAllocationBytes or more that exceeds host_memory_available(), throws
  // OutOfMemoryError naming the bytes requested, held and available.
  void* allocate(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= int64_t(bytes);
        note_allocated(bytes);
        return p;
      }
    }
    if (bytes >= kHostLargeAllocationBytes) refuse_if_unavailable(bytes);
    void* p = os_allocate(bytes);
    if (!p) {
      empty();
      p = os_allocate(bytes);
    }
    if (!p) throw OutOfMemoryError(out_of_memory_message(bytes, host_memory_available()));
    note_allocated(bytes);
    return p;
  }

  // Takes a block back for reuse. Never throws (it runs in ~Storage): when the cache's
  // bookkeeping cannot grow, the block goes back to the OS instead.
  void release(void* p, size_t bytes) noexcept {
    allocated_bytes_ -= int64_t(bytes);
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      if (take_injected_failure(injected_cache_insert_failures)) throw std::bad_alloc();
      free_[bytes].push_back(p);
      cached_bytes_ += int64_t(bytes);
      return;
    } catch (...) {
    }
    std::free(p);
  }

  // Frees every cached block.
  void empty() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) std::free(p);
      cached_bytes_ -= int64_t(size * blocks.size());
    }
    free_.clear();
  }

  HostAllocatorStats stats() const {
    return {allocated_bytes_.load(), cached_bytes_.load(), peak_allocated_bytes_.load()};
  }
  void reset_peak() { peak_allocated_bytes_.store(allocated_bytes_.load()); }

 private:
  // allocated_bytes_ += bytes, raising the peak with it.
  void note_allocated(size_t bytes) {
    const int64_t now = allocated_bytes_ += int64_t(bytes);
    int64_t peak = peak_allocated_bytes_.load();
    while (now > peak && !peak_allocated_bytes_.compare_exchange_weak(peak, now)) {
    }
  }

  static void* os_allocate(size_t bytes) {
    if (take_injected_failure(injected_allocation_failures)) return nullptr;
    return std::aligned_alloc(64, bytes);
  }

  void refuse_if_unavailable(size_t bytes) {
    HostMemoryAvailable avail = host_memory_available();
    if (int64_t(bytes) <= avail.available()) return;
    if (cached_bytes_.load() > 0) {  // cached blocks go back to the OS: look again
      empty();
      avail = host_memory_available();
      if (int64_t(bytes) <= avail.available()) return;
    }
    throw OutOfMemoryError(out_of_memory_message(bytes, avail));
  }

  std::string out_of_memory_message(size_t bytes, const HostMemoryAvailable& avail) const {
    const HostAllocatorStats s = stats();
    const int64_t available = avail.available();
    return fmt::format(
        "out of host memory: a tensor of {} was requested; this process holds {} resident "
        "({} in tensors, {} cached) and {} is available ({})",
        human_bytes_exact(double(bytes)),
        avail.resident_bytes >= 0 ? human_bytes_exact(double(avail.resident_bytes))
                                  : std::string("?"),
        human_bytes(double(s.allocated_bytes)), human_bytes(double(s.cached_bytes)),
        available == std::numeric_limits<int64_t>::max() ? std::string("an unknown amount")
                                                         : human_bytes_exact(double(available)),
        avail.binding_limit());
  }

  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::atomic<int64_t> allocated_bytes_{0};
  std::atomic<int64_t> cached_bytes_{0};
  std::atomic<int64_t> peak_allocated_bytes_{0};
};
HostBlockCache& host_cache() {
  static HostBlockCache* cache = new HostBlockCache();  // never destroyed: outlives tensors
  return *cache;
}
// Size classes: multiples of 64 bytes up to 4 KiB, then 8 classes per power of two
// (at most 12.5% slack), so sizes that vary from step to step (tokens per expert)
// share a bounded set of blocks.
size_t rounded_bytes(size_t n) {
  if (n <= 4096) return (n + 63) / 64 * 64;
  size_t top = size_t(1) << (63 - __builtin_clzll(n - 1));  // largest power of two < n
  size_t step = top / 8;
  return (n + step - 1) / step * step;
}

}  // namespace

HostAllocatorStats host_allocator_stats() { return host_cache().stats(); }
void reset_peak_host_memory() { host_cache().reset_peak(); }
void empty_host_cache() { host_cache().empty(); }

namespace testing_hooks {
void fail_next_host_allocations(int count) { injected_allocation_failures.store(count); }
void fail_next_host_cache_inserts(int count) { injected_cache_insert_failures.store(count); }
}  // namespace testing_hooks

Storage::Storage(size_t n, Device dev) : bytes(n), device(dev) {
  if (dev == Device::CUDA) {
#ifdef MEGATON_WITH_CUDA
    data = n ? cuda::device_allocate(n) : nullptr;
    return;
#else
    throw Error("a CUDA tensor was requested, but this megaton was built without CUDA");
#endif
  }
  data = n ? host_cache().allocate(rounded_bytes(n)) : nullptr;
}
Storage::Storage(void* external, size_t n, Device dev)
    : data(external), bytes(n), device(dev), owned(false) {}
Storage::~Storage() { release(); }

void Storage::release() noexcept {
  if (adopted) {  // lent memory: forgotten, not freed
    data = nullptr;
    adopted = false;
    return;
  }
  if (!data || !owned) return;
  void* ptr = std::exchange(data, nullptr);
#ifdef MEGATON_WITH_CUDA
  if (device == Device::CUDA) {
    cuda::device_free(ptr, bytes);
    return;
  }
#endif
  host_cache().release(ptr, rounded_bytes(bytes));
}

void Storage::adopt(void* memory) {
  MEGATON_CHECK(owned && !data && bytes > 0 && memory,
                "Storage::adopt: the storage must be released and own its memory");
  data = memory;
  adopted = true;
}

void Storage::allocate() {
  MEGATON_CHECK(owned, "Storage::allocate of memory owned elsewhere");
  if (data || !bytes) return;
  if (device == Device::CUDA) {
#ifdef MEGATON_WITH_CUDA
    data = cuda::device_allocate(bytes);
    return;
#endif
  }
  data = host_cache().allocate(rounded_bytes(bytes));
}

// Copies `bytes` between any two storages (host or device), in stream order; waits for
// the copy when the destination is host memory so the caller can read it at once. Host
// sources go through cuda::upload, which never waits: the host buffer may change as soon
// as this returns.
static void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                       size_t bytes) {
  if (bytes == 0) return;
  if (dst_device == Device::CPU && src_device == Device::CPU) {
    std::memmove(dst, src, bytes);
    return;
  }
#ifdef MEGATON_WITH_CUDA
  if (src_device == Device::CPU && dst_device == Device::CUDA) {
    cuda::upload(dst, src, bytes);
    return;
  }
  // A copy to the host waits for it; inside a CUDA graph capture synchronize() refuses
  // that before the copy is queued.
  if (dst_device == Device::CPU && cuda::capturing()) cuda::synchronize();
  MEGATON_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda::stream()));
  if (dst_device == Device::CPU || src_device == Device::CPU) cuda::synchronize();
#else
  MEGATON_CHECK(false, "CUDA copy in a build without CUDA");
#endif
}

[[noreturn]] static void throw_shape_too_large(const Shape& s) {
  throw OutOfMemoryError(
      fmt::format("tensor of shape {} needs more than 2^63 bytes", shape_str(s)));
}

// Elements of shape `s`; OutOfMemoryError when the count overflows int64 (such a tensor
// could never be allocated).
static int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    MEGATON_CHECK(d >= 0, "negative dimension in shape {}", shape_str(s));
    if (__builtin_mul_overflow(n, d, &n)) {
      // A zero later in the shape makes the tensor empty, not too large.
      for (int64_t z : s)
        if (z == 0) return 0;
      throw_shape_too_large(s);
    }
  }
  return n;
}

// Bytes of a tensor of `shape` and `dtype`; OutOfMemoryError beyond int64.
static size_t bytes_of(const Shape& shape, DType dtype) {
  int64_t bytes = 0;
  if (__builtin_mul_overflow(numel_of(shape), int64_t(dtype_size(dtype)), &bytes))
    throw_shape_too_large(shape);
  return size_t(bytes);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(bytes_of(shape, dtype), device);
  return t;
}
Tensor Tensor::borrow(void* data, const Shape& shape, DType dtype, Device device) {
  MEGATON_CHECK(data != nullptr || numel_of(shape) == 0, "Tensor::borrow of a null pointer");
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(data, bytes_of(shape, dtype), device);
  return t;
}
Tensor Tensor::unallocated(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(nullptr, bytes_of(shape, dtype), device);
  t.storage_->owned = true;  // allocate_storage() takes memory this storage then frees
  return t;
}
Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero();
  return t;
}
Tensor Tensor::from(const Shape& shape, const std::vector<float>& values) {
  Tensor t = empty(shape);
  MEGATON_CHECK(int64_t(values.size()) == t.numel(), "{} values for shape {}", values.size(),
                shape_str(shape));
  std::memcpy(t.raw(), values.data(), t.nbytes());
  return t;
}
Tensor Tensor::from_i32(const Shape& shape, const std::vector<int32_t>& values) {
  Tensor t = empty(shape, DType::I32);
  MEGATON_CHECK(int64_t(values.size()) == t.numel(), "{} values for shape {}", values.size(),
                shape_str(shape));
  std::memcpy(t.raw(), values.data(), t.nbytes());
  return t;
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  MEGATON_CHECK(i >= 0 && i < n, "dim {} of a {}-d tensor", i, n);
  return shape_[i];
}
int64_t Tensor::numel() const { return storage_ ? numel_of(shape_) : 0; }
void* Tensor::raw() const {
  if (!storage_) return nullptr;
  MEGATON_CHECK(storage_->data || !storage_->bytes,
                "a tensor {} {} was used while its storage is released (an FSDP-sharded "
                "parameter or gradient read outside its all-gather)",
                dtype_name(dtype_), shape_str(shape_));
  return static_cast<char*>(storage_->data) + offset_;
}

void Tensor::release_storage() const {
  if (storage_) storage_->release();
}

void Tensor::allocate_storage() const {
  if (storage_) storage_->allocate();
}

void Tensor::adopt_storage(void* memory) const {
  MEGATON_CHECK(storage_, "Tensor::adopt_storage on an undefined tensor");
  storage_->adopt(memory);
}

Tensor Tensor::view(const Shape& shape) const {
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      MEGATON_CHECK(infer < 0, "two -1 in view {}", shape_str(shape));
      infer = i;
    } else
      known *= s[i];
  }
  if (infer >= 0) s[infer] = known ? numel() / known : 0;
  MEGATON_CHECK(numel_of(s) == numel(), "view {} of a tensor of shape {}", shape_str(shape),
                shape_str(shape_));
  Tensor t = *this;
  t.shape_ = s;
  return t;
}

Tensor Tensor::rows(int64_t start, int64_t count) const {
  MEGATON_CHECK(ndim() >= 1 && start >= 0 && count >= 0 && start + count <= shape_[0],
                "rows [{}, {}) of shape {}", start, start + count, shape_str(shape_));
  Tensor t = *this;
  int64_t row = shape_[0] ? numel() / shape_[0] : 0;
  t.offset_ += start * row * dtype_size(dtype_);
  t.shape_[0] = count;
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  copy_bytes(t.raw(), t.device(), raw(), device(), nbytes());
  return t;
}

Tensor Tensor::to(Device device_out) const {
  if (device_out == device()) return *this;
  Tensor t = empty(shape_, dtype_, device_out);
  copy_bytes(t.raw(), device_out, raw(), device(), nbytes());
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  MEGATON_CHECK(src.numel() == numel() && src.dtype() == dtype_, "copy {} {} into {} {}",
                dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dtype_),
                shape_str(shape_));
  copy_bytes(raw(), device(), src.raw(), src.device(), nbytes());
}

float Tensor::item(int64_t i) const {
  MEGATON_CHECK(i >= 0 && i < numel(), "item {} of {} elements", i, numel());
  if (device() != Device::CPU) return to(Device::CPU).item(i);
  const char* p = static_cast<const char*>(raw());
  switch (dtype_) {
    case DType::F32:
      return reinterpret_cast<const float*>(p)[i];
    case DType::BF16:
      return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::F16:
      return fp16_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::F8E4M3:
      return fp8e4m3_to_float(reinterpret_cast<const uint8_t*>(p)[i]);
    case DType::F8E5M2:
      return fp8e5m2_to_float(reinterpret_cast<const uint8_t*>(p)[i]);
    case DType::I32:
      return float(reinterpret_cast<const int32_t*>(p)[i]);
    case DType::I64:
      return float(reinterpret_cast<const int64_t*>(p)[i]);
    case DType::I16:
      return float(reinterpret_cast<const int16_t*>(p)[i]);
  }
  return 0;
}

std::vector<float> Tensor::to_vector() const {
  if (device() != Device::CPU) return to(Device::CPU).to_vector();
  std::vector<float> v(numel());
  for (int64_t i = 0; i < numel(); ++i) v[i] = item(i);
  return v;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  if (device() != Device::CPU) return to(Device::CPU).to(dtype).to(device());
  Tensor t = empty(shape_, dtype, device());
  char* p = static_cast<char*>(t.raw());
  int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) {
    float v = item(i);
    switch (dtype) {
      case DType::F32:
        reinterpret_cast<float*>(p)[i] = v;
        break;
      case DType::BF16:
        reinterpret_cast<uint16_t*>(p)[i] = float_to_bf16(v);
        break;
      case DType::F16:
        reinterpret_cast<uint16_t*>(p)[i] = float_to_fp16(v);
        break;
      case DType::F8E4M3:
        reinterpret_cast<uint8_t*>(p)[i] = float_to_fp8e4m3(v);
        break;
      case DType::F8E5M2:
        reinterpret_cast<uint8_t*>(p)[i] = float_to_fp8e5m2(v);
        break;
      case DType::I32:
        reinterpret_cast<int32_t*>(p)[i] = dtype_ == DType::I64 ? int32_t(i64()[i]) : int32_t(v);
        break;
      case DType::I64:
        reinterpret_cast<int64_t*>(p)[i] = dtype_ == DType::I32 ? i32()[i] : int64_t(v);
        break;
      case DType::I16:
        reinterpret_cast<int16_t*>(p)[i] = int16_t(v);
        break;
    }
  }
  return t;
}

void Tensor::fill(float value) {
  if (device() != Device::CPU) {
#ifdef MEGATON_WITH_CUDA
    // One element converted on the host, written everywhere by a kernel.
    Tensor one = Tensor::empty({1}, dtype_);
    one.fill(value);
    cuda::fill(raw(), one.raw(), dtype_size(dtype_), numel());
#endif
    return;
  }
  if (dtype_ == DType::F32) {
    float* p = f32();
    for (int64_t i = 0, n = numel(); i < n; ++i) p[i] = value;
  } else {
    Tensor one = Tensor::from({1}, {value}).to(dtype_);
    size_t es = dtype_size(dtype_);
    for (int64_t i = 0, n = numel(); i < n; ++i)
      std::memcpy(static_cast<char*>(raw()) + i * es, one.raw(), es);
  }
}
void Tensor::zero() {
  if (!numel()) return;
#ifdef MEGATON_WITH_CUDA
  if (device() == Device::CUDA) {
    MEGATON_CUDA_CHECK(cudaMemsetAsync(raw(), 0, nbytes(), cuda::stream()));
    return;
  }
#endif
  std::memset(raw(), 0, nbytes());
}

}  // namespace megaton
