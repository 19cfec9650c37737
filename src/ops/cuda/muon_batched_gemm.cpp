// The GEMMs of the GPU Newton-Schulz (ops/cuda/muon.h ns_batched_matmul): each of a step's
// three GEMMs as one strided-batched cuBLASLt call over the whole batch of matrices, in the
// iteration's dtype with fp32 accumulation (CUBLAS_COMPUTE_32F) or with TF32 inputs
// (CUBLAS_COMPUTE_32F_FAST_TF32, torch's "high" float32 matmul precision: Megatron's
// --muon-fp32-matmul-prec high). Row-major as blas::matmul (gemm.cpp says how that maps to
// cuBLAS's column-major roles). Plans cached per problem, as gemm.cpp's.
//
// The batched call runs, where cuBLASLt accepts it, the very algorithm the heuristic gives
// one matrix of the batch alone (the one blas::matmul would run per matrix), so that
// batching changes no bits: a kernel configuration (tile, split-K, reduction scheme)
// computes each matrix of a strided batch as it computes a single one. Only when that
// algorithm does not take the batched layout (or needs more workspace than there is) does
// the heuristic choose one for the batched problem itself; and when it has none, the
// matrices go one by one through the per-matrix path the iteration used before.
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cublas_gemm.h"
#include "ops/cuda/muon.h"

namespace megaton::ops::cuda {
namespace {

// One problem: the shapes, leading dimensions and batch strides (elements), the flags, the
// dtype and compute type, and the operands' alignments (bytes) over the whole batch.
struct BatchedKey {
  int64_t m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch;
  bool trans_a, trans_b, tf32, beta_zero;
  DType dtype;
  uint32_t align_a, align_b, align_c;
  bool operator==(const BatchedKey&) const = default;
};

struct BatchedKeyHash {
  size_t operator()(const BatchedKey& key) const {
    size_t h = 0;
    for (int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.stride_a, key.stride_b,
                      key.stride_c, key.batch})
      blas::hash_combine(h, uint64_t(v));
    blas::hash_combine(h, uint64_t(key.trans_a) | uint64_t(key.trans_b) << 1 |
                              uint64_t(key.tf32) << 2 | uint64_t(key.beta_zero) << 3 |
                              uint64_t(key.dtype) << 8);
    blas::hash_combine(
        h, uint64_t(key.align_a) | uint64_t(key.align_b) << 16 | uint64_t(key.align_c) << 32);
    return h;
  }
};

// How a cached problem runs.
enum class Route {
  Lt,         // cublasLtMatmul with the plan's algorithm over the whole batch
  PerMatrix,  // batch > 1 and no cuBLASLt algorithm for the batched layouts: one call per matrix
  GemmEx,     // batch 1 (TF32 only) and no cuBLASLt algorithm: cublasGemmEx, same compute type
};

// cuBLASLt's descriptors and algorithm for one problem. Lives as long as the process (the
// set of shapes in a training run is small and fixed).
struct BatchedPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  // Column-major roles: cuBLAS's A is our b, its B is our a, C (= D's layout) is our c.
  cublasLtMatrixLayout_t lt_a = nullptr, lt_b = nullptr, lt_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  Route route = Route::Lt;
};

// The largest power of two up to 256 dividing `bytes` (256 for 0): with a pointer's
// alignment, the alignment every matrix of a strided batch keeps.
uint32_t stride_alignment(int64_t bytes) {
  uint32_t alignment = 256;
  while (alignment > 1 && bytes % alignment != 0) alignment /= 2;
  return alignment;
}

// The three layouts of `key` (stored, pre-op shapes read column-major: row-major b [k, n]
// ([n, k] when trans_b) is [n, k] ([k, n]); likewise a; c [m, n] is [n, m]), with the
// batch count and strides on each when `batched`.
void create_layouts(const BatchedKey& key, bool batched, cublasLtMatrixLayout_t* lt_a,
                    cublasLtMatrixLayout_t* lt_b, cublasLtMatrixLayout_t* lt_c) {
  const cudaDataType_t type = blas::cuda_dtype(key.dtype);
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(lt_a, type, key.trans_b ? key.k : key.n,
                                                  key.trans_b ? key.n : key.k, key.ldb));
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(lt_b, type, key.trans_a ? key.m : key.k,
                                                  key.trans_a ? key.k : key.m, key.lda));
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(lt_c, type, key.n, key.m, key.ldc));
  if (!batched) return;
  const int32_t count = int32_t(key.batch);
  for (auto [layout, stride] : {std::pair{*lt_a, key.stride_b}, std::pair{*lt_b, key.stride_a},
                                std::pair{*lt_c, key.stride_c}}) {
    MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
}

void destroy_layouts(cublasLtMatrixLayout_t lt_a, cublasLtMatrixLayout_t lt_b,
                     cublasLtMatrixLayout_t lt_c) {
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(lt_a));
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(lt_b));
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(lt_c));
}

// lt_heuristic on the plan's layouts; throws on a failure other than "not supported".
bool heuristic(const BatchedKey& key, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t lt_a,
               cublasLtMatrixLayout_t lt_b, cublasLtMatrixLayout_t lt_c,
               cublasLtMatmulAlgo_t* algo) {
  bool found = false;
  // cuBLAS's A is our b. BF16 output: no split-K partials in bf16 (as blas::matmul).
  const cublasStatus_t status =
      blas::lt_heuristic(desc, lt_a, lt_b, lt_c, key.align_b, key.align_a, key.align_c,
                         key.dtype != DType::F32, algo, &found);
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED)
    throw InternalError(fmt::format(
        "{}:{}: cublasLtMatmulAlgoGetHeuristic failed: {} ({}) for m={} n={} k={} batch={} "
        "{}{}",
        __FILE__, __LINE__, cublasLtGetStatusString(status), int(status), key.m, key.n, key.k,
        key.batch, dtype_name(key.dtype), key.tf32 ? " TF32" : ""));
  return found;
}

// Whether `algo` runs the batched layouts: strided batches supported, the descriptors
// accepted (cublasLtMatmulAlgoCheck) and its workspace within lt_context()'s.
bool runs_batched(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t lt_a,
                  cublasLtMatrixLayout_t lt_b, cublasLtMatrixLayout_t lt_c,
                  const cublasLtMatmulAlgo_t& algo) {
  int32_t strided = 0;
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_STRIDED_BATCH_SUPPORT, &strided,
                                        sizeof(strided), &written) != CUBLAS_STATUS_SUCCESS ||
      strided == 0)
    return false;
  blas::LtContext& context = blas::lt_context();
  cublasLtMatmulHeuristicResult_t result{};
  return cublasLtMatmulAlgoCheck(context.handle, desc, lt_a, lt_b, lt_c, lt_c, &algo, &result) ==
             CUBLAS_STATUS_SUCCESS &&
         result.workspaceSize <= context.workspace_bytes;
}

BatchedPlan make_plan(const BatchedKey& key) {
  BatchedPlan plan;
  const cublasComputeType_t compute = key.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  MEGATON_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, compute, CUDA_R_32F));
  const cublasOperation_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS A = our b
  const cublasOperation_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS B = our a
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  // One matrix's layouts and algorithm: blas::matmul's (or, TF32, the former tf32_matmul's)
  // descriptors and heuristic call, hence its algorithm.
  cublasLtMatrixLayout_t one_a = nullptr, one_b = nullptr, one_c = nullptr;
  create_layouts(key, false, &one_a, &one_b, &one_c);
  cublasLtMatmulAlgo_t one_algo{};
  const bool one_found = heuristic(key, plan.desc, one_a, one_b, one_c, &one_algo);
  if (key.batch == 1) {
    plan.lt_a = one_a;
    plan.lt_b = one_b;
    plan.lt_c = one_c;
    plan.algo = one_algo;
    plan.route = one_found ? Route::Lt : Route::GemmEx;
    return plan;
  }
  destroy_layouts(one_a, one_b, one_c);
  create_layouts(key, true, &plan.lt_a, &plan.lt_b, &plan.lt_c);
  if (one_found && runs_batched(plan.desc, plan.lt_a, plan.lt_b, plan.lt_c, one_algo)) {
    plan.algo = one_algo;
    return plan;
  }
  // Another kernel than one matrix's: the same GEMMs, possibly other last bits.
  if (heuristic(key, plan.desc, plan.lt_a, plan.lt_b, plan.lt_c, &plan.algo)) return plan;
  plan.route = Route::PerMatrix;
  return plan;
}

const BatchedPlan& plan_for(const BatchedKey& key) {
  static std::mutex mutex;
  static auto* plans =
      new std::unordered_map<BatchedKey, BatchedPlan, BatchedKeyHash>();  // never freed
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans->find(key);
  if (it == plans->end()) it = plans->emplace(key, make_plan(key)).first;
  return it->second;  // unordered_map never moves its elements
}

BatchedKey key_of(const void* a, bool trans_a, int64_t lda, int64_t stride_a, const void* b,
                  bool trans_b, int64_t ldb, int64_t stride_b, const void* c, int64_t ldc,
                  int64_t stride_c, const void* d, int64_t m, int64_t n, int64_t k, int64_t batch,
                  DType dtype, bool tf32, float beta) {
  const int64_t elem = int64_t(dtype_size(dtype));
  // A single matrix keeps its pointers' alignments (and no strides), as blas::matmul's key.
  const bool one = batch == 1;
  auto align = [&](const void* p, int64_t stride) {
    return one ? blas::alignment_of(p)
               : std::min(blas::alignment_of(p), stride_alignment(stride * elem));
  };
  return BatchedKey{m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldc,
                    one ? 0 : stride_a,
                    one ? 0 : stride_b,
                    one ? 0 : stride_c,
                    batch,
                    trans_a,
                    trans_b,
                    tf32,
                    beta == 0.0f,
                    dtype,
                    align(a, stride_a),
                    align(b, stride_b),
                    std::min(align(c, stride_c), align(d, stride_c))};
}

// One matrix with TF32 inputs (what tf32_matmul did): its cached cuBLASLt plan, or
// cublasGemmEx with the same compute type where cuBLASLt has no algorithm (C copied into
// a separate D first: cublasGemmEx has no D).
void tf32_single(const float* a, bool trans_a, int64_t lda, const float* b, bool trans_b,
                 int64_t ldb, const float* c, int64_t ldc, float* d, int64_t m, int64_t n,
                 int64_t k, float alpha, float beta) {
  const BatchedPlan& plan = plan_for(key_of(a, trans_a, lda, 0, b, trans_b, ldb, 0, c, ldc, 0, d, m,
                                            n, k, 1, DType::F32, true, beta));
  cudaStream_t stream = ::megaton::cuda::stream();
  if (plan.route == Route::GemmEx) {
    if (d != c && beta != 0.0f)
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

// One matrix through the per-matrix path the iteration used before batching: blas::matmul
// (out-of-place D unless d is c), or tf32_single.
void single_matmul(const void* a, bool trans_a, int64_t lda, const void* b, bool trans_b,
                   int64_t ldb, const void* c, int64_t ldc, void* d, int64_t m, int64_t n,
                   int64_t k, DType dtype, bool tf32, float alpha, float beta) {
  if (tf32) {
    tf32_single(static_cast<const float*>(a), trans_a, lda, static_cast<const float*>(b), trans_b,
                ldb, static_cast<const float*>(c), ldc, static_cast<float*>(d), m, n, k, alpha,
                beta);
    return;
  }
  blas::matmul(a, trans_a, lda, b, trans_b, ldb, const_cast<void*>(c), ldc, m, n, k, dtype, dtype,
               alpha, beta, nullptr, d == c ? nullptr : d);
}

}  // namespace

void ns_batched_matmul(const void* a, bool trans_a, int64_t lda, int64_t stride_a, const void* b,
                       bool trans_b, int64_t ldb, int64_t stride_b, const void* c, int64_t ldc,
                       int64_t stride_c, void* d, int64_t m, int64_t n, int64_t k, int64_t batch,
                       DType dtype, bool tf32, float alpha, float beta) {
  MEGATON_CHECK(m > 0 && n > 0 && k > 0 && batch >= 1 && batch <= INT32_MAX,
                "ns_batched_matmul: empty problem or bad batch m={} n={} k={} batch={}", m, n, k,
                batch);
  MEGATON_CHECK(dtype == DType::F32 || dtype == DType::BF16,
                "ns_batched_matmul: dtype {} (F32 or BF16 expected)", dtype_name(dtype));
  tf32 = tf32 && dtype == DType::F32;
  if (batch == 1) {
    single_matmul(a, trans_a, lda, b, trans_b, ldb, c, ldc, d, m, n, k, dtype, tf32, alpha, beta);
    return;
  }
  const BatchedPlan& plan = plan_for(key_of(a, trans_a, lda, stride_a, b, trans_b, ldb, stride_b, c,
                                            ldc, stride_c, d, m, n, k, batch, dtype, tf32, beta));
  if (plan.route == Route::PerMatrix) {
    // cuBLASLt has no algorithm for the batched layouts: the per-matrix loop the iteration
    // ran before batching (kept for exactly this case).
    const size_t elem = dtype_size(dtype);
    auto at = [elem](const void* p, int64_t i, int64_t stride) {
      return static_cast<const char*>(p) + size_t(i) * size_t(stride) * elem;
    };
    for (int64_t i = 0; i < batch; ++i)
      single_matmul(at(a, i, stride_a), trans_a, lda, at(b, i, stride_b), trans_b, ldb,
                    at(c, i, stride_c), ldc, const_cast<char*>(at(d, i, stride_c)), m, n, k, dtype,
                    tf32, alpha, beta);
    return;
  }
  blas::LtContext& context = blas::lt_context();
  MEGATON_CUBLAS_CHECK(cublasLtMatmul(context.handle, plan.desc, &alpha, b, plan.lt_a, a, plan.lt_b,
                                      &beta, c, plan.lt_c, d, plan.lt_c, &plan.algo,
                                      context.workspace, context.workspace_bytes,
                                      ::megaton::cuda::stream()));
}

}  // namespace megaton::ops::cuda
