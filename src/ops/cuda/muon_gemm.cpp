// The TF32 GEMMs of Newton-Schulz under --muon-fp32-matmul-prec high (ops/cuda/muon.h
// tf32_matmul): blas::matmul's row-major convention with cuBLASLt's
// CUBLAS_COMPUTE_32F_FAST_TF32, which is what torch's "high" float32 matmul precision
// selects for fp32 GEMMs (TF32 inputs, fp32 accumulation and output). blas::matmul keeps
// CUBLAS_COMPUTE_32F for everything else.
#include <cublasLt.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cublas_gemm.h"
#include "ops/cuda/muon.h"

namespace megaton::ops::cuda {
namespace {

struct Tf32Key {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
  uint32_t align_a, align_b, align_c;
  bool operator==(const Tf32Key&) const = default;
};

struct Tf32KeyHash {
  size_t operator()(const Tf32Key& key) const {
    size_t h = 0;
    for (int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc})
      blas::hash_combine(h, uint64_t(v));
    blas::hash_combine(h, uint64_t(key.trans_a) | uint64_t(key.trans_b) << 1 |
                              uint64_t(key.align_a) << 8 | uint64_t(key.align_b) << 24 |
                              uint64_t(key.align_c) << 40);
    return h;
  }
};

// cuBLASLt's descriptors and algorithm for one problem (process lifetime, as gemm.cpp's).
struct Tf32Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  // Column-major roles: cuBLAS's A is our b, its B is our a, C (= D) is our c.
  cublasLtMatrixLayout_t lt_a = nullptr, lt_b = nullptr, lt_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool use_gemm_ex = false;  // no cuBLASLt algorithm: cublasGemmEx with the same compute type
};

Tf32Plan make_plan(const Tf32Key& key) {
  Tf32Plan plan;
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F));
  const cublasOperation_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS A = our b
  const cublasOperation_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS B = our a
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  // Stored shapes, column-major: row-major b [k, n] ([n, k] when trans_b) is read as [n, k]
  // ([k, n]); likewise a; c [m, n] is read as [n, m].
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(
      &plan.lt_a, CUDA_R_32F, key.trans_b ? key.k : key.n, key.trans_b ? key.n : key.k, key.ldb));
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(
      &plan.lt_b, CUDA_R_32F, key.trans_a ? key.m : key.k, key.trans_a ? key.k : key.m, key.lda));
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_c, CUDA_R_32F, key.n, key.m, key.ldc));
  bool found = false;
  const cublasStatus_t heuristic =
      blas::lt_heuristic(plan.desc, plan.lt_a, plan.lt_b, plan.lt_c, key.align_b, key.align_a,
                         key.align_c, /*half_output=*/false, &plan.algo, &found);
  if (heuristic != CUBLAS_STATUS_SUCCESS && heuristic != CUBLAS_STATUS_NOT_SUPPORTED)
    throw InternalError(fmt::format(
        "{}:{}: cublasLtMatmulAlgoGetHeuristic (TF32) failed: {} ({}) for m={} n={} k={}", __FILE__,
        __LINE__, cublasLtGetStatusString(heuristic), int(heuristic), key.m, key.n, key.k));
  plan.use_gemm_ex = !found;
  return plan;
}

const Tf32Plan& plan_for(const Tf32Key& key) {
  static std::mutex mutex;
  static auto* plans = new std::unordered_map<Tf32Key, Tf32Plan, Tf32KeyHash>();  // never freed
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans->find(key);
  if (it == plans->end()) it = plans->emplace(key, make_plan(key)).first;
  return it->second;
}

}  // namespace

void tf32_matmul(const float* a, bool trans_a, int64_t lda, const float* b, bool trans_b,
                 int64_t ldb, const float* c, int64_t ldc, float* d, int64_t m, int64_t n,
                 int64_t k, float alpha, float beta) {
  MEGATON_CHECK(m > 0 && n > 0 && k > 0, "tf32_matmul: empty problem m={} n={} k={}", m, n, k);
  const uint32_t align_c = std::min(blas::alignment_of(c), blas::alignment_of(d));
  const Tf32Plan& plan = plan_for(Tf32Key{m, n, k, lda, ldb, ldc, trans_a, trans_b,
                                          blas::alignment_of(a), blas::alignment_of(b), align_c});
  cudaStream_t stream = ::megaton::cuda::stream();
  if (plan.use_gemm_ex) {
    if (d != c && beta != 0.0f)  // cublasGemmEx has no separate D: C copied there first
      MEGATON_CUDA_CHECK(cudaMemcpy2DAsync(d, size_t(ldc) * sizeof(float), c,
                                           size_t(ldc) * sizeof(float), size_t(n) * sizeof(float),
                                           size_t(m), cudaMemcpyDeviceToDevice, stream));
    // Column-major d^T [n, m] = op(b)^T [n, k] @ op(a)^T [k, m], as gemm.cpp's gemm_ex.
    MEGATON_CUBLAS_CHECK(cublasGemmEx_64(blas::cublas_handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b,
                                         CUDA_R_32F, ldb, a, CUDA_R_32F, lda, &beta, d, CUDA_R_32F,
                                         ldc, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
    return;
  }
  blas::LtContext& context = blas::lt_context();
  MEGATON_CUBLAS_CHECK(cublasLtMatmul(context.handle, plan.desc, &alpha, b, plan.lt_a, a, plan.lt_b,
                                      &beta, c, plan.lt_c, d, plan.lt_c, &plan.algo,
                                      context.workspace, context.workspace_bytes, stream));
}

}  // namespace megaton::ops::cuda
