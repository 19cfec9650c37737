// Newton-Schulz on the GPU (ops/muon.h) as three cuBLASLt GEMMs per step, each one
// strided-batched call over all the matrices (muon_batched_gemm.cpp), in the input's dtype
// with fp32 accumulation (or TF32 inputs), EO's newton_schulz_step (muon_utils.py, v0.3.0):
//   A = X X^T;  B = b A + c A A  (torch.addmm(A, A, A, beta=b, alpha=c));
//   X' = a X + B X               (torch.addmm(X, B, X, beta=a, alpha=1)),
// each GEMM's epilogue adding the scaled input and rounding once into the output
// (cuBLASLt's out-of-place D); in the distributed mode the Gram batch is all-reduced
// between the first GEMM and the others. Also the QKV split and copy_columns as strided
// copies.
#include "ops/cuda/muon.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda/cuda_check.h"

namespace megaton::ops::cuda {
namespace {

// The iterated matrix X [k, n] of one stored matrix x [rows, cols]: x itself, or, when
// `transpose`, x^T (k = cols, n = rows), read through the GEMMs' operand flags: the
// transpose EO takes explicitly lives there, and nothing is copied.
struct Iterated {
  bool transpose;
  int64_t k, n;
  Iterated(bool t, int64_t rows, int64_t cols)
      : transpose(t), k(t ? cols : rows), n(t ? rows : cols) {}
};

// A step's GEMMs over the whole batch: the iterates x, next [batch, rows, cols] (stride
// rows * cols), the Gram and polynomial matrices [batch, k, k] (stride k * k); each GEMM
// is one ns_batched_matmul call, d = alpha op(a) op(b) + beta c as blas::matmul.
struct NsGemms {
  DType dtype;
  bool tf32;
  int64_t batch;
  Iterated it;
  int64_t matrix_stride() const { return it.k * it.n; }
  int64_t gram_stride() const { return it.k * it.k; }
  void gemm(const void* a, bool trans_a, int64_t lda, int64_t stride_a, const void* b, bool trans_b,
            int64_t ldb, int64_t stride_b, const void* c, int64_t ldc, int64_t stride_c, void* d,
            int64_t m, int64_t n, int64_t k, float alpha, float beta) const {
    ns_batched_matmul(a, trans_a, lda, stride_a, b, trans_b, ldb, stride_b, c, ldc, stride_c, d, m,
                      n, k, batch, dtype, tf32, alpha, beta);
  }

  // A = X X^T: x^T x when transposed (x stored [n, k]), x x^T otherwise.
  void gram_step(const void* x, void* gram) const {
    const int64_t k = it.k, n = it.n, xs = matrix_stride(), gs = gram_stride();
    if (it.transpose)
      gemm(x, true, k, xs, x, false, k, xs, gram, k, gs, gram, k, k, n, 1.0f, 0.0f);
    else
      gemm(x, false, n, xs, x, true, n, xs, gram, k, gs, gram, k, k, n, 1.0f, 0.0f);
  }

  // B = c A A + b A into poly, then x' = a X + B X into next (distinct from x): stored
  // transposed, x' = x B^T + a x = (a X + B X)^T.
  void update_step(const void* x, const void* gram, void* poly, void* next,
                   const NsCoefficientSet& s) const {
    const int64_t k = it.k, n = it.n, xs = matrix_stride(), gs = gram_stride();
    gemm(gram, false, k, gs, gram, false, k, gs, gram, k, gs, poly, k, k, k, s.c, s.b);
    if (it.transpose)
      gemm(x, false, k, xs, poly, true, k, gs, x, k, xs, next, n, k, k, 1.0f, s.a);
    else
      gemm(poly, false, k, gs, x, false, n, xs, x, n, xs, next, k, n, k, 1.0f, s.a);
  }
};

// The distributed mode's callback on `t`, which must stay of its shape, dtype and device.
void all_reduce_checked(const std::function<void(Tensor&)>& all_reduce, Tensor& t,
                        const char* what) {
  const Shape shape = t.shape();
  const DType dtype = t.dtype();
  all_reduce(t);
  MEGATON_CHECK(
      t.defined() && t.shape() == shape && t.dtype() == dtype && t.device() == Device::CUDA,
      "newton_schulz: the all-reduce of the {} left {} {}, expected {} {} on the GPU", what,
      t.defined() ? shape_str(t.shape()) : "undefined", dtype_name(t.dtype()), dtype_name(dtype),
      shape_str(shape));
}

// The pieces' strided copies: piece i's rows of group grp are rows
// [grp * per_group + offset_i, + split_shapes[i]) of u.
void copy_qkv(const Tensor& u, const std::vector<Tensor>& pieces,
              const std::vector<int64_t>& split_shapes, bool to_pieces) {
  int64_t per_group = 0;
  for (int64_t s : split_shapes) per_group += s;
  const int64_t groups = u.dim(0) / per_group;
  const size_t row_bytes = size_t(u.dim(1)) * dtype_size(u.dtype());
  auto* whole = static_cast<char*>(u.raw());
  int64_t at = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const size_t piece_bytes = size_t(split_shapes[i]) * row_bytes;
    char* in_u = whole + size_t(at) * row_bytes;
    char* piece = static_cast<char*>(pieces[i].raw());
    const size_t u_pitch = size_t(per_group) * row_bytes;
    if (to_pieces)
      MEGATON_CUDA_CHECK(cudaMemcpy2DAsync(piece, piece_bytes, in_u, u_pitch, piece_bytes,
                                           size_t(groups), cudaMemcpyDeviceToDevice,
                                           ::megaton::cuda::stream()));
    else
      MEGATON_CUDA_CHECK(cudaMemcpy2DAsync(in_u, u_pitch, piece, piece_bytes, piece_bytes,
                                           size_t(groups), cudaMemcpyDeviceToDevice,
                                           ::megaton::cuda::stream()));
    at += split_shapes[i];
  }
}

}  // namespace

void newton_schulz(const Tensor& g, Tensor& out, int64_t batch, int64_t rows, int64_t cols,
                   const std::vector<NsCoefficientSet>& per_step, float eps, bool transpose,
                   bool tf32, const std::function<void(Tensor&)>& all_reduce) {
  MEGATON_CHECK(!per_step.empty(), "newton_schulz: no steps");
  const DType dtype = g.dtype();
  const NsGemms gemms{dtype, tf32 && dtype == DType::F32, batch, Iterated(transpose, rows, cols)};
  const Iterated& it = gemms.it;
  const int64_t per_matrix = rows * cols;
  // Ping-pong between out and one scratch copy, X_0 placed so that the last step lands in
  // out: X_k lives in `first` for even k, in `second` for odd k; first = scratch when the
  // step count is odd.
  Tensor scratch = Tensor::empty(g.shape(), dtype, Device::CUDA);
  // Every matrix's Gram and polynomial matrices of a step, for the batched GEMMs (and the
  // distributed mode's all-reduce of the Gram batch).
  Tensor grams = Tensor::empty({batch, it.k, it.k}, dtype, Device::CUDA);
  Tensor poly = Tensor::empty({batch, it.k, it.k}, dtype, Device::CUDA);
  const bool odd = per_step.size() % 2 == 1;
  Tensor& first = odd ? scratch : out;
  Tensor& second = odd ? out : scratch;
  if (all_reduce) {
    Tensor sums = Tensor::empty({batch}, DType::F32, Device::CUDA);
    matrix_sums_of_squares(g, batch, per_matrix, sums);
    all_reduce_checked(all_reduce, sums, "sums of squares");
    divide_by_root_of_sums(g, first, batch, per_matrix, sums, eps);
  } else {
    frobenius_normalize(g, first, batch, per_matrix, eps);
  }
  // Each GEMM runs over the whole batch; the all-reduce sees a step's whole Gram batch
  // between the first GEMM and the others.
  for (size_t step = 0; step < per_step.size(); ++step) {
    const Tensor& x = step % 2 == 0 ? first : second;
    const Tensor& next = step % 2 == 0 ? second : first;
    gemms.gram_step(x.raw(), grams.raw());
    if (all_reduce) all_reduce_checked(all_reduce, grams, "Gram matrices");
    // grams.raw() read after the all-reduce, which may replace the tensor.
    gemms.update_step(x.raw(), grams.raw(), poly.raw(), next.raw(), per_step[step]);
  }
}

void split_qkv_update(const Tensor& u, const std::vector<int64_t>& split_shapes,
                      std::vector<Tensor>& pieces) {
  copy_qkv(u, pieces, split_shapes, true);
}

void join_qkv_update(const std::vector<Tensor>& pieces, const std::vector<int64_t>& split_shapes,
                     Tensor& u) {
  copy_qkv(u, pieces, split_shapes, false);
}

void copy_columns(const Tensor& src, int64_t src_col0, Tensor& dst, int64_t dst_col0,
                  int64_t cols) {
  const size_t elem = dtype_size(src.dtype());
  const auto* from = static_cast<const char*>(src.raw()) + size_t(src_col0) * elem;
  auto* to = static_cast<char*>(dst.raw()) + size_t(dst_col0) * elem;
  MEGATON_CUDA_CHECK(cudaMemcpy2DAsync(
      to, size_t(dst.dim(1)) * elem, from, size_t(src.dim(1)) * elem, size_t(cols) * elem,
      size_t(src.dim(0)), cudaMemcpyDeviceToDevice, ::megaton::cuda::stream()));
}

}  // namespace megaton::ops::cuda
