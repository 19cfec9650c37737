// Tensor storage, views, copies and conversions.
#include "core/tensor.h"

#ifdef MEGATON_WITH_CUDA
#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/graph.h"
#endif

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <new>
#include <string_view>
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

int64_t saturating_int64(double bytes) {
  return bytes >= 9.2e18 ? std::numeric_limits<int64_t>::max() : int64_t(bytes);
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

// ---- /proc and /sys readers for host_memory_available (-1: absent or unreadable) -----

// The number after `key` in a "key value [kB]" file (/proc/meminfo, /proc/self/status,
// memory.stat); `scale` multiplies it (1024 for kB).
int64_t read_keyed_value(const std::string& path, std::string_view key, int64_t scale) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.size() <= key.size() || line.compare(0, key.size(), key) != 0) continue;
    const char c = line[key.size()];
    if (c != ' ' && c != ':' && c != '\t') continue;
    const char* p = line.c_str() + key.size();
    while (*p == ':' || *p == ' ' || *p == '\t') ++p;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(p, &end, 10);
    if (end == p) return -1;
    return saturating_int64(double(v) * double(scale));
  }
  return -1;
}

// A file holding one number; -1 for "max", absent or unreadable.
int64_t read_single_value(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(word.c_str(), &end, 10);
  if (end == word.c_str()) return -1;
  return saturating_int64(double(v));
}

// What the memory cgroup of this process still lets it have: limit - usage + the page
// cache charged to it (reclaimable, as MemAvailable counts it), the smallest over the
// cgroup and its ancestors. -1 when there is no limit or no cgroup.
int64_t cgroup_memory_available() {
  std::ifstream in("/proc/self/cgroup");
  std::string v1_path, v2_path;
  for (std::string line; std::getline(in, line);) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) v2_path = path;
    std::string list = "," + controllers + ",";
    if (list.find(",memory,") != std::string::npos) v1_path = path;
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  int64_t best = -1;
  auto consider = [&best](int64_t limit, int64_t usage, int64_t cache) {
    // Limits near 2^63 (cgroup v1's "unlimited") are no limit.
    if (limit < 0 || usage < 0 || limit >= (int64_t(1) << 62)) return;
    const int64_t left = std::max<int64_t>(0, limit - usage + std::max<int64_t>(cache, 0));
    best = best < 0 ? left : std::min(best, left);
  };
  if (!v1_path.empty()) {
    // cgroup v1: hierarchical_memory_limit already takes the ancestors' limits.
    fs::path dir = fs::path("/sys/fs/cgroup/memory") / fs::path(v1_path).relative_path();
    if (!fs::exists(dir / "memory.usage_in_bytes", ec)) dir = "/sys/fs/cgroup/memory";
    const std::string stat = (dir / "memory.stat").string();
    int64_t limit = read_keyed_value(stat, "hierarchical_memory_limit", 1);
    if (limit < 0) limit = read_single_value((dir / "memory.limit_in_bytes").string());
    consider(limit, read_single_value((dir / "memory.usage_in_bytes").string()),
             read_keyed_value(stat, "total_cache", 1));
  } else if (!v2_path.empty()) {
    const fs::path root = "/sys/fs/cgroup";
    fs::path dir = root / fs::path(v2_path).relative_path();
    if (!fs::exists(dir / "memory.current", ec)) dir = root;
    for (;;) {
      consider(read_single_value((dir / "memory.max").string()),
               read_single_value((dir / "memory.current").string()),
               read_keyed_value((dir / "memory.stat").string(), "file", 1));
      if (dir == root || !dir.has_parent_path() || dir.parent_path() == dir) break;
      dir = dir.parent_path();
    }
  }
  return best;
}

}  // namespace

HostAllocatorStats host_allocator_stats() { return host_cache().stats(); }
void reset_peak_host_memory() { host_cache().reset_peak(); }
void empty_host_cache() { host_cache().empty(); }

int64_t HostMemoryAvailable::physical() const {
  int64_t ram = -1;
  if (mem_available >= 0) ram = mem_available;
  if (cgroup_available >= 0) ram = ram < 0 ? cgroup_available : std::min(ram, cgroup_available);
  if (ram < 0) return std::numeric_limits<int64_t>::max();
  return saturating_int64(double(ram) + double(std::max<int64_t>(swap_free, 0)));
}

int64_t HostMemoryAvailable::available() const {
  const int64_t p = physical();
  return address_space_left >= 0 ? std::min(p, address_space_left) : p;
}

std::string HostMemoryAvailable::binding_limit() const {
  if (address_space_left >= 0 && address_space_left <= physical())
    return "ulimit -v (address space)";
  return physical_limit();
}

std::string HostMemoryAvailable::physical_limit() const {
  if (cgroup_available >= 0 && (mem_available < 0 || cgroup_available < mem_available))
    return swap_free > 0 ? "cgroup memory limit + SwapFree" : "cgroup memory limit";
  if (mem_available >= 0) return swap_free > 0 ? "MemAvailable + SwapFree" : "MemAvailable";
  return "no known limit";
}

HostMemoryAvailable host_memory_available() {
  HostMemoryAvailable out;
  out.mem_available = read_keyed_value("/proc/meminfo", "MemAvailable", 1024);
  out.swap_free = read_keyed_value("/proc/meminfo", "SwapFree", 1024);
  out.cgroup_available = cgroup_memory_available();
  out.resident_bytes = read_keyed_value("/proc/self/status", "VmRSS", 1024);
  rlimit limit{};
  if (::getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    const int64_t used = read_keyed_value("/proc/self/status", "VmSize", 1024);
    const int64_t cap = saturating_int64(double(limit.rlim_cur));
    out.address_space_left = std::max<int64_t>(0, cap - std::max<int64_t>(used, 0));
  }
  return out;
}

std::string human_bytes(double bytes) {
  if (!(bytes >= 1000)) return fmt::format("{:.0f} bytes", bytes);
  static const char* const units[] = {"KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"};
  int u = -1;
  while (bytes >= 999.95 && u < 7) {
    bytes /= 1000;
    ++u;
  }
  if (bytes >= 999.95) return fmt::format("{:.3g} YB", bytes);  // beyond the units
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

std::string human_bytes_exact(double bytes) {
  if (std::isinf(bytes)) return "an unlimited amount";
  if (bytes < 1e18) return fmt::format("{} ({:.0f} bytes)", human_bytes(bytes), bytes);
  return fmt::format("{} ({:.3e} bytes)", human_bytes(bytes), bytes);
}

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
