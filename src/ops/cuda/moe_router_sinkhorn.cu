// Megatron's sinkhorn on the GPU (moe_utils.py `sinkhorn`, the selection of
// --moe-router-load-balancing-type sinkhorn). Semantics: ops.h (moe_sinkhorn); CPU twin:
// ops/cpu/moe_router.cpp, whose arithmetic this follows operation for operation: d0, d1,
// the products and the error are fp32 values as in torch, the sums fp64 in the CPU's
// order (a row over e; a column over fixed 256-row chunks in row order, then the chunks
// in order; the error over e). The loop therefore stops at the CPU's iteration unless a
// cost differs: cost = exp(x) is rounded once from fp64 here, glibc's expf is within
// 0.502 ulp, so a rare cost may differ by one ulp.
//
// cost is written into `out`, then each iteration is four kernels: row scales d0 (a thread
// per row), column partials (a thread per chunk and column), column scales d1 with their
// changes (a thread per column), and the error (one thread). The stopping test runs on
// the device: once the error is <= tol a flag freezes every later kernel, so iterations
// are queued in batches and the host reads the flag once per batch (one synchronisation
// per kCheckEvery iterations), yet the result is that of the CPU's iteration count.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

constexpr float kTolerance = 1e-4f;  // Megatron's sinkhorn(tol=0.0001), an fp32 error
constexpr float kEps = 1e-8f;        // Megatron's eps = 0.00000001
constexpr int kCheckEvery = 8;       // iterations queued per host read of the stop flag
constexpr int kChunkRows = 256;      // rows per column partial (the CPU's chunk)
constexpr int kThreadsPerBlock = 128;

// Device state of the loop: the stop flag and the iterations run.
struct SinkhornState {
  int32_t done;
  int32_t iterations;
};

// cost = exp(x) rounded once from fp64; d1 = 1 (d1_old = d1 is implied); state cleared.
__global__ void sinkhorn_init_kernel(const float* __restrict__ logits, int64_t n,
                                     float* __restrict__ cost, float* __restrict__ d1, int64_t E,
                                     SinkhornState* state) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n; i += stride) cost[i] = float(exp(double(logits[i])));
  for (int64_t e = first; e < E; e += stride) d1[e] = 1.0f;
  if (first == 0) *state = {0, 0};
}

// d0[t] = (1 / (sum_e d1[e] cost[t, e] + eps)) * (1/T), a thread per row, e in order.
__global__ void sinkhorn_rows_kernel(const float* __restrict__ cost, const float* __restrict__ d1,
                                     int64_t T, int64_t E, float inv_T, const SinkhornState* state,
                                     float* __restrict__ d0) {
  if (state->done) return;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const float* row = cost + t * E;
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += double(__fmul_rn(d1[e], row[e]));
  d0[t] = __fmul_rn(__fdiv_rn(1.0f, __fadd_rn(float(sum), kEps)), inv_T);
}

// partials[chunk, e] = sum over the chunk's rows, in order, of d0[t] cost[t, e]; grid
// x: columns, y: chunks.
__global__ void sinkhorn_column_partials_kernel(const float* __restrict__ cost,
                                                const float* __restrict__ d0, int64_t T, int64_t E,
                                                const SinkhornState* state,
                                                double* __restrict__ partials) {
  if (state->done) return;
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int64_t chunk = blockIdx.y;
  const int64_t end = std::min<int64_t>(T, (chunk + 1) * kChunkRows);
  double acc = 0.0;
  for (int64_t t = chunk * kChunkRows; t < end; ++t)
    acc += double(__fmul_rn(d0[t], cost[t * E + e]));
  partials[chunk * E + e] = acc;
}

// d1[e] = (1 / (column sum + eps)) * (1/E), the chunks in order; change[e] = |d1_old - d1|.
__global__ void sinkhorn_columns_kernel(const double* __restrict__ partials, int64_t chunks,
                                        int64_t E, float inv_E, const SinkhornState* state,
                                        float* __restrict__ d1, double* __restrict__ change) {
  if (state->done) return;
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  double sum = 0.0;
  for (int64_t c = 0; c < chunks; ++c) sum += partials[c * E + e];
  const float d1_new = __fmul_rn(__fdiv_rn(1.0f, __fadd_rn(float(sum), kEps)), inv_E);
  change[e] = std::fabs(double(d1[e]) - double(d1_new));
  d1[e] = d1_new;
}

// One thread: error = float(sum_e change[e] / E), e in order; stop once !(error > tol)
// (Megatron's `while error > tol`, so a NaN error stops too).
__global__ void sinkhorn_error_kernel(const double* __restrict__ change, int64_t E,
                                      SinkhornState* state) {
  if (state->done) return;
  double abs_change = 0.0;
  for (int64_t e = 0; e < E; ++e) abs_change += change[e];
  const float error = float(abs_change / double(E));
  state->iterations += 1;
  if (!(error > kTolerance)) state->done = 1;
}

// out[t, e] = d1[e] * cost[t, e] * d0[t], in place on the cost.
__global__ void sinkhorn_scale_kernel(float* __restrict__ out, const float* __restrict__ d0,
                                      const float* __restrict__ d1, int64_t n, int64_t E) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __fmul_rn(__fmul_rn(d1[i % E], out[i]), d0[i / E]);
}

}  // namespace

void moe_sinkhorn(const Tensor& logits, Tensor& out) {
  constexpr const char* op = "moe_sinkhorn";
  detail::check_dtype(logits, DType::F32, op, "logits");
  MEGATON_CHECK(logits.ndim() == 2, "{}: logits must be [T, E], got {}", op,
                shape_str(logits.shape()));
  detail::check_dtype(out, DType::F32, op, "out");
  detail::check_same_shape(out, logits, op, "out", "logits");
  MEGATON_CHECK(out.raw() != logits.raw(), "{}: out must not alias logits", op);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const int64_t n = T * E;
  if (n == 0) return;
  const int64_t chunks = (T + kChunkRows - 1) / kChunkRows;
  const int64_t row_blocks = (T + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int64_t column_blocks = (E + kThreadsPerBlock - 1) / kThreadsPerBlock;
  MEGATON_CHECK(row_blocks <= INT32_MAX && column_blocks <= INT32_MAX && chunks <= 65535,
                "{}: logits {} exceed the grid limit", op, shape_str(logits.shape()));
  cudaStream_t stream = ::megaton::cuda::stream();

  // Scratch: d0 [T] and d1 [E] fp32; the fp64 column partials [chunks, E] and changes [E]
  // (in I64 tensors: the same size, Tensor has no F64 dtype); the loop state.
  Tensor d0 = Tensor::empty({T}, DType::F32, Device::CUDA);
  Tensor d1 = Tensor::empty({E}, DType::F32, Device::CUDA);
  Tensor partials = Tensor::empty({chunks, E}, DType::I64, Device::CUDA);
  Tensor change = Tensor::empty({E}, DType::I64, Device::CUDA);
  Tensor state_tensor = Tensor::empty({2}, DType::I32, Device::CUDA);
  auto* state = static_cast<SinkhornState*>(state_tensor.raw());
  auto* partials_ptr = static_cast<double*>(partials.raw());
  auto* change_ptr = static_cast<double*>(change.raw());
  // As the CPU: fp32 1/T and 1/E rounded from fp64.
  const float inv_T = float(1.0 / double(T)), inv_E = float(1.0 / double(E));

  sinkhorn_init_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(logits.f32(), n, out.f32(),
                                                                     d1.f32(), E, state);
  MEGATON_CUDA_CHECK_LAUNCH();
  SinkhornState host{0, 0};
  while (!host.done) {
    for (int i = 0; i < kCheckEvery; ++i) {
      sinkhorn_rows_kernel<<<unsigned(row_blocks), kThreadsPerBlock, 0, stream>>>(
          out.f32(), d1.f32(), T, E, inv_T, state, d0.f32());
      MEGATON_CUDA_CHECK_LAUNCH();
      sinkhorn_column_partials_kernel<<<dim3(unsigned(column_blocks), unsigned(chunks)),
                                        kThreadsPerBlock, 0, stream>>>(out.f32(), d0.f32(), T, E,
                                                                       state, partials_ptr);
      MEGATON_CUDA_CHECK_LAUNCH();
      sinkhorn_columns_kernel<<<unsigned(column_blocks), kThreadsPerBlock, 0, stream>>>(
          partials_ptr, chunks, E, inv_E, state, d1.f32(), change_ptr);
      MEGATON_CUDA_CHECK_LAUNCH();
      sinkhorn_error_kernel<<<1, 1, 0, stream>>>(change_ptr, E, state);
      MEGATON_CUDA_CHECK_LAUNCH();
    }
    MEGATON_CUDA_CHECK(cudaMemcpyAsync(&host, state, sizeof(host), cudaMemcpyDeviceToHost, stream));
    ::megaton::cuda::synchronize();
  }
  sinkhorn_scale_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(out.f32(), d0.f32(), d1.f32(),
                                                                      n, E);
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
