// Multi-tensor optimizer ops on the GPU: multi_tensor_sum_of_squares,
// multi_tensor_count_zeros, multi_tensor_scale_ (multi_tensor_adamw: multi_tensor_adamw.cu).
// One launch covers a batch of tensors (multi_tensor_launch.cuh). Hundreds of parameters
// take a handful of launches instead of one or more each, and the sum of squares and the
// zero count a single host synchronization each.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/multi_tensor_launch.cuh"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

// ---- sum of squares and scale: a list of F32, BF16 or F16 tensors ----

// A list entry's dtype.
enum ElemType : uint8_t { kElemF32 = 0, kElemBF16 = 1, kElemF16 = 2 };

// Tensors per launch: 22 bytes each.
constexpr int kListTensors = 160;
struct ListLaunch {
  void* data[kListTensors];
  int64_t numel[kListTensors];
  uint32_t first_chunk[kListTensors + 1];
  uint8_t elem_type[kListTensors];  // ElemType
  // data is aligned for 4-element packs (16 bytes F32, 8 bytes BF16 or F16).
  uint8_t vectorized[kListTensors];
  int32_t num_tensors;
};
static_assert(sizeof(ListLaunch) + 2 * sizeof(void*) <= kMaxKernelParamBytes);

// Elements [begin, end) of x; thread k takes quads k, k + kThreads, ... and adds each
// quad's four squares in element order. The scalar path (misaligned tensor, last partial
// quad) follows the same order, so the sum does not depend on the alignment.
template <typename T>
__device__ double chunk_sum_of_squares(const T* x, int64_t begin, int64_t end, bool vectorized) {
  double acc = 0.0;
  for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kThreads) {
    if (vectorized && i + 4 <= end) {
      const Pack<T, 4> pack = load_pack<4>(x + i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const double v = to_float(pack.v[j]);
        acc += v * v;
      }
    } else {
      for (int64_t j = i; j < end && j < i + 4; ++j) {
        const double v = to_float(x[j]);
        acc += v * v;
      }
    }
  }
  return acc;
}

// Sum over the block of one double per thread in a fixed tree order; valid in thread 0.
__device__ double block_sum(double v) {
  __shared__ double shared[kThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

// Pass 1: partials[blockIdx.x] = the fp64 sum of squares of this block's chunk.
__global__ void __launch_bounds__(kThreads)
    sum_of_squares_partials(const __grid_constant__ ListLaunch launch, double* partials) {
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kReduceChunk;
  const int64_t end = std::min(launch.numel[t], begin + kReduceChunk);
  const bool vectorized = launch.vectorized[t];
  const void* data = launch.data[t];
  const double acc =
      launch.elem_type[t] == kElemBF16
          ? chunk_sum_of_squares(static_cast<const __nv_bfloat16*>(data), begin, end, vectorized)
      : launch.elem_type[t] == kElemF16
          ? chunk_sum_of_squares(static_cast<const __half*>(data), begin, end, vectorized)
          : chunk_sum_of_squares(static_cast<const float*>(data), begin, end, vectorized);
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Pass 2, one block: result[0] = the sum of all partials, in an order fixed by `count`.
__global__ void __launch_bounds__(kThreads)
    sum_of_squares_finish(const double* partials, int64_t count, double* result) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) acc += partials[i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) result[0] = total;
}

// ---- count zeros: a list of F32 tensors (the list machinery above, always F32) ----

// 1 for +0 and -0, the two floats whose bits, sign dropped, are all zero. On the bits
// rather than v == 0.0f so that a flush-to-zero build cannot count denormals.
__device__ __forceinline__ unsigned int is_zero(float v) { return (__float_as_uint(v) << 1) == 0u; }

// Zeros among elements [begin, end) of x, this thread's quads (as chunk_sum_of_squares).
// At most kReduceChunk / kThreads per thread.
__device__ unsigned int chunk_count_zeros(const float* x, int64_t begin, int64_t end,
                                          bool vectorized) {
  unsigned int count = 0;
  for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kThreads) {
    if (vectorized && i + 4 <= end) {
      const Pack<float, 4> pack = load_pack<4>(x + i);
#pragma unroll
      for (int j = 0; j < 4; ++j) count += is_zero(pack.v[j]);
    } else {
      for (int64_t j = i; j < end && j < i + 4; ++j) count += is_zero(x[j]);
    }
  }
  return count;
}

// Sum over the block of one count per thread; valid in thread 0. A chunk has at most
// kReduceChunk (2^16) zeros, so 32 bits hold the block's total.
__device__ unsigned int block_count(unsigned int v) {
  __shared__ unsigned int warp_totals[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) warp_totals[threadIdx.x / 32] = v;
  __syncthreads();
  unsigned int total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) total += warp_totals[w];
  return total;
}

// *count += zeros in this block's chunk. Integer addition is exact in any order, so the
// atomics need no second pass to be deterministic.
__global__ void __launch_bounds__(kThreads)
    count_zeros_chunks(const __grid_constant__ ListLaunch launch, unsigned long long* count) {
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kReduceChunk;
  const int64_t end = std::min(launch.numel[t], begin + kReduceChunk);
  const unsigned int zeros = block_count(chunk_count_zeros(
      static_cast<const float*>(launch.data[t]), begin, end, launch.vectorized[t]));
  if (threadIdx.x == 0 && zeros != 0) atomicAdd(count, static_cast<unsigned long long>(zeros));
}

// x *= s in fp32 (BF16 and F16 rounded to nearest even), as ops::scale_.
template <typename T>
__device__ void chunk_scale(T* x, int64_t begin, int64_t end, bool vectorized, float s) {
  for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kThreads) {
    if (vectorized && i + 4 <= end) {
      Pack<T, 4> pack = load_pack<4>(x + i);
#pragma unroll
      for (int j = 0; j < 4; ++j) pack.v[j] = from_float<T>(to_float(pack.v[j]) * s);
      store_pack<4>(x + i, pack);
    } else {
      for (int64_t j = i; j < end && j < i + 4; ++j) x[j] = from_float<T>(to_float(x[j]) * s);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    scale_chunks(const __grid_constant__ ListLaunch launch, float s) {
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kElementwiseChunk;
  const int64_t end = std::min(launch.numel[t], begin + kElementwiseChunk);
  if (launch.elem_type[t] == kElemBF16)
    chunk_scale(static_cast<__nv_bfloat16*>(launch.data[t]), begin, end, launch.vectorized[t], s);
  else if (launch.elem_type[t] == kElemF16)
    chunk_scale(static_cast<__half*>(launch.data[t]), begin, end, launch.vectorized[t], s);
  else
    chunk_scale(static_cast<float*>(launch.data[t]), begin, end, launch.vectorized[t], s);
}

// Fills and launches one ListLaunch per batch; launch_batch(meta, blocks, batch).
template <typename F>
void for_each_list_launch(const std::vector<Tensor>& tensors, int64_t chunk, const char* op,
                          F&& launch_batch) {
  std::vector<int64_t> numels(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) numels[i] = tensors[i].numel();
  for (const LaunchBatch& batch : plan_launches(numels, chunk, kListTensors, op)) {
    ListLaunch meta{};
    meta.num_tensors = int32_t(batch.tensors.size());
    for (size_t k = 0; k < batch.tensors.size(); ++k) {
      const Tensor& t = tensors[batch.tensors[k]];
      meta.data[k] = t.raw();
      meta.numel[k] = t.numel();
      meta.first_chunk[k] = batch.first_chunk[k];
      meta.elem_type[k] = t.dtype() == DType::BF16  ? kElemBF16
                          : t.dtype() == DType::F16 ? kElemF16
                                                    : kElemF32;
      meta.vectorized[k] = is_aligned(t.raw(), 4 * dtype_size(t.dtype()));
    }
    meta.first_chunk[batch.tensors.size()] = batch.first_chunk.back();
    launch_batch(meta, batch.first_chunk.back(), batch);
  }
}

}  // namespace

namespace {
// multi_tensor_sum_of_squares into result (fp64, device memory).
void sum_of_squares_to(const std::vector<Tensor>& tensors, double* result) {
  constexpr const char* kOp = "multi_tensor_sum_of_squares";
  for (size_t i = 0; i < tensors.size(); ++i)
    check_listed(tensors[i], kOp, "tensors", i, Listed::kFloat);
  int64_t total_blocks = 0;
  for (const Tensor& t : tensors) total_blocks += (t.numel() + kReduceChunk - 1) / kReduceChunk;
  cudaStream_t stream = compute_stream();
  if (total_blocks == 0) {
    MEGATON_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), stream));  // +0.0
    return;
  }
  // fp64 scratch: one partial per block of every launch (no F64 dtype; I64 has the size).
  Tensor scratch = Tensor::empty({total_blocks}, DType::I64, Device::CUDA);
  double* partials = static_cast<double*>(scratch.raw());
  for_each_list_launch(tensors, kReduceChunk, kOp,
                       [&](const ListLaunch& meta, uint32_t blocks, const LaunchBatch& batch) {
                         sum_of_squares_partials<<<blocks, kThreads, 0, stream>>>(
                             meta, partials + batch.first_global_block);
                         MEGATON_CUDA_CHECK_LAUNCH();
                       });
  sum_of_squares_finish<<<1, kThreads, 0, stream>>>(partials, total_blocks, result);
  MEGATON_CUDA_CHECK_LAUNCH();
}
}  // namespace

double multi_tensor_sum_of_squares(const std::vector<Tensor>& tensors) {
  Tensor out = Tensor::empty({1}, DType::I64, Device::CUDA);
  sum_of_squares_to(tensors, static_cast<double*>(out.raw()));
  double host = 0.0;
  MEGATON_CUDA_CHECK(cudaMemcpyAsync(&host, out.raw(), sizeof(double), cudaMemcpyDeviceToHost,
                                     compute_stream()));
  ::megaton::cuda::synchronize();
  return host;
}

void multi_tensor_sum_of_squares(const std::vector<Tensor>& tensors, Tensor& out) {
  MEGATON_CHECK(out.defined() && out.dtype() == DType::I64 && out.numel() == 1 &&
                    out.device() == Device::CUDA,
                "multi_tensor_sum_of_squares: out must be I64 [1] (fp64 bits) on the GPU");
  sum_of_squares_to(tensors, static_cast<double*>(out.raw()));
}

int64_t multi_tensor_count_zeros(const std::vector<Tensor>& tensors) {
  constexpr const char* kOp = "multi_tensor_count_zeros";
  for (size_t i = 0; i < tensors.size(); ++i)
    check_listed(tensors[i], kOp, "tensors", i, Listed::kF32);
  int64_t total_elements = 0;
  for (const Tensor& t : tensors) total_elements += t.numel();
  if (total_elements == 0) return 0;
  // One uint64 counter (I64 has the size), zeroed in stream order before the launches.
  Tensor counter = Tensor::empty({1}, DType::I64, Device::CUDA);
  auto* count = static_cast<unsigned long long*>(counter.raw());
  cudaStream_t stream = compute_stream();
  MEGATON_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned long long), stream));
  for_each_list_launch(tensors, kReduceChunk, kOp,
                       [&](const ListLaunch& meta, uint32_t blocks, const LaunchBatch&) {
                         count_zeros_chunks<<<blocks, kThreads, 0, stream>>>(meta, count);
                         MEGATON_CUDA_CHECK_LAUNCH();
                       });
  unsigned long long host = 0;
  MEGATON_CUDA_CHECK(
      cudaMemcpyAsync(&host, count, sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream));
  ::megaton::cuda::synchronize();
  return static_cast<int64_t>(host);
}

void multi_tensor_scale_(std::vector<Tensor>& tensors, float scale) {
  constexpr const char* kOp = "multi_tensor_scale_";
  for (size_t i = 0; i < tensors.size(); ++i)
    check_listed(tensors[i], kOp, "tensors", i, Listed::kFloat);
  cudaStream_t stream = compute_stream();
  for_each_list_launch(tensors, kElementwiseChunk, kOp,
                       [&](const ListLaunch& meta, uint32_t blocks, const LaunchBatch&) {
                         scale_chunks<<<blocks, kThreads, 0, stream>>>(meta, scale);
                         MEGATON_CUDA_CHECK_LAUNCH();
                       });
}

}  // namespace megaton::ops::cuda
