// ops::cuda::grouped_gemm and grouped_gemm_wgrad: the MoE experts' GEMMs, one group per
// non-empty expert, in one cublasGemmGroupedBatchedEx call where cuBLAS supports the case.
//
// cublasGemmGroupedBatchedEx (cuBLAS 12.5+) takes the per-group sizes, leading dimensions,
// transposes and scalars as host arrays, and the A/B/C pointer arrays in device memory.
// Its documented type table (CUBLAS_COMPUTE_32F) has A/B/C = BF16/BF16/BF16 and
// F32/F32/F32 but not BF16 x BF16 -> F32, and for BF16 it requires aligned pointers
// (16 bytes ideally; weaker rules depend on k). So the grouped call is used when the
// dtypes are in that table and every pointer is 16-byte aligned (the case for hidden and
// FFN sizes that are multiples of 8); otherwise -- in particular the weight gradient of
// BF16 experts into fp32 main_grad -- the groups run as a loop of cublasGemmEx calls
// (not cached cuBLASLt plans: the per-expert row counts change every step, and a plan
// per count would pile up; cuBLAS bounds its own heuristics cache).
#include <cublas_v2.h>

#include <climits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cublas_gemm.h"
#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {
namespace {

// One row-major GEMM: c [m, n] = op(a) @ op(b) + beta * c, lda/ldb/ldc the row strides.
struct Problem {
  const void* a;
  const void* b;
  void* c;
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
};

// The device pointer arrays are written by a kernel whose arguments carry the pointers:
// stream-ordered like everything else, and no pageable host copy (which may block the
// host until the stream drains).
constexpr int kPointersPerLaunch = 64;
struct PointerChunk {
  const void* a[kPointersPerLaunch];
  const void* b[kPointersPerLaunch];
  void* c[kPointersPerLaunch];
  int count;
};

__global__ void write_pointer_arrays(PointerChunk chunk, const void** a_out, const void** b_out,
                                     void** c_out) {
  int i = threadIdx.x;
  if (i < chunk.count) {
    a_out[i] = chunk.a[i];
    b_out[i] = chunk.b[i];
    c_out[i] = chunk.c[i];
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether one cublasGemmGroupedBatchedEx call may run these problems (see the file comment).
bool grouped_call_supported(const std::vector<Problem>& problems, DType ab, DType c) {
  if (ab != c) return false;
  for (const Problem& p : problems) {
    if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.c)) return false;
    for (int64_t v : {p.m, p.n, p.k, p.lda, p.ldb, p.ldc})
      if (v > INT_MAX) return false;
  }
  return true;
}

void grouped_call(const std::vector<Problem>& problems, DType ab, DType c_dtype, float beta) {
  const int count = int(problems.size());
  // Column-major view as in gemm.cpp: cuBLAS's A is our b, its B is our a, m and n swap.
  std::vector<cublasOperation_t> trans_a(count), trans_b(count);
  std::vector<int> m(count), n(count), k(count), lda(count), ldb(count), ldc(count);
  std::vector<int> group_size(count, 1);
  std::vector<float> alpha(count, 1.0f), betas(count, beta);
  for (int i = 0; i < count; ++i) {
    const Problem& p = problems[i];
    trans_a[i] = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    trans_b[i] = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    m[i] = int(p.n);
    n[i] = int(p.m);
    k[i] = int(p.k);
    lda[i] = int(p.ldb);
    ldb[i] = int(p.lda);
    ldc[i] = int(p.ldc);
  }

  // [cuBLAS A pointers | cuBLAS B pointers | C pointers], 8 bytes each.
  Tensor pointers = Tensor::empty({3 * int64_t(count)}, DType::I64, Device::CUDA);
  auto** a_array = static_cast<const void**>(pointers.raw());
  const void** b_array = a_array + count;
  void** c_array = static_cast<void**>(pointers.raw()) + 2 * count;
  for (int start = 0; start < count; start += kPointersPerLaunch) {
    PointerChunk chunk{};
    chunk.count = std::min(kPointersPerLaunch, count - start);
    for (int i = 0; i < chunk.count; ++i) {
      chunk.a[i] = problems[start + i].b;
      chunk.b[i] = problems[start + i].a;
      chunk.c[i] = problems[start + i].c;
    }
    write_pointer_arrays<<<1, kPointersPerLaunch, 0, ::megaton::cuda::stream()>>>(
        chunk, a_array + start, b_array + start, c_array + start);
    MEGATON_CUDA_CHECK_LAUNCH();
  }

  const cudaDataType_t ab_type = blas::cuda_dtype(ab), c_type = blas::cuda_dtype(c_dtype);
  MEGATON_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      blas::cublas_handle(), trans_a.data(), trans_b.data(), m.data(), n.data(), k.data(),
      alpha.data(), a_array, ab_type, lda.data(), b_array, ab_type, ldb.data(), betas.data(),
      c_array, c_type, ldc.data(), count, group_size.data(), CUBLAS_COMPUTE_32F));
  // `pointers` goes back to the allocator's cache here; any later user of the block is
  // queued on the same stream after this GEMM, so the arrays are read before reuse.
}

// Runs the problems (all with k > 0): one grouped call when supported, else one
// cublasGemmEx each.
void run_problems(const std::vector<Problem>& problems, DType ab, DType c_dtype, float beta) {
  if (problems.empty()) return;
  if (grouped_call_supported(problems, ab, c_dtype)) {
    grouped_call(problems, ab, c_dtype, beta);
    return;
  }
  for (const Problem& p : problems)
    blas::gemm_ex(p.a, p.trans_a, p.lda, p.b, p.trans_b, p.ldb, p.c, p.ldc, p.m, p.n, p.k, ab,
                  c_dtype, 1.0f, beta);
}

// c = beta * c for a group with no rows (the sum over its rows is empty).
void scale_empty(Tensor& c, float beta) {
  if (c.numel() == 0 || beta == 1.0f) return;
  if (beta == 0.0f)
    c.zero();  // overwrite, as a GEMM with beta == 0 would (NaN included)
  else
    scale_(c, beta);
}

int64_t total_rows(const std::vector<int64_t>& group_rows, const char* op) {
  int64_t rows = 0;
  for (int64_t r : group_rows) {
    MEGATON_CHECK(r >= 0, "{}: negative group size {}", op, r);
    rows += r;
  }
  return rows;
}

void check_operand(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.device() == Device::CUDA, "{}: {} must be on the GPU, it is on the CPU", op,
                name);
  MEGATON_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16,
                "{}: {} must be F32 or BF16, got {}", op, name, dtype_name(t.dtype()));
}

// Rows and columns of the 2-d view (leading dimensions merged), as ops::gemm reads it.
std::pair<int64_t, int64_t> matrix_dims(const Tensor& t) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) rows *= t.dim(i);
  return {rows, t.dim(-1)};
}

const char* offset_rows(const Tensor& t, int64_t first_row) {
  return static_cast<const char*>(t.raw()) + first_row * t.dim(1) * int64_t(dtype_size(t.dtype()));
}

}  // namespace

void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const std::vector<int64_t>& group_rows, float beta) {
  const char* op = "grouped_gemm";
  MEGATON_CHECK(b.size() == group_rows.size(), "grouped_gemm: {} weights for {} groups", b.size(),
                group_rows.size());
  check_operand(a, op, "a");
  check_operand(c, op, "c");
  const int64_t rows = total_rows(group_rows, op);
  MEGATON_CHECK(a.ndim() == 2 && c.ndim() == 2 && a.dim(0) == rows && c.dim(0) == rows,
                "grouped_gemm: a {} and c {} must have sum(group_rows) = {} rows",
                shape_str(a.shape()), shape_str(c.shape()), rows);
  MEGATON_CHECK(blas::supported_dtypes(a.dtype(), c.dtype()),
                "grouped_gemm: a {} into c {} (c is F32, or BF16 when a is)", dtype_name(a.dtype()),
                dtype_name(c.dtype()));
  const int64_t k = a.dim(1), n = c.dim(1);
  std::vector<Problem> problems;
  int64_t start = 0;
  for (size_t g = 0; g < b.size(); ++g) {
    const int64_t count = group_rows[g];
    if (count > 0) {  // an empty group's weight is not read (nor checked, as on the CPU)
      check_operand(b[g], op, "b[g]");
      MEGATON_CHECK(b[g].ndim() >= 2 && b[g].dtype() == a.dtype(),
                    "grouped_gemm: b[{}] {} {} must be a matrix of a's dtype {}", g,
                    dtype_name(b[g].dtype()), shape_str(b[g].shape()), dtype_name(a.dtype()));
      auto [b_rows, b_cols] = matrix_dims(b[g]);
      MEGATON_CHECK(b_rows == (trans_b ? n : k) && b_cols == (trans_b ? k : n),
                    "grouped_gemm: b[{}] {} must be [{}, {}] for a {}, c {}{}", g,
                    shape_str(b[g].shape()), trans_b ? n : k, trans_b ? k : n, shape_str(a.shape()),
                    shape_str(c.shape()), trans_b ? " (trans_b)" : "");
      problems.push_back({offset_rows(a, start), b[g].raw(),
                          const_cast<char*>(offset_rows(c, start)), count, n, k, k, b_cols, n,
                          false, trans_b});
    }
    start += count;
  }
  if (rows == 0 || n == 0) return;
  if (k == 0) {  // every row's product is an empty sum
    scale_empty(c, beta);
    return;
  }
  run_problems(problems, a.dtype(), c.dtype(), beta);
}

void grouped_gemm_wgrad(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                        const std::vector<int64_t>& group_rows, float beta) {
  const char* op = "grouped_gemm_wgrad";
  MEGATON_CHECK(c.size() == group_rows.size(), "grouped_gemm_wgrad: {} outputs for {} groups",
                c.size(), group_rows.size());
  check_operand(a, op, "a");
  check_operand(b, op, "b");
  const int64_t rows = total_rows(group_rows, op);
  MEGATON_CHECK(a.ndim() == 2 && b.ndim() == 2 && a.dim(0) == rows && b.dim(0) == rows,
                "grouped_gemm_wgrad: a {} and b {} must have sum(group_rows) = {} rows",
                shape_str(a.shape()), shape_str(b.shape()), rows);
  MEGATON_CHECK(a.dtype() == b.dtype(), "grouped_gemm_wgrad: a {} and b {} differ in dtype",
                dtype_name(a.dtype()), dtype_name(b.dtype()));
  const int64_t m = a.dim(1), n = b.dim(1);
  DType c_dtype = c.empty() ? DType::F32 : c[0].dtype();
  for (size_t g = 0; g < c.size(); ++g) {
    check_operand(c[g], op, "c[g]");
    MEGATON_CHECK(c[g].dtype() == c_dtype && blas::supported_dtypes(a.dtype(), c_dtype),
                  "grouped_gemm_wgrad: c[{}] is {}, c[0] {}, a {} (one c dtype: F32, or BF16 "
                  "when a is)",
                  g, dtype_name(c[g].dtype()), dtype_name(c_dtype), dtype_name(a.dtype()));
    MEGATON_CHECK(c[g].ndim() >= 2 && matrix_dims(c[g]) == std::make_pair(m, n),
                  "grouped_gemm_wgrad: c[{}] {} must be [{}, {}] (a {}, b {})", g,
                  shape_str(c[g].shape()), m, n, shape_str(a.shape()), shape_str(b.shape()));
  }
  if (m == 0 || n == 0) return;
  std::vector<Problem> problems;
  int64_t start = 0;
  for (size_t g = 0; g < c.size(); ++g) {
    const int64_t count = group_rows[g];
    // c[g] [m, n] = a[rows_g]^T @ b[rows_g]: a[rows_g] is stored [count, m], transposed.
    if (count > 0)
      problems.push_back({offset_rows(a, start), offset_rows(b, start), c[g].raw(), m, n, count, m,
                          n, n, true, false});
    else
      scale_empty(c[g], beta);
    start += count;
  }
  run_problems(problems, a.dtype(), c_dtype, beta);
}

}  // namespace megaton::ops::cuda
