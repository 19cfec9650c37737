// Muon's elementwise kernels (ops/cuda/muon.h): the per-matrix Frobenius normalisation
// before Newton-Schulz (whole, or in two halves around the distributed mode's all-reduce),
// and the momentum EMA. The GEMMs of the iteration are in muon.cpp.
#include <algorithm>
#include <type_traits>

#include "ops/cuda/muon.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/ops.h"

namespace megaton::ops::cuda {
namespace {

constexpr int kThreads = 256;
// Blocks per matrix for the sum of squares: enough to fill an H200 for one large matrix.
constexpr int64_t kMaxChunks = 512;

using detail::compute_stream;
using detail::from_float;
using detail::to_float;

// The fp64 sum of v over the block (kThreads threads), in a fixed order; valid in thread 0.
__device__ double block_sum(double v) {
  __shared__ double shared[kThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

// Pass 1, grid (chunks, batch): block (c, b) sums the squares of matrix b's elements
// c * kThreads + t + k * chunks * kThreads, writing partials[b * chunks + c]. The partition
// depends only on the shape, so the sum's order (and bits) do too.
template <typename T>
__global__ void sum_squares_partials(const T* g, int64_t per_matrix, double* partials) {
  const T* matrix = g + int64_t(blockIdx.y) * per_matrix;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  double acc = 0.0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < per_matrix; i += stride) {
    const double v = to_float(matrix[i]);
    acc += v * v;
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = total;
}

// Pass 2, one block per matrix: denom[b] = max(fp32(sqrt(sum of its partials)), eps).
__global__ void finish_norms(const double* partials, int64_t chunks, float eps, float* denom) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < chunks; i += kThreads) acc += partials[blockIdx.x * chunks + i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) denom[blockIdx.x] = fmaxf(float(sqrt(total)), eps);
}

// Pass 2 of the distributed mode, one block per matrix: sums[b] = fp32(sum of its partials).
__global__ void finish_sums(const double* partials, int64_t chunks, float* sums) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < chunks; i += kThreads) acc += partials[blockIdx.x * chunks + i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) sums[blockIdx.x] = float(total);
}

// Pass 3, grid (blocks, batch): out = g / d in fp32, rounded to T, with d = denom[b]
// (FromSums false) or max(sqrt(denom[b]), eps) in fp32 (FromSums: EO's
// distributed_normalize_p2 on the all-reduced sums of squares).
template <typename T, bool FromSums>
__global__ void divide_by_norm(const T* g, T* out, int64_t per_matrix, const float* denom,
                               float eps) {
  const int64_t base = int64_t(blockIdx.y) * per_matrix;
  const float d = FromSums ? fmaxf(__fsqrt_rn(denom[blockIdx.y]), eps) : denom[blockIdx.y];
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < per_matrix; i += stride)
    out[base + i] = from_float<T>(to_float(g[base + i]) / d);
}

// EO's OrthogonalizedOptimizer.step, steps 2-3, in fp32 with torch's lerp formula
// (at::lerp: a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w)) so that the result
// follows PyTorch's rounding: m = m.lerp(g, 1 - beta), u = g.lerp(m, beta).
__device__ __forceinline__ float torch_lerp(float a, float b, float w) {
  return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

// G, U: float or __nv_bfloat16 (the grad and the update). control: null (grad scale 1, no
// skip) or the step's control tensor. The plain op and a unit control run the same
// instantiation, and g * 1 is exact, so they give the same bits.
template <typename G, typename U>
__global__ void momentum_kernel(float* momentum, const G* grad, float beta, float one_minus_beta,
                                bool nesterov, U* update, int64_t n, const float* control) {
  const bool skip = control != nullptr && control[kAdamSkip] != 0.0f;
  const float scale = control != nullptr ? control[kAdamGradScale] : 1.0f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (skip) {
      update[i] = from_float<U>(0.0f);
      continue;
    }
    const float g = __fmul_rn(to_float(grad[i]), scale);  // read before update[i] (grad's)
    const float m = torch_lerp(momentum[i], g, one_minus_beta);
    momentum[i] = m;
    update[i] = from_float<U>(nesterov ? torch_lerp(g, m, beta) : m);
  }
}

}  // namespace

void frobenius_normalize(const Tensor& g, Tensor& out, int64_t batch, int64_t per_matrix,
                         float eps) {
  MEGATON_CHECK(batch >= 1 && batch <= 65535 && per_matrix >= 1,
                "frobenius_normalize: {} matrices of {} elements (at most 65535 matrices)", batch,
                per_matrix);
  const int64_t chunks = std::min<int64_t>((per_matrix + kThreads - 1) / kThreads, kMaxChunks);
  // fp64 partials (8 bytes each: I64 has the size) and the fp32 norms.
  Tensor partials = Tensor::empty({batch * chunks}, DType::I64, Device::CUDA);
  Tensor denom = Tensor::empty({batch}, DType::F32, Device::CUDA);
  auto* partial_sums = static_cast<double*>(partials.raw());
  cudaStream_t stream = compute_stream();
  detail::dispatch_float(g.dtype(), [&](auto t) {
    using T = decltype(t);
    const dim3 grid{unsigned(chunks), unsigned(batch)};
    sum_squares_partials<T>
        <<<grid, kThreads, 0, stream>>>(static_cast<const T*>(g.raw()), per_matrix, partial_sums);
    MEGATON_CUDA_CHECK_LAUNCH();
    finish_norms<<<unsigned(batch), kThreads, 0, stream>>>(partial_sums, chunks, eps, denom.f32());
    MEGATON_CUDA_CHECK_LAUNCH();
    const int64_t blocks = std::min<int64_t>((per_matrix + kThreads - 1) / kThreads, 4096);
    divide_by_norm<T, false><<<dim3(unsigned(blocks), unsigned(batch)), kThreads, 0, stream>>>(
        static_cast<const T*>(g.raw()), static_cast<T*>(out.raw()), per_matrix, denom.f32(), eps);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void matrix_sums_of_squares(const Tensor& g, int64_t batch, int64_t per_matrix, Tensor& sums) {
  MEGATON_CHECK(batch >= 1 && batch <= 65535 && per_matrix >= 1,
                "matrix_sums_of_squares: {} matrices of {} elements (at most 65535 matrices)",
                batch, per_matrix);
  const int64_t chunks = std::min<int64_t>((per_matrix + kThreads - 1) / kThreads, kMaxChunks);
  Tensor partials = Tensor::empty({batch * chunks}, DType::I64, Device::CUDA);  // fp64 bits
  auto* partial_sums = static_cast<double*>(partials.raw());
  cudaStream_t stream = compute_stream();
  detail::dispatch_float(g.dtype(), [&](auto t) {
    using T = decltype(t);
    sum_squares_partials<T><<<dim3{unsigned(chunks), unsigned(batch)}, kThreads, 0, stream>>>(
        static_cast<const T*>(g.raw()), per_matrix, partial_sums);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
  finish_sums<<<unsigned(batch), kThreads, 0, stream>>>(partial_sums, chunks, sums.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void divide_by_root_of_sums(const Tensor& g, Tensor& out, int64_t batch, int64_t per_matrix,
                            const Tensor& sums, float eps) {
  const int64_t blocks = std::min<int64_t>((per_matrix + kThreads - 1) / kThreads, 4096);
  detail::dispatch_float(g.dtype(), [&](auto t) {
    using T = decltype(t);
    divide_by_norm<T, true>
        <<<dim3(unsigned(blocks), unsigned(batch)), kThreads, 0, compute_stream()>>>(
            static_cast<const T*>(g.raw()), static_cast<T*>(out.raw()), per_matrix, sums.f32(),
            eps);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void muon_momentum_update(Tensor& momentum, const Tensor& grad, float beta, bool nesterov,
                          Tensor& update, const float* control) {
  const int64_t n = grad.numel();
  if (n == 0) return;
  // EO's weight 1 - beta (a Python double) rounded to fp32, as torch passes it to the kernel.
  const float one_minus_beta = float(1.0 - double(beta));
  auto launch = [&](auto* grad_ptr, auto* update_ptr) {
    using G = std::remove_const_t<std::remove_pointer_t<decltype(grad_ptr)>>;
    using U = std::remove_pointer_t<decltype(update_ptr)>;
    momentum_kernel<G, U><<<detail::grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(
        momentum.f32(), grad_ptr, beta, one_minus_beta, nesterov, update_ptr, n, control);
    MEGATON_CUDA_CHECK_LAUNCH();
  };
  const bool grad_bf16 = grad.dtype() == DType::BF16, update_bf16 = update.dtype() == DType::BF16;
  const auto* grad_f32 = static_cast<const float*>(grad.raw());
  const auto* grad_b16 = static_cast<const __nv_bfloat16*>(grad.raw());
  auto* update_f32 = static_cast<float*>(update.raw());
  auto* update_b16 = static_cast<__nv_bfloat16*>(update.raw());
  if (!grad_bf16 && !update_bf16) launch(grad_f32, update_f32);
  if (!grad_bf16 && update_bf16) launch(grad_f32, update_b16);
  if (grad_bf16 && !update_bf16) launch(grad_b16, update_f32);
  if (grad_bf16 && update_bf16) launch(grad_b16, update_b16);
}

}  // namespace megaton::ops::cuda
