// The launch machinery shared by the multi-tensor kernels (multi_tensor.cu,
// multi_tensor_adamw.cu): a batch of tensors per launch whose pointers, sizes and
// per-tensor constants travel by value in a __grid_constant__ kernel parameter (at most
// 4 KB, the classic limit); block b of a launch processes one fixed-size chunk of one
// tensor. Internal to those files (an unnamed namespace per translation unit).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cuda/cuda_check.h"
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

// The dtypes a list's entries may have.
enum class Listed : uint8_t {
  kF32,        // main params
  kF32OrBF16,  // main grads read by AdamW (BF16: --main-grads-dtype bf16)
  kFloat,      // F32, BF16 or F16: the compute weights
  kAdamMoment, // F32, BF16, F16 or F8E4M3: AdamW moments (the precision-aware optimizer)
};

void check_listed(const Tensor& t, const char* op, const char* list, size_t i, Listed allowed) {
  MEGATON_CHECK(t.defined(), "{}: {}[{}] is undefined", op, list, i);
  MEGATON_CHECK(t.device() == Device::CUDA, "{}: {}[{}] must be on the GPU, it is on the CPU", op,
                list, i);
  const DType d = t.dtype();
  const bool ok = d == DType::F32 || (allowed != Listed::kF32 && d == DType::BF16) ||
                  (allowed == Listed::kFloat && d == DType::F16) ||
                  (allowed == Listed::kAdamMoment && (d == DType::F16 || d == DType::F8E4M3));
  MEGATON_CHECK(ok, "{}: {}[{}] must be {}, got {}", op, list, i,
                allowed == Listed::kF32         ? "F32"
                : allowed == Listed::kF32OrBF16 ? "F32 or BF16"
                : allowed == Listed::kFloat     ? "F32, BF16 or F16"
                                                : "F32, BF16, F16 or F8_E4M3",
                dtype_name(d));
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
}  // namespace
}  // namespace megaton::ops::cuda
