// The CUDA side of ops/muon.h: the Newton-Schulz iteration (muon.cpp; its strided-batched
// cuBLASLt GEMMs in muon_batched_gemm.cpp) and its kernels (muon.cu), the momentum update,
// muon_apply (muon_apply.cu), the QKV split and copy_columns; reached through the doors in
// ops/cpu/muon.cpp and ops/cpu/muon_update.cpp, which check the arguments first.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"
#include "ops/muon.h"

namespace megaton::ops::cuda {

// ops::newton_schulz on the GPU with the steps' coefficients already resolved
// (per_step[k] for step k, per_step.size() >= 1). g, out [batch, rows, cols] (batch 1 for a
// 2-d g), F32 or BF16, not empty. transpose: iterate on g^T (resolved from
// NsOptions::transpose); tf32: TF32 GEMMs for F32 (ignored for BF16); all_reduce: the
// distributed mode's callback, or empty (NsOptions::all_reduce).
void newton_schulz(const Tensor& g, Tensor& out, int64_t batch, int64_t rows, int64_t cols,
                   const std::vector<NsCoefficientSet>& per_step, float eps, bool transpose,
                   bool tf32, const std::function<void(Tensor&)>& all_reduce);

// muon_batched_gemm.cpp: batch row-major GEMMs at once, on the compute stream:
//   d[i] = alpha op(a[i]) op(b[i]) + beta c[i],   i = 0 .. batch-1,
// matrix i of an operand starting stride_* elements after matrix i-1 (a + i stride_a, ...).
// Per matrix as blas::matmul (ops/cuda/cublas_gemm.h): op(a[i]) [m, k] (a[i] stored [k, m]
// when trans_a), op(b[i]) [k, n], c[i] and d[i] [m, n]; lda, ldb, ldc are row strides in
// elements as stored, and d has c's layout (ldc, stride_c). One strided-batched
// cublasLtMatmul over the batch, with D out of place (alpha acc + beta c rounded once into
// d; d may be c, then in place: with beta != 0 and BF16 that rounds twice, see gemm.cpp).
// c is not read when beta == 0. The matrices of d must not overlap a, b or each other.
//   dtype: F32 or BF16, for a, b, c and d alike; fp32 accumulation and scalars
//       (CUBLAS_COMPUTE_32F), or with tf32 (F32 only; ignored for BF16) TF32 inputs
//       (CUBLAS_COMPUTE_32F_FAST_TF32, torch's "high" float32 matmul precision).
//   batch 1 is one matrix through the per-matrix path (blas::matmul, or one TF32 cuBLASLt
//       GEMM: cublasGemmEx with TF32 where cuBLASLt has no algorithm); strides unused.
// Batched, each matrix gets one matrix's algorithm where cuBLASLt runs it over the batch
// (the same bits as batch separate calls with the batch's alignment), else the batched
// problem's own; where cuBLASLt has none for the batched layouts, the matrices go one by
// one through the batch-1 path. Plans cached per (shape, leading dimensions, strides,
// transposes, dtype, compute type, batch, alignments, beta == 0). InternalError unless
// m, n, k > 0 and 1 <= batch <= INT32_MAX, or for another dtype; cuBLAS failures name the
// call.
void ns_batched_matmul(const void* a, bool trans_a, int64_t lda, int64_t stride_a, const void* b,
                       bool trans_b, int64_t ldb, int64_t stride_b, const void* c, int64_t ldc,
                       int64_t stride_c, void* d, int64_t m, int64_t n, int64_t k, int64_t batch,
                       DType dtype, bool tf32, float alpha, float beta);

// muon.cu: out[b] = g[b] / max(||g[b]||_F, eps) for each of the batch matrices of
// per_matrix elements, the squares summed in fp64 in a fixed order, the norm rounded to
// fp32 and the division done in fp32 (EO's torch.nn.functional.normalize). g, out F32 or
// BF16 alike; out may be g.
void frobenius_normalize(const Tensor& g, Tensor& out, int64_t batch, int64_t per_matrix,
                         float eps);

// muon.cu: the distributed mode's normalisation in two halves around the all-reduce:
// sums[b] = fp32(sum of g[b]'s squares, in fp64 in a fixed order), then out[b] =
// g[b] / max(sqrt(sums[b]), eps) in fp32 (EO's distributed_normalize_p2). sums: F32 [batch].
void matrix_sums_of_squares(const Tensor& g, int64_t batch, int64_t per_matrix, Tensor& sums);
void divide_by_root_of_sums(const Tensor& g, Tensor& out, int64_t batch, int64_t per_matrix,
                            const Tensor& sums, float eps);

// muon.cu: ops::muon_momentum_update, both overloads (checked at the door): grad F32 or
// BF16, update F32 or BF16; control: null (the plain op: grad scale 1, no skip) or the
// device's control tensor (ops.h kAdam* entries).
void muon_momentum_update(Tensor& momentum, const Tensor& grad, float beta, bool nesterov,
                          Tensor& update, const float* control);

// muon_apply.cu: ops::muon_apply (checked at the door; lists not empty).
void muon_apply(std::vector<Tensor>& mains, const std::vector<Tensor>& updates,
                std::vector<Tensor>& copies, const std::vector<float>& weight_decays,
                const std::vector<float>& scales, const Tensor& control);

// muon.cpp: ops::copy_columns (checked at the door; rows and cols > 0), one
// cudaMemcpy2DAsync on the compute stream.
void copy_columns(const Tensor& src, int64_t src_col0, Tensor& dst, int64_t dst_col0, int64_t cols);

// ops::split_qkv_update / join_qkv_update as one strided copy per piece (cudaMemcpy2DAsync).
// groups = u's rows / sum(split_shapes); pieces allocated by the caller.
void split_qkv_update(const Tensor& u, const std::vector<int64_t>& split_shapes,
                      std::vector<Tensor>& pieces);
void join_qkv_update(const std::vector<Tensor>& pieces, const std::vector<int64_t>& split_shapes,
                     Tensor& u);

}  // namespace megaton::ops::cuda
