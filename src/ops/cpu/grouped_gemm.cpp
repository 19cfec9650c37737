// Grouped GEMM over row segments (MoE experts) and casts, CPU reference: one GEMM per group.
#include "core/error.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {

static int64_t total_rows(const std::vector<int64_t>& group_rows) {
  int64_t r = 0;
  for (int64_t n : group_rows) {
    MEGATON_CHECK(n >= 0, "grouped_gemm: negative group size {}", n);
    r += n;
  }
  return r;
}

void grouped_gemm(const Tensor& a, const std::vector<Tensor>& b, bool trans_b, Tensor& c,
                  const std::vector<int64_t>& group_rows, float beta) {
  MEGATON_CUDA_DISPATCH(a, cuda::grouped_gemm(a, b, trans_b, c, group_rows, beta));
  MEGATON_CHECK(b.size() == group_rows.size(), "grouped_gemm: {} weights for {} groups", b.size(),
                group_rows.size());
  MEGATON_CHECK(a.ndim() == 2 && c.ndim() == 2 && a.dim(0) == total_rows(group_rows) &&
                    c.dim(0) == a.dim(0),
                "grouped_gemm: a {} and c {} must have sum(group_rows) = {} rows",
                shape_str(a.shape()), shape_str(c.shape()), total_rows(group_rows));
  int64_t start = 0;
  for (size_t g = 0; g < b.size(); ++g) {
    int64_t n = group_rows[g];
    if (n > 0) {
      Tensor cg = c.rows(start, n);
      gemm(a.rows(start, n), false, b[g], trans_b, cg, 1.0f, beta);
    }
    start += n;
  }
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
  int64_t start = 0;
  for (size_t g = 0; g < c.size(); ++g) {
    int64_t n = group_rows[g];
    if (n > 0) gemm(a.rows(start, n), true, b.rows(start, n), false, c[g], 1.0f, beta);
    else if (beta != 1.0f) scale_(c[g], beta);
    start += n;
  }
}

void cast(const Tensor& src, Tensor& dst) {
  MEGATON_CUDA_DISPATCH(src, cuda::cast(src, dst));
  MEGATON_CHECK(src.numel() == dst.numel(), "cast: {} elements into {}", src.numel(), dst.numel());
  MEGATON_CHECK(dst.device() == Device::CPU, "cast: host source, device destination");
  dst.copy_from(src.to(dst.dtype()));
}

}  // namespace megaton::ops
