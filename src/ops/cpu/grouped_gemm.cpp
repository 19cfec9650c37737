// Grouped GEMM over row segments (MoE experts) and casts, CPU reference: one GEMM per group.
#include <algorithm>
#include <utility>

#include "core/error.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {

namespace {

int64_t total_rows(const std::vector<int64_t>& group_rows) {
  int64_t r = 0;
  for (int64_t n : group_rows) {
    MEGATON_CHECK(n >= 0, "grouped_gemm: negative group size {}", n);
    r += n;
  }
  return r;
}

// The counts of the tensor-count ops: I64 [groups] on the host, none negative.
void check_group_rows(const Tensor& group_rows, size_t groups, const char* op) {
  MEGATON_CHECK(group_rows.defined() && group_rows.dtype() == DType::I64 &&
                    group_rows.ndim() == 1 && group_rows.numel() == int64_t(groups),
                "{}: group_rows must be I64 [{}] (one count per group), got {} {}", op, groups,
                dtype_name(group_rows.dtype()), shape_str(group_rows.shape()));
  MEGATON_CHECK(group_rows.device() == Device::CPU,
                "{}: group_rows must be on a's device (the CPU), it is on the GPU", op);
  const int64_t* counts = group_rows.i64();
  for (size_t g = 0; g < groups; ++g)
    MEGATON_CHECK(counts[g] >= 0, "{}: group_rows[{}] = {} is negative", op, g, counts[g]);
}

// Rows and columns of the 2-d view (leading dimensions merged), as gemm reads it.
std::pair<int64_t, int64_t> matrix_dims(const Tensor& t) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) rows *= t.dim(i);
  return {rows, t.dim(-1)};
}

// The math of both grouped_gemm forms: group g's rows start where the previous group's
// end, its count (>= 0) cut at a's rows.
void grouped_gemm_rows(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                       const int64_t* group_rows, float beta) {
  const int64_t rows = a.dim(0);
  int64_t start = 0;
  for (size_t g = 0; g < b.size(); ++g) {
    const int64_t n = std::min(group_rows[g], rows - start);
    if (n > 0) {
      Tensor cg = c.rows(start, n);
      gemm(a.rows(start, n), false, b[g], trans_b, cg, 1.0f, beta);
    }
    start += n;
  }
}

// The math of both grouped_gemm_wgrad forms, counts as in grouped_gemm_rows.
void grouped_gemm_wgrad_rows(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                             const int64_t* group_rows, float beta) {
  const int64_t rows = a.dim(0);
  int64_t start = 0;
  for (size_t g = 0; g < c.size(); ++g) {
    const int64_t n = std::min(group_rows[g], rows - start);
    if (n > 0)
      gemm(a.rows(start, n), true, b.rows(start, n), false, c[g], 1.0f, beta);
    else if (beta != 1.0f)  // an empty sum: c[g] = beta * c[g]
      scale_(c[g], beta);
    start += n;
  }
}

}  // namespace

void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const std::vector<int64_t>& group_rows, float beta) {
  MEGATON_CUDA_DISPATCH(a, cuda::grouped_gemm(a, b, trans_b, c, group_rows, beta));
  MEGATON_CHECK(b.size() == group_rows.size(), "grouped_gemm: {} weights for {} groups", b.size(),
                group_rows.size());
  MEGATON_CHECK(a.ndim() == 2 && c.ndim() == 2 && a.dim(0) == total_rows(group_rows) &&
                    c.dim(0) == a.dim(0),
                "grouped_gemm: a {} and c {} must have sum(group_rows) = {} rows",
                shape_str(a.shape()), shape_str(c.shape()), total_rows(group_rows));
  grouped_gemm_rows(a, b, trans_b, c, group_rows.data(), beta);
}

void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const Tensor& group_rows, float beta) {
  MEGATON_CUDA_DISPATCH(a, cuda::grouped_gemm(a, b, trans_b, c, group_rows, beta));
  const char* op = "grouped_gemm";
  check_group_rows(group_rows, b.size(), op);
  MEGATON_CHECK(a.ndim() == 2 && c.ndim() == 2 && c.dim(0) == a.dim(0),
                "grouped_gemm: a {} and c {} must be matrices with the same rows",
                shape_str(a.shape()), shape_str(c.shape()));
  const int64_t k = a.dim(1), n = c.dim(1);
  for (size_t g = 0; g < b.size(); ++g)  // every weight, as on the GPU
    MEGATON_CHECK(b[g].defined() && b[g].ndim() >= 2 &&
                      matrix_dims(b[g]) == (trans_b ? std::make_pair(n, k) : std::make_pair(k, n)),
                  "grouped_gemm: b[{}] {} must be [{}, {}] for a {}, c {}{}", g,
                  shape_str(b[g].shape()), trans_b ? n : k, trans_b ? k : n, shape_str(a.shape()),
                  shape_str(c.shape()), trans_b ? " (trans_b)" : "");
  grouped_gemm_rows(a, b, trans_b, c, group_rows.i64(), beta);
}

void grouped_gemm_wgrad(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                        const std::vector<int64_t>& group_rows, float beta) {
  MEGATON_CUDA_DISPATCH(a, cuda::grouped_gemm_wgrad(a, b, c, group_rows, beta));
  MEGATON_CHECK(c.size() == group_rows.size(), "grouped_gemm_wgrad: {} outputs for {} groups",
                c.size(), group_rows.size());
  MEGATON_CHECK(a.ndim() == 2 && b.ndim() == 2 && a.dim(0) == total_rows(group_rows) &&
                    b.dim(0) == a.dim(0),
                "grouped_gemm_wgrad: a {} and b {} must have sum(group_rows) = {} rows",
                shape_str(a.shape()), shape_str(b.shape()), total_rows(group_rows));
  grouped_gemm_wgrad_rows(a, b, c, group_rows.data(), beta);
}

void grouped_gemm_wgrad(const Tensor& a, const Tensor& b, std::vector<Tensor>& c,
                        const Tensor& group_rows) {
  MEGATON_CUDA_DISPATCH(a, cuda::grouped_gemm_wgrad(a, b, c, group_rows));
  const char* op = "grouped_gemm_wgrad";
  check_group_rows(group_rows, c.size(), op);
  MEGATON_CHECK(a.ndim() == 2 && b.ndim() == 2 && b.dim(0) == a.dim(0),
                "grouped_gemm_wgrad: a {} and b {} must be matrices with the same rows",
                shape_str(a.shape()), shape_str(b.shape()));
  const int64_t m = a.dim(1), n = b.dim(1);
  for (size_t g = 0; g < c.size(); ++g)  // every output, as on the GPU
    MEGATON_CHECK(c[g].defined() && c[g].ndim() >= 2 && matrix_dims(c[g]) == std::make_pair(m, n),
                  "grouped_gemm_wgrad: c[{}] {} must be [{}, {}] (a {}, b {})", g,
                  shape_str(c[g].shape()), m, n, shape_str(a.shape()), shape_str(b.shape()));
  grouped_gemm_wgrad_rows(a, b, c, group_rows.i64(), 1.0f);
}

void cast(const Tensor& src, Tensor& dst) {
  MEGATON_CUDA_DISPATCH(src, cuda::cast(src, dst));
  MEGATON_CHECK(src.numel() == dst.numel(), "cast: {} elements into {}", src.numel(), dst.numel());
  MEGATON_CHECK(dst.device() == Device::CPU, "cast: host source, device destination");
  dst.copy_from(src.to(dst.dtype()));
}

}  // namespace megaton::ops
