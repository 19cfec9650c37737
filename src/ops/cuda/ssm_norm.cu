// Mamba-2's gated RMSNorm on the GPU (ops/ssm.h; mamba_ssm's RMSNormGated with
// norm_before_gate = False; CPU twin and argument checks: ops/cpu/ssm.cpp). y, z, out, dout,
// dy, dz one dtype (F32, BF16, F16); weight any of those, read as fp32; rstd and dweight
// F32; fp32 arithmetic.
//
// Forward and dy/dz: one warp per (row, group) of group_size columns, grid-striding over
// them (the group's columns are contiguous: item t * groups + q starts at element
// item * group_size); lanes stride the group in packs of kPackElems when the sizes and
// pointers allow 16-byte access, else one element at a time. Two passes over the group (the
// sum of squares, then the output), the second reading from L1/L2.
//   g = y silu(z);  r = 1 / sqrt(mean(g^2) + eps);  out = g r w
// Backward, with gh = g r and dgh = dout w:
//   dg = r (dgh - gh mean(dgh gh));  dy = dg silu(z);  dz = dg y sigmoid(z) (1 + z (1 -
//   sigmoid(z)))
// dweight: deterministic two-kernel reduction (as ops/cuda/norm.cu): per-chunk column sums
// of dout gh into F32 scratch [chunks, D] (block kGradCols x kGradRowThreads), then the chunks
// added in order into dweight_acc.
#include <algorithm>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/ssm.h"
#include "ops/cuda/ssm_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::compute_stream;
using detail::from_float;
using detail::load_pack;
using detail::Pack;
using detail::pack_aligned;
using detail::store_pack;
using detail::to_float;
using detail::warp_sum;
using ssm::param_at;
using ssm::ParamVector;

constexpr int kNormThreads = 256;
constexpr int kGradCols = 32;
constexpr int kGradRowThreads = 16;
constexpr int64_t kMinRowsPerChunk = 256;
constexpr int64_t kMaxRowChunks = 128;

__device__ __forceinline__ float gate(float y, float z) { return y * z * ssm::sigmoid(z); }

template <typename T, int N>
__global__ void __launch_bounds__(kNormThreads)
    gated_rmsnorm_forward_kernel(const T* __restrict__ y, const T* __restrict__ z,
                                 ParamVector weight, float eps, T* __restrict__ out,
                                 float* __restrict__ rstd, int64_t items, int64_t cols,
                                 int64_t group_size) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (kNormThreads / 32);
  const float inv_size = 1.0f / float(group_size);
  for (int64_t item = (int64_t(blockIdx.x) * kNormThreads + threadIdx.x) / 32; item < items;
       item += warps) {
    const int64_t base = item * group_size, col0 = base % cols;
    float ss = 0.0f;
    for (int64_t j = int64_t(lane) * N; j < group_size; j += 32 * N) {
      const Pack<T, N> yp = load_pack<N>(y + base + j), zp = load_pack<N>(z + base + j);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float g = gate(to_float(yp.v[k]), to_float(zp.v[k]));
        ss += g * g;
      }
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) * inv_size + eps);
    for (int64_t j = int64_t(lane) * N; j < group_size; j += 32 * N) {
      const Pack<T, N> yp = load_pack<N>(y + base + j), zp = load_pack<N>(z + base + j);
      Pack<T, N> op;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float g = gate(to_float(yp.v[k]), to_float(zp.v[k]));
        op.v[k] = from_float<T>(g * r * param_at(weight, col0 + j + k));
      }
      store_pack<N>(out + base + j, op);
    }
    if (lane == 0) rstd[item] = r;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kNormThreads)
    gated_rmsnorm_backward_kernel(const T* __restrict__ dout, const T* __restrict__ y,
                                  const T* __restrict__ z, ParamVector weight,
                                  const float* __restrict__ rstd, T* __restrict__ dy,
                                  T* __restrict__ dz, int64_t items, int64_t cols,
                                  int64_t group_size) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (kNormThreads / 32);
  const float inv_size = 1.0f / float(group_size);
  for (int64_t item = (int64_t(blockIdx.x) * kNormThreads + threadIdx.x) / 32; item < items;
       item += warps) {
    const int64_t base = item * group_size, col0 = base % cols;
    const float r = rstd[item];
    float dot = 0.0f;
    for (int64_t j = int64_t(lane) * N; j < group_size; j += 32 * N) {
      const Pack<T, N> dp = load_pack<N>(dout + base + j), yp = load_pack<N>(y + base + j),
                       zp = load_pack<N>(z + base + j);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float gh = gate(to_float(yp.v[k]), to_float(zp.v[k])) * r;
        dot += to_float(dp.v[k]) * param_at(weight, col0 + j + k) * gh;
      }
    }
    const float mean_dot = warp_sum(dot) * inv_size;
    for (int64_t j = int64_t(lane) * N; j < group_size; j += 32 * N) {
      const Pack<T, N> dp = load_pack<N>(dout + base + j), yp = load_pack<N>(y + base + j),
                       zp = load_pack<N>(z + base + j);
      Pack<T, N> dyp, dzp;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float yv = to_float(yp.v[k]), zv = to_float(zp.v[k]);
        const float sg = ssm::sigmoid(zv), silu = zv * sg;
        const float gh = yv * silu * r;
        const float dgh = to_float(dp.v[k]) * param_at(weight, col0 + j + k);
        const float dg = r * (dgh - gh * mean_dot);
        dyp.v[k] = from_float<T>(dg * silu);
        dzp.v[k] = from_float<T>(dg * yv * sg * (1.0f + zv * (1.0f - sg)));
      }
      store_pack<N>(dy + base + j, dyp);
      store_pack<N>(dz + base + j, dzp);
    }
  }
}

// partial[chunk, col] = sum over the chunk's rows t of dout[t, col] * g[t, col] * r[t, group].
// Block (kGradCols, kGradRowThreads); grid (column tiles, chunks).
template <typename T>
__global__ void gated_rmsnorm_weight_grad_partial_kernel(
    const T* __restrict__ dout, const T* __restrict__ y, const T* __restrict__ z,
    const float* __restrict__ rstd, float* __restrict__ partial, int64_t rows, int64_t cols,
    int64_t group_size, int64_t rows_per_chunk) {
  __shared__ float sums[kGradRowThreads][kGradCols + 1];
  const int64_t col = int64_t(blockIdx.x) * kGradCols + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t row_begin = chunk * rows_per_chunk;
  const int64_t row_end = std::min(rows, row_begin + rows_per_chunk);
  const int64_t groups = cols / group_size;
  float s = 0.0f;
  if (col < cols) {
    for (int64_t t = row_begin + threadIdx.y; t < row_end; t += kGradRowThreads) {
      const int64_t at = t * cols + col;
      s += to_float(dout[at]) * gate(to_float(y[at]), to_float(z[at])) *
           rstd[t * groups + col / group_size];
    }
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int i = 1; i < kGradRowThreads; ++i) s += sums[i][threadIdx.x];
    partial[chunk * cols + col] = s;
  }
}

__global__ void gated_rmsnorm_weight_grad_finalize_kernel(const float* __restrict__ partial,
                                                          float* __restrict__ dweight,
                                                          int64_t chunks, int64_t cols) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float s = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) s += partial[c * cols + col];
  dweight[col] += s;
}

unsigned norm_blocks(int64_t items) { return detail::grid_for(items * 32, kNormThreads); }

}  // namespace

void gated_rmsnorm_forward(const Tensor& y, const Tensor& z, const Tensor& weight,
                           int64_t group_size, float eps, Tensor& out, Tensor& rstd) {
  const int64_t cols = y.dim(-1), rows = cols > 0 ? y.numel() / cols : 0;
  if (rows == 0 || cols == 0) return;
  const int64_t items = rows * (cols / group_size);
  detail::dispatch_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = detail::kPackElems<T>;
    const T* yp = static_cast<const T*>(y.raw());
    const T* zp = static_cast<const T*>(z.raw());
    T* op = static_cast<T*>(out.raw());
    const bool vec = group_size % kN == 0 && pack_aligned<kN>(yp) && pack_aligned<kN>(zp) &&
                     pack_aligned<kN>(op);
    auto launch = [&](auto kernel) {
      kernel<<<norm_blocks(items), kNormThreads, 0, compute_stream()>>>(
          yp, zp, ssm::param_vector(weight), eps, op, rstd.f32(), items, cols, group_size);
    };
    if (vec)
      launch(gated_rmsnorm_forward_kernel<T, kN>);
    else
      launch(gated_rmsnorm_forward_kernel<T, 1>);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

void gated_rmsnorm_backward(const Tensor& dout, const Tensor& y, const Tensor& z,
                            const Tensor& weight, const Tensor& rstd, int64_t group_size,
                            Tensor& dy, Tensor& dz, Tensor& dweight_acc) {
  const int64_t cols = y.dim(-1), rows = cols > 0 ? y.numel() / cols : 0;
  if (rows == 0 || cols == 0) return;
  const int64_t items = rows * (cols / group_size);
  const int64_t rows_per_chunk =
      std::max(kMinRowsPerChunk, (rows + kMaxRowChunks - 1) / kMaxRowChunks);
  const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  Tensor partial = Tensor::empty({chunks, cols}, DType::F32, Device::CUDA);
  detail::dispatch_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = detail::kPackElems<T>;
    const T* dop = static_cast<const T*>(dout.raw());
    const T* yp = static_cast<const T*>(y.raw());
    const T* zp = static_cast<const T*>(z.raw());
    T* dyp = static_cast<T*>(dy.raw());
    T* dzp = static_cast<T*>(dz.raw());
    const bool vec = group_size % kN == 0 && pack_aligned<kN>(dop) && pack_aligned<kN>(yp) &&
                     pack_aligned<kN>(zp) && pack_aligned<kN>(dyp) && pack_aligned<kN>(dzp);
    auto launch = [&](auto kernel) {
      kernel<<<norm_blocks(items), kNormThreads, 0, compute_stream()>>>(
          dop, yp, zp, ssm::param_vector(weight), rstd.f32(), dyp, dzp, items, cols, group_size);
    };
    if (vec)
      launch(gated_rmsnorm_backward_kernel<T, kN>);
    else
      launch(gated_rmsnorm_backward_kernel<T, 1>);
    MEGATON_CUDA_CHECK_LAUNCH();
    dim3 grid(unsigned((cols + kGradCols - 1) / kGradCols), unsigned(chunks));
    gated_rmsnorm_weight_grad_partial_kernel<T>
        <<<grid, dim3(kGradCols, kGradRowThreads), 0, compute_stream()>>>(
            dop, yp, zp, rstd.f32(), partial.f32(), rows, cols, group_size, rows_per_chunk);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
  constexpr int kThreads = 256;
  gated_rmsnorm_weight_grad_finalize_kernel<<<unsigned((cols + kThreads - 1) / kThreads), kThreads,
                                              0, compute_stream()>>>(
      partial.f32(), dweight_acc.f32(), chunks, cols);
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
