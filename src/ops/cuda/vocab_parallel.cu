// Vocab-parallel embedding and softmax cross entropy on the GPU (semantics: ops.h, CPU
// twin: ops/cpu/vocab_parallel.cpp).
//
// Global ids outside this rank's vocabulary rows are expected (another rank holds them),
// so every id and label is range-checked on the device: an id another rank holds gives a
// zero output row and no gradient, never an access outside the shard. A negative label
// gives a NaN target logit and a NaN gradient row (the CPU twin throws), as a bad label
// does in cross_entropy.cu; a negative token id is simply outside every shard.
//
// embedding_backward_vocab_range accumulates with fp32 atomicAdd, as embedding_backward:
// when an id repeats within the batch the last bits of dtable can change from run to run.
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

// ids any rank (T = numel) I32; table [V_local, H]; rows [T, H] or ids.shape + [H].
void check_embedding(const char* op, const Tensor& ids, const Tensor& table, const char* table_name,
                     const Tensor& rows, const char* rows_name, int64_t vocab_start) {
  detail::check_dtype(ids, DType::I32, op, "ids");
  detail::check_cuda_tensor(table, op, table_name);
  detail::check_cuda_tensor(rows, op, rows_name);
  MEGATON_CHECK(table.ndim() == 2, "{}: {} must be [V_local, H], got {}", op, table_name,
                shape_str(table.shape()));
  const int64_t hidden = table.dim(1);
  MEGATON_CHECK(rows.ndim() >= 1 && rows.dim(-1) == hidden && rows.numel() == ids.numel() * hidden,
                "{}: {} {} does not match ids {} and {} {} (expected [T, H])", op, rows_name,
                shape_str(rows.shape()), shape_str(ids.shape()), table_name,
                shape_str(table.shape()));
  check_vocab_start(op, vocab_start);
}

// logits [T, V_local] F32 or BF16 with V_local > 0 and T within the grid (a block per
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

constexpr int kEmbeddingMaxThreads = 256;
constexpr int64_t kEmbeddingMaxBlocks = 1 << 16;  // blocks stride over tokens beyond this
constexpr int kStatThreads = 256;

// Embedding: one block per token (striding beyond kEmbeddingMaxBlocks), threads over packs.
int embedding_threads(int64_t hidden, int pack) {
  const int64_t packs = (hidden + pack - 1) / pack;
  return int(std::clamp<int64_t>((packs + 31) / 32 * 32, 32, kEmbeddingMaxThreads));
}
unsigned embedding_blocks(int64_t tokens) {
  return unsigned(std::min(tokens, kEmbeddingMaxBlocks));
}

// ---- device ----

// out[t, :] = table[ids[t] - vocab_start, :] for an id in [vocab_start, vocab_start +
// vocab_local), else 0. N divides hidden. The branch is uniform within a block (one token).
template <typename T, int N>
__global__ void embedding_forward_vocab_range_kernel(const int32_t* __restrict__ ids,
                                                     const T* __restrict__ table,
                                                     T* __restrict__ out, int64_t tokens,
                                                     int64_t hidden, int64_t vocab_start,
                                                     int64_t vocab_local) {
  Pack<T, N> zero;
#pragma unroll
  for (int k = 0; k < N; ++k) zero.v[k] = from_float<T>(0.0f);
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t row = int64_t(ids[t]) - vocab_start;
    T* dst = out + t * hidden;
    if (row >= 0 && row < vocab_local) {
      const T* src = table + row * hidden;
      for (int64_t j = int64_t(threadIdx.x) * N; j < hidden; j += int64_t(blockDim.x) * N)
        store_pack<N>(dst + j, load_pack<N>(src + j));
    } else {
      for (int64_t j = int64_t(threadIdx.x) * N; j < hidden; j += int64_t(blockDim.x) * N)
        store_pack<N>(dst + j, zero);
    }
  }
}

// dtable[ids[t] - vocab_start, :] += dout[t, :] for the ids in this rank's rows; N divides
// hidden (N = 4: one float4 atomic per pack).
template <typename T, int N>
__global__ void embedding_backward_vocab_range_kernel(const T* __restrict__ dout,
                                                      const int32_t* __restrict__ ids,
                                                      float* dtable, int64_t tokens, int64_t hidden,
                                                      int64_t vocab_start, int64_t vocab_local) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t row = int64_t(ids[t]) - vocab_start;
    if (row < 0 || row >= vocab_local) continue;
    float* dst = dtable + row * hidden;
    const T* src = dout + t * hidden;
    for (int64_t j = int64_t(threadIdx.x) * N; j < hidden; j += int64_t(blockDim.x) * N)
      atomic_add_pack<N>(dst + j, load_pack<N>(src + j));
  }
}

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

void embedding_forward_vocab_range(const Tensor& ids, const Tensor& table, int64_t vocab_start,
                                   Tensor& out) {
  const char* op = "embedding_forward_vocab_range";
  check_embedding(op, ids, table, "table", out, "out", vocab_start);
  detail::check_float(table, op, "table");
  detail::check_same_dtype(out, table, op, "out", "table");
  const int64_t tokens = ids.numel(), vocab_local = table.dim(0), hidden = table.dim(1);
  if (tokens == 0 || hidden == 0) return;
  detail::dispatch_float(table.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* tp = static_cast<const T*>(table.raw());
    T* outp = static_cast<T*>(out.raw());
    if (hidden % kN == 0 && pack_aligned<kN>(tp) && pack_aligned<kN>(outp)) {
      embedding_forward_vocab_range_kernel<T, kN>
          <<<embedding_blocks(tokens), embedding_threads(hidden, kN), 0, compute_stream()>>>(
              ids.i32(), tp, outp, tokens, hidden, vocab_start, vocab_local);
    } else {
      embedding_forward_vocab_range_kernel<T, 1>
          <<<embedding_blocks(tokens), embedding_threads(hidden, 1), 0, compute_stream()>>>(
              ids.i32(), tp, outp, tokens, hidden, vocab_start, vocab_local);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void embedding_backward_vocab_range(const Tensor& dout, const Tensor& ids, int64_t vocab_start,
                                    Tensor& dtable) {
  const char* op = "embedding_backward_vocab_range";
  check_embedding(op, ids, dtable, "dtable", dout, "dout", vocab_start);
  detail::check_dtype(dtable, DType::F32, op, "dtable");
  detail::check_float(dout, op, "dout");
  const int64_t tokens = ids.numel(), vocab_local = dtable.dim(0), hidden = dtable.dim(1);
  if (tokens == 0 || hidden == 0 || vocab_local == 0) return;
  detail::dispatch_float(dout.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = 4;
    const T* dp = static_cast<const T*>(dout.raw());
    float* tablep = dtable.f32();
    if (hidden % kN == 0 && pack_aligned<kN>(dp) && pack_aligned<kN>(tablep)) {
      embedding_backward_vocab_range_kernel<T, kN>
          <<<embedding_blocks(tokens), embedding_threads(hidden, kN), 0, compute_stream()>>>(
              dp, ids.i32(), tablep, tokens, hidden, vocab_start, vocab_local);
    } else {
      embedding_backward_vocab_range_kernel<T, 1>
          <<<embedding_blocks(tokens), embedding_threads(hidden, 1), 0, compute_stream()>>>(
              dp, ids.i32(), tablep, tokens, hidden, vocab_start, vocab_local);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

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
