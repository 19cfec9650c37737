// ops::cuda::grouped_gemm and grouped_gemm_wgrad: the MoE experts' GEMMs, all groups in
// one launch.
//
// BF16 operands with 16-byte aligned rows (hidden and FFN sizes that are multiples of 8)
// run CUTLASS's Hopper grouped GEMM (grouped_gemm_cutlass.cuh), including the weight
// gradient BF16 x BF16 -> fp32 accumulated into main_grad, which cuBLAS's grouped GEMM
// (cublasGemmGroupedBatchedEx) does not offer. Everything else (F32 or F16 operands, odd
// sizes) runs one launch of a tiled CUDA-core kernel (simt_grouped_gemm below): correct for
// every shape, not fast. F16 (--fp16) has no CUTLASS instantiation: each one costs minutes
// of compile time, and the tiled kernel computes the same fp32 sums, F16 x F16 -> F16 or
// F16 x F16 -> fp32 main_grad alike. With host counts, empty groups are dropped before either
// kernel sees them. With device counts (the Tensor group_rows overloads), nothing on the host knows
// them: a one-block setup kernel writes each group's shape and row pointers into the
// kernel's arguments (an empty group becomes a problem with no output tile), and the
// grid is sized without them (CUTLASS: one persistent CTA per SM; the fallback: R rows per
// group, the tiles past a group's rows returning at once).
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

void upload(void* device_dst, const void* host_src, size_t bytes) {
  ::megaton::cuda::upload(device_dst, host_src, bytes);
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

bool cutlass_grouped_gemm(const GroupedRowsProblem& p, DType ab, DType c, float beta) {
  if (ab != DType::BF16 || p.groups == 0 || p.groups > INT_MAX) return false;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  // Every group's row pointer is row 0's plus whole rows, and rows are 16-byte multiples:
  // checking row 0 and the strides covers all groups, whatever the counts.
  if (!aligned(p.a) || !aligned(p.trans_a ? p.b : p.c)) return false;
  for (const void* ptr : p.b_groups)
    if (!aligned(ptr)) return false;
  for (const void* ptr : p.c_groups)
    if (!aligned(ptr)) return false;
  if (p.lda % 8 || p.ldb % 8 || (p.ldc * int64_t(dtype_size(c))) % 16) return false;
  // The dims the counts do not give, and R (the largest count), as CUTLASS's int shapes.
  const int64_t fixed_a = p.trans_a ? p.m : p.k;
  for (int64_t v : {fixed_a, p.n})
    if (v <= 0 || v > INT_MAX) return false;
  if (p.total_rows > INT_MAX) return false;
  if (!p.trans_a && p.trans_b && c == DType::BF16) return grouped_cutlass::run_fprop(p, beta);
  if (!p.trans_a && !p.trans_b && c == DType::BF16) return grouped_cutlass::run_dgrad(p, beta);
  if (p.trans_a && !p.trans_b && c == DType::F32) return grouped_cutlass::run_wgrad(p, beta);
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

// One 64 x 64 tile of c at (row0, col0) of problem p.
template <typename AB, typename C>
__device__ void simt_tile(const SimtProblem& p, int64_t row0, int64_t col0, float beta) {
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

// blockIdx.z = group, blockIdx.x = column tile; the blocks along y step through the row
// tiles (a grid for device counts covers R rows per group, more than 65535 tiles when R
// is large). Tiles past the group's m return at once.
template <typename AB, typename C>
__global__ void simt_grouped_kernel(const SimtProblem* problems, float beta) {
  const SimtProblem p = problems[blockIdx.z];
  const int64_t col0 = int64_t(blockIdx.x) * kTile;
  if (col0 >= p.n) return;
  for (int64_t row0 = int64_t(blockIdx.y) * kTile; row0 < p.m; row0 += int64_t(gridDim.y) * kTile)
    simt_tile<AB, C>(p, row0, col0, beta);
}

// The device-count form: the host wrote every group's descriptor as if the group started
// at row 0 (the count's dim left 0); this moves the row-cut operands to the group's first
// row and sets the count's dim (k for wgrad, where an empty group gets m = 0: c[g] is left
// as it is; m otherwise).
constexpr int kSimtSetupThreads = 256;
__global__ void simt_rows_setup_kernel(const int64_t* group_rows, int64_t groups,
                                       int64_t total_rows, SimtProblem* problems, int64_t ab_bytes,
                                       int64_t c_bytes) {
  group_rows_of<kSimtSetupThreads>(
      group_rows, groups, total_rows, [&](int64_t g, int64_t first_row, int64_t count) {
        SimtProblem& p = problems[g];
        p.a = static_cast<const char*>(p.a) + first_row * p.lda * ab_bytes;
        if (p.trans_a) {
          p.b = static_cast<const char*>(p.b) + first_row * p.ldb * ab_bytes;
          p.k = count;
          if (count == 0) p.m = 0;
        } else {
          p.c = static_cast<char*>(p.c) + first_row * p.ldc * c_bytes;
          p.m = count;
        }
      });
}

// Uploads the descriptors (device memory that lives until the launches queued after it
// have run: the allocator's cache hands it out again only in stream order).
Tensor upload_descriptors(const std::vector<SimtProblem>& host) {
  const size_t bytes = host.size() * sizeof(SimtProblem);
  Tensor descriptors = Tensor::empty({int64_t((bytes + 7) / 8)}, DType::I64, Device::CUDA);
  grouped_cutlass::upload(descriptors.raw(), host.data(), bytes);
  return descriptors;
}

void launch_simt(const Tensor& descriptors, int64_t groups, int64_t max_m, int64_t max_n, DType ab,
                 DType c, float beta) {
  const int64_t row_tiles = std::min<int64_t>((max_m + kTile - 1) / kTile, 65535);
  const dim3 grid(unsigned((max_n + kTile - 1) / kTile), unsigned(std::max<int64_t>(row_tiles, 1)),
                  unsigned(groups));
  const dim3 block(kThreads, kThreads);
  auto* d = static_cast<const SimtProblem*>(descriptors.raw());
  cudaStream_t stream = ::megaton::cuda::stream();
  if (ab == DType::F32 && c == DType::F32)
    simt_grouped_kernel<float, float><<<grid, block, 0, stream>>>(d, beta);
  else if (ab == DType::BF16 && c == DType::F32)
    simt_grouped_kernel<__nv_bfloat16, float><<<grid, block, 0, stream>>>(d, beta);
  else if (ab == DType::BF16 && c == DType::BF16)
    simt_grouped_kernel<__nv_bfloat16, __nv_bfloat16><<<grid, block, 0, stream>>>(d, beta);
  else if (ab == DType::F16 && c == DType::F32)
    simt_grouped_kernel<__half, float><<<grid, block, 0, stream>>>(d, beta);
  else if (ab == DType::F16 && c == DType::F16)
    simt_grouped_kernel<__half, __half><<<grid, block, 0, stream>>>(d, beta);
  else
    MEGATON_CHECK(false, "grouped GEMM: no kernel for {} operands into {}", dtype_name(ab),
                  dtype_name(c));
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace

void simt_grouped_gemm(const std::vector<GroupedProblem>& problems, DType ab, DType c,
                       float beta) {
  if (problems.empty()) return;
  MEGATON_CHECK(problems.size() <= 65535, "grouped GEMM: {} groups (at most 65535)",
                problems.size());
  std::vector<SimtProblem> host(problems.size());
  int64_t max_m = 0, max_n = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    const GroupedProblem& p = problems[i];
    host[i] = {p.a, p.b, p.c, p.m, p.n, p.k, p.lda, p.ldb, p.ldc, p.trans_a, p.trans_b};
    max_m = std::max(max_m, p.m);
    max_n = std::max(max_n, p.n);
  }
  launch_simt(upload_descriptors(host), int64_t(problems.size()), max_m, max_n, ab, c, beta);
}

void simt_grouped_gemm(const GroupedRowsProblem& p, DType ab, DType c, float beta) {
  if (p.groups == 0) return;
  MEGATON_CHECK(p.groups <= 65535, "grouped GEMM: {} groups (at most 65535)", p.groups);
  std::vector<SimtProblem> host(p.groups);
  for (int64_t g = 0; g < p.groups; ++g) {
    if (p.trans_a)  // wgrad: k = the count
      host[g] = {p.a, p.b, p.c_groups[g], p.m, p.n, 0, p.lda, p.ldb, p.ldc, true, p.trans_b};
    else  // fprop, dgrad: m = the count
      host[g] = {p.a, p.b_groups[g], p.c, 0, p.n, p.k, p.lda, p.ldb, p.ldc, false, p.trans_b};
  }
  Tensor descriptors = upload_descriptors(host);
  simt_rows_setup_kernel<<<1, kSimtSetupThreads, 0, ::megaton::cuda::stream()>>>(
      p.group_rows, p.groups, p.total_rows, static_cast<SimtProblem*>(descriptors.raw()),
      int64_t(dtype_size(ab)), int64_t(dtype_size(c)));
  MEGATON_CUDA_CHECK_LAUNCH();
  // A group has at most R rows (fprop, dgrad: m <= R); wgrad's m is fixed.
  launch_simt(descriptors, p.groups, p.trans_a ? p.m : p.total_rows, p.n, ab, c, beta);
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
  MEGATON_CHECK(detail::is_cuda_float(t.dtype()), "{}: {} must be F32, BF16 or F16, got {}", op,
                name, dtype_name(t.dtype()));
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

// b[g] of grouped_gemm: a GPU matrix of a's dtype, op(b[g]) [k, n].
void check_weight(const Tensor& w, size_t g, bool trans_b, const Tensor& a, const Tensor& c) {
  const char* op = "grouped_gemm";
  const int64_t k = a.dim(1), n = c.dim(1);
  check_operand(w, op, "b[g]");
  MEGATON_CHECK(w.ndim() >= 2 && w.dtype() == a.dtype(),
                "grouped_gemm: b[{}] {} {} must be a matrix of a's dtype {}", g,
                dtype_name(w.dtype()), shape_str(w.shape()), dtype_name(a.dtype()));
  auto [b_rows, b_cols] = matrix_dims(w);
  MEGATON_CHECK(b_rows == (trans_b ? n : k) && b_cols == (trans_b ? k : n),
                "grouped_gemm: b[{}] {} must be [{}, {}] for a {}, c {}{}", g, shape_str(w.shape()),
                trans_b ? n : k, trans_b ? k : n, shape_str(a.shape()), shape_str(c.shape()),
                trans_b ? " (trans_b)" : "");
}

// Every c[g] of grouped_gemm_wgrad: [m, n] GPU matrices of one dtype (F32, or a's dtype
// when a is BF16 or F16). Returns that dtype (F32 when there are no groups).
DType check_weight_grads(const std::vector<Tensor>& c, const Tensor& a, const Tensor& b) {
  const char* op = "grouped_gemm_wgrad";
  const int64_t m = a.dim(1), n = b.dim(1);
  DType c_dtype = c.empty() ? DType::F32 : c[0].dtype();
  for (size_t g = 0; g < c.size(); ++g) {
    check_operand(c[g], op, "c[g]");
    MEGATON_CHECK(c[g].dtype() == c_dtype && blas::supported_dtypes(a.dtype(), c_dtype),
                  "grouped_gemm_wgrad: c[{}] is {}, c[0] {}, a {} (one c dtype: F32, or a's "
                  "dtype when a is BF16 or F16)",
                  g, dtype_name(c[g].dtype()), dtype_name(c_dtype), dtype_name(a.dtype()));
    MEGATON_CHECK(c[g].ndim() >= 2 && matrix_dims(c[g]) == std::make_pair(m, n),
                  "grouped_gemm_wgrad: c[{}] {} must be [{}, {}] (a {}, b {})", g,
                  shape_str(c[g].shape()), m, n, shape_str(a.shape()), shape_str(b.shape()));
  }
  return c_dtype;
}

// The counts of the device-count ops: I64 [groups] on the GPU (their values are the
// kernels' to read).
void check_group_rows(const Tensor& group_rows, size_t groups, const char* op) {
  MEGATON_CHECK(group_rows.defined() && group_rows.dtype() == DType::I64 &&
                    group_rows.ndim() == 1 && group_rows.numel() == int64_t(groups),
                "{}: group_rows must be I64 [{}] (one count per group), got {} {}", op, groups,
                dtype_name(group_rows.dtype()), shape_str(group_rows.shape()));
  MEGATON_CHECK(group_rows.device() == Device::CUDA,
                "{}: group_rows must be on a's device (the GPU), it is on the CPU", op);
}

// Runs a device-count call in one grouped launch (after its setup kernel).
void run_rows_problem(const GroupedRowsProblem& problem, DType ab, DType c_dtype, float beta) {
  if (!cutlass_grouped_gemm(problem, ab, c_dtype, beta))
    simt_grouped_gemm(problem, ab, c_dtype, beta);
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
                "grouped_gemm: a {} into c {} (c is F32, or a's dtype when a is BF16 or F16)",
                dtype_name(a.dtype()), dtype_name(c.dtype()));
  const int64_t k = a.dim(1), n = c.dim(1);
  std::vector<GroupedProblem> problems;
  int64_t start = 0;
  for (size_t g = 0; g < b.size(); ++g) {
    const int64_t count = group_rows[g];
    if (count > 0) {  // an empty group's weight is not read (nor checked, as on the CPU)
      check_weight(b[g], g, trans_b, a, c);
      problems.push_back({offset_rows(a, start), b[g].raw(),
                          const_cast<char*>(offset_rows(c, start)), count, n, k, k, trans_b ? k : n,
                          n, false, trans_b});
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
  const DType c_dtype = check_weight_grads(c, a, b);
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

void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const Tensor& group_rows, float beta) {
  const char* op = "grouped_gemm";
  check_group_rows(group_rows, b.size(), op);
  check_operand(a, op, "a");
  check_operand(c, op, "c");
  MEGATON_CHECK(a.ndim() == 2 && c.ndim() == 2 && c.dim(0) == a.dim(0),
                "grouped_gemm: a {} and c {} must be matrices with the same rows",
                shape_str(a.shape()), shape_str(c.shape()));
  MEGATON_CHECK(blas::supported_dtypes(a.dtype(), c.dtype()),
                "grouped_gemm: a {} into c {} (c is F32, or a's dtype when a is BF16 or F16)",
                dtype_name(a.dtype()), dtype_name(c.dtype()));
  // Every weight: which groups are empty is for the kernels to find out.
  for (size_t g = 0; g < b.size(); ++g) check_weight(b[g], g, trans_b, a, c);
  const int64_t rows = a.dim(0), k = a.dim(1), n = c.dim(1);
  if (b.empty() || rows == 0 || n == 0) return;
  GroupedRowsProblem problem{.group_rows = group_rows.i64(),
                             .groups = int64_t(b.size()),
                             .total_rows = rows,
                             .m = 0,  // the counts
                             .n = n,
                             .k = k,
                             .lda = k,
                             .ldb = trans_b ? k : n,
                             .ldc = n,
                             .trans_a = false,
                             .trans_b = trans_b,
                             .a = a.raw(),
                             .b = nullptr,
                             .c = c.raw(),
                             .b_groups = {},
                             .c_groups = {}};
  for (const Tensor& w : b) problem.b_groups.push_back(w.raw());
  // k == 0 (c[rows_g] = beta * c[rows_g]) is not CUTLASS's (it refuses it): the fallback
  // kernel scales exactly the groups' rows.
  run_rows_problem(problem, a.dtype(), c.dtype(), beta);
}

void grouped_gemm_wgrad(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                        const Tensor& group_rows) {
  const char* op = "grouped_gemm_wgrad";
  check_group_rows(group_rows, c.size(), op);
  check_operand(a, op, "a");
  check_operand(b, op, "b");
  MEGATON_CHECK(a.ndim() == 2 && b.ndim() == 2 && b.dim(0) == a.dim(0),
                "grouped_gemm_wgrad: a {} and b {} must be matrices with the same rows",
                shape_str(a.shape()), shape_str(b.shape()));
  MEGATON_CHECK(a.dtype() == b.dtype(), "grouped_gemm_wgrad: a {} and b {} differ in dtype",
                dtype_name(a.dtype()), dtype_name(b.dtype()));
  const DType c_dtype = check_weight_grads(c, a, b);
  const int64_t rows = a.dim(0), m = a.dim(1), n = b.dim(1);
  if (c.empty() || rows == 0 || m == 0 || n == 0) return;
  // c[g] [m, n] += a[rows_g]^T @ b[rows_g]: a[rows_g] is stored [count, m], transposed.
  GroupedRowsProblem problem{.group_rows = group_rows.i64(),
                             .groups = int64_t(c.size()),
                             .total_rows = rows,
                             .m = m,
                             .n = n,
                             .k = 0,  // the counts
                             .lda = m,
                             .ldb = n,
                             .ldc = n,
                             .trans_a = true,
                             .trans_b = false,
                             .a = a.raw(),
                             .b = b.raw(),
                             .c = nullptr,
                             .b_groups = {},
                             .c_groups = {}};
  for (Tensor& grad : c) problem.c_groups.push_back(grad.raw());
  run_rows_problem(problem, a.dtype(), c_dtype, /*beta=*/1.0f);
}

}  // namespace megaton::ops::cuda
