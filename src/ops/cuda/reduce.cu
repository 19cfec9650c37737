// Elementwise updates, casts and reductions on the GPU: cast, add_, scale_, bias_add_,
// bias_backward and their row-weighted forms (MoE experts), sum_of_squares, sum. F32, BF16
// or F16 tensors; arithmetic in fp32, sums over many elements in fp64 with a fixed
// reduction order (the same bits on every run).
#include <algorithm>
#include <utility>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

constexpr int kThreads = 256;

// ---- host: door checks and dtype dispatch ----

// F32, BF16 or F16 on the GPU.
using detail::check_float;

// Calls f(T{}) with T = float, __nv_bfloat16 or __half (checked at the door).
template <typename F>
void with_float_type(DType dtype, F&& f) {
  detail::dispatch_float(dtype, std::forward<F>(f));
}

// Blocks for a grid-stride loop over n items (gridDim.x stays far below its 2^31 limit).
unsigned blocks_for(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, int64_t(1) << 20));
}

// ---- device ----

template <typename T>
__device__ __forceinline__ float load(const T* p, int64_t i) {
  return detail::to_float(p[i]);
}
// Round-to-nearest-even, as the CPU's float_to_bf16 and float_to_fp16.
template <typename T>
__device__ __forceinline__ void store(T* p, int64_t i, float v) {
  p[i] = detail::from_float<T>(v);
}

__device__ __forceinline__ int64_t global_thread() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_threads() { return int64_t(gridDim.x) * blockDim.x; }

template <typename Src, typename Dst>
__global__ void cast_kernel(const Src* src, Dst* dst, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) store(dst, i, load(src, i));
}

template <typename Y, typename X>
__global__ void add_kernel(Y* y, const X* x, float alpha, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    store(y, i, load(y, i) + alpha * load(x, i));
}

template <typename T>
__global__ void scale_kernel(T* x, float s, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) store(x, i, load(x, i) * s);
}

template <typename Y, typename B>
__global__ void bias_add_kernel(Y* y, const B* bias, int64_t n, int64_t cols) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    store(y, i, load(y, i) + load(bias, i % cols));
}

// bias_backward, pass 1. Block (32, 8) sums columns [32 * blockIdx.x, +32) over its slice
// of rows (each row scaled by weights[row] when given: weighted_bias_backward): blockIdx.y
// takes rows [rows_per_slice * blockIdx.y, +rows_per_slice), and within it threadIdx.y
// every 8th row. The 8 partials are added in threadIdx.y order, so
// partials[blockIdx.y, col] depends only on the shape.
constexpr int kBiasCols = 32, kBiasRowThreads = 8;
template <typename T>
__global__ void bias_backward_partials(const T* dy, int64_t rows, int64_t cols,
                                       int64_t rows_per_slice, double* partials,
                                       const float* weights = nullptr) {
  __shared__ double sums[kBiasRowThreads][kBiasCols];
  const int64_t col = int64_t(blockIdx.x) * kBiasCols + threadIdx.x;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_slice;
  const int64_t row_end = std::min(rows, row_begin + rows_per_slice);
  double acc = 0.0;
  if (col < cols)
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kBiasRowThreads)
      acc += weights ? double(weights[r]) * load(dy, r * cols + col) : load(dy, r * cols + col);
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    double total = 0.0;
    for (int i = 0; i < kBiasRowThreads; ++i) total += sums[i][threadIdx.x];
    partials[int64_t(blockIdx.y) * cols + col] = total;
  }
}

// bias_backward, pass 2: dbias[col] += the slices' partials, in slice order.
__global__ void bias_backward_finish(const double* partials, int64_t slices, int64_t cols,
                                     float* dbias) {
  for (int64_t col = global_thread(); col < cols; col += grid_threads()) {
    double total = 0.0;
    for (int64_t s = 0; s < slices; ++s) total += partials[s * cols + col];
    dbias[col] += float(total);
  }
}

// y[i] += weights[row] * bias[col] in fp32, rounded once (weighted_bias_add_).
template <typename Y, typename B>
__global__ void weighted_bias_add_kernel(Y* y, const B* bias, const float* weights, int64_t n,
                                         int64_t cols) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    store(y, i, load(y, i) + weights[i / cols] * load(bias, i % cols));
}

// weighted_bias_backward's row dots: dweights[r] += <dy[r, :], bias>, one warp per row,
// lane-strided partial sums then the warp's butterfly (a fixed order).
template <typename T, typename B>
__global__ void row_dot_bias_kernel(const T* dy, const B* bias, int64_t rows, int64_t cols,
                                    float* dweights) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  float dot = 0.0f;
  for (int64_t j = lane; j < cols; j += 32) dot += load(dy, r * cols + j) * load(bias, j);
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (lane == 0) dweights[r] += dot;
}

// Sum over the block of one double per thread, in a fixed tree order; valid in thread 0.
// blockDim.x == kThreads.
__device__ double block_sum(double v) {
  __shared__ double shared[kThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

// sum / sum_of_squares, pass 1: block b writes the fp64 sum of its grid-stride share.
// The grid size depends only on n, so the partition and the order are fixed.
template <typename T, bool kSquare>
__global__ void partial_sums(const T* x, int64_t n, double* partials) {
  double acc = 0.0;
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    double v = load(x, i);
    acc += kSquare ? v * v : v;
  }
  double total = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Pass 2, one block: result[0] = sum of the partials.
__global__ void finish_sum(const double* partials, int64_t count, double* result) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) acc += partials[i];
  double total = block_sum(acc);
  if (threadIdx.x == 0) result[0] = total;
}

constexpr int64_t kMaxSumBlocks = 1024;

// dot, pass 1: block b writes the fp64 sum of a[i] * b[i] over its grid-stride share.
__global__ void partial_dots(const float* a, const float* b, int64_t n, double* partials) {
  double acc = 0.0;
  for (int64_t i = global_thread(); i < n; i += grid_threads()) acc += double(a[i]) * double(b[i]);
  double total = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// dot and sum(x, out), pass 2, one block: out[0] = the sum of the partials, rounded to fp32.
__global__ void finish_dot(const double* partials, int64_t count, float* out) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) acc += partials[i];
  double total = block_sum(acc);
  if (threadIdx.x == 0) out[0] = float(total);
}

template <bool kSquare>
double reduce_all(const Tensor& x, const char* op) {
  check_float(x, op, "x");
  const int64_t n = x.numel();
  if (n == 0) return 0.0;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxSumBlocks);
  // fp64 scratch: [result | partials...], 8 bytes each (no F64 dtype; I64 has the size).
  Tensor scratch = Tensor::empty({blocks + 1}, DType::I64, Device::CUDA);
  auto* result = static_cast<double*>(scratch.raw());
  double* partials = result + 1;
  cudaStream_t stream = ::megaton::cuda::stream();
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    partial_sums<T, kSquare>
        <<<unsigned(blocks), kThreads, 0, stream>>>(static_cast<const T*>(x.raw()), n, partials);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
  finish_sum<<<1, kThreads, 0, stream>>>(partials, blocks, result);
  MEGATON_CUDA_CHECK_LAUNCH();
  double host = 0.0;
  MEGATON_CUDA_CHECK(
      cudaMemcpyAsync(&host, result, sizeof(double), cudaMemcpyDeviceToHost, stream));
  ::megaton::cuda::synchronize();
  return host;
}

}  // namespace

void cast(const Tensor& src, Tensor& dst) {
  check_float(src, "cast", "src");
  check_float(dst, "cast", "dst");
  MEGATON_CHECK(src.numel() == dst.numel(), "cast: {} elements into {}", src.numel(), dst.numel());
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) {
    if (src.raw() != dst.raw())
      MEGATON_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(),
                                         cudaMemcpyDeviceToDevice, ::megaton::cuda::stream()));
    return;
  }
  with_float_type(src.dtype(), [&](auto s) {
    with_float_type(dst.dtype(), [&](auto d) {
      using Src = decltype(s);
      using Dst = decltype(d);
      cast_kernel<<<blocks_for(n), kThreads, 0, ::megaton::cuda::stream()>>>(
          static_cast<const Src*>(src.raw()), static_cast<Dst*>(dst.raw()), n);
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  });
}

void add_(Tensor& y, const Tensor& x, float alpha) {
  check_float(y, "add_", "y");
  check_float(x, "add_", "x");
  MEGATON_CHECK(y.numel() == x.numel(), "add_: y {} and x {} differ in numel", shape_str(y.shape()),
                shape_str(x.shape()));
  const int64_t n = y.numel();
  if (n == 0) return;
  with_float_type(y.dtype(), [&](auto yt) {
    with_float_type(x.dtype(), [&](auto xt) {
      using Y = decltype(yt);
      using X = decltype(xt);
      add_kernel<<<blocks_for(n), kThreads, 0, ::megaton::cuda::stream()>>>(
          static_cast<Y*>(y.raw()), static_cast<const X*>(x.raw()), alpha, n);
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  });
}

void scale_(Tensor& x, float s) {
  check_float(x, "scale_", "x");
  const int64_t n = x.numel();
  if (n == 0) return;
  with_float_type(x.dtype(), [&](auto t) {
    using T = decltype(t);
    scale_kernel<<<blocks_for(n), kThreads, 0, ::megaton::cuda::stream()>>>(
        static_cast<T*>(x.raw()), s, n);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void bias_add_(Tensor& y, const Tensor& bias) {
  check_float(y, "bias_add_", "y");
  check_float(bias, "bias_add_", "bias");
  MEGATON_CHECK(y.ndim() >= 1 && bias.ndim() == 1 && bias.dim(0) == y.dim(-1),
                "bias_add_: y {} with bias {} (bias must be [N], N = last dim of y)",
                shape_str(y.shape()), shape_str(bias.shape()));
  const int64_t n = y.numel(), cols = bias.dim(0);
  if (n == 0) return;
  with_float_type(y.dtype(), [&](auto yt) {
    with_float_type(bias.dtype(), [&](auto bt) {
      using Y = decltype(yt);
      using B = decltype(bt);
      bias_add_kernel<<<blocks_for(n), kThreads, 0, ::megaton::cuda::stream()>>>(
          static_cast<Y*>(y.raw()), static_cast<const B*>(bias.raw()), n, cols);
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  });
}

namespace {
// dbias[:] += sum_r w_r dy[r, :] (w_r = weights[r], or 1 without weights).
void column_sums(const Tensor& dy, const float* weights, Tensor& dbias) {
  const int64_t cols = dbias.dim(0);
  const int64_t rows = cols ? dy.numel() / cols : 0;
  if (cols == 0 || rows == 0) return;
  // Row slices of >= 256 rows, at most 128 of them: enough blocks to fill the GPU when
  // there are few columns, and a small pass 2.
  const int64_t slices = std::clamp<int64_t>(rows / 256, 1, 128);
  const int64_t rows_per_slice = (rows + slices - 1) / slices;
  const int64_t column_blocks = (cols + kBiasCols - 1) / kBiasCols;
  MEGATON_CHECK(column_blocks <= INT32_MAX, "bias_backward: {} columns", cols);
  Tensor partials = Tensor::empty({slices * cols}, DType::I64, Device::CUDA);  // fp64 scratch
  auto* partial_sums_ptr = static_cast<double*>(partials.raw());
  cudaStream_t stream = ::megaton::cuda::stream();
  with_float_type(dy.dtype(), [&](auto t) {
    using T = decltype(t);
    bias_backward_partials<<<dim3(unsigned(column_blocks), unsigned(slices)),
                             dim3(kBiasCols, kBiasRowThreads), 0, stream>>>(
        static_cast<const T*>(dy.raw()), rows, cols, rows_per_slice, partial_sums_ptr, weights);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
  bias_backward_finish<<<blocks_for(cols), kThreads, 0, stream>>>(partial_sums_ptr, slices, cols,
                                                                  dbias.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}
}  // namespace

void bias_backward(const Tensor& dy, Tensor& dbias) {
  check_float(dy, "bias_backward", "dy");
  check_float(dbias, "bias_backward", "dbias");
  MEGATON_CHECK(dbias.dtype() == DType::F32, "bias_backward: dbias must be F32 (main_grad), got {}",
                dtype_name(dbias.dtype()));
  MEGATON_CHECK(dy.ndim() >= 1 && dbias.ndim() == 1 && dbias.dim(0) == dy.dim(-1),
                "bias_backward: dy {} with dbias {} (dbias must be [N], N = last dim of dy)",
                shape_str(dy.shape()), shape_str(dbias.shape()));
  column_sums(dy, nullptr, dbias);
}

void weighted_bias_add_(Tensor& y, const Tensor& bias, const Tensor& weights) {
  const char* op = "weighted_bias_add_";
  check_float(y, op, "y");
  check_float(bias, op, "bias");
  detail::check_dtype(weights, DType::F32, op, "weights");
  MEGATON_CHECK(y.ndim() >= 1 && bias.ndim() == 1 && bias.dim(0) == y.dim(-1),
                "{}: y {} with bias {} (bias must be [N], N = last dim of y)", op,
                shape_str(y.shape()), shape_str(bias.shape()));
  const int64_t n = y.numel(), cols = bias.dim(0), rows = cols ? n / cols : 0;
  MEGATON_CHECK(weights.numel() == rows, "{}: weights {} must have {} elements, one per row", op,
                shape_str(weights.shape()), rows);
  if (n == 0) return;
  with_float_type(y.dtype(), [&](auto yt) {
    with_float_type(bias.dtype(), [&](auto bt) {
      using Y = decltype(yt);
      using B = decltype(bt);
      weighted_bias_add_kernel<<<blocks_for(n), kThreads, 0, ::megaton::cuda::stream()>>>(
          static_cast<Y*>(y.raw()), static_cast<const B*>(bias.raw()), weights.f32(), n, cols);
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  });
}

void weighted_bias_backward(const Tensor& dy, const Tensor& bias, const Tensor& weights,
                            Tensor& dbias, Tensor* dweights) {
  const char* op = "weighted_bias_backward";
  check_float(dy, op, "dy");
  check_float(bias, op, "bias");
  detail::check_dtype(weights, DType::F32, op, "weights");
  detail::check_dtype(dbias, DType::F32, op, "dbias");
  MEGATON_CHECK(dy.ndim() >= 1 && bias.ndim() == 1 && bias.dim(0) == dy.dim(-1) &&
                    dbias.shape() == bias.shape(),
                "{}: dy {} with bias {} and dbias {} (both [N], N = last dim of dy)", op,
                shape_str(dy.shape()), shape_str(bias.shape()), shape_str(dbias.shape()));
  const int64_t cols = bias.dim(0), rows = cols ? dy.numel() / cols : 0;
  MEGATON_CHECK(weights.numel() == rows, "{}: weights {} must have {} elements, one per row", op,
                shape_str(weights.shape()), rows);
  if (dweights) {
    detail::check_dtype(*dweights, DType::F32, op, "dweights");
    MEGATON_CHECK(dweights->numel() == rows, "{}: dweights {} must have {} elements", op,
                  shape_str(dweights->shape()), rows);
  }
  column_sums(dy, weights.f32(), dbias);
  if (!dweights || rows == 0) return;
  constexpr int kRowsPerBlock = kThreads / 32;
  with_float_type(dy.dtype(), [&](auto dt) {
    with_float_type(bias.dtype(), [&](auto bt) {
      using T = decltype(dt);
      using B = decltype(bt);
      row_dot_bias_kernel<<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0,
                            ::megaton::cuda::stream()>>>(static_cast<const T*>(dy.raw()),
                                                         static_cast<const B*>(bias.raw()), rows,
                                                         cols, dweights->f32());
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  });
}

double sum_of_squares(const Tensor& x) { return reduce_all<true>(x, "sum_of_squares"); }

double sum(const Tensor& x) { return reduce_all<false>(x, "sum"); }

void sum(const Tensor& x, Tensor& out) {
  check_float(x, "sum", "x");
  check_float(out, "sum", "out");
  MEGATON_CHECK(x.dtype() == DType::F32 && out.dtype() == DType::F32 && out.numel() == 1,
                "sum: x {} and out {} [{}] (want F32, F32 with 1 element)", dtype_name(x.dtype()),
                dtype_name(out.dtype()), out.numel());
  const int64_t n = x.numel();
  const int64_t blocks = std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxSumBlocks);
  Tensor partials = Tensor::empty({blocks}, DType::I64, Device::CUDA);  // fp64, 8 bytes each
  auto* p = static_cast<double*>(partials.raw());
  cudaStream_t stream = ::megaton::cuda::stream();
  partial_sums<float, false>
      <<<unsigned(blocks), kThreads, 0, stream>>>(static_cast<const float*>(x.raw()), n, p);
  MEGATON_CUDA_CHECK_LAUNCH();
  finish_dot<<<1, kThreads, 0, stream>>>(p, blocks, static_cast<float*>(out.raw()));
  MEGATON_CUDA_CHECK_LAUNCH();
}

void dot(const Tensor& a, const Tensor& b, Tensor& out) {
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&a, "a"}, {&b, "b"}, {&out, "out"}}) {
    check_float(*t, "dot", name);
    MEGATON_CHECK(t->dtype() == DType::F32, "dot: {} must be F32, got {}", name,
                  dtype_name(t->dtype()));
  }
  MEGATON_CHECK(a.numel() == b.numel() && out.numel() == 1,
                "dot: a has {} elements, b {}, out {} (want equal, equal, 1)", a.numel(),
                b.numel(), out.numel());
  const int64_t n = a.numel();
  const int64_t blocks = std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxSumBlocks);
  Tensor partials = Tensor::empty({blocks}, DType::I64, Device::CUDA);  // fp64, 8 bytes each
  auto* p = static_cast<double*>(partials.raw());
  cudaStream_t stream = ::megaton::cuda::stream();
  partial_dots<<<unsigned(blocks), kThreads, 0, stream>>>(static_cast<const float*>(a.raw()),
                                                          static_cast<const float*>(b.raw()), n, p);
  MEGATON_CUDA_CHECK_LAUNCH();
  finish_dot<<<1, kThreads, 0, stream>>>(p, blocks, static_cast<float*>(out.raw()));
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
