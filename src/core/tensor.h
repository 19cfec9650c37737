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

// Raw bytes owned by one allocation. CPU storage is 64-byte aligned.
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device = Device::CPU;
  bool owned = true;  // false: memory someone else allocated and frees (Tensor::borrow)
  explicit Storage(size_t bytes, Device device);
  // Memory owned elsewhere, not freed with this storage.
  Storage(void* data, size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

// Every tensor is row-major and contiguous. Views (reshape, rows along dim 0) share
// storage and never copy. An empty (default) tensor has no storage and numel 0.
class Tensor {
 public:
  Tensor() = default;
  // Uninitialised storage.
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  // fp32 tensor holding `values` (numel must match shape).
  static Tensor from(const Shape& shape, const std::vector<float>& values);
  static Tensor from_i32(const Shape& shape, const std::vector<int32_t>& values);
  // A tensor over memory that the caller owns (at least numel x dtype size bytes at data,
  // on `device`), which must outlive every use of the tensor and its views; it is not
  // freed with them (Comm::pull_input's peer-memory slots).
  static Tensor borrow(void* data, const Shape& shape, DType dtype, Device device);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Size of dimension i; negative i counts from the end.
  int64_t dim(int i) const;
  int64_t numel() const;
  size_t nbytes() const { return numel() * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::CPU; }

  void* raw() const;
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
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::BF16; }  // bf16 or f16 bits
template <> constexpr DType dtype_of<uint8_t>() { return DType::F8E4M3; }  // fp8 bits

template <typename T>
T* Tensor::data() const {
  constexpr DType want = dtype_of<T>();
  bool ok = dtype_ == want || (want == DType::BF16 && dtype_ == DType::F16) ||
            (want == DType::F8E4M3 && dtype_ == DType::F8E5M2);
  MEGATON_CHECK(ok, "tensor of dtype {} accessed as {}", dtype_name(dtype_), dtype_name(want));
  return static_cast<T*>(raw());
}

}  // namespace megaton
