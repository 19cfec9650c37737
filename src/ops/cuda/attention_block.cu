// The small kernels of the GPU block attention (ops/attention_block.h, host side in
// attention_block.cpp): the log-sum-exp layout change between the op's token-major [S, H]
// and cuDNN's packed head-major Stats [H, S], and the log-sum-exp merge of two partial
// results. Memory-bound; fp32 arithmetic.
#include <cmath>

#include "ops/cuda/attention_block.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::compute_stream;
using detail::dispatch_float;
using detail::from_float;
using detail::grid_for;
using detail::to_float;

__global__ void transpose_kernel(const float* in, float* out, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    out[c * rows + r] = in[i];
  }
}

// One warp per (token, head) row r of S * H: lse' = log(exp(a) + exp(b)) computed as
// hi + log1p(exp(lo - hi)), out' = out exp(a - lse') + out_b exp(b - lse'); a row whose
// partial result saw no key (lse_b = -inf) keeps its values, one that had none takes b's
// (the CPU op's arithmetic, ops/cpu/attention_block.cpp).
template <typename O, typename B>
__global__ void merge_kernel(O* out, float* lse, const B* out_b, const float* lse_b, int64_t rows,
                             int64_t dv) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float a = lse[row], b = lse_b[row];
  if (b == -INFINITY) return;
  O* o = out + row * dv;
  const B* ob = out_b + row * dv;
  float merged = b, wa = 0.0f, wb = 1.0f;
  if (a != -INFINITY) {
    const float hi = fmaxf(a, b), lo = fminf(a, b);
    merged = hi + log1pf(expf(lo - hi));
    wa = expf(a - merged);
    wb = expf(b - merged);
  }
  for (int64_t x = lane; x < dv; x += 32)
    o[x] = from_float<O>(a == -INFINITY ? to_float(ob[x])
                                        : to_float(o[x]) * wa + to_float(ob[x]) * wb);
  if (lane == 0) lse[row] = merged;
}

// One query against one key (cuDNN refuses s_q = s_kv = 1): per query head h, with kv head
// h / group, lse = scale q.k and out = v (the softmax of one score is 1).
template <typename T>
__global__ void single_key_forward_kernel(const T* q, const T* k, const T* v, T* out, float* lse,
                                          int64_t hq, int64_t group, int64_t d, int64_t dv,
                                          float scale) {
  const int64_t h = blockIdx.x;
  const int64_t hk = h / group;
  float dot = 0.0f;
  for (int64_t x = threadIdx.x; x < d; x += blockDim.x)
    dot += to_float(q[h * d + x]) * to_float(k[hk * d + x]);
  dot = detail::block_sum(dot);
  if (threadIdx.x == 0) lse[h] = scale * dot;
  for (int64_t x = threadIdx.x; x < dv; x += blockDim.x) out[h * dv + x] = v[hk * dv + x];
  (void)hq;
}

// Its gradient given the query's MERGED out and lse (its whole attention, of which this key
// is one term): per query head h, s = scale q.k, p = exp(s - lse), ds = p (dout.v - dout.out)
// (FlashAttention-2's backward for one element), dq[h] += scale ds k, dk += scale ds q[h],
// dv += p dout[h]. One block per kv head, its query heads in turn (no two blocks write one
// row of dk, dv); each thread owns its elements of every row, so the sums need no atomics.
template <typename T, typename A>
__global__ void single_key_backward_kernel(const T* dout, const T* q, const T* k, const T* v,
                                           const T* out, const float* lse, A* dq, A* dk, A* dv,
                                           int64_t group, int64_t d, int64_t dvd, float scale) {
  const int64_t hk = blockIdx.x;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    float qk = 0.0f, dp = 0.0f, delta = 0.0f;
    for (int64_t x = threadIdx.x; x < d; x += blockDim.x)
      qk += to_float(q[h * d + x]) * to_float(k[hk * d + x]);
    for (int64_t x = threadIdx.x; x < dvd; x += blockDim.x) {
      dp += to_float(dout[h * dvd + x]) * to_float(v[hk * dvd + x]);
      delta += to_float(dout[h * dvd + x]) * to_float(out[h * dvd + x]);
    }
    qk = detail::block_sum(qk);
    dp = detail::block_sum(dp);
    delta = detail::block_sum(delta);
    const float p = expf(scale * qk - lse[h]);
    const float ds = p * (dp - delta);
    for (int64_t x = threadIdx.x; x < d; x += blockDim.x) {
      dq[h * d + x] = from_float<A>(to_float(dq[h * d + x]) + scale * ds * to_float(k[hk * d + x]));
      dk[hk * d + x] =
          from_float<A>(to_float(dk[hk * d + x]) + scale * ds * to_float(q[h * d + x]));
    }
    for (int64_t x = threadIdx.x; x < dvd; x += blockDim.x)
      dv[hk * dvd + x] =
          from_float<A>(to_float(dv[hk * dvd + x]) + p * to_float(dout[h * dvd + x]));
  }
}

}  // namespace

void attention_single_key_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                  Tensor& lse, float scale) {
  const int64_t hq = q.dim(1), hkv = k.dim(1), d = q.dim(2), dv = v.dim(2);
  dispatch_float(q.dtype(), [&](auto t) {
    using T = decltype(t);
    single_key_forward_kernel<T><<<unsigned(hq), 128, 0, compute_stream()>>>(
        static_cast<const T*>(q.raw()), static_cast<const T*>(k.raw()),
        static_cast<const T*>(v.raw()), static_cast<T*>(out.raw()), lse.f32(), hq, hq / hkv, d, dv,
        scale);
  });
  MEGATON_CUDA_CHECK(cudaGetLastError());
}

void attention_single_key_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& out, const Tensor& lse,
                                   Tensor& dq, Tensor& dk, Tensor& dv, float scale) {
  const int64_t hq = q.dim(1), hkv = k.dim(1), d = q.dim(2), dvd = v.dim(2);
  MEGATON_CHECK(dq.dtype() == dk.dtype() && dk.dtype() == dv.dtype(),
                "attention_single_key_backward: dq, dk, dv of one dtype");
  dispatch_float(q.dtype(), [&](auto t) {
    dispatch_float(dq.dtype(), [&](auto a) {
      using T = decltype(t);
      using A = decltype(a);
      single_key_backward_kernel<T, A><<<unsigned(hkv), 128, 0, compute_stream()>>>(
          static_cast<const T*>(dout.raw()), static_cast<const T*>(q.raw()),
          static_cast<const T*>(k.raw()), static_cast<const T*>(v.raw()),
          static_cast<const T*>(out.raw()), lse.f32(), static_cast<A*>(dq.raw()),
          static_cast<A*>(dk.raw()), static_cast<A*>(dv.raw()), hq / hkv, d, dvd, scale);
    });
  });
  MEGATON_CUDA_CHECK(cudaGetLastError());
}

void lse_transpose(const Tensor& in, Tensor& out) {
  MEGATON_CHECK(in.ndim() == 2 && in.dtype() == DType::F32 && out.dtype() == DType::F32 &&
                    out.shape() == (Shape{in.dim(1), in.dim(0)}) && in.device() == Device::CUDA &&
                    out.device() == Device::CUDA,
                "lse_transpose: {} {} into {} {}", shape_str(in.shape()), dtype_name(in.dtype()),
                shape_str(out.shape()), dtype_name(out.dtype()));
  const int64_t n = in.numel();
  if (n == 0) return;
  transpose_kernel<<<grid_for(n, 256), 256, 0, compute_stream()>>>(in.f32(), out.f32(), in.dim(0),
                                                                   in.dim(1));
  MEGATON_CUDA_CHECK(cudaGetLastError());
}

void attention_lse_merge(Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) {
  const char* op = "attention_lse_merge";
  detail::check_float(out, op, "out");
  detail::check_float(out_b, op, "out_b");
  detail::check_dtype(lse, DType::F32, op, "lse");
  detail::check_dtype(lse_b, DType::F32, op, "lse_b");
  MEGATON_CHECK(out.ndim() == 3, "attention_lse_merge: out must be [S, H, Dv], got {}",
                shape_str(out.shape()));
  const int64_t S = out.dim(0), H = out.dim(1), Dv = out.dim(2);
  detail::check_shape(out_b, out.shape(), op, "out_b");
  detail::check_shape(lse, {S, H}, op, "lse");
  detail::check_shape(lse_b, {S, H}, op, "lse_b");
  const int64_t rows = S * H;
  if (rows == 0) return;
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned((rows * 32 + kThreads - 1) / kThreads);
  dispatch_float(out.dtype(), [&](auto o) {
    dispatch_float(out_b.dtype(), [&](auto b) {
      using O = decltype(o);
      using B = decltype(b);
      merge_kernel<O, B><<<blocks, kThreads, 0, compute_stream()>>>(
          static_cast<O*>(out.raw()), lse.f32(), static_cast<const B*>(out_b.raw()), lse_b.f32(),
          rows, Dv);
    });
  });
  MEGATON_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megaton::ops::cuda
