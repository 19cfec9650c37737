// RMSNorm and LayerNorm forward/backward on the GPU (semantics: ops.h, CPU twin:
// ops/cpu/norm.cpp).
//
// x, y, dy, dx share one activation dtype (F32, BF16 or F16); weight and bias may be F32,
// BF16 or F16 independently of it; mean and rstd are F32; dweight and dbias are F32 main grads
// and accumulate. All arithmetic is fp32.
//
// Forward and dx: one thread block per row, the row's reductions done in the block.
// dweight/dbias: deterministic two-kernel reduction. Rows are cut into at most
// kMaxRowChunks chunks (a function of the shape only); the first kernel writes per-chunk
// column sums to an F32 scratch [chunks, H], the second adds the chunks in order into
// dweight/dbias. No float atomics, so repeated runs give identical bits.
#include <algorithm>
#include <type_traits>
#include <utility>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/norm_checks.h"

namespace megaton::ops::cuda {
namespace {

using detail::block_sum;
using detail::compute_stream;
using detail::from_float;
using detail::kPackElems;
using detail::load_pack;
using detail::Pack;
using detail::pack_aligned;
using detail::store_pack;
using detail::to_float;

constexpr int kMaxRowThreads = 512;

// Weight-gradient tiling: a block covers kGradCols columns and one chunk of rows, its
// kGradRowThreads thread rows striding through the chunk.
constexpr int kGradCols = 32;
constexpr int kGradRowThreads = 16;
constexpr int64_t kMinRowsPerChunk = 256;
constexpr int64_t kMaxRowChunks = 128;

// x is [T, H] (leading dimensions merged). Returns {T, H}.
std::pair<int64_t, int64_t> rows_cols(const Tensor& x, const char* op) {
  detail::check_float(x, op, "x");
  MEGATON_CHECK(x.ndim() >= 1, "{}: x must be [T, H], got a scalar", op);
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i) rows *= x.dim(i);
  MEGATON_CHECK(rows < (int64_t(1) << 31), "{}: {} rows exceed the grid limit", op, rows);
  return {rows, x.dim(-1)};
}

// Same shape and dtype as x.
void check_like_x(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  detail::check_float(t, op, name);
  detail::check_same_shape(t, x, op, name, "x");
  detail::check_same_dtype(t, x, op, name, "x");
}

void check_vector(const Tensor& t, int64_t n, const char* op, const char* name) {
  MEGATON_CHECK(t.numel() == n && t.ndim() >= 1, "{}: {} {} must have {} elements", op, name,
                shape_str(t.shape()), n);
}
void check_param(const Tensor& t, int64_t n, const char* op, const char* name) {
  detail::check_float(t, op, name);
  check_vector(t, n, op, name);
}
void check_f32_vector(const Tensor& t, int64_t n, const char* op, const char* name) {
  detail::check_dtype(t, DType::F32, op, name);
  check_vector(t, n, op, name);
}

// dweight is summed after dx is written, so dx must not be dy or x (as on the CPU).
void check_not_aliased(const Tensor& dx, const Tensor& dy, const Tensor& x, const char* op) {
  MEGATON_CHECK(dx.numel() == 0 || (dx.raw() != dy.raw() && dx.raw() != x.raw()),
                "{}: dx must not share memory with dy or x", op);
}

// Threads per row block: one N-element pack per thread up to kMaxRowThreads.
int row_threads(int64_t cols, int pack) {
  int64_t packs = (cols + pack - 1) / pack;
  return int(std::clamp<int64_t>((packs + 31) / 32 * 32, 32, kMaxRowThreads));
}

// ---- kernels ----

// y = (x - mean) * rstd * weight + bias; RMSNorm (kLayerNorm false): mean = 0, no bias,
// rstd from mean(x^2). LayerNorm's variance takes a second pass over the (cached) row
// instead of E[x^2] - mean^2, which cancels badly for rows with a large mean.
//
// kAdd (add_rmsnorm_forward / add_layernorm_forward): a first pass writes
// sum = x + residual, rounded to T, and the norm then runs on sum. Each thread reads back
// only the packs it wrote (the same begin/stride in every pass), so sum may be x's or
// residual's buffer (no __restrict__ on those three).
template <bool kLayerNorm, bool kAdd, typename T, typename W, int N>
__global__ void norm_forward_kernel(const T* x, const T* residual, T* sum,
                                    const W* __restrict__ weight, const W* __restrict__ bias,
                                    float eps, T* __restrict__ y, float* __restrict__ mean,
                                    float* __restrict__ rstd, int64_t cols) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  const int64_t begin = int64_t(threadIdx.x) * N, stride = int64_t(blockDim.x) * N;
  const float inv_cols = 1.0f / float(cols);
  if constexpr (kAdd) {
    const T* rr = residual + row * cols;
    T* sr = sum + row * cols;
    for (int64_t j = begin; j < cols; j += stride) {
      Pack<T, N> xp = load_pack<N>(xr + j), rp = load_pack<N>(rr + j), sp;
#pragma unroll
      for (int k = 0; k < N; ++k) sp.v[k] = from_float<T>(to_float(xp.v[k]) + to_float(rp.v[k]));
      store_pack<N>(sr + j, sp);
    }
    xr = sr;
  }

  float mu = 0.0f;
  if constexpr (kLayerNorm) {
    float s = 0.0f;
    for (int64_t j = begin; j < cols; j += stride) {
      Pack<T, N> xp = load_pack<N>(xr + j);
#pragma unroll
      for (int k = 0; k < N; ++k) s += to_float(xp.v[k]);
    }
    mu = block_sum(s) * inv_cols;
  }
  float ss = 0.0f;
  for (int64_t j = begin; j < cols; j += stride) {
    Pack<T, N> xp = load_pack<N>(xr + j);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float d = to_float(xp.v[k]) - mu;
      ss += d * d;
    }
  }
  const float r = 1.0f / sqrtf(block_sum(ss) * inv_cols + eps);

  for (int64_t j = begin; j < cols; j += stride) {
    Pack<T, N> xp = load_pack<N>(xr + j);
    Pack<W, N> wp = load_pack<N>(weight + j);
    Pack<W, N> bp;
    if (bias != nullptr) bp = load_pack<N>(bias + j);
    Pack<T, N> yp;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float v = (to_float(xp.v[k]) - mu) * r * to_float(wp.v[k]);
      if (bias != nullptr) v += to_float(bp.v[k]);
      yp.v[k] = from_float<T>(v);
    }
    store_pack<N>(yr + j, yp);
  }
  if (threadIdx.x == 0) {
    rstd[row] = r;
    if constexpr (kLayerNorm) mean[row] = mu;
  }
}

// With xhat = (x - mean) r and g = dy * w:
//   LayerNorm dx = r (g - mean(g) - xhat mean(g xhat)),
//   RMSNorm   dx = r (g - xhat mean(g xhat))   (mean = 0; see ops/cpu/norm.cpp).
// dres (may be null): the residual gradient added to dx (dx may be dres's buffer: each
// element is read before the same thread writes it, so neither is __restrict__).
template <bool kLayerNorm, typename T, typename W, int N>
__global__ void norm_backward_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                        const W* __restrict__ weight,
                                        const float* __restrict__ mean,
                                        const float* __restrict__ rstd, const T* dres, T* dx,
                                        int64_t cols) {
  const int64_t row = blockIdx.x;
  const T* dyr = dy + row * cols;
  const T* xr = x + row * cols;
  T* dxr = dx + row * cols;
  const T* dresr = dres != nullptr ? dres + row * cols : nullptr;
  const int64_t begin = int64_t(threadIdx.x) * N, stride = int64_t(blockDim.x) * N;
  const float inv_cols = 1.0f / float(cols);
  const float mu = kLayerNorm ? mean[row] : 0.0f;
  const float r = rstd[row];

  float g_sum = 0.0f, gx_sum = 0.0f;
  for (int64_t j = begin; j < cols; j += stride) {
    Pack<T, N> dyp = load_pack<N>(dyr + j);
    Pack<T, N> xp = load_pack<N>(xr + j);
    Pack<W, N> wp = load_pack<N>(weight + j);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float g = to_float(dyp.v[k]) * to_float(wp.v[k]);
      g_sum += g;
      gx_sum += g * ((to_float(xp.v[k]) - mu) * r);
    }
  }
  const float g_mean = kLayerNorm ? block_sum(g_sum) * inv_cols : 0.0f;
  const float gx_mean = block_sum(gx_sum) * inv_cols;

  for (int64_t j = begin; j < cols; j += stride) {
    Pack<T, N> dyp = load_pack<N>(dyr + j);
    Pack<T, N> xp = load_pack<N>(xr + j);
    Pack<W, N> wp = load_pack<N>(weight + j);
    Pack<T, N> dxp, drp;
    if (dresr != nullptr) drp = load_pack<N>(dresr + j);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float g = to_float(dyp.v[k]) * to_float(wp.v[k]);
      float xhat = (to_float(xp.v[k]) - mu) * r;
      float v = r * (g - g_mean - xhat * gx_mean);
      if (dresr != nullptr) v += to_float(drp.v[k]);
      dxp.v[k] = from_float<T>(v);
    }
    store_pack<N>(dxr + j, dxp);
  }
}

// Per-chunk column sums: dweight_partial[c, j] = sum over rows t of chunk c of
// dy[t, j] * xhat[t, j], dbias_partial[c, j] = sum of dy[t, j] (dbias_partial may be
// null). Block (kGradCols, kGradRowThreads); grid (column tiles, chunks).
template <bool kLayerNorm, typename T>
__global__ void norm_weight_grad_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                const float* __restrict__ mean,
                                                const float* __restrict__ rstd,
                                                float* __restrict__ dweight_partial,
                                                float* __restrict__ dbias_partial, int64_t rows,
                                                int64_t cols, int64_t rows_per_chunk) {
  __shared__ float dw_shared[kGradRowThreads][kGradCols + 1];
  __shared__ float db_shared[kGradRowThreads][kGradCols + 1];
  const int64_t col = int64_t(blockIdx.x) * kGradCols + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t row_begin = chunk * rows_per_chunk;
  const int64_t row_end = std::min(rows, row_begin + rows_per_chunk);

  float dw = 0.0f, db = 0.0f;
  if (col < cols) {
    for (int64_t t = row_begin + threadIdx.y; t < row_end; t += kGradRowThreads) {
      float g = to_float(dy[t * cols + col]);
      float mu = kLayerNorm ? mean[t] : 0.0f;
      dw += g * ((to_float(x[t * cols + col]) - mu) * rstd[t]);
      db += g;
    }
  }
  dw_shared[threadIdx.y][threadIdx.x] = dw;
  db_shared[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int i = 1; i < kGradRowThreads; ++i) {
      dw += dw_shared[i][threadIdx.x];
      db += db_shared[i][threadIdx.x];
    }
    dweight_partial[chunk * cols + col] = dw;
    if (dbias_partial != nullptr) dbias_partial[chunk * cols + col] = db;
  }
}

// dweight[j] += sum over chunks of dweight_partial[c, j], chunks in order (same for dbias).
__global__ void norm_weight_grad_finalize_kernel(const float* __restrict__ dweight_partial,
                                                 const float* __restrict__ dbias_partial,
                                                 float* __restrict__ dweight,
                                                 float* __restrict__ dbias, int64_t chunks,
                                                 int64_t cols) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float dw = 0.0f, db = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    dw += dweight_partial[c * cols + col];
    if (dbias_partial != nullptr) db += dbias_partial[c * cols + col];
  }
  dweight[col] += dw;
  if (dbias != nullptr) dbias[col] += db;
}

// ---- launchers ----

// residual and sum: defined for the fused add (kAdd), else undefined.
template <bool kLayerNorm>
void launch_forward(const Tensor& x, const Tensor& residual, Tensor* sum, const Tensor& weight,
                    const Tensor& bias, float eps, Tensor& y, Tensor* mean, Tensor& rstd,
                    int64_t rows, int64_t cols) {
  if (rows == 0) return;
  MEGATON_CHECK(cols > 0, "norm forward: rows of zero width");
  detail::dispatch_float(x.dtype(), [&](auto x_tag) {
    detail::dispatch_float(weight.dtype(), [&](auto w_tag) {
      using T = decltype(x_tag);
      using W = decltype(w_tag);
      constexpr int kN = kPackElems<T>;
      const T* xp = static_cast<const T*>(x.raw());
      const T* rp = sum ? static_cast<const T*>(residual.raw()) : nullptr;
      T* sp = sum ? static_cast<T*>(sum->raw()) : nullptr;
      const W* wp = static_cast<const W*>(weight.raw());
      const W* bp = bias.defined() ? static_cast<const W*>(bias.raw()) : nullptr;
      T* yp = static_cast<T*>(y.raw());
      float* mp = mean ? mean->f32() : nullptr;
      bool vec = cols % kN == 0 && pack_aligned<kN>(xp) && pack_aligned<kN>(yp) &&
                 pack_aligned<kN>(wp) && (bp == nullptr || pack_aligned<kN>(bp)) &&
                 (sp == nullptr || (pack_aligned<kN>(rp) && pack_aligned<kN>(sp)));
      auto launch = [&](auto add_tag, auto n_tag) {
        constexpr bool kAdd = decltype(add_tag)::value;
        constexpr int kPack = decltype(n_tag)::value;
        norm_forward_kernel<kLayerNorm, kAdd, T, W, kPack>
            <<<unsigned(rows), row_threads(cols, kPack), 0, compute_stream()>>>(
                xp, rp, sp, wp, bp, eps, yp, mp, rstd.f32(), cols);
      };
      using One = std::integral_constant<int, 1>;
      using Vec = std::integral_constant<int, kN>;
      if (sp) {
        if (vec) launch(std::true_type{}, Vec{});
        else launch(std::true_type{}, One{});
      } else {
        if (vec) launch(std::false_type{}, Vec{});
        else launch(std::false_type{}, One{});
      }
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  });
}

template <bool kLayerNorm>
void launch_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor* mean,
                     const Tensor& rstd, const Tensor& dresidual, Tensor& dx, Tensor& dweight,
                     Tensor* dbias, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  const float* mp = mean ? mean->f32() : nullptr;
  detail::dispatch_float(x.dtype(), [&](auto x_tag) {
    using T = decltype(x_tag);
    const T* dyp = static_cast<const T*>(dy.raw());
    const T* xp = static_cast<const T*>(x.raw());

    // dx: one block per row.
    detail::dispatch_float(weight.dtype(), [&](auto w_tag) {
      using W = decltype(w_tag);
      constexpr int kN = kPackElems<T>;
      const W* wp = static_cast<const W*>(weight.raw());
      T* dxp = static_cast<T*>(dx.raw());
      const T* drp = dresidual.defined() ? static_cast<const T*>(dresidual.raw()) : nullptr;
      bool vec = cols % kN == 0 && pack_aligned<kN>(dyp) && pack_aligned<kN>(xp) &&
                 pack_aligned<kN>(dxp) && pack_aligned<kN>(wp) &&
                 (drp == nullptr || pack_aligned<kN>(drp));
      if (vec) {
        norm_backward_dx_kernel<kLayerNorm, T, W, kN>
            <<<unsigned(rows), row_threads(cols, kN), 0, compute_stream()>>>(
                dyp, xp, wp, mp, rstd.f32(), drp, dxp, cols);
      } else {
        norm_backward_dx_kernel<kLayerNorm, T, W, 1>
            <<<unsigned(rows), row_threads(cols, 1), 0, compute_stream()>>>(
                dyp, xp, wp, mp, rstd.f32(), drp, dxp, cols);
      }
      MEGATON_CUDA_CHECK_LAUNCH();
    });

    // dweight, dbias: per-chunk partials, then an in-order sum over chunks.
    const int64_t rows_per_chunk =
        std::max(kMinRowsPerChunk, (rows + kMaxRowChunks - 1) / kMaxRowChunks);
    const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    Tensor dweight_partial = Tensor::empty({chunks, cols}, DType::F32, Device::CUDA);
    Tensor dbias_partial;
    if (dbias) dbias_partial = Tensor::empty({chunks, cols}, DType::F32, Device::CUDA);
    float* dbias_partial_ptr = dbias ? dbias_partial.f32() : nullptr;
    dim3 grid(unsigned((cols + kGradCols - 1) / kGradCols), unsigned(chunks));
    dim3 block(kGradCols, kGradRowThreads);
    norm_weight_grad_partial_kernel<kLayerNorm, T>
        <<<grid, block, 0, compute_stream()>>>(dyp, xp, mp, rstd.f32(), dweight_partial.f32(),
                                               dbias_partial_ptr, rows, cols, rows_per_chunk);
    MEGATON_CUDA_CHECK_LAUNCH();
    constexpr int kFinalizeThreads = 256;
    norm_weight_grad_finalize_kernel<<<unsigned((cols + kFinalizeThreads - 1) / kFinalizeThreads),
                                       kFinalizeThreads, 0, compute_stream()>>>(
        dweight_partial.f32(), dbias_partial_ptr, dweight.f32(), dbias ? dbias->f32() : nullptr,
        chunks, cols);
    MEGATON_CUDA_CHECK_LAUNCH();
    // The scratch tensors are released here; the caching allocator hands blocks out in
    // stream order on the one compute stream, so the kernels above finish first.
  });
}

}  // namespace

// dresidual, when defined: like x; dx may be its buffer (each element is read by the
// thread that then writes it), not part of it (another block's rows).
static void check_residual_grad(const Tensor& dresidual, const Tensor& x, const Tensor& dx,
                                const char* op) {
  if (!dresidual.defined()) return;
  check_like_x(dresidual, x, op, "dresidual");
  ::megaton::ops::detail::check_residual_grad_aliasing(dx, dresidual, op);
}

void rmsnorm_forward(const Tensor& x, const Tensor& weight, float eps, Tensor& y, Tensor& rstd) {
  const char* op = "rmsnorm_forward";
  auto [rows, cols] = rows_cols(x, op);
  check_param(weight, cols, op, "weight");
  check_like_x(y, x, op, "y");
  check_f32_vector(rstd, rows, op, "rstd");
  launch_forward<false>(x, Tensor(), nullptr, weight, Tensor(), eps, y, nullptr, rstd, rows, cols);
}

void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& weight, float eps,
                         Tensor& sum, Tensor& y, Tensor& rstd) {
  const char* op = "add_rmsnorm_forward";
  auto [rows, cols] = rows_cols(x, op);
  check_like_x(residual, x, op, "residual");
  check_like_x(sum, x, op, "sum");
  check_param(weight, cols, op, "weight");
  check_like_x(y, x, op, "y");
  check_f32_vector(rstd, rows, op, "rstd");
  ::megaton::ops::detail::check_fused_add_aliasing(x, residual, sum, y, op);
  launch_forward<false>(x, residual, &sum, weight, Tensor(), eps, y, nullptr, rstd, rows, cols);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      Tensor& dx, Tensor& dweight, const Tensor& dresidual) {
  const char* op = "rmsnorm_backward";
  auto [rows, cols] = rows_cols(x, op);
  check_like_x(dy, x, op, "dy");
  check_param(weight, cols, op, "weight");
  check_f32_vector(rstd, rows, op, "rstd");
  check_like_x(dx, x, op, "dx");
  check_f32_vector(dweight, cols, op, "dweight");
  check_not_aliased(dx, dy, x, op);
  check_residual_grad(dresidual, x, dx, op);
  launch_backward<false>(dy, x, weight, nullptr, rstd, dresidual, dx, dweight, nullptr, rows,
                         cols);
}

static void check_layernorm_params(const Tensor& weight, const Tensor& bias, int64_t cols,
                                   const char* op) {
  check_param(weight, cols, op, "weight");
  if (bias.defined()) {
    check_param(bias, cols, op, "bias");
    detail::check_same_dtype(bias, weight, op, "bias", "weight");
  }
}

void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       Tensor& y, Tensor& mean, Tensor& rstd) {
  const char* op = "layernorm_forward";
  auto [rows, cols] = rows_cols(x, op);
  check_layernorm_params(weight, bias, cols, op);
  check_like_x(y, x, op, "y");
  check_f32_vector(mean, rows, op, "mean");
  check_f32_vector(rstd, rows, op, "rstd");
  launch_forward<true>(x, Tensor(), nullptr, weight, bias, eps, y, &mean, rstd, rows, cols);
}

void add_layernorm_forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                           const Tensor& bias, float eps, Tensor& sum, Tensor& y, Tensor& mean,
                           Tensor& rstd) {
  const char* op = "add_layernorm_forward";
  auto [rows, cols] = rows_cols(x, op);
  check_like_x(residual, x, op, "residual");
  check_like_x(sum, x, op, "sum");
  check_layernorm_params(weight, bias, cols, op);
  check_like_x(y, x, op, "y");
  check_f32_vector(mean, rows, op, "mean");
  check_f32_vector(rstd, rows, op, "rstd");
  ::megaton::ops::detail::check_fused_add_aliasing(x, residual, sum, y, op);
  launch_forward<true>(x, residual, &sum, weight, bias, eps, y, &mean, rstd, rows, cols);
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dweight, Tensor& dbias,
                        const Tensor& dresidual) {
  const char* op = "layernorm_backward";
  auto [rows, cols] = rows_cols(x, op);
  check_like_x(dy, x, op, "dy");
  check_param(weight, cols, op, "weight");
  check_f32_vector(mean, rows, op, "mean");
  check_f32_vector(rstd, rows, op, "rstd");
  check_like_x(dx, x, op, "dx");
  check_f32_vector(dweight, cols, op, "dweight");
  if (dbias.defined()) check_f32_vector(dbias, cols, op, "dbias");
  check_not_aliased(dx, dy, x, op);
  check_residual_grad(dresidual, x, dx, op);
  launch_backward<true>(dy, x, weight, &mean, rstd, dresidual, dx, dweight,
                        dbias.defined() ? &dbias : nullptr, rows, cols);
}

}  // namespace megaton::ops::cuda
