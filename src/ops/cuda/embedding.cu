// Token embedding lookup and its gradient on the GPU (semantics: ops.h, CPU twin:
// ops/cpu/embedding.cpp).
//
// Token ids are trusted here: they are validated when the data is loaded (the CPU op
// checks them, the GPU op does not, as a device-side check would need a
// synchronisation to report). An out-of-range id reads or writes outside the table;
// debug builds trap on it through assert().
//
// embedding_backward accumulates with fp32 atomicAdd, so when an id repeats within the
// batch the order of its additions, and hence the last bits of dtable, can change from
// run to run. A deterministic version would sort (token, id) pairs by id and reduce each
// segment in token order.
#include <algorithm>
#include <cassert>
#include <cstdint>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::atomic_add_pack;
using detail::compute_stream;
using detail::kPackElems;
using detail::load_pack;
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

// out[t, :] = table[ids[t], :]; N divides hidden.
template <typename T, int N>
__global__ void embedding_forward_kernel(const int32_t* __restrict__ ids,
                                         const T* __restrict__ table, T* __restrict__ out,
                                         int64_t tokens, int64_t hidden, int64_t vocab) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t id = ids[t];
    assert(id >= 0 && id < vocab);
    const T* src = table + id * hidden;
    T* dst = out + t * hidden;
    for (int64_t j = int64_t(threadIdx.x) * N; j < hidden; j += int64_t(blockDim.x) * N)
      store_pack<N>(dst + j, load_pack<N>(src + j));
  }
}

// dtable[ids[t], :] += dout[t, :]; N divides hidden (N = 4: one float4 atomic per pack).
template <typename T, int N>
__global__ void embedding_backward_kernel(const T* __restrict__ dout,
                                          const int32_t* __restrict__ ids, float* dtable,
                                          int64_t tokens, int64_t hidden, int64_t vocab) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t id = ids[t];
    assert(id >= 0 && id < vocab);
    float* row = dtable + id * hidden;
    const T* d = dout + t * hidden;
    for (int64_t j = int64_t(threadIdx.x) * N; j < hidden; j += int64_t(blockDim.x) * N) {
      atomic_add_pack<N>(row + j, load_pack<N>(d + j));
    }
  }
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const char* op = "embedding_forward";
  check_shapes(op, ids, table, "table", out, "out");
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
      embedding_forward_kernel<T, kN>
          <<<blocks_for(tokens), threads_for(hidden, kN), 0, compute_stream()>>>(
              ids.i32(), tp, outp, tokens, hidden, vocab);
    } else {
      embedding_forward_kernel<T, 1>
          <<<blocks_for(tokens), threads_for(hidden, 1), 0, compute_stream()>>>(
              ids.i32(), tp, outp, tokens, hidden, vocab);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  const char* op = "embedding_backward";
  check_shapes(op, ids, dtable, "dtable", dout, "dout");
  detail::check_dtype(dtable, DType::F32, op, "dtable");
  detail::check_float(dout, op, "dout");
  const int64_t tokens = ids.numel(), hidden = dtable.dim(1), vocab = dtable.dim(0);
  if (tokens == 0 || hidden == 0) return;
  detail::dispatch_float(dout.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = 4;
    const T* dp = static_cast<const T*>(dout.raw());
    float* tablep = dtable.f32();
    if (hidden % kN == 0 && pack_aligned<kN>(dp) && pack_aligned<kN>(tablep)) {
      embedding_backward_kernel<T, kN>
          <<<blocks_for(tokens), threads_for(hidden, kN), 0, compute_stream()>>>(
              dp, ids.i32(), tablep, tokens, hidden, vocab);
    } else {
      embedding_backward_kernel<T, 1>
          <<<blocks_for(tokens), threads_for(hidden, 1), 0, compute_stream()>>>(
              dp, ids.i32(), tablep, tokens, hidden, vocab);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace megaton::ops::cuda
