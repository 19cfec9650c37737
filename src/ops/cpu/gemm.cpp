// ops::gemm on the CPU: door checks, then OpenBLAS cblas_sgemm (row-major).
#include <cblas.h>

#include <climits>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

struct Matrix {
  int64_t rows, cols;
};

// The 2-d view of a tensor of rank >= 2: leading dimensions merged into rows.
Matrix as_matrix(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "gemm: {} is undefined", name);
  MEGATON_CHECK(t.ndim() >= 2, "gemm: {} must have rank >= 2, got shape {}", name,
                shape_str(t.shape()));
  MEGATON_CHECK(t.dtype() == DType::F32, "gemm: {} must be F32, got {}", name,
                dtype_name(t.dtype()));
  int64_t rows = 1;  // not numel / cols: that loses the rows when cols == 0 (k == 0)
  for (int i = 0; i + 1 < t.ndim(); ++i) rows *= t.dim(i);
  return {rows, t.dim(-1)};
}

bool overlaps(const Tensor& x, const Tensor& y) {
  auto* x0 = static_cast<const char*>(x.raw());
  auto* y0 = static_cast<const char*>(y.raw());
  return x.nbytes() && y.nbytes() && x0 < y0 + y.nbytes() && y0 < x0 + x.nbytes();
}

namespace cpu {

void gemm(const float* a, bool trans_a, const float* b, bool trans_b, float* c, int m, int n, int k,
          float alpha, float beta) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // op(a) @ op(b) is all zeros; BLAS would reject the leading dimensions
    for (int64_t i = 0; i < int64_t(m) * n; ++i) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return;
  }
  int lda = trans_a ? m : k;
  int ldb = trans_b ? k : n;
  // OpenBLAS does not read c when beta == 0 (as the BLAS reference specifies), so NaN in
  // an uninitialised output does not leak into the result.
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, n);
}

}  // namespace cpu
}  // namespace

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, float alpha,
          float beta) {
  MEGATON_CUDA_DISPATCH(a, cuda::gemm(a, trans_a, b, trans_b, c, alpha, beta));
  Matrix ma = as_matrix(a, "a"), mb = as_matrix(b, "b"), mc = as_matrix(c, "c");
  int64_t m = trans_a ? ma.cols : ma.rows, k = trans_a ? ma.rows : ma.cols;
  int64_t kb = trans_b ? mb.cols : mb.rows, n = trans_b ? mb.rows : mb.cols;
  MEGATON_CHECK(k == kb && mc.rows == m && mc.cols == n,
                "gemm: op(a) [{}, {}] @ op(b) [{}, {}] into c [{}, {}] (a {}{}, b {}{}, c {})", m,
                k, kb, n, mc.rows, mc.cols, shape_str(a.shape()), trans_a ? "^T" : "",
                shape_str(b.shape()), trans_b ? "^T" : "", shape_str(c.shape()));
  MEGATON_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX,
                "gemm: sizes m={} n={} k={} exceed the 32-bit BLAS interface", m, n, k);
  MEGATON_CHECK(!overlaps(c, a) && !overlaps(c, b), "gemm: c must not overlap a or b");
  MEGATON_CHECK(a.device() == c.device() && b.device() == c.device(),
                "gemm: tensors on different devices");
  // A CUDA backend dispatches here (cuBLASLt); this binary has only the CPU one.
  MEGATON_CHECK(c.device() == Device::CPU, "gemm: no CUDA backend in this build");
  cpu::gemm(a.f32(), trans_a, b.f32(), trans_b, c.f32(), int(m), int(n), int(k), alpha, beta);
}

void gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& bias,
               Tensor& c) {
  MEGATON_CUDA_DISPATCH(a, cuda::gemm_bias(a, trans_a, b, trans_b, bias, c));
  gemm(a, trans_a, b, trans_b, c);
  bias_add_(c, bias);
}

}  // namespace megaton::ops
