// Token dropping by expert capacity on the GPU. Semantics: ops.h; CPU twin:
// ops/cpu/moe_router_capacity.cpp; source: Megatron-LM transformer/moe/moe_utils.py
// (apply_router_token_dropping). moe_mark_dropped (the routing map after dropping) is one
// elementwise kernel at the end of the file.
//
// Entries (flat index t * k + j) are ranked within their expert by one radix sort of a
// 64-bit key: the expert in the high word, and in the low word (policy probs) the
// probability's bits mapped to an unsigned order and inverted, so larger probabilities
// come first. The sort is stable and its input is in flat order, so equal keys keep the
// lower flat index first, the CPU's tie order; the position policy sorts on the expert word
// alone. An entry is kept when its position in the sorted list, less its expert's first
// position, is below the capacity. Integers only: deterministic, and no host
// synchronization.
#include <bit>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

constexpr int kThreads = 256;

// ---- host: door checks ----

constexpr const char* kOp = "moe_capacity_drop";
void check_on_gpu(const Tensor& t, DType want, const char* name) {
  detail::check_dtype(t, want, kOp, name);
}
void check_shape(const Tensor& t, const Shape& want, const char* name) {
  detail::check_shape(t, want, kOp, name);
}

// ---- device ----

// The sort key of entry i: expert in bits 32.., an index outside [0, E) becoming E (a
// segment of its own, after every expert, never kept); below it, for the probs policy,
// ~u with u the probability's bits in an unsigned order (-0 taken as +0, as the CPU's
// comparisons do), so a larger probability has the smaller key.
__global__ void capacity_keys_kernel(const float* __restrict__ probs,
                                     const int32_t* __restrict__ indices, int64_t n, int E,
                                     bool by_position, uint64_t* __restrict__ keys,
                                     int32_t* __restrict__ entries) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t e = indices[i];
    const uint32_t expert = e >= 0 && e < E ? uint32_t(e) : uint32_t(E);
    uint32_t low = 0;
    if (!by_position) {
      uint32_t bits = __float_as_uint(probs[i]);
      if ((bits & 0x7fffffffu) == 0) bits = 0;  // -0 -> +0
      const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
      low = ~ordered;
    }
    keys[i] = uint64_t(expert) << 32 | low;
    entries[i] = int32_t(i);
  }
}

// Each expert's segment [first[e], end[e]) of the sorted list, from its boundaries
// (experts without entries keep the zeros they were cleared to).
__global__ void capacity_segments_kernel(const uint64_t* __restrict__ sorted_keys, int64_t n, int E,
                                         int32_t* __restrict__ first, int32_t* __restrict__ end) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t e = uint32_t(sorted_keys[i] >> 32);
    if (e >= uint32_t(E)) continue;
    if (i == 0 || uint32_t(sorted_keys[i - 1] >> 32) != e) first[e] = int32_t(i);
    if (i == n - 1 || uint32_t(sorted_keys[i + 1] >> 32) != e) end[e] = int32_t(i + 1);
  }
}

__global__ void capacity_keep_kernel(const uint64_t* __restrict__ sorted_keys,
                                     const int32_t* __restrict__ sorted_entries, int64_t n, int E,
                                     int64_t capacity, const int32_t* __restrict__ first,
                                     float* __restrict__ keep) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t e = uint32_t(sorted_keys[i] >> 32);
    const bool kept = e < uint32_t(E) && i - first[e] < capacity;
    keep[sorted_entries[i]] = kept ? 1.0f : 0.0f;
  }
}

__global__ void capacity_counts_kernel(const int32_t* __restrict__ first,
                                       const int32_t* __restrict__ end, int E, int64_t capacity,
                                       float* __restrict__ kept_counts) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    const int64_t routed = end[e] - first[e];
    kept_counts[e] += float(routed < capacity ? routed : capacity);
  }
}

// routed[i] = indices[i] where keep[i] != 0, else E (the dropped marker).
__global__ void mark_dropped_kernel(const int32_t* __restrict__ indices,
                                    const float* __restrict__ keep, int64_t n, int32_t E,
                                    int32_t* __restrict__ routed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    routed[i] = keep[i] != 0.0f ? indices[i] : E;
}

}  // namespace

void moe_capacity_drop(const Tensor& probs, const Tensor& indices, int64_t num_experts,
                       int64_t capacity, bool by_position, Tensor& keep, Tensor& kept_counts) {
  check_on_gpu(probs, DType::F32, "probs");
  MEGATON_CHECK(probs.ndim() == 2, "moe_capacity_drop: probs must be [T, k], got {}",
                shape_str(probs.shape()));
  check_on_gpu(indices, DType::I32, "indices");
  check_shape(indices, probs.shape(), "indices");
  check_on_gpu(keep, DType::F32, "keep");
  check_shape(keep, probs.shape(), "keep");
  MEGATON_CHECK(num_experts >= 1 && num_experts < INT32_MAX,
                "moe_capacity_drop: num_experts {} must be in [1, {})", num_experts, INT32_MAX);
  MEGATON_CHECK(capacity >= 0, "moe_capacity_drop: capacity {} must be >= 0", capacity);
  check_on_gpu(kept_counts, DType::F32, "kept_counts");
  check_shape(kept_counts, {num_experts}, "kept_counts");
  const int64_t n = probs.numel();
  MEGATON_CHECK(n <= INT32_MAX, "moe_capacity_drop: {} entries exceed the int32 sort", n);
  if (n == 0) return;
  const int E = int(num_experts);
  cudaStream_t stream = ::megaton::cuda::stream();

  Tensor keys = Tensor::empty({2, n}, DType::I64, Device::CUDA);  // in, sorted
  Tensor entries = Tensor::empty({2, n}, DType::I32, Device::CUDA);
  Tensor segments = Tensor::empty({2, num_experts}, DType::I32, Device::CUDA);  // first, end
  auto* keys_in = reinterpret_cast<uint64_t*>(keys.i64());
  uint64_t* keys_sorted = keys_in + n;
  int32_t *entries_in = entries.i32(), *entries_sorted = entries_in + n;
  int32_t *first = segments.i32(), *end = first + num_experts;

  capacity_keys_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(
      probs.f32(), indices.i32(), n, E, by_position, keys_in, entries_in);
  MEGATON_CUDA_CHECK_LAUNCH();

  // Expert values 0 .. E (E: an index outside the range) need bit_width(E) bits.
  const int begin_bit = by_position ? 32 : 0;
  const int end_bit = 32 + int(std::bit_width(uint32_t(E)));
  size_t temp_bytes = 0;
  MEGATON_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_sorted,
                                                     entries_in, entries_sorted, int(n), begin_bit,
                                                     end_bit, stream));
  Tensor temp = Tensor::empty({int64_t(temp_bytes / 8 + 1)}, DType::I64, Device::CUDA);
  MEGATON_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw(), temp_bytes, keys_in, keys_sorted,
                                                     entries_in, entries_sorted, int(n), begin_bit,
                                                     end_bit, stream));

  MEGATON_CUDA_CHECK(cudaMemsetAsync(segments.raw(), 0, segments.nbytes(), stream));
  capacity_segments_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(keys_sorted, n,
                                                                                   E, first, end);
  MEGATON_CUDA_CHECK_LAUNCH();
  capacity_keep_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(
      keys_sorted, entries_sorted, n, E, capacity, first, keep.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
  capacity_counts_kernel<<<detail::grid_for(num_experts, kThreads), kThreads, 0, stream>>>(
      first, end, E, capacity, kept_counts.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void moe_mark_dropped(const Tensor& indices, const Tensor& keep, int64_t num_experts,
                      Tensor& routed) {
  constexpr const char* op = "moe_mark_dropped";
  detail::check_dtype(indices, DType::I32, op, "indices");
  MEGATON_CHECK(indices.ndim() == 2, "moe_mark_dropped: indices must be [T, k], got {}",
                shape_str(indices.shape()));
  detail::check_dtype(keep, DType::F32, op, "keep");
  detail::check_shape(keep, indices.shape(), op, "keep");
  detail::check_dtype(routed, DType::I32, op, "routed");
  detail::check_shape(routed, indices.shape(), op, "routed");
  MEGATON_CHECK(num_experts >= 1 && num_experts < INT32_MAX,
                "moe_mark_dropped: num_experts {} must be in [1, {})", num_experts, INT32_MAX);
  const int64_t n = indices.numel();
  if (n == 0) return;
  MEGATON_CHECK(routed.raw() != indices.raw(), "moe_mark_dropped: routed must not alias indices");
  mark_dropped_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, ::megaton::cuda::stream()>>>(
      indices.i32(), keep.f32(), n, int32_t(num_experts), routed.i32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
