// Multi-tensor optimizer ops on the GPU: multi_tensor_sum_of_squares,
// multi_tensor_count_zeros, multi_tensor_scale_, multi_tensor_adamw. One launch covers a
// batch of tensors whose pointers, sizes and per-tensor constants travel by value in a
// __grid_constant__ kernel parameter (at most 4 KB, the classic limit); block b of a
// launch processes one fixed-size chunk of one tensor. Hundreds of parameters take a
// handful of launches instead of one or more each, and the sum of squares and the zero
// count a single host synchronization each.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "ops/adam_control_math.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::compute_stream;
using detail::from_float;
using detail::is_aligned;
using detail::load_pack;
using detail::Pack;
using detail::store_pack;
using detail::to_float;

constexpr int kThreads = 256;
// Elements per block. Elementwise ops: 16 quads per thread, small enough that a model's
// many small tensors (biases, norms) still spread over the SMs. The sum of squares uses
// larger chunks so that its second pass, one block over all per-chunk partials, stays
// short (a 7B-parameter model gives ~110k partials).
constexpr int64_t kElementwiseChunk = 16384;
constexpr int64_t kReduceChunk = 65536;
// Blocks in one launch (gridDim.x allows 2^31 - 1); chunk indices fit in uint32.
constexpr int64_t kMaxBlocksPerLaunch = int64_t(1) << 30;
// The kernel-parameter space every CUDA version and architecture accepts.
constexpr size_t kMaxKernelParamBytes = 4096;

// ---- host: planning launches ----

// A batch of tensors for one launch: their indices in the caller's list (non-empty
// tensors only) and, for each, the first block (chunk) of the launch that covers it.
struct LaunchBatch {
  std::vector<size_t> tensors;
  std::vector<uint32_t> first_chunk;  // tensors.size() + 1 entries; the last is gridDim.x
  int64_t first_global_block = 0;     // blocks in the earlier batches of this call
};

// Splits the non-empty tensors (in list order) into batches of at most max_tensors tensors
// and kMaxBlocksPerLaunch chunks of `chunk` elements.
std::vector<LaunchBatch> plan_launches(const std::vector<int64_t>& numels, int64_t chunk,
                                       int max_tensors, const char* op) {
  std::vector<LaunchBatch> batches;
  int64_t global_block = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] == 0) continue;
    const int64_t chunks = (numels[i] + chunk - 1) / chunk;
    MEGATON_CHECK(chunks <= kMaxBlocksPerLaunch, "{}: tensor {} has {} elements, above {}", op, i,
                  numels[i], kMaxBlocksPerLaunch * chunk);
    if (batches.empty() || int(batches.back().tensors.size()) == max_tensors ||
        batches.back().first_chunk.back() + chunks > kMaxBlocksPerLaunch) {
      batches.emplace_back();
      batches.back().first_chunk.push_back(0);
      batches.back().first_global_block = global_block;
    }
    LaunchBatch& batch = batches.back();
    batch.tensors.push_back(i);
    batch.first_chunk.push_back(uint32_t(batch.first_chunk.back() + chunks));
    global_block += chunks;
  }
  return batches;
}

// ---- host: door checks ----

void check_listed(const Tensor& t, const char* op, const char* list, size_t i, bool allow_bf16) {
  MEGATON_CHECK(t.defined(), "{}: {}[{}] is undefined", op, list, i);
  MEGATON_CHECK(t.device() == Device::CUDA, "{}: {}[{}] must be on the GPU, it is on the CPU", op,
                list, i);
  MEGATON_CHECK(t.dtype() == DType::F32 || (allow_bf16 && t.dtype() == DType::BF16),
                "{}: {}[{}] must be F32{}, got {}", op, list, i, allow_bf16 ? " or BF16" : "",
                dtype_name(t.dtype()));
}

// ---- device: block -> (tensor, chunk) ----

// The tensor whose chunks cover this block: the t with first_chunk[t] <= blockIdx.x <
// first_chunk[t + 1] (every listed tensor has at least one chunk). The reads are uniform
// across the block, so they are broadcasts from the parameter bank.
__device__ __forceinline__ int tensor_of_block(const uint32_t* first_chunk, int num_tensors) {
  int lo = 0, hi = num_tensors;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first_chunk[mid] <= blockIdx.x)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// ---- sum of squares and scale: a list of F32 or BF16 tensors ----

// Tensors per launch: 22 bytes each.
constexpr int kListTensors = 160;
struct ListLaunch {
  void* data[kListTensors];
  int64_t numel[kListTensors];
  uint32_t first_chunk[kListTensors + 1];
  uint8_t is_bf16[kListTensors];
  // data is aligned for 4-element packs (16 bytes F32, 8 bytes BF16).
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
  const double acc =
      launch.is_bf16[t]
          ? chunk_sum_of_squares(static_cast<const __nv_bfloat16*>(launch.data[t]), begin, end,
                                 vectorized)
          : chunk_sum_of_squares(static_cast<const float*>(launch.data[t]), begin, end, vectorized);
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

// x *= s in fp32 (BF16 rounded to nearest even), as ops::scale_.
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
  if (launch.is_bf16[t])
    chunk_scale(static_cast<__nv_bfloat16*>(launch.data[t]), begin, end, launch.vectorized[t], s);
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
      meta.is_bf16[k] = t.dtype() == DType::BF16;
      meta.vectorized[k] = is_aligned(t.raw(), 4 * dtype_size(t.dtype()));
    }
    meta.first_chunk[batch.tensors.size()] = batch.first_chunk.back();
    launch_batch(meta, batch.first_chunk.back(), batch);
  }
}

// ---- AdamW ----

// Per-step constants shared by every tensor, computed on the host in fp64 (or on the
// device by adamw_step_control: the control tensor):
//   g = grad * grad_scale,
//   p = p * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps),
//   step_size = lr / (1 - b1^step), inv_sqrt_bc2 = 1 / sqrt(1 - b2^step),
//   decay = 1 - lr * wd (per tensor, weight_decay in AdamWLaunch; adamw_decay).
// grad_scale is the gradient-clipping coefficient (1 without clipping).
struct AdamWConstants {
  float beta1, beta2, eps, step_size, inv_sqrt_bc2, grad_scale, lr;
};

// float(1 - lr * wd) in fp64, each operation rounded on its own (never contracted into an
// FMA), so the host-scalar and the control paths give the same factor.
__device__ __forceinline__ float adamw_decay(float lr, float weight_decay) {
  return float(__dsub_rn(1.0, __dmul_rn(double(lr), double(weight_decay))));
}

// Kinds of param copy (param_copies[i]).
enum CopyKind : uint8_t { kNoCopy = 0, kCopyF32 = 1, kCopyBF16 = 2 };

// Tensors per launch: 59 bytes each.
constexpr int kAdamWTensors = 64;
struct AdamWLaunch {
  float* param[kAdamWTensors];
  const float* grad[kAdamWTensors];
  float* exp_avg[kAdamWTensors];
  float* exp_avg_sq[kAdamWTensors];
  void* copy[kAdamWTensors];
  int64_t numel[kAdamWTensors];
  uint32_t first_chunk[kAdamWTensors + 1];
  float weight_decay[kAdamWTensors];
  uint8_t copy_kind[kAdamWTensors];
  // param, grad and both moments 16-byte aligned: the update runs on float4, otherwise
  // element by element.
  uint8_t vectorized[kAdamWTensors];
  // The copy is aligned for a 4-element store (16 bytes F32, 8 bytes BF16).
  uint8_t copy_vectorized[kAdamWTensors];
  int32_t num_tensors;
};
static_assert(sizeof(AdamWLaunch) + sizeof(AdamWConstants) + sizeof(float*) <= kMaxKernelParamBytes);

// One AdamW element update (ops.h adamw_step's formula) from the gradient as stored.
// ops::adamw_step on the GPU (adam.cu) calls this kernel too, so single- and multi-tensor
// results are bitwise equal. The clipping scale is its own correctly rounded multiply
// (__fmul_rn is never contracted into an FMA), so g is bitwise the gradient that scale_
// would have written, and with grad_scale == 1 it is the stored gradient itself.
__device__ __forceinline__ void adamw_update(float& p, float grad, float& m, float& v, float decay,
                                             const AdamWConstants& c) {
  const float g = __fmul_rn(grad, c.grad_scale);
  m = c.beta1 * m + (1.0f - c.beta1) * g;
  v = c.beta2 * v + (1.0f - c.beta2) * g * g;
  p = p * decay - c.step_size * m / (sqrtf(v) * c.inv_sqrt_bc2 + c.eps);
}

struct NoCopy {};

// Elements [begin, end) of one tensor; Copy = float, __nv_bfloat16 or NoCopy.
template <typename Copy>
__device__ void adamw_chunk(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                            void* copy_raw, int64_t begin, int64_t end, bool vectorized,
                            bool copy_vectorized, float decay, const AdamWConstants& c) {
  [[maybe_unused]] Copy* copy = static_cast<Copy*>(copy_raw);
  for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kThreads) {
    if (vectorized && i + 4 <= end) {
      float4 p = *reinterpret_cast<const float4*>(param + i);
      const float4 g = *reinterpret_cast<const float4*>(grad + i);
      float4 m = *reinterpret_cast<const float4*>(exp_avg + i);
      float4 v = *reinterpret_cast<const float4*>(exp_avg_sq + i);
      adamw_update(p.x, g.x, m.x, v.x, decay, c);
      adamw_update(p.y, g.y, m.y, v.y, decay, c);
      adamw_update(p.z, g.z, m.z, v.z, decay, c);
      adamw_update(p.w, g.w, m.w, v.w, decay, c);
      *reinterpret_cast<float4*>(param + i) = p;
      *reinterpret_cast<float4*>(exp_avg + i) = m;
      *reinterpret_cast<float4*>(exp_avg_sq + i) = v;
      if constexpr (!std::is_same_v<Copy, NoCopy>) {
        Pack<Copy, 4> out;
        out.v[0] = from_float<Copy>(p.x);
        out.v[1] = from_float<Copy>(p.y);
        out.v[2] = from_float<Copy>(p.z);
        out.v[3] = from_float<Copy>(p.w);
        if (copy_vectorized) {
          store_pack<4>(copy + i, out);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) copy[i + j] = out.v[j];
        }
      }
    } else {
      for (int64_t j = i; j < end && j < i + 4; ++j) {
        float p = param[j], m = exp_avg[j], v = exp_avg_sq[j];
        adamw_update(p, grad[j], m, v, decay, c);
        param[j] = p;
        exp_avg[j] = m;
        exp_avg_sq[j] = v;
        if constexpr (!std::is_same_v<Copy, NoCopy>) copy[j] = from_float<Copy>(p);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    adamw_chunks(const __grid_constant__ AdamWLaunch launch, const AdamWConstants host_constants,
                 const float* control) {
  // With a control tensor (adamw_step_control's), the step's scalars come from the device.
  AdamWConstants c = host_constants;
  if (control != nullptr) {
    if (control[kAdamSkip] != 0.0f) return;
    c.step_size = control[kAdamStepSize];
    c.inv_sqrt_bc2 = control[kAdamInvSqrtBc2];
    c.grad_scale = control[kAdamGradScale];
    c.lr = control[kAdamLr];
  }
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kElementwiseChunk;
  const int64_t end = std::min(launch.numel[t], begin + kElementwiseChunk);
  const bool vectorized = launch.vectorized[t], copy_vectorized = launch.copy_vectorized[t];
  const float decay = adamw_decay(c.lr, launch.weight_decay[t]);
  switch (launch.copy_kind[t]) {
    case kCopyF32:
      adamw_chunk<float>(launch.param[t], launch.grad[t], launch.exp_avg[t], launch.exp_avg_sq[t],
                         launch.copy[t], begin, end, vectorized, copy_vectorized, decay, c);
      break;
    case kCopyBF16:
      adamw_chunk<__nv_bfloat16>(launch.param[t], launch.grad[t], launch.exp_avg[t],
                                 launch.exp_avg_sq[t], launch.copy[t], begin, end, vectorized,
                                 copy_vectorized, decay, c);
      break;
    default:
      adamw_chunk<NoCopy>(launch.param[t], launch.grad[t], launch.exp_avg[t], launch.exp_avg_sq[t],
                          nullptr, begin, end, vectorized, false, decay, c);
  }
}

}  // namespace

namespace {
// multi_tensor_sum_of_squares into result (fp64, device memory).
void sum_of_squares_to(const std::vector<Tensor>& tensors, double* result) {
  constexpr const char* kOp = "multi_tensor_sum_of_squares";
  for (size_t i = 0; i < tensors.size(); ++i) check_listed(tensors[i], kOp, "tensors", i, true);
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
  for (size_t i = 0; i < tensors.size(); ++i) check_listed(tensors[i], kOp, "tensors", i, false);
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
  for (size_t i = 0; i < tensors.size(); ++i) check_listed(tensors[i], kOp, "tensors", i, true);
  cudaStream_t stream = compute_stream();
  for_each_list_launch(tensors, kElementwiseChunk, kOp,
                       [&](const ListLaunch& meta, uint32_t blocks, const LaunchBatch&) {
                         scale_chunks<<<blocks, kThreads, 0, stream>>>(meta, scale);
                         MEGATON_CUDA_CHECK_LAUNCH();
                       });
}

namespace {
// multi_tensor_adamw's checks and launches; control: null (the scalars below) or
// adamw_step_control's device tensor.
void launch_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                  std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                  float lr, float beta1, float beta2, float eps, int64_t step, float grad_scale,
                  const float* control) {
  constexpr const char* kOp = "multi_tensor_adamw";
  const size_t n = params.size();
  MEGATON_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n &&
                    param_copies.size() == n && weight_decays.size() == n,
                "{}: list lengths differ: params {}, grads {}, exp_avg {}, exp_avg_sq {}, "
                "param_copies {}, weight_decays {}",
                kOp, n, grads.size(), exp_avg.size(), exp_avg_sq.size(), param_copies.size(),
                weight_decays.size());
  MEGATON_CHECK(step >= 1, "{}: step {} must be >= 1 (1-based)", kOp, step);
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "{}: betas ({}, {}) must be in [0, 1)", kOp, beta1, beta2);
  MEGATON_CHECK(std::isfinite(grad_scale), "{}: grad_scale {} must be finite", kOp, grad_scale);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    check_listed(params[i], kOp, "params", i, false);
    check_listed(grads[i], kOp, "grads", i, false);
    check_listed(exp_avg[i], kOp, "exp_avg", i, false);
    check_listed(exp_avg_sq[i], kOp, "exp_avg_sq", i, false);
    numels[i] = params[i].numel();
    const Tensor* entries[] = {&grads[i], &exp_avg[i], &exp_avg_sq[i]};
    for (const Tensor* t : entries)
      MEGATON_CHECK(t->numel() == numels[i], "{}: tensor {}: {} elements in a list, param has {}",
                    kOp, i, t->numel(), numels[i]);
    if (param_copies[i].defined()) {
      check_listed(param_copies[i], kOp, "param_copies", i, true);
      MEGATON_CHECK(param_copies[i].numel() == numels[i],
                    "{}: param_copies[{}] {} has {} elements, param has {}", kOp, i,
                    shape_str(param_copies[i].shape()), param_copies[i].numel(), numels[i]);
    }
  }
  // The single-tensor op (adam.cu) calls this function, so both get these bits.
  // By squaring, not pow: adamw_step_control computes the same bits on the device.
  const double bias_correction1 = 1.0 - power_by_squaring(double(beta1), step);
  const double bias_correction2 = 1.0 - power_by_squaring(double(beta2), step);
  const float step_size = float(lr / bias_correction1);
  const float inv_sqrt_bc2 = float(1.0 / std::sqrt(bias_correction2));
  const AdamWConstants constants{beta1, beta2, eps, step_size, inv_sqrt_bc2, grad_scale, lr};
  cudaStream_t stream = compute_stream();
  for (const LaunchBatch& batch : plan_launches(numels, kElementwiseChunk, kAdamWTensors, kOp)) {
    AdamWLaunch meta{};
    meta.num_tensors = int32_t(batch.tensors.size());
    for (size_t k = 0; k < batch.tensors.size(); ++k) {
      const size_t i = batch.tensors[k];
      meta.param[k] = params[i].f32();
      meta.grad[k] = grads[i].f32();
      meta.exp_avg[k] = exp_avg[i].f32();
      meta.exp_avg_sq[k] = exp_avg_sq[i].f32();
      meta.numel[k] = numels[i];
      meta.first_chunk[k] = batch.first_chunk[k];
      meta.weight_decay[k] = weight_decays[i];
      meta.vectorized[k] = is_aligned(meta.param[k], 16) && is_aligned(meta.grad[k], 16) &&
                           is_aligned(meta.exp_avg[k], 16) && is_aligned(meta.exp_avg_sq[k], 16);
      const Tensor& copy = param_copies[i];
      if (copy.defined()) {
        meta.copy[k] = copy.raw();
        meta.copy_kind[k] = copy.dtype() == DType::BF16 ? kCopyBF16 : kCopyF32;
        meta.copy_vectorized[k] = is_aligned(copy.raw(), 4 * dtype_size(copy.dtype()));
      }
    }
    meta.first_chunk[batch.tensors.size()] = batch.first_chunk.back();
    adamw_chunks<<<batch.first_chunk.back(), kThreads, 0, stream>>>(meta, constants, control);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}
}  // namespace

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale) {
  launch_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, lr, beta1, beta2,
               eps, step, grad_scale, nullptr);
}

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control) {
  MEGATON_CHECK(control.defined() && control.dtype() == DType::F32 &&
                    control.numel() == kAdamControlSize && control.device() == Device::CUDA,
                "multi_tensor_adamw: control must be F32 [{}] on the GPU", kAdamControlSize);
  // Step 1, scale 1 and lr 0 pass the host checks; the kernels take the device's values.
  launch_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, 0.0f, beta1, beta2,
               eps, 1, 1.0f, control.f32());
}

}  // namespace megaton::ops::cuda
