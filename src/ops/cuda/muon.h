// The CUDA side of ops/muon.h: the Newton-Schulz iteration (muon.cpp, cuBLASLt GEMMs; TF32
// ones in muon_gemm.cpp) and its kernels (muon.cu), the momentum update, muon_apply
// (muon_apply.cu), the QKV split and copy_columns; reached through the doors in
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

// muon_gemm.cpp: the row-major F32 GEMM d = alpha op(a) op(b) + beta c of blas::matmul
// (ops/cuda/cublas_gemm.h: shapes, leading dimensions, c not read when beta == 0) with
// cuBLASLt's CUBLAS_COMPUTE_32F_FAST_TF32 (inputs rounded to TF32, fp32 accumulation). d may
// be c. Plans cached per shape and alignment; where cuBLASLt has no algorithm,
// cublasGemmEx with the same compute type.
void tf32_matmul(const float* a, bool trans_a, int64_t lda, const float* b, bool trans_b,
                 int64_t ldb, const float* c, int64_t ldc, float* d, int64_t m, int64_t n,
                 int64_t k, float alpha, float beta);

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
