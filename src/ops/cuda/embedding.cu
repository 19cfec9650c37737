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
// A deterministic version would sort (token, id) pairs by id and reduce each segment in
// token order.
#include <algorithm>
#include <cassert>
#include <cstdint>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

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
    if (hidden % kN == 0 && pack_aligned<kN>(dp) && pack_aligned<kN>(tablep)) {
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
