// ops::cuda::fp8_gemm: the FP8 GEMM of ops/fp8.h through cuBLASLt, per-tensor or blockwise
// (DeepSeek-V3 1x128 / 128x128) scaled, with descriptors and the heuristic's algorithm
// cached per problem.
//
// Layout. Row-major c [M, N] = a [M, K] @ b [N, K]^T is computed column-major as
// c^T [N, M] = b [N, K] @ a^T: cuBLAS's A is our b (stored [K, N] column-major, ld K,
// op T), its B is our a ([K, M], ld K, op N), D (= C) is c^T [N, M] with ld N. That is
// the "TN" layout cuBLASLt requires for FP8 on Hopper (cuBLAS docs, cublasLtMatmul(),
// "To use tensor- or block-scaled FP8 kernels": A transposed, B not, CUBLAS_COMPUTE_32F,
// scale type CUDA_R_32F; https://docs.nvidia.com/cuda/cublas/#cublasltmatmul). Because the
// roles swap, cuBLAS's A scale is b_scale_inv and its B scale is a_scale_inv.
//
// Types (same table): E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3 (not E5M2 x E5M2), C and
// D both BF16 or both F32, so beta = 1 accumulates into an F32 main grad in place.
//
// Accumulation: CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0 unless the caller asks for fast
// accumulation, i.e. cuBLAS promotes the tensor cores' partial sums to fp32 ("split
// accumulator"). Transformer Engine turns fast accumulation on for the forward GEMM of its
// per-tensor recipes (recipe.py: fp8_gemm_fprop = MMParams(use_split_accumulator=False))
// and off for dgrad, wgrad and every GEMM of Float8BlockScaling, where cuBLAS requires it
// off.
//
// Block scales (cuBLAS docs 3.1.4.5, "128-element 1D and 128x128 2D Block Scaling For FP8
// Data Types", and 3.1.4.5.1 "Scaling factors layouts",
// https://docs.nvidia.com/cuda/cublas/#element-1d-and-128x128-2d-block-scaling-for-fp8-data-types):
// Hopper takes A/B scale modes VEC128_32F x VEC128_32F, VEC128_32F x BLK128x128_32F and
// BLK128x128_32F x VEC128_32F (not BLK x BLK); D must be F16, BF16 or F32; scale arrays
// start 16-byte aligned; M and N multiples of 4. Their layouts, in cuBLAS's M/N/K:
//   VEC128_32F:     A's scales M-major [M x L] (element (m, l) at l * M + m), B's N-major
//                   [N x L]; L = ceil(K / 128).
//   BLK128x128_32F: K-major [L4 x ceil(M / 128)] with L4 = L rounded up to a multiple of
//                   4 and the stride between columns a multiple of 4 (element (l, mb) at
//                   mb * L4 + l).
// ops/fp8.h keeps 1x128 scales as [rows, L] (K-block fastest): they are transposed to
// [L, rows] on every call (a kernel over M * L floats, ~0.1% of the GEMM's bytes). 128x128
// scales [N / 128, L] are already cuBLAS's layout when L % 4 == 0 and the pointer is
// 16-byte aligned; otherwise they are copied with the rows padded to L4.
#include <cublasLt.h>

#include <mutex>
#include <unordered_map>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "ops/cuda/cublas_gemm.h"
#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {

// fp8.cu: transpose: dst[b * ld + r] = src[r * blocks + b]; else dst[r * ld + b] = src[r *
// blocks + b] with zeros for b >= blocks. On the compute stream.
void fp8_gemm_scale_layout(const float* src, int64_t rows, int64_t blocks, bool transpose,
                           int64_t ld, float* dst);

namespace {

constexpr int64_t kBlock = 128;

using blas::alignment_of;
using blas::lt_context;
using blas::LtContext;

enum class ScaleMode : uint8_t { Tensor, Vec128, Block128x128 };

const char* scale_mode_name(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::Tensor:
      return "per-tensor";
    case ScaleMode::Vec128:
      return "1x128";
    case ScaleMode::Block128x128:
      return "128x128";
  }
  return "?";
}

int32_t cublas_scale_mode(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::Tensor:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case ScaleMode::Vec128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::Block128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

cudaDataType_t fp8_cuda_dtype(DType dtype) {
  switch (dtype) {
    case DType::F8E4M3:
      return CUDA_R_8F_E4M3;
    case DType::F8E5M2:
      return CUDA_R_8F_E5M2;
    default:
      break;
  }
  MEGATON_CHECK(false, "fp8_gemm: {} is not an FP8 dtype", dtype_name(dtype));
  return CUDA_R_8F_E4M3;
}

// Our roles (a, b), not cuBLAS's.
struct PlanKey {
  int64_t m, n, k;
  DType a, b, c;
  ScaleMode a_mode, b_mode;
  bool beta_zero;
  bool fast_accumulation;
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
    mix(uint64_t(key.a) | uint64_t(key.b) << 8 | uint64_t(key.c) << 16 |
        uint64_t(key.a_mode) << 24 | uint64_t(key.b_mode) << 32 | uint64_t(key.beta_zero) << 40 |
        uint64_t(key.fast_accumulation) << 41);
    mix(uint64_t(key.align_a) | uint64_t(key.align_b) << 16 | uint64_t(key.align_c) << 32);
    return h;
  }
};

std::string describe(const PlanKey& key) {
  return fmt::format("a {} [{}, {}] ({} scales) x b {} [{}, {}] ({} scales) -> c {} [{}, {}]",
                     dtype_name(key.a), key.m, key.k, scale_mode_name(key.a_mode),
                     dtype_name(key.b), key.n, key.k, scale_mode_name(key.b_mode),
                     dtype_name(key.c), key.m, key.n);
}

// Everything cublasLtMatmul needs besides the pointers and scalars; lives as long as the
// process. The scale pointers are descriptor attributes, set again on every call.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  // Column-major roles: cuBLAS's A is our b, its B is our a, C (= D) is c^T.
  cublasLtMatrixLayout_t lt_a = nullptr, lt_b = nullptr, lt_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

void set_scale_pointers(const Plan& plan, const void* a_scale, const void* b_scale) {
  // cuBLAS's A is our b.
  MEGATON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
      plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  MEGATON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
      plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale, sizeof(a_scale)));
}

Plan make_plan(const PlanKey& key, const void* a_scale, const void* b_scale) {
  Plan plan;
  MEGATON_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = CUBLAS_OP_T, op_b = CUBLAS_OP_N;
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MEGATON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const int8_t fast_accumulation = key.fast_accumulation ? 1 : 0;
  MEGATON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
      plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accumulation, sizeof(fast_accumulation)));
  if (key.a_mode != ScaleMode::Tensor) {
    const int32_t mode_a = cublas_scale_mode(key.b_mode), mode_b = cublas_scale_mode(key.a_mode);
    MEGATON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
    MEGATON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
  }
  set_scale_pointers(plan, a_scale, b_scale);

  MEGATON_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan.lt_a, fp8_cuda_dtype(key.b), key.k, key.n, key.k));
  MEGATON_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan.lt_b, fp8_cuda_dtype(key.a), key.k, key.m, key.k));
  MEGATON_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan.lt_c, blas::cuda_dtype(key.c), key.n, key.m, key.n));

  // cuBLAS's A is our b.
  bool found = false;
  const cublasStatus_t heuristic =
      blas::lt_heuristic(plan.desc, plan.lt_a, plan.lt_b, plan.lt_c, key.align_b, key.align_a,
                         key.align_c, key.c == DType::BF16, &plan.algo, &found);
  if (!found)
    throw InternalError(fmt::format(
        "{}:{}: fp8_gemm: cuBLASLt has no algorithm for {} (cublasLtMatmulAlgoGetHeuristic: {}; "
        "alignments a {} b {} c {} bytes)",
        __FILE__, __LINE__, describe(key), cublasLtGetStatusString(heuristic), key.align_a,
        key.align_b, key.align_c));
  return plan;
}

// Plans are created and their scale pointers set under this lock; cublasLtMatmul reads
// the descriptor when it enqueues, so the next call may change them.
std::mutex& plan_mutex() {
  static std::mutex mutex;
  return mutex;
}

const Plan& plan_for(const PlanKey& key, const void* a_scale, const void* b_scale) {
  static auto* plans = new std::unordered_map<PlanKey, Plan, PlanKeyHash>();  // never freed
  auto it = plans->find(key);
  if (it == plans->end()) it = plans->emplace(key, make_plan(key, a_scale, b_scale)).first;
  return it->second;  // unordered_map never moves its elements
}

// The 2-d view [rows, cols] of a tensor of rank >= 1 (leading dimensions merged).
struct Matrix {
  int64_t rows, cols;
};
Matrix as_matrix(const Tensor& t) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) rows *= t.dim(i);
  return {rows, t.ndim() ? t.dim(-1) : 1};
}

// How an operand with `rows` rows is scaled, from its scale_inv's shape (the door checked
// the shapes): [1] per tensor, [rows, L] 1x128, [ceil(rows / 128), L] 128x128.
ScaleMode scale_mode_of(const Tensor& scale_inv, int64_t rows) {
  if (scale_inv.numel() == 1 && scale_inv.ndim() <= 1) return ScaleMode::Tensor;
  return scale_inv.dim(0) == rows ? ScaleMode::Vec128 : ScaleMode::Block128x128;
}

}  // namespace

void fp8_gemm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
              const Tensor& b_scale_inv, Tensor& c, float alpha, float beta,
              bool fast_accumulation) {
  const Matrix ma = as_matrix(a), mb = as_matrix(b);
  const int64_t m = ma.rows, n = mb.rows, k = ma.cols;
  if (m == 0 || n == 0) return;
  if (k == 0) {  // a @ b^T is all zeros; cuBLASLt is not asked about empty sums
    if (beta == 0.0f)
      c.zero();
    else if (beta != 1.0f)
      scale_(c, beta);
    return;
  }
  const ScaleMode a_mode = scale_mode_of(a_scale_inv, m), b_mode = scale_mode_of(b_scale_inv, n);
  MEGATON_CHECK((a_mode == ScaleMode::Tensor) == (b_mode == ScaleMode::Tensor) &&
                    a_mode != ScaleMode::Block128x128,
                "fp8_gemm: a scaled {} with b scaled {} (both per tensor, or a 1x128 with b "
                "1x128 or 128x128)",
                scale_mode_name(a_mode), scale_mode_name(b_mode));
  PlanKey key{m,
              n,
              k,
              a.dtype(),
              b.dtype(),
              c.dtype(),
              a_mode,
              b_mode,
              beta == 0.0f,
              fast_accumulation,
              alignment_of(a.raw()),
              alignment_of(b.raw()),
              alignment_of(c.raw())};

  // Block scales in cuBLASLt's layouts (see the top of this file). The scratch tensors
  // are stream-ordered like every allocation, so they may be freed on return.
  const void* a_scale = a_scale_inv.raw();
  const void* b_scale = b_scale_inv.raw();
  Tensor a_scale_layout, b_scale_layout;
  if (a_mode == ScaleMode::Vec128) {
    const int64_t blocks = (k + kBlock - 1) / kBlock;
    a_scale_layout = Tensor::empty({blocks, m}, DType::F32, Device::CUDA);
    fp8_gemm_scale_layout(a_scale_inv.f32(), m, blocks, true, m, a_scale_layout.f32());
    a_scale = a_scale_layout.raw();
    const int64_t b_rows = b_scale_inv.dim(0);
    if (b_mode == ScaleMode::Vec128) {
      b_scale_layout = Tensor::empty({blocks, n}, DType::F32, Device::CUDA);
      fp8_gemm_scale_layout(b_scale_inv.f32(), n, blocks, true, n, b_scale_layout.f32());
      b_scale = b_scale_layout.raw();
    } else if (blocks % 4 != 0 || alignment_of(b_scale) < 16) {
      const int64_t padded = (blocks + 3) / 4 * 4;
      b_scale_layout = Tensor::empty({b_rows, padded}, DType::F32, Device::CUDA);
      fp8_gemm_scale_layout(b_scale_inv.f32(), b_rows, blocks, false, padded, b_scale_layout.f32());
      b_scale = b_scale_layout.raw();
    }
  }

  LtContext& context = lt_context();
  std::lock_guard<std::mutex> lock(plan_mutex());
  const Plan& plan = plan_for(key, a_scale, b_scale);
  set_scale_pointers(plan, a_scale, b_scale);
  // A BF16 or F16 c that is read (beta != 0, the wgrad into a BF16 main grad) gets a
  // separate D, copied into c after: in place, cuBLASLt rounds the product to c's dtype
  // before adding C (two roundings; measured, see ops::cuda::gemm in gemm.cpp).
  Tensor d;
  if (beta != 0.0f && c.dtype() != DType::F32) d = Tensor::empty(c.shape(), c.dtype(), Device::CUDA);
  MEGATON_CUBLAS_CHECK(cublasLtMatmul(context.handle, plan.desc, &alpha, b.raw(), plan.lt_a,
                                      a.raw(), plan.lt_b, &beta, c.raw(), plan.lt_c,
                                      d.defined() ? d.raw() : c.raw(), plan.lt_c, &plan.algo,
                                      context.workspace, context.workspace_bytes,
                                      ::megaton::cuda::stream()));
  if (d.defined()) c.copy_from(d);
}

}  // namespace megaton::ops::cuda
