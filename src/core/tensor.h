// Tensor: a typed, shaped, contiguous view of shared storage on a device.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace megaton {

enum class Device : uint8_t { CPU, CUDA };

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);

// Raw bytes owned by one allocation. CPU storage is 64-byte aligned. The constructor
// throws OutOfMemoryError when the host or device cannot give `bytes` (naming the bytes
// requested, held and available); the destructor never throws (a block that cannot be
// cached is freed).
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device = Device::CPU;
  bool owned = true;     // false: memory someone else allocated and frees (Tensor::borrow)
  bool adopted = false;  // data lent by adopt() until the next release()
  explicit Storage(size_t bytes, Device device);
  // Memory owned elsewhere, not freed with this storage.
  Storage(void* data, size_t bytes, Device device);
  ~Storage();
  // Gives the memory back (to the caching allocator) and keeps the size: every tensor
  // viewing this storage keeps its shape but has no data until allocate() (FSDP's
  // sharded parameters and gradients between their uses). allocate() takes `bytes` anew
  // (uninitialised; OutOfMemoryError as the constructor). Memory owned elsewhere:
  // InternalError.
  void release() noexcept;
  void allocate();
  // A released storage takes `bytes` at `memory`, which someone else owns and keeps alive
  // until this storage's next release() (which then only forgets it): FSDP's persistent
  // double buffers (model/param_buffer.h). InternalError unless released and owned.
  void adopt(void* memory);
  bool released() const { return bytes > 0 && data == nullptr; }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

// ---- Host memory: the host allocator's holdings and what the machine has left ----------

// Bytes held by the caching host allocator (sizes rounded to its size classes).
struct HostAllocatorStats {
  int64_t allocated_bytes = 0;       // in live CPU tensors
  int64_t cached_bytes = 0;          // freed blocks kept for reuse
  int64_t peak_allocated_bytes = 0;  // max of allocated_bytes since start or reset
};
HostAllocatorStats host_allocator_stats();
// Starts peak_allocated_bytes again from the bytes allocated now.
void reset_peak_host_memory();
// Returns every cached (unused) host block to the OS.
void empty_host_cache();

// Host memory this process can still obtain, in bytes, from the limits Linux applies;
// -1 where a limit is unknown or absent. Read from /proc and /sys at each call (about
// 100 us): for size checks made before large allocations, not for the step.
struct HostMemoryAvailable {
  int64_t mem_available = -1;       // /proc/meminfo MemAvailable
  int64_t swap_free = -1;           // /proc/meminfo SwapFree
  int64_t cgroup_available = -1;    // cgroup memory limit - usage + its page cache
  int64_t address_space_left = -1;  // RLIMIT_AS (ulimit -v) - this process's VmSize
  int64_t resident_bytes = -1;      // this process's VmRSS (for messages)
  // Memory that pages can still be backed by: min(MemAvailable, cgroup) + SwapFree
  // (INT64_MAX when neither is known). Swap is added so that a check against this never
  // refuses what the kernel would have granted.
  int64_t physical() const;
  // min(physical(), address_space_left): what one more allocation can get.
  int64_t available() const;
  // Which limit gives physical(): "MemAvailable", "cgroup memory limit" (each with
  // " + SwapFree" when there is swap) or "no known limit".
  std::string physical_limit() const;
  // Which limit gives available(): physical_limit() or "ulimit -v (address space)".
  std::string binding_limit() const;
};
HostMemoryAvailable host_memory_available();

// Host requests of at least this many bytes are compared with host_memory_available()
// before the allocator is called: Linux overcommits, so such a malloc can succeed and the
// kernel kill the process later, when the pages are touched.
inline constexpr size_t kHostLargeAllocationBytes = size_t(1) << 30;

// Decimal units for messages: "512 bytes", "21.4 GB", "3.3 TB" (one decimal).
std::string human_bytes(double bytes);
// human_bytes with the exact count: "21.4 GB (21400000000 bytes)"; past 1e18 the count in
// scientific notation (a double holds no more digits), "an unlimited amount" for +inf.
std::string human_bytes_exact(double bytes);

namespace testing_hooks {
// Fault injection for tests of the allocation and release paths. The next `count`
// requests for a new host block fail as if the OS had no memory left (aligned_alloc
// returning nullptr); the next `count` returns of a block to the host cache fail as if
// the cache's bookkeeping could not allocate (std::bad_alloc inside ~Storage).
void fail_next_host_allocations(int count);
void fail_next_host_cache_inserts(int count);
}  // namespace testing_hooks

// Every tensor is row-major and contiguous. Views (reshape, rows along dim 0) share
// storage and never copy. An empty (default) tensor has no storage and numel 0.
class Tensor {
 public:
  Tensor() = default;
  // Uninitialised storage. Throws OutOfMemoryError when the memory cannot be had, or when
  // the shape's element or byte count overflows int64 ("needs more than 2^63 bytes").
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  // fp32 tensor holding `values` (numel must match shape).
  static Tensor from(const Shape& shape, const std::vector<float>& values);
  static Tensor from_i32(const Shape& shape, const std::vector<int32_t>& values);
  // A tensor over memory that the caller owns (at least numel x dtype size bytes at data,
  // on `device`), which must outlive every use of the tensor and its views; it is not
  // freed with them (Comm::pull_input's peer-memory slots).
  static Tensor borrow(void* data, const Shape& shape, DType dtype, Device device);
  // A tensor whose storage starts released (Storage::release): shape and dtype, no memory
  // until allocate_storage().
  static Tensor unallocated(const Shape& shape, DType dtype, Device device);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Size of dimension i; negative i counts from the end.
  int64_t dim(int i) const;
  int64_t numel() const;
  size_t nbytes() const { return numel() * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::CPU; }

  // The data; InternalError when the storage is released (Storage::release).
  void* raw() const;
  // Storage::release / allocate / released of the storage this tensor views: the memory of
  // every view of it goes and comes back together (FSDP, optim/distributed_data_parallel.h).
  void release_storage() const;
  void allocate_storage() const;
  // Storage::adopt of the storage this tensor views.
  void adopt_storage(void* memory) const;
  bool storage_released() const { return storage_ && storage_->released(); }
  // Views the same elements of the same storage (released or not), where raw() would
  // compare pointers.
  bool same_data(const Tensor& other) const {
    return storage_ == other.storage_ && offset_ == other.offset_;
  }
  // Typed pointer; throws InternalError when T does not match dtype().
  template <typename T>
  T* data() const;
  float* f32() const { return data<float>(); }
  int32_t* i32() const { return data<int32_t>(); }
  int64_t* i64() const { return data<int64_t>(); }

  // Same storage, new shape (numel must match; one -1 is inferred).
  Tensor view(const Shape& shape) const;
  // Rows [start, start + count) along dim 0, sharing storage.
  Tensor rows(int64_t start, int64_t count) const;
  // Deep copy.
  Tensor clone() const;
  // Copy converting to `dtype` (float types through fp32). On a device this goes through
  // the host: for tests and checkpoints, not the training step.
  Tensor to(DType dtype) const;
  // The same values on `device` (this tensor itself when already there).
  Tensor to(Device device) const;
  // Copy values from `src` (same numel and dtype) into this tensor.
  void copy_from(const Tensor& src);
  void fill(float value);
  void zero();
  // Element i as float (any float dtype or int), for tests and logging (a device tensor
  // is copied to the host first).
  float item(int64_t i = 0) const;
  std::vector<float> to_vector() const;

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  DType dtype_ = DType::F32;
};

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::I64;
}
template <>
constexpr DType dtype_of<int16_t>() {
  return DType::I16;
}
template <>
constexpr DType dtype_of<uint16_t>() {
  return DType::BF16;
}  // bf16 or f16 bits
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::F8E4M3;
}  // fp8 bits

template <typename T>
T* Tensor::data() const {
  constexpr DType want = dtype_of<T>();
  bool ok = dtype_ == want || (want == DType::BF16 && dtype_ == DType::F16) ||
            (want == DType::F8E4M3 && dtype_ == DType::F8E5M2);
  MEGATON_CHECK(ok, "tensor of dtype {} accessed as {}", dtype_name(dtype_), dtype_name(want));
  return static_cast<T*>(raw());
}

}  // namespace megaton
