// Internal to ops/cuda: the checked-cuBLAS macro, the cuBLAS handle, and the row-major
// GEMMs on raw device pointers (cached cuBLASLt plans; cublasGemmEx) that gemm.cpp and
// grouped_gemm.cu share.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdint>
#include <functional>

#include "core/error.h"
#include "core/tensor.h"

// MEGATON_CUBLAS_CHECK(cublasLtMatmul(...)): throws InternalError naming the call, the file
// and line, and cuBLAS's status name and number. (cublasLtGetStatusString also names the
// statuses of the classic cuBLAS API: both return cublasStatus_t.)
#define MEGATON_CUBLAS_CHECK(call)                                                        \
  do {                                                                                    \
    cublasStatus_t megaton_status_ = (call);                                              \
    if (megaton_status_ != CUBLAS_STATUS_SUCCESS) {                                       \
      throw ::megaton::InternalError(                                                     \
          ::fmt::format("{}:{}: {} failed: {} ({})", __FILE__, __LINE__, #call,           \
                        cublasLtGetStatusString(megaton_status_), int(megaton_status_))); \
    }                                                                                     \
  } while (0)

namespace megaton::ops::cuda::blas {

// The classic cuBLAS handle (grouped GEMMs, gemm_ex), on the compute stream, with fp32
// split-K reductions for BF16 and F16 outputs.
cublasHandle_t cublas_handle();

// CUDA_R_32F for F32, CUDA_R_16BF for BF16, CUDA_R_16F for F16; InternalError for any
// other dtype.
cudaDataType_t cuda_dtype(DType dtype);

// Whether cuBLASLt multiplies A/B of `ab` into C of `c` with fp32 accumulation here:
// F32 x F32 -> F32, BF16 x BF16 -> BF16 or F32, F16 x F16 -> F16 or F32.
bool supported_dtypes(DType ab, DType c);

// The cuBLASLt handle and the workspace every cuBLASLt GEMM (gemm.cpp, fp8_gemm.cpp) passes
// to cublasLtMatmul on the compute stream: 32 MiB covers Hopper's split-K and stream-K
// choices for LLM training shapes (cuBLAS's own default for sm_90 is 32 MiB). Created on
// first use, never destroyed.
struct LtContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
LtContext& lt_context();

// The largest power of two up to 256 that divides the address. cuBLASLt assumes 256-byte
// aligned operands unless told otherwise, and a view (Tensor::rows, an expert's rows) can
// start anywhere.
uint32_t alignment_of(const void* p);

// The heuristic's best algorithm for `desc` over the layouts a, b, c (= d), in cuBLAS's
// roles, within lt_context()'s workspace; align_* are the operands' pointer alignments in
// bytes (alignment_of). half_output (c is BF16 or F16): no split-K partial sums kept in
// c's 16-bit type (the sum over k stays fp32 until the final rounding, as PyTorch does when
// reduced-precision reductions are disallowed). Returns cublasLtMatmulAlgoGetHeuristic's status,
// with *found false when it gave no usable algorithm; throws nothing.
cublasStatus_t lt_heuristic(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                            cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, uint32_t align_a,
                            uint32_t align_b, uint32_t align_c, bool half_output,
                            cublasLtMatmulAlgo_t* algo, bool* found);

// Mixes v into the hash h (boost's hash_combine): the plan caches' keys.
inline void hash_combine(size_t& h, uint64_t v) {
  h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
}

// Row-major GEMM on the compute stream: c = alpha * op(a) @ op(b) + beta * c with
// op(a) [m, k], op(b) [k, n], c [m, n]; lda, ldb, ldc are the row strides (elements) of a,
// b and c as stored (a is [k, m] when trans_a). a and b have dtype `ab`, c has `c_dtype`
// (supported_dtypes). Requires m, n, k > 0. Compute type CUBLAS_COMPUTE_32F (no TF32).
// When beta == 0, c is not read (it may hold NaN). The descriptors and the algorithm are
// cached per (shape, strides, transposes, dtypes, beta == 0, pointer alignments); where
// cuBLASLt has no algorithm for a layout, the problem goes to cublasGemmEx instead.
// bias: null, or n elements of c_dtype added to every row of c by cuBLASLt's bias epilogue
// (to the fp32 result, before c's rounding). Returns false when the bias was not added
// (no cuBLASLt algorithm with the epilogue: the caller adds it).
// d: null (the result goes to c, in place), or a buffer of c's dtype and layout (ldc) that
// receives the result while c is only read: cuBLASLt's out-of-place D, which rounds
// alpha * acc + beta * c once into a 16-bit type where the in-place call rounds twice (see
// ops::cuda::gemm in gemm.cpp). With cublasGemmEx (no cuBLASLt algorithm), c is first
// copied into d and the GEMM runs in place there (two roundings: has_lt_algorithm).
bool matmul(const void* a, bool trans_a, int64_t lda, const void* b, bool trans_b, int64_t ldb,
            void* c, int64_t ldc, int64_t m, int64_t n, int64_t k, DType ab, DType c_dtype,
            float alpha, float beta, const void* bias = nullptr, void* d = nullptr);

// Whether matmul with these arguments (and no bias) runs a cuBLASLt algorithm, rather
// than cublasGemmEx (which rounds twice into a 16-bit c read with beta != 0, as an
// in-place cuBLASLt call does; see ops::cuda::gemm in gemm.cpp). Caches the plan.
bool has_lt_algorithm(const void* a, bool trans_a, int64_t lda, const void* b, bool trans_b,
                      int64_t ldb, const void* c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                      DType ab, DType c_dtype, float beta);

// The same GEMM through the classic cublasGemmEx, which chooses (and caches, bounded)
// its algorithm itself: for shapes that change from call to call, such as one expert's
// row count, where a cached plan per shape would pile up. Any alignment.
void gemm_ex(const void* a, bool trans_a, int64_t lda, const void* b, bool trans_b, int64_t ldb,
             void* c, int64_t ldc, int64_t m, int64_t n, int64_t k, DType ab, DType c_dtype,
             float alpha, float beta);

}  // namespace megaton::ops::cuda::blas
