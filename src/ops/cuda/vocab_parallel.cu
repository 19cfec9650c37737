// Vocab-parallel softmax cross entropy on the GPU (semantics: ops.h, CPU twin:
// ops/cpu/vocab_parallel.cpp); the vocab-parallel embedding is in embedding.cu.
//
// Labels outside this rank's vocabulary rows are expected (another rank holds them), so
// every label is range-checked on the device. A negative label gives a NaN target logit
// and a NaN gradient row (the CPU twin throws), as a bad label does in cross_entropy.cu.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cross_entropy_rows.cuh"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::atomic_add_pack;
using detail::compute_stream;
using detail::from_float;
using detail::kPackElems;
using detail::load_pack;
using detail::MaxSum;
using detail::Pack;
using detail::pack_aligned;
using detail::store_pack;
using detail::to_float;

// ---- host: door checks and launch shapes ----

void check_vocab_start(const char* op, int64_t vocab_start) {
  MEGATON_CHECK(vocab_start >= 0, "{}: vocab_start {} is negative", op, vocab_start);
}

// logits [T, V_local] F32, BF16 or F16 with V_local > 0 and T within the grid (a block per
// row); labels [T] I32.
void check_logits_labels(const char* op, const Tensor& logits, const Tensor& labels,
                         int64_t vocab_start) {
  detail::check_float(logits, op, "logits");
  MEGATON_CHECK(logits.ndim() == 2 && logits.dim(1) > 0,
                "{}: logits must be [T, V_local] with V_local > 0, got {}", op,
                shape_str(logits.shape()));
  MEGATON_CHECK(logits.dim(0) <= INT32_MAX, "{}: {} rows exceed the grid limit", op, logits.dim(0));
  detail::check_dtype(labels, DType::I32, op, "labels");
  MEGATON_CHECK(labels.shape() == Shape{logits.dim(0)}, "{}: labels {} must be [{}]", op,
                shape_str(labels.shape()), logits.dim(0));
  check_vocab_start(op, vocab_start);
}

// An fp32 per-token statistic [T] on the GPU.
void check_stat(const char* op, const Tensor& t, int64_t T, const char* name) {
  detail::check_dtype(t, DType::F32, op, name);
  MEGATON_CHECK(t.shape() == Shape{T}, "{}: {} {} must be [{}]", op, name, shape_str(t.shape()), T);
}

constexpr int kStatThreads = 256;

// ---- device ----

// One block per row of the shard: row_max, sum_exp (relative to row_max) and the target
// logit (0 when another rank holds the label, NaN for a negative label).
template <typename T, int kN>
__global__ void cross_entropy_partial_stats_kernel(
    const T* __restrict__ logits, const int32_t* __restrict__ labels, float* __restrict__ row_max,
    float* __restrict__ sum_exp, float* __restrict__ target_logit, int64_t V, int64_t vocab_start) {
  const int64_t t = blockIdx.x;
  const T* row = logits + t * V;
  const MaxSum acc = detail::block_row_max_sum<T, kN>(row, V);
  if (threadIdx.x == 0) {
    const int32_t label = labels[t];
    const int64_t local_label = int64_t(label) - vocab_start;
    row_max[t] = acc.max;
    sum_exp[t] = acc.sum;
    target_logit[t] = label < 0                               ? NAN
                      : (local_label >= 0 && local_label < V) ? to_float(row[local_label])
                                                              : 0.0f;
  }
}

__global__ void cross_entropy_rescale_sum_exp_kernel(const float* __restrict__ row_max,
                                                     const float* __restrict__ global_max,
                                                     float* __restrict__ sum_exp, int64_t T) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < T;
       t += int64_t(gridDim.x) * blockDim.x) {
    const float m = row_max[t], g = global_max[t];
    // The rank holding the maximum keeps its sum (also when both are -inf, where
    // exp(-inf - -inf) would be NaN).
    if (m != g) sum_exp[t] *= expf(m - g);
  }
}

__global__ void cross_entropy_finish_kernel(const float* __restrict__ global_max,
                                            const float* __restrict__ sum_exp,
                                            const float* __restrict__ target_logit,
                                            float* __restrict__ losses, float* __restrict__ lse,
                                            int64_t T) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < T;
       t += int64_t(gridDim.x) * blockDim.x) {
    const float row_lse = global_max[t] + logf(sum_exp[t]);
    lse[t] = row_lse;
    losses[t] = row_lse - target_logit[t];
  }
}

// dlogits[t, v] = dlosses[t] * (exp(logits[t, v] - lse[t]) - [v + vocab_start ==
// labels[t]]); dlogits may alias logits (detail::cross_entropy_backward_row), hence no
// __restrict__ on them.
template <typename T, int kN>
__global__ void cross_entropy_backward_vocab_range_kernel(const float* __restrict__ dlosses,
                                                          const T* logits,
                                                          const int32_t* __restrict__ labels,
                                                          const float* __restrict__ lse, T* dlogits,
                                                          int64_t V, int64_t vocab_start) {
  const int64_t t = blockIdx.x;
  // Labels are global: any non-negative one is valid here (no upper bound).
  detail::cross_entropy_backward_row<T, kN>(dlosses[t], logits + t * V, labels[t], lse[t],
                                            dlogits + t * V, V, vocab_start,
                                            /*label_end=*/INT64_MAX);
}

}  // namespace

void cross_entropy_partial_stats(const Tensor& logits, const Tensor& labels, int64_t vocab_start,
                                 Tensor& row_max, Tensor& sum_exp, Tensor& target_logit) {
  const char* op = "cross_entropy_partial_stats";
  check_logits_labels(op, logits, labels, vocab_start);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_stat(op, row_max, T, "row_max");
  check_stat(op, sum_exp, T, "sum_exp");
  check_stat(op, target_logit, T, "target_logit");
  if (T == 0) return;
  const bool packed = detail::rows_fit_packs(V, dtype_size(logits.dtype()), {logits.raw()});
  detail::dispatch_float(logits.dtype(), [&](auto tag) {
    using T_elem = decltype(tag);
    auto launch = [&](auto pack) {
      constexpr int kN = decltype(pack)::value;
      cross_entropy_partial_stats_kernel<T_elem, kN>
          <<<unsigned(T), detail::cross_entropy_threads(V / kN), 0, compute_stream()>>>(
              static_cast<const T_elem*>(logits.raw()), labels.i32(), row_max.f32(), sum_exp.f32(),
              target_logit.f32(), V, vocab_start);
    };
    if (packed)
      launch(std::integral_constant<int, kPackElems<T_elem>>{});
    else
      launch(std::integral_constant<int, 1>{});
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_rescale_sum_exp(const Tensor& row_max, const Tensor& global_max,
                                   Tensor& sum_exp) {
  const char* op = "cross_entropy_rescale_sum_exp";
  detail::check_dtype(sum_exp, DType::F32, op, "sum_exp");
  MEGATON_CHECK(sum_exp.ndim() == 1, "{}: sum_exp must be [T], got {}", op,
                shape_str(sum_exp.shape()));
  const int64_t T = sum_exp.dim(0);
  check_stat(op, row_max, T, "row_max");
  check_stat(op, global_max, T, "global_max");
  if (T == 0) return;
  cross_entropy_rescale_sum_exp_kernel<<<detail::grid_for(T, kStatThreads), kStatThreads, 0,
                                         compute_stream()>>>(row_max.f32(), global_max.f32(),
                                                             sum_exp.f32(), T);
  MEGATON_CUDA_CHECK_LAUNCH();
}

void cross_entropy_finish(const Tensor& global_max, const Tensor& sum_exp,
                          const Tensor& target_logit, Tensor& losses, Tensor& lse) {
  const char* op = "cross_entropy_finish";
  detail::check_dtype(sum_exp, DType::F32, op, "sum_exp");
  MEGATON_CHECK(sum_exp.ndim() == 1, "{}: sum_exp must be [T], got {}", op,
                shape_str(sum_exp.shape()));
  const int64_t T = sum_exp.dim(0);
  check_stat(op, global_max, T, "global_max");
  check_stat(op, target_logit, T, "target_logit");
  check_stat(op, losses, T, "losses");
  check_stat(op, lse, T, "lse");
  if (T == 0) return;
  cross_entropy_finish_kernel<<<detail::grid_for(T, kStatThreads), kStatThreads, 0,
                                compute_stream()>>>(global_max.f32(), sum_exp.f32(),
                                                    target_logit.f32(), losses.f32(), lse.f32(), T);
  MEGATON_CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward_vocab_range(const Tensor& dlosses, const Tensor& logits,
                                        const Tensor& labels, const Tensor& lse,
                                        int64_t vocab_start, Tensor& dlogits) {
  const char* op = "cross_entropy_backward_vocab_range";
  check_logits_labels(op, logits, labels, vocab_start);
  const int64_t T = logits.dim(0), V = logits.dim(1);
  check_stat(op, dlosses, T, "dlosses");
  check_stat(op, lse, T, "lse");
  detail::check_dtype(dlogits, logits.dtype(), op, "dlogits");
  MEGATON_CHECK(dlogits.shape() == logits.shape(), "{}: dlogits {} must match logits {}", op,
                shape_str(dlogits.shape()), shape_str(logits.shape()));
  // In place (the same elements) is supported; a partial overlap would let one row's
  // writes feed another row's reads.
  const char* in = static_cast<const char*>(logits.raw());
  const char* out = static_cast<const char*>(dlogits.raw());
  const size_t bytes = logits.nbytes();
  MEGATON_CHECK(in == out || in + bytes <= out || out + bytes <= in,
                "{}: dlogits partially overlaps logits (in place must be exact)", op);
  if (T == 0) return;
  const bool packed =
      detail::rows_fit_packs(V, dtype_size(logits.dtype()), {logits.raw(), dlogits.raw()});
  detail::dispatch_float(logits.dtype(), [&](auto tag) {
    using T_elem = decltype(tag);
    auto launch = [&](auto pack) {
      constexpr int kN = decltype(pack)::value;
      cross_entropy_backward_vocab_range_kernel<T_elem, kN>
          <<<unsigned(T), detail::cross_entropy_threads(V / kN), 0, compute_stream()>>>(
              dlosses.f32(), static_cast<const T_elem*>(logits.raw()), labels.i32(), lse.f32(),
              static_cast<T_elem*>(dlogits.raw()), V, vocab_start);
    };
    if (packed)
      launch(std::integral_constant<int, kPackElems<T_elem>>{});
    else
      launch(std::integral_constant<int, 1>{});
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace megaton::ops::cuda
