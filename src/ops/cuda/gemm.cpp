// ops::cuda::gemm: row-major GEMM through cuBLASLt, with descriptors and the heuristic's
// algorithm cached per problem (cublasGemmEx where cuBLASLt offers no algorithm).
//
// cuBLAS is column-major. A row-major [r, c] matrix with row stride ld is, read
// column-major, its transpose [c, r] with the same ld. So row-major c = op(a) op(b) is
// computed as the column-major c^T = op(b)^T op(a)^T: the operands swap places and keep
// their transpose flags, and no data moves.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <mutex>
#include <unordered_map>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "ops/cuda/cublas_gemm.h"
#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {
namespace blas {

cudaDataType_t cuda_dtype(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      break;
  }
  MEGATON_CHECK(false, "cuBLAS GEMM: no CUDA data type for {}", dtype_name(dtype));
  return CUDA_R_32F;
}

bool supported_dtypes(DType ab, DType c) {
  if (ab == DType::F32) return c == DType::F32;
  if (ab == DType::BF16 || ab == DType::F16) return c == ab || c == DType::F32;
  return false;
}

cublasHandle_t cublas_handle() {
  static cublasHandle_t handle = [] {
    cublasHandle_t created = nullptr;  // never destroyed: outlives static teardown
    MEGATON_CUBLAS_CHECK(cublasCreate(&created));
    MEGATON_CUBLAS_CHECK(cublasSetStream(created, ::megaton::cuda::stream()));
    // BF16 and F16 outputs: split-K partial sums stay fp32 (as the cuBLASLt reduction-scheme
    // mask).
    MEGATON_CUBLAS_CHECK(cublasSetMathMode(
        created,
        cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    return created;
  }();
  return handle;
}

LtContext& lt_context() {
  static LtContext* context = [] {
    auto* c = new LtContext();  // never destroyed, like the allocator: no teardown order
    MEGATON_CUBLAS_CHECK(cublasLtCreate(&c->handle));
    c->workspace_bytes = size_t(32) << 20;
    c->workspace = ::megaton::cuda::device_allocate(c->workspace_bytes);
    return c;
  }();
  return *context;
}

uint32_t alignment_of(const void* p) {
  auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

cublasStatus_t lt_heuristic(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                            cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, uint32_t align_a,
                            uint32_t align_b, uint32_t align_c, bool half_output,
                            cublasLtMatmulAlgo_t* algo, bool* found) {
  LtContext& context = lt_context();
  cublasLtMatmulPreference_t preference = nullptr;
  MEGATON_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  size_t workspace_bytes = context.workspace_bytes;
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes, sizeof(workspace_bytes)));
  if (half_output) {
    uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    MEGATON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
  }
  MEGATON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
  MEGATON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
  MEGATON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
  MEGATON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(context.handle, desc, a, b, c, c,
                                                               preference, 1, &result, &count);
  MEGATON_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(preference));
  *found = status == CUBLAS_STATUS_SUCCESS && count > 0 && result.state == CUBLAS_STATUS_SUCCESS;
  if (*found) *algo = result.algo;
  return status;
}

namespace {

struct PlanKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b, beta_zero, bias;
  DType ab, c;
  uint32_t align_a, align_b, align_c;
  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = 0;
    const auto mix = [&h](uint64_t v) { blas::hash_combine(h, v); };
    mix(key.m);
    mix(key.n);
    mix(key.k);
    mix(key.lda);
    mix(key.ldb);
    mix(key.ldc);
    mix(uint64_t(key.trans_a) | uint64_t(key.trans_b) << 1 | uint64_t(key.beta_zero) << 2 |
        uint64_t(key.bias) << 3 |
        uint64_t(key.ab) << 8 | uint64_t(key.c) << 16);
    mix(uint64_t(key.align_a) | uint64_t(key.align_b) << 16 | uint64_t(key.align_c) << 32);
    return h;
  }
};

// Everything cublasLtMatmul needs besides the pointers and scalars. Lives as long as the
// process (the set of shapes in a training run is small and fixed).
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  // Column-major roles: cuBLAS's A is our b, its B is our a, C (= D) is our c.
  cublasLtMatrixLayout_t lt_a = nullptr, lt_b = nullptr, lt_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool use_gemm_ex = false;  // cuBLASLt found no algorithm: use cublasGemmEx instead
  // The key's bias epilogue is in the descriptor (false: no cuBLASLt algorithm has it for
  // this problem, so the plan is the plain GEMM's and the caller adds the bias).
  bool bias_epilogue = false;
};

Plan make_plan(const PlanKey& key) {
  Plan plan;
  MEGATON_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS A = our b
  cublasOperation_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS B = our a
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (key.bias) {
    // Our c's columns are the rows of cuBLAS's column-major D: the bias epilogue's vector.
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    MEGATON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                        &epilogue, sizeof(epilogue)));
    const cudaDataType_t bias_type = cuda_dtype(key.c);
    MEGATON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  // Stored (pre-op) shapes, column-major: row-major b is [k, n] (or [n, k] when trans_b),
  // read as [n, k] (or [k, n]); likewise a; c [m, n] is read as [n, m].
  const cudaDataType_t ab = cuda_dtype(key.ab), c = cuda_dtype(key.c);
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_a, ab, key.trans_b ? key.k : key.n,
                                                  key.trans_b ? key.n : key.k, key.ldb));
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_b, ab, key.trans_a ? key.m : key.k,
                                                  key.trans_a ? key.k : key.m, key.lda));
  MEGATON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_c, c, key.n, key.m, key.ldc));

  // cuBLAS's A is our b.
  bool found = false;
  const cublasStatus_t heuristic =
      lt_heuristic(plan.desc, plan.lt_a, plan.lt_b, plan.lt_c, key.align_b, key.align_a,
                   key.align_c, key.c != DType::F32, &plan.algo, &found);
  if (heuristic != CUBLAS_STATUS_SUCCESS && heuristic != CUBLAS_STATUS_NOT_SUPPORTED)
    throw InternalError(fmt::format(
        "{}:{}: cublasLtMatmulAlgoGetHeuristic failed: {} ({}) for m={} n={} k={}", __FILE__,
        __LINE__, cublasLtGetStatusString(heuristic), int(heuristic), key.m, key.n, key.k));
  if (!found && key.bias) {
    // None with the epilogue: the plain GEMM's plan rather than cublasGemmEx for all of it.
    (void)cublasLtMatmulDescDestroy(plan.desc);
    (void)cublasLtMatrixLayoutDestroy(plan.lt_a);
    (void)cublasLtMatrixLayoutDestroy(plan.lt_b);
    (void)cublasLtMatrixLayoutDestroy(plan.lt_c);
    PlanKey plain = key;
    plain.bias = false;
    return make_plan(plain);
  }
  // No cuBLASLt algorithm for this layout and alignment (NOT_SUPPORTED, or none found):
  // the classic cublasGemmEx accepts any leading dimension and alignment.
  plan.use_gemm_ex = !found;
  plan.bias_epilogue = key.bias;
  return plan;
}

const Plan& plan_for(const PlanKey& key) {
  static std::mutex mutex;
  static auto* plans = new std::unordered_map<PlanKey, Plan, PlanKeyHash>();  // never freed
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans->find(key);
  if (it == plans->end()) it = plans->emplace(key, make_plan(key)).first;
  return it->second;  // unordered_map never moves its elements
}

}  // namespace

namespace {
PlanKey plan_key(const void* a, bool trans_a, int64_t lda, const void* b, bool trans_b,
                 int64_t ldb, const void* c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                 DType ab, DType c_dtype, float beta, const void* bias) {
  MEGATON_CHECK(m > 0 && n > 0 && k > 0, "cuBLASLt matmul: empty problem m={} n={} k={}", m, n, k);
  MEGATON_CHECK(supported_dtypes(ab, c_dtype), "cuBLASLt matmul: a/b {} into c {}", dtype_name(ab),
                dtype_name(c_dtype));
  return PlanKey{m,
                 n,
                 k,
                 lda,
                 ldb,
                 ldc,
                 trans_a,
                 trans_b,
                 beta == 0,
                 bias != nullptr,
                 ab,
                 c_dtype,
                 alignment_of(a),
                 alignment_of(b),
                 alignment_of(c)};
}
}  // namespace

bool has_lt_algorithm(const void* a, bool trans_a, int64_t lda, const void* b, bool trans_b,
                      int64_t ldb, const void* c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                      DType ab, DType c_dtype, float beta) {
  return !plan_for(plan_key(a, trans_a, lda, b, trans_b, ldb, c, ldc, m, n, k, ab, c_dtype, beta,
                            nullptr))
              .use_gemm_ex;
}

bool matmul(const void* a, bool trans_a, int64_t lda, const void* b, bool trans_b, int64_t ldb,
            void* c, int64_t ldc, int64_t m, int64_t n, int64_t k, DType ab, DType c_dtype,
            float alpha, float beta, const void* bias, void* d) {
  if (d == nullptr) d = c;
  const Plan& plan = plan_for(
      plan_key(a, trans_a, lda, b, trans_b, ldb, c, ldc, m, n, k, ab, c_dtype, beta, bias));
  if (plan.use_gemm_ex) {
    if (d != c && beta != 0.0f) {  // cublasGemmEx has no separate D: C copied there first
      const size_t bytes = size_t(dtype_size(c_dtype));
      MEGATON_CUDA_CHECK(cudaMemcpy2DAsync(d, size_t(ldc) * bytes, c, size_t(ldc) * bytes,
                                           size_t(n) * bytes, size_t(m), cudaMemcpyDeviceToDevice,
                                           ::megaton::cuda::stream()));
    }
    gemm_ex(a, trans_a, lda, b, trans_b, ldb, d, ldc, m, n, k, ab, c_dtype, alpha, beta);
    return bias == nullptr;
  }
  LtContext& context = lt_context();
  if (plan.bias_epilogue)  // per call; the plan's descriptor keeps the epilogue
    MEGATON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  MEGATON_CUBLAS_CHECK(cublasLtMatmul(
      context.handle, plan.desc, &alpha, b, plan.lt_a, a, plan.lt_b, &beta, c, plan.lt_c, d,
      plan.lt_c, &plan.algo, context.workspace, context.workspace_bytes, ::megaton::cuda::stream()));
  return bias == nullptr || plan.bias_epilogue;
}

void gemm_ex(const void* a, bool trans_a, int64_t lda, const void* b, bool trans_b, int64_t ldb,
             void* c, int64_t ldc, int64_t m, int64_t n, int64_t k, DType ab, DType c_dtype,
             float alpha, float beta) {
  MEGATON_CHECK(m > 0 && n > 0 && k > 0, "cublasGemmEx: empty problem m={} n={} k={}", m, n, k);
  MEGATON_CHECK(supported_dtypes(ab, c_dtype), "cublasGemmEx: a/b {} into c {}", dtype_name(ab),
                dtype_name(c_dtype));
  // Column-major c^T [n, m] = op(b)^T [n, k] @ op(a)^T [k, m], as for cuBLASLt above.
  MEGATON_CUBLAS_CHECK(cublasGemmEx_64(
      cublas_handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n,
      m, k, &alpha, b, cuda_dtype(ab), ldb, a, cuda_dtype(ab), lda, &beta, c, cuda_dtype(c_dtype),
      ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace blas

namespace {

struct Matrix {
  int64_t rows, cols;
};

// The 2-d view of a tensor of rank >= 2 on the GPU: leading dimensions merged into rows.
Matrix as_matrix(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "gemm: {} is undefined", name);
  MEGATON_CHECK(t.ndim() >= 2, "gemm: {} must have rank >= 2, got shape {}", name,
                shape_str(t.shape()));
  MEGATON_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16 || t.dtype() == DType::F16,
                "gemm: {} must be F32, BF16 or F16, got {}", name, dtype_name(t.dtype()));
  MEGATON_CHECK(t.device() == Device::CUDA, "gemm: {} must be on the GPU, it is on the CPU", name);
  int64_t rows = 1;  // not numel / cols: that loses the rows when cols == 0 (k == 0)
  for (int i = 0; i + 1 < t.ndim(); ++i) rows *= t.dim(i);
  return {rows, t.dim(-1)};
}

bool overlaps(const Tensor& x, const Tensor& y) {
  auto* x0 = static_cast<const char*>(x.raw());
  auto* y0 = static_cast<const char*>(y.raw());
  return x.nbytes() && y.nbytes() && x0 < y0 + y.nbytes() && y0 < x0 + x.nbytes();
}

}  // namespace

namespace {
// gemm and gemm_bias (bias undefined: none).
void gemm_impl(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
               float alpha, float beta, const Tensor& bias) {
  Matrix ma = as_matrix(a, "a"), mb = as_matrix(b, "b"), mc = as_matrix(c, "c");
  int64_t m = trans_a ? ma.cols : ma.rows, k = trans_a ? ma.rows : ma.cols;
  int64_t kb = trans_b ? mb.cols : mb.rows, n = trans_b ? mb.rows : mb.cols;
  MEGATON_CHECK(k == kb && mc.rows == m && mc.cols == n,
                "gemm: op(a) [{}, {}] @ op(b) [{}, {}] into c [{}, {}] (a {}{}, b {}{}, c {})", m,
                k, kb, n, mc.rows, mc.cols, shape_str(a.shape()), trans_a ? "^T" : "",
                shape_str(b.shape()), trans_b ? "^T" : "", shape_str(c.shape()));
  MEGATON_CHECK(a.dtype() == b.dtype() && blas::supported_dtypes(a.dtype(), c.dtype()),
                "gemm: a {} and b {} into c {} (a and b share one dtype, F32, BF16 or F16; c is "
                "F32, or a and b's dtype)",
                dtype_name(a.dtype()), dtype_name(b.dtype()), dtype_name(c.dtype()));
  MEGATON_CHECK(!overlaps(c, a) && !overlaps(c, b), "gemm: c must not overlap a or b");
  if (bias.defined())
    MEGATON_CHECK(bias.device() == Device::CUDA && bias.dtype() == c.dtype() && bias.ndim() == 1 &&
                      bias.dim(0) == n,
                  "gemm_bias: bias {} {} must be [{}] of c's dtype {} on the GPU",
                  dtype_name(bias.dtype()), shape_str(bias.shape()), n, dtype_name(c.dtype()));
  if (m == 0 || n == 0) return;
  bool bias_done = !bias.defined();
  if (k == 0) {  // op(a) @ op(b) is all zeros; cuBLASLt is not asked about empty sums
    if (beta == 0.0f)
      c.zero();
    else if (beta != 1.0f)
      scale_(c, beta);
  } else {
    // A BF16 or F16 c that is read (beta != 0) goes to cuBLASLt as C with a separate D,
    // then D is copied into c: in place (D == C) cuBLASLt (H200) rounds the product to
    // c's dtype and then adds C, rounding twice (measured on an H200, cuBLAS 13, every
    // algorithm its heuristic offers for a 96x160x256 bf16 GEMM with beta 1: D ==
    // bf16(C + bf16(acc)) in all 15360 elements, up to 225 bf16 ulps from bf16(C + acc)
    // where C cancels acc), while out of place it gives bf16(C + acc) (one rounding) in
    // all of them. The temporary is stream-ordered, freed on return.
    // cublasGemmEx (no cuBLASLt algorithm for the layout) rounds twice in place too and has
    // no separate D: there the product goes to an fp32 temporary, added into c by add_
    // (fp32 sum, one rounding; with beta not 1, c is scaled first: one more rounding).
    // bias is only given with beta == 0 (gemm_bias), so neither path has one.
    const bool half_read = beta != 0.0f && c.dtype() != DType::F32;
    if (half_read && !blas::has_lt_algorithm(a.raw(), trans_a, ma.cols, b.raw(), trans_b,
                                             mb.cols, c.raw(), mc.cols, m, n, k, a.dtype(),
                                             c.dtype(), beta)) {
      Tensor acc = Tensor::empty(c.shape(), DType::F32, Device::CUDA);
      blas::matmul(a.raw(), trans_a, ma.cols, b.raw(), trans_b, mb.cols, acc.raw(), mc.cols, m,
                   n, k, a.dtype(), DType::F32, alpha, 0.0f);
      if (beta != 1.0f) scale_(c, beta);
      add_(c, acc, 1.0f);
      return;
    }
    Tensor d;
    if (half_read) d = Tensor::empty(c.shape(), c.dtype(), Device::CUDA);
    bias_done = blas::matmul(a.raw(), trans_a, ma.cols, b.raw(), trans_b, mb.cols, c.raw(),
                             mc.cols, m, n, k, a.dtype(), c.dtype(), alpha, beta,
                             bias.defined() ? bias.raw() : nullptr,
                             d.defined() ? d.raw() : nullptr);
    if (d.defined()) c.copy_from(d);
  }
  if (!bias_done) bias_add_(c, bias);
}
}  // namespace

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, float alpha,
          float beta) {
  gemm_impl(a, trans_a, b, trans_b, c, alpha, beta, Tensor());
}

void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& bias,
               Tensor& c) {
  gemm_impl(a, trans_a, b, trans_b, c, 1.0f, 0.0f, bias);
}

}  // namespace megaton::ops::cuda
