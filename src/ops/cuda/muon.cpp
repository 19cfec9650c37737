// Newton-Schulz on the GPU (ops/muon.h) as three cuBLASLt GEMMs per step in the input's
// dtype with fp32 accumulation, EO's newton_schulz_step (muon_utils.py, v0.3.0):
//   A = X X^T;  B = b A + c A A  (torch.addmm(A, A, A, beta=b, alpha=c));
//   X' = a X + B X               (torch.addmm(X, B, X, beta=a, alpha=1)),
// each GEMM's epilogue adding the scaled input and rounding once into the output
// (cuBLASLt's out-of-place D). Also the QKV split as strided copies.
#include "ops/cuda/muon.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cublas_gemm.h"

namespace megaton::ops::cuda {
namespace {

// One step on one matrix, x -> next (distinct buffers), gram and poly [k, k] scratch.
// Wide (rows <= cols): X = x [k = rows, n = cols] as stored. Tall: x [n = rows, k = cols] is
// X^T, and the same step reads A = x^T x, x' = a x + x B^T = (a X + B X)^T: the transpose
// EO takes explicitly lives in the GEMMs' operand flags, and nothing is copied.
void ns_step(void* x, void* next, void* gram, void* poly, int64_t rows, int64_t cols, DType dtype,
             const NsCoefficientSet& s) {
  const bool tall = rows > cols;
  const int64_t k = tall ? cols : rows, n = tall ? rows : cols;
  if (tall)  // A = x^T x
    blas::matmul(x, true, k, x, false, k, gram, k, k, k, n, dtype, dtype, 1.0f, 0.0f);
  else  // A = x x^T
    blas::matmul(x, false, n, x, true, n, gram, k, k, k, n, dtype, dtype, 1.0f, 0.0f);
  // B = c A A + b A
  blas::matmul(gram, false, k, gram, false, k, gram, k, k, k, k, dtype, dtype, s.c, s.b, nullptr,
               poly);
  if (tall)  // x' = x B^T + a x
    blas::matmul(x, false, k, poly, true, k, x, k, n, k, k, dtype, dtype, 1.0f, s.a, nullptr, next);
  else  // x' = B x + a x
    blas::matmul(poly, false, k, x, false, n, x, n, k, n, k, dtype, dtype, 1.0f, s.a, nullptr,
                 next);
}

// The pieces' strided copies: piece i's rows of group grp are rows
// [grp * per_group + offset_i, + split_shapes[i]) of u.
void copy_qkv(const Tensor& u, const std::vector<Tensor>& pieces,
              const std::vector<int64_t>& split_shapes, bool to_pieces) {
  int64_t per_group = 0;
  for (int64_t s : split_shapes) per_group += s;
  const int64_t groups = u.dim(0) / per_group;
  const size_t row_bytes = size_t(u.dim(1)) * dtype_size(u.dtype());
  auto* whole = static_cast<char*>(u.raw());
  int64_t at = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const size_t piece_bytes = size_t(split_shapes[i]) * row_bytes;
    char* in_u = whole + size_t(at) * row_bytes;
    char* piece = static_cast<char*>(pieces[i].raw());
    const size_t u_pitch = size_t(per_group) * row_bytes;
    if (to_pieces)
      MEGATON_CUDA_CHECK(cudaMemcpy2DAsync(piece, piece_bytes, in_u, u_pitch, piece_bytes,
                                           size_t(groups), cudaMemcpyDeviceToDevice,
                                           ::megaton::cuda::stream()));
    else
      MEGATON_CUDA_CHECK(cudaMemcpy2DAsync(in_u, u_pitch, piece, piece_bytes, piece_bytes,
                                           size_t(groups), cudaMemcpyDeviceToDevice,
                                           ::megaton::cuda::stream()));
    at += split_shapes[i];
  }
}

}  // namespace

void newton_schulz(const Tensor& g, Tensor& out, int64_t batch, int64_t rows, int64_t cols,
                   const std::vector<NsCoefficientSet>& per_step, float eps) {
  MEGATON_CHECK(!per_step.empty(), "newton_schulz: no steps");
  const DType dtype = g.dtype();
  const int64_t per_matrix = rows * cols, k = std::min(rows, cols);
  // Ping-pong between out and one scratch copy, X_0 placed so that the last step lands in
  // out: X_k lives in buffers[k % 2], buffers[0] = scratch when the step count is odd.
  Tensor scratch = Tensor::empty(g.shape(), dtype, Device::CUDA);
  Tensor gram = Tensor::empty({k, k}, dtype, Device::CUDA);
  Tensor poly = Tensor::empty({k, k}, dtype, Device::CUDA);
  const bool odd = per_step.size() % 2 == 1;
  Tensor& first = odd ? scratch : out;
  Tensor& second = odd ? out : scratch;
  frobenius_normalize(g, first, batch, per_matrix, eps);
  const size_t matrix_bytes = size_t(per_matrix) * dtype_size(dtype);
  for (int64_t b = 0; b < batch; ++b) {
    char* buffers[2] = {static_cast<char*>(first.raw()) + size_t(b) * matrix_bytes,
                        static_cast<char*>(second.raw()) + size_t(b) * matrix_bytes};
    for (size_t step = 0; step < per_step.size(); ++step)
      ns_step(buffers[step % 2], buffers[(step + 1) % 2], gram.raw(), poly.raw(), rows, cols, dtype,
              per_step[step]);
  }
}

void split_qkv_update(const Tensor& u, const std::vector<int64_t>& split_shapes,
                      std::vector<Tensor>& pieces) {
  copy_qkv(u, pieces, split_shapes, true);
}

void join_qkv_update(const std::vector<Tensor>& pieces, const std::vector<int64_t>& split_shapes,
                     Tensor& u) {
  copy_qkv(u, pieces, split_shapes, false);
}

}  // namespace megaton::ops::cuda
