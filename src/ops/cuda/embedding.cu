// Token embedding lookup and its gradient on the GPU, whole table or one vocab-parallel
// shard (semantics: ops.h, CPU twins: ops/cpu/embedding.cpp, ops/cpu/vocab_parallel.cpp).
//
// Whole table: token ids are trusted (they are validated when the data is loaded; the CPU
// op checks them, the GPU op does not, as a device-side check would need a
// synchronisation to report). An out-of-range id reads or writes outside the table; debug
// builds trap on it through assert().
// Vocab range (a tensor-parallel rank's rows [vocab_start, vocab_start + V_local)): ids
// outside them are expected (another rank holds them) and give a zero output row and no
// gradient, never an access outside the shard.
//
// The backwards accumulate with fp32 atomicAdd, so when an id repeats within the batch the
// order of its additions, and hence the last bits of dtable, can change from run to run.
// Under ops::deterministic() (--deterministic-mode) they instead sort the tokens by id
// (cub's stable radix sort of (row, token) pairs) and give each id one block, which sums
// its tokens' rows in token order and adds the sum to dtable once: the same bits on every
// run.
#include <algorithm>
#include <cassert>
#include <cstdint>

#include <cub/device/device_radix_sort.cuh>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/determinism.h"

namespace megaton::ops::cuda {
namespace {

using detail::atomic_add_pack;
using detail::compute_stream;
using detail::from_float;
using detail::kPackElems;
using detail::load_pack;
using detail::Pack;
using detail::pack_aligned;
using detail::store_pack;

constexpr int kMaxThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // blocks stride over tokens beyond this

// ids may be [T] or [B, S] (any rank, T = numel); rows is [T, H] or ids.shape + [H].
void check_shapes(const char* op, const Tensor& ids, const Tensor& table, const char* table_name,
                  const Tensor& rows, const char* rows_name) {
  detail::check_dtype(ids, DType::I32, op, "ids");
  detail::check_cuda_tensor(table, op, table_name);
  detail::check_cuda_tensor(rows, op, rows_name);
  MEGATON_CHECK(table.ndim() == 2, "{}: {} must be [V, H], got {}", op, table_name,
                shape_str(table.shape()));
  int64_t hidden = table.dim(1);
  MEGATON_CHECK(rows.ndim() >= 1 && rows.dim(-1) == hidden && rows.numel() == ids.numel() * hidden,
                "{}: {} {} does not match ids {} and {} {} (expected [T, H])", op, rows_name,
                shape_str(rows.shape()), shape_str(ids.shape()), table_name,
                shape_str(table.shape()));
}

// One block per token (striding when there are more than kMaxBlocks), threads over packs.
int threads_for(int64_t hidden, int pack) {
  int64_t packs = (hidden + pack - 1) / pack;
  return int(std::clamp<int64_t>((packs + 31) / 32 * 32, 32, kMaxThreads));
}
unsigned blocks_for(int64_t tokens) { return unsigned(std::min(tokens, kMaxBlocks)); }

// out[t, :] = table[ids[t] - vocab_start, :]; N divides hidden. kVocabRange: an id outside
// [vocab_start, vocab_start + vocab) gives a zero row (the branch is uniform within a
// block, one token); otherwise every id must be inside (vocab_start 0).
template <typename T, int N, bool kVocabRange>
__global__ void embedding_forward_kernel(const int32_t* __restrict__ ids,
                                         const T* __restrict__ table, T* __restrict__ out,
                                         int64_t tokens, int64_t hidden, int64_t vocab_start,
                                         int64_t vocab) {
  Pack<T, N> zero;
#pragma unroll
  for (int k = 0; k < N; ++k) zero.v[k] = from_float<T>(0.0f);
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t row = int64_t(ids[t]) - vocab_start;
    const bool inside = row >= 0 && row < vocab;
    if (!kVocabRange) assert(inside);
    T* dst = out + t * hidden;
    const T* src = table + row * hidden;
    for (int64_t j = int64_t(threadIdx.x) * N; j < hidden; j += int64_t(blockDim.x) * N)
      store_pack<N>(dst + j, !kVocabRange || inside ? load_pack<N>(src + j) : zero);
  }
}

// dtable[ids[t] - vocab_start, :] += dout[t, :] (kVocabRange: only for the ids in this
// shard's rows); N divides hidden (N = 4: one float4 atomic per pack).
template <typename T, int N, bool kVocabRange>
__global__ void embedding_backward_kernel(const T* __restrict__ dout,
                                          const int32_t* __restrict__ ids, float* dtable,
                                          int64_t tokens, int64_t hidden, int64_t vocab_start,
                                          int64_t vocab) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t row = int64_t(ids[t]) - vocab_start;
    const bool inside = row >= 0 && row < vocab;
    if (!kVocabRange) assert(inside);
    if (kVocabRange && !inside) continue;
    float* dst = dtable + row * hidden;
    const T* d = dout + t * hidden;
    for (int64_t j = int64_t(threadIdx.x) * N; j < hidden; j += int64_t(blockDim.x) * N)
      atomic_add_pack<N>(dst + j, load_pack<N>(d + j));
  }
}

template <bool kVocabRange>
void forward(const char* op, const Tensor& ids, const Tensor& table, int64_t vocab_start,
             Tensor& out) {
  check_shapes(op, ids, table, "table", out, "out");
  MEGATON_CHECK(vocab_start >= 0, "{}: vocab_start {} is negative", op, vocab_start);
  detail::check_float(table, op, "table");
  detail::check_same_dtype(out, table, op, "out", "table");
  const int64_t tokens = ids.numel(), hidden = table.dim(1), vocab = table.dim(0);
  if (tokens == 0 || hidden == 0) return;
  detail::dispatch_float(table.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* tp = static_cast<const T*>(table.raw());
    T* outp = static_cast<T*>(out.raw());
    if (hidden % kN == 0 && pack_aligned<kN>(tp) && pack_aligned<kN>(outp)) {
      embedding_forward_kernel<T, kN, kVocabRange>
          <<<blocks_for(tokens), threads_for(hidden, kN), 0, compute_stream()>>>(
              ids.i32(), tp, outp, tokens, hidden, vocab_start, vocab);
    } else {
      embedding_forward_kernel<T, 1, kVocabRange>
          <<<blocks_for(tokens), threads_for(hidden, 1), 0, compute_stream()>>>(
              ids.i32(), tp, outp, tokens, hidden, vocab_start, vocab);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

// The deterministic backward's keys: row = ids[t] - vocab_start for the ids of this table
// (or shard), `vocab` (sorted last, skipped) for the others; token[t] = t.
__global__ void embedding_sort_keys_kernel(const int32_t* __restrict__ ids,
                                           int32_t* __restrict__ rows,
                                           int32_t* __restrict__ tokens, int64_t n,
                                           int64_t vocab_start, int64_t vocab) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = int64_t(ids[t]) - vocab_start;
    rows[t] = row >= 0 && row < vocab ? int32_t(row) : int32_t(vocab);
    tokens[t] = int32_t(t);
  }
}

// One block per sorted position i that starts a run of equal rows (the other blocks
// return): dtable[row] += the sum, in token order, of the run's dout rows (fp32).
template <typename T, int N>
__global__ void embedding_backward_sorted_kernel(const T* __restrict__ dout,
                                                 const int32_t* __restrict__ rows,
                                                 const int32_t* __restrict__ tokens,
                                                 float* __restrict__ dtable, int64_t n,
                                                 int64_t hidden, int64_t vocab) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int32_t row = rows[i];
    if (row >= vocab || (i > 0 && rows[i - 1] == row)) continue;
    int64_t end = i + 1;
    while (end < n && rows[end] == row) ++end;
    float* dst = dtable + int64_t(row) * hidden;
    for (int64_t j = int64_t(threadIdx.x) * N; j < hidden; j += int64_t(blockDim.x) * N) {
      float acc[N] = {};
      for (int64_t r = i; r < end; ++r) {
        const Pack<T, N> p = load_pack<N>(dout + int64_t(tokens[r]) * hidden + j);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += detail::to_float(p.v[k]);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) dst[j + k] += acc[k];
    }
  }
}

template <typename T, int N>
void backward_sorted(const T* dout, const Tensor& ids, float* dtable, int64_t tokens,
                     int64_t hidden, int64_t vocab_start, int64_t vocab) {
  MEGATON_CHECK(tokens < (int64_t(1) << 31) && vocab < (int64_t(1) << 31) - 1,
                "embedding backward (deterministic): {} tokens or {} rows exceed int32", tokens,
                vocab);
  const int n = int(tokens);
  Tensor keys = Tensor::empty({4, tokens}, DType::I32, Device::CUDA);
  int32_t* rows_in = keys.i32();
  int32_t* tokens_in = rows_in + tokens;
  int32_t* rows_out = tokens_in + tokens;
  int32_t* tokens_out = rows_out + tokens;
  const unsigned grid = unsigned(std::min<int64_t>((tokens + 255) / 256, kMaxBlocks));
  embedding_sort_keys_kernel<<<grid, 256, 0, compute_stream()>>>(ids.i32(), rows_in, tokens_in,
                                                                 tokens, vocab_start, vocab);
  MEGATON_CUDA_CHECK_LAUNCH();
  // Keys span [0, vocab]: sort only the bits that can be set.
  int end_bit = 1;
  while ((int64_t(1) << end_bit) <= vocab) ++end_bit;
  size_t temp_bytes = 0;
  MEGATON_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, rows_in, rows_out,
                                                     tokens_in, tokens_out, n, 0, end_bit,
                                                     compute_stream()));
  Tensor temp = Tensor::empty({int64_t(std::max<size_t>(temp_bytes, 8) + 7) / 8}, DType::I64,
                              Device::CUDA);
  MEGATON_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw(), temp_bytes, rows_in, rows_out,
                                                     tokens_in, tokens_out, n, 0, end_bit,
                                                     compute_stream()));
  embedding_backward_sorted_kernel<T, N>
      <<<blocks_for(tokens), threads_for(hidden, N), 0, compute_stream()>>>(
          dout, rows_out, tokens_out, dtable, tokens, hidden, vocab);
  MEGATON_CUDA_CHECK_LAUNCH();
}

template <bool kVocabRange>
void backward(const char* op, const Tensor& dout, const Tensor& ids, int64_t vocab_start,
              Tensor& dtable) {
  check_shapes(op, ids, dtable, "dtable", dout, "dout");
  MEGATON_CHECK(vocab_start >= 0, "{}: vocab_start {} is negative", op, vocab_start);
  detail::check_dtype(dtable, DType::F32, op, "dtable");
  detail::check_float(dout, op, "dout");
  const int64_t tokens = ids.numel(), hidden = dtable.dim(1), vocab = dtable.dim(0);
  if (tokens == 0 || hidden == 0 || vocab == 0) return;
  detail::dispatch_float(dout.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = 4;
    const T* dp = static_cast<const T*>(dout.raw());
    float* tablep = dtable.f32();
    const bool vec = hidden % kN == 0 && pack_aligned<kN>(dp) && pack_aligned<kN>(tablep);
    if (deterministic()) {
      if (vec) backward_sorted<T, kN>(dp, ids, tablep, tokens, hidden, vocab_start, vocab);
      else backward_sorted<T, 1>(dp, ids, tablep, tokens, hidden, vocab_start, vocab);
      return;
    }
    if (vec) {
      embedding_backward_kernel<T, kN, kVocabRange>
          <<<blocks_for(tokens), threads_for(hidden, kN), 0, compute_stream()>>>(
              dp, ids.i32(), tablep, tokens, hidden, vocab_start, vocab);
    } else {
      embedding_backward_kernel<T, 1, kVocabRange>
          <<<blocks_for(tokens), threads_for(hidden, 1), 0, compute_stream()>>>(
              dp, ids.i32(), tablep, tokens, hidden, vocab_start, vocab);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  forward<false>("embedding_forward", ids, table, 0, out);
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  backward<false>("embedding_backward", dout, ids, 0, dtable);
}

void embedding_forward_vocab_range(const Tensor& ids, const Tensor& table, int64_t vocab_start,
                                   Tensor& out) {
  forward<true>("embedding_forward_vocab_range", ids, table, vocab_start, out);
}

void embedding_backward_vocab_range(const Tensor& dout, const Tensor& ids, int64_t vocab_start,
                                    Tensor& dtable) {
  backward<true>("embedding_backward_vocab_range", dout, ids, vocab_start, dtable);
}

}  // namespace megaton::ops::cuda
