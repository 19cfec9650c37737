// ops::cuda::grouped_gemm and grouped_gemm_wgrad: the MoE experts' GEMMs, all groups in
// one launch.
//
// BF16 operands with 16-byte aligned rows (hidden and FFN sizes that are multiples of 8)
// run CUTLASS's Hopper grouped GEMM (grouped_gemm_cutlass.cuh), including the weight
// gradient BF16 x BF16 -> fp32 accumulated into main_grad, which cuBLAS's grouped GEMM
// (cublasGemmGroupedBatchedEx) does not offer. Everything else (F32 operands, odd sizes)
// runs one launch of a tiled CUDA-core kernel (simt_grouped_gemm below): correct for every
// shape, not fast. Empty groups are dropped before either kernel sees them.
#include <algorithm>
#include <climits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cublas_gemm.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/grouped_gemm_cutlass.cuh"
#include "ops/cuda/grouped_gemm_problem.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {

namespace grouped_cutlass {

namespace {
constexpr size_t kUploadChunk = 4096;
struct UploadChunk {
  unsigned char bytes[kUploadChunk];
};
__global__ void upload_kernel(UploadChunk chunk, unsigned char* dst, size_t bytes) {
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = chunk.bytes[i];
}
}  // namespace

void upload(void* device_dst, const void* host_src, size_t bytes) {
  auto* dst = static_cast<unsigned char*>(device_dst);
  const auto* src = static_cast<const unsigned char*>(host_src);
  for (size_t at = 0; at < bytes; at += kUploadChunk) {
    const size_t n = std::min(kUploadChunk, bytes - at);
    UploadChunk chunk;
    std::memcpy(chunk.bytes, src + at, n);
    upload_kernel<<<1, 256, 0, ::megaton::cuda::stream()>>>(chunk, dst + at, n);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace grouped_cutlass

bool cutlass_grouped_gemm(const std::vector<GroupedProblem>& problems, DType ab, DType c,
                          float beta) {
  if (ab != DType::BF16 || problems.empty()) return false;
  const bool trans_a = problems[0].trans_a, trans_b = problems[0].trans_b;
  const size_t c_size = dtype_size(c);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  for (const GroupedProblem& p : problems) {
    if (p.trans_a != trans_a || p.trans_b != trans_b) return false;
    if (!aligned(p.a) || !aligned(p.b) || !aligned(p.c)) return false;
    if (p.lda % 8 || p.ldb % 8 || (p.ldc * c_size) % 16) return false;
    for (int64_t v : {p.m, p.n, p.k})
      if (v > INT_MAX) return false;
  }
  if (!trans_a && trans_b && c == DType::BF16) return grouped_cutlass::run_fprop(problems, beta);
  if (!trans_a && !trans_b && c == DType::BF16) return grouped_cutlass::run_dgrad(problems, beta);
  if (trans_a && !trans_b && c == DType::F32) return grouped_cutlass::run_wgrad(problems, beta);
  return false;
}

namespace {

// ---- the fallback: one launch, blockIdx.z = group, 64 x 64 output tiles, 16 x 16
// threads computing 4 x 4 outputs each, k in steps of 16 through shared memory.
constexpr int kTile = 64, kTileK = 16, kThreads = 16;

struct SimtProblem {
  const void* a;
  const void* b;
  void* c;
  int64_t m, n, k, lda, ldb, ldc;
  int trans_a, trans_b;
};

template <typename T>
__device__ float load_element(const void* base, int64_t index) {
  return detail::to_float(static_cast<const T*>(base)[index]);
}

template <typename AB, typename C>
__global__ void simt_grouped_kernel(const SimtProblem* problems, float beta) {
  const SimtProblem p = problems[blockIdx.z];
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  if (row0 >= p.m || col0 >= p.n) return;
  __shared__ float a_tile[kTileK][kTile + 1];
  __shared__ float b_tile[kTileK][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kThreads + tx;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < p.k; k0 += kTileK) {
    for (int i = tid; i < kTile * kTileK; i += kThreads * kThreads) {
      const int r = i / kTileK, kk = i % kTileK;  // a_tile[kk][r] = op(a)[row0 + r, k0 + kk]
      const int64_t row = row0 + r, k = k0 + kk;
      float a_value = 0.0f, b_value = 0.0f;
      if (row < p.m && k < p.k)
        a_value = load_element<AB>(p.a, p.trans_a ? k * p.lda + row : row * p.lda + k);
      const int64_t col = col0 + r;  // b_tile[kk][r] = op(b)[k0 + kk, col0 + r]
      if (col < p.n && k < p.k)
        b_value = load_element<AB>(p.b, p.trans_b ? col * p.ldb + k : k * p.ldb + col);
      a_tile[kk][r] = a_value;
      b_tile[kk][r] = b_value;
    }
    __syncthreads();
    for (int kk = 0; kk < kTileK; ++kk)
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j)
          acc[i][j] += a_tile[kk][ty + i * kThreads] * b_tile[kk][tx + j * kThreads];
    __syncthreads();
  }
  C* c = static_cast<C*>(p.c);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const int64_t row = row0 + ty + i * kThreads, col = col0 + tx + j * kThreads;
      if (row >= p.m || col >= p.n) continue;
      C& out = c[row * p.ldc + col];
      // beta == 0 overwrites (NaN in c included), as a GEMM does.
      const float value = beta == 0.0f ? acc[i][j] : acc[i][j] + beta * detail::to_float(out);
      out = detail::from_float<C>(value);
    }
}

}  // namespace

void simt_grouped_gemm(const std::vector<GroupedProblem>& problems, DType ab, DType c,
                       float beta) {
  if (problems.empty()) return;
  std::vector<SimtProblem> host(problems.size());
  int64_t max_m = 0, max_n = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    const GroupedProblem& p = problems[i];
    host[i] = {p.a, p.b, p.c, p.m, p.n, p.k, p.lda, p.ldb, p.ldc, p.trans_a, p.trans_b};
    max_m = std::max(max_m, p.m);
    max_n = std::max(max_n, p.n);
  }
  const size_t bytes = host.size() * sizeof(SimtProblem);
  Tensor descriptors = Tensor::empty({int64_t((bytes + 7) / 8)}, DType::I64, Device::CUDA);
  grouped_cutlass::upload(descriptors.raw(), host.data(), bytes);
  MEGATON_CHECK(problems.size() <= 65535, "grouped GEMM: {} groups (at most 65535)",
                problems.size());
  const dim3 grid(unsigned((max_n + kTile - 1) / kTile), unsigned((max_m + kTile - 1) / kTile),
                  unsigned(problems.size()));
  const dim3 block(kThreads, kThreads);
  auto* d = static_cast<const SimtProblem*>(descriptors.raw());
  cudaStream_t stream = ::megaton::cuda::stream();
  if (ab == DType::F32 && c == DType::F32)
    simt_grouped_kernel<float, float><<<grid, block, 0, stream>>>(d, beta);
  else if (ab == DType::BF16 && c == DType::F32)
    simt_grouped_kernel<__nv_bfloat16, float><<<grid, block, 0, stream>>>(d, beta);
  else if (ab == DType::BF16 && c == DType::BF16)
    simt_grouped_kernel<__nv_bfloat16, __nv_bfloat16><<<grid, block, 0, stream>>>(d, beta);
  else
    MEGATON_CHECK(false, "grouped GEMM: no kernel for {} operands into {}", dtype_name(ab),
                  dtype_name(c));
  MEGATON_CUDA_CHECK_LAUNCH();
}

namespace {

// Runs the problems (all with m, n, k > 0) in one launch.
void run_problems(const std::vector<GroupedProblem>& problems, DType ab, DType c_dtype,
                  float beta) {
  if (problems.empty()) return;
  if (!cutlass_grouped_gemm(problems, ab, c_dtype, beta))
    simt_grouped_gemm(problems, ab, c_dtype, beta);
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
  std::vector<GroupedProblem> problems;
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
  std::vector<GroupedProblem> problems;
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
