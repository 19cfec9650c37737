// fp8_transpose: q_t [C, R] = q [R, C]^T for FP8 bytes (ops/fp8.h).
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
using detail::compute_stream;
namespace {

constexpr int kTile = 64;      // bytes per tile side
constexpr int kRowsPerPass = 16;  // a block of 64 x 16 threads moves a tile in 4 passes

// One 64 x 64 tile per block: read row-major into shared memory (a 4-byte word per
// thread along the row), written back transposed. The +4 padding keeps the transposed
// reads of a warp on distinct banks.
__global__ void __launch_bounds__(kTile / 4 * kRowsPerPass)
    transpose_kernel(const uint8_t* __restrict__ q, uint8_t* __restrict__ q_t, int64_t rows,
                     int64_t cols) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int tx = threadIdx.x % (kTile / 4), ty = threadIdx.x / (kTile / 4);
  for (int i = ty; i < kTile; i += kRowsPerPass) {
    const int64_t r = r0 + i;
    for (int b = 0; b < 4; ++b) {
      const int64_t c = c0 + tx * 4 + b;
      tile[i][tx * 4 + b] = r < rows && c < cols ? q[r * cols + c] : 0;
    }
  }
  __syncthreads();
  for (int i = ty; i < kTile; i += kRowsPerPass) {
    const int64_t c = c0 + i;  // a row of q_t
    for (int b = 0; b < 4; ++b) {
      const int64_t r = r0 + tx * 4 + b;
      if (c < cols && r < rows) q_t[c * rows + r] = tile[tx * 4 + b][i];
    }
  }
}

}  // namespace

void fp8_transpose(const Tensor& q, Tensor& q_t) {
  const int64_t cols = q.dim(-1), rows = q.numel() / cols;
  const dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned((rows + kTile - 1) / kTile));
  MEGATON_CHECK(grid.y <= 65535, "fp8_transpose: {} rows exceed the grid", rows);
  transpose_kernel<<<grid, kTile / 4 * kRowsPerPass, 0, compute_stream()>>>(
      static_cast<const uint8_t*>(q.raw()), static_cast<uint8_t*>(q_t.raw()), rows, cols);
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
