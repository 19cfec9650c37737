// Elementwise updates and reductions on the CPU: add_, scale_, bias_add_, bias_backward,
// their row-weighted forms (MoE experts), sum_of_squares, sum, dot.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;

void check_f32(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.dtype() == DType::F32, "{}: {} must be F32, got {}", op, name,
                dtype_name(t.dtype()));
}

// A CUDA backend dispatches where this is called; this binary has only the CPU one.
void require_cpu(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    MEGATON_CHECK(t->device() == Device::CPU, "{}: no CUDA backend in this build", op);
}

namespace cpu {

void add(float* y, const float* x, float alpha, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// BF16 y: the fp32 sum rounded once to nearest even (a BF16 main grad += an fp32
// gradient, model/main_grad.h; the CUDA add_kernel computes the same).
void add(uint16_t* y, const float* x, float alpha, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = float_to_bf16(bf16_to_float(y[i]) + alpha * x[i]);
}

void scale(uint16_t* x, float s, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] = float_to_bf16(bf16_to_float(x[i]) * s);
}

void scale(float* x, float s, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void bias_add(float* y, const float* bias, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    float* yr = y + t * cols;
    for (int64_t j = 0; j < cols; ++j) yr[j] += bias[j];
  }
}

// Columns are split into blocks, one thread per block, each summing all rows in token
// order: no races, and the result does not depend on the thread count.
void bias_backward(const float* dy, float* dbias, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 64;
  int64_t blocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    int64_t j0 = blk * kBlock, j1 = std::min(cols, j0 + kBlock);
    double acc[kBlock] = {};
    for (int64_t t = 0; t < rows; ++t) {
      const float* dyr = dy + t * cols;
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += dyr[j];
    }
    for (int64_t j = j0; j < j1; ++j) dbias[j] += float(acc[j - j0]);
  }
}

// fp64 sum of f(x[i]) over fixed-size chunks, chunk sums added in order: the result is
// the same for any thread count (a resumed or re-sharded run logs the same grad norm).
template <typename T, typename F>
double chunked_sum(const T* x, int64_t n, F f) {
  constexpr int64_t kChunk = 4096;
  int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    double s = 0;
    for (int64_t i = c * kChunk, end = std::min(n, i + kChunk); i < end; ++i) {
      if constexpr (std::is_same_v<T, uint16_t>) s += f(bf16_to_float(x[i]));  // BF16 bits
      else s += f(x[i]);
    }
    partial[c] = s;
  }
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

}  // namespace cpu
}  // namespace

void add_(Tensor& y, const Tensor& x, float alpha) {
  MEGATON_CUDA_DISPATCH(y, cuda::add_(y, x, alpha));
  // y may also be BF16 (x F32): a BF16 main grad taking an fp32 gradient, rounded once.
  if (!(y.defined() && y.dtype() == DType::BF16)) check_f32(y, "add_", "y");
  check_f32(x, "add_", "x");
  MEGATON_CHECK(y.numel() == x.numel(), "add_: y {} and x {} differ in numel", shape_str(y.shape()),
                shape_str(x.shape()));
  require_cpu("add_", {&y, &x});
  if (y.dtype() == DType::BF16) cpu::add(y.data<uint16_t>(), x.f32(), alpha, y.numel());
  else cpu::add(y.f32(), x.f32(), alpha, y.numel());
}

void scale_(Tensor& x, float s) {
  MEGATON_CUDA_DISPATCH(x, cuda::scale_(x, s));
  // BF16 too (gradient clipping of BF16 main grads): fp32 product rounded once, as on CUDA.
  if (!(x.defined() && x.dtype() == DType::BF16)) check_f32(x, "scale_", "x");
  require_cpu("scale_", {&x});
  if (x.dtype() == DType::BF16) cpu::scale(x.data<uint16_t>(), s, x.numel());
  else cpu::scale(x.f32(), s, x.numel());
}

void bias_add_(Tensor& y, const Tensor& bias) {
  MEGATON_CUDA_DISPATCH(y, cuda::bias_add_(y, bias));
  check_f32(y, "bias_add_", "y");
  check_f32(bias, "bias_add_", "bias");
  MEGATON_CHECK(y.ndim() >= 1 && bias.ndim() == 1 && bias.dim(0) == y.dim(-1),
                "bias_add_: y {} with bias {} (bias must be [N], N = last dim of y)",
                shape_str(y.shape()), shape_str(bias.shape()));
  require_cpu("bias_add_", {&y, &bias});
  int64_t cols = bias.dim(0);
  cpu::bias_add(y.f32(), bias.f32(), cols ? y.numel() / cols : 0, cols);
}

void bias_backward(const Tensor& dy, Tensor& dbias) {
  MEGATON_CUDA_DISPATCH(dy, cuda::bias_backward(dy, dbias));
  check_f32(dy, "bias_backward", "dy");
  check_f32(dbias, "bias_backward", "dbias");
  MEGATON_CHECK(dy.ndim() >= 1 && dbias.ndim() == 1 && dbias.dim(0) == dy.dim(-1),
                "bias_backward: dy {} with dbias {} (dbias must be [N], N = last dim of dy)",
                shape_str(dy.shape()), shape_str(dbias.shape()));
  require_cpu("bias_backward", {&dy, &dbias});
  int64_t cols = dbias.dim(0);
  cpu::bias_backward(dy.f32(), dbias.f32(), cols ? dy.numel() / cols : 0, cols);
}

// Megatron's TEGroupedMLP._apply_bias (transformer/moe/experts.py): the expert bias scaled
// by each row's routing probability.
void weighted_bias_add_(Tensor& y, const Tensor& bias, const Tensor& weights) {
  MEGATON_CUDA_DISPATCH(y, cuda::weighted_bias_add_(y, bias, weights));
  const char* op = "weighted_bias_add_";
  check_f32(y, op, "y");
  check_f32(bias, op, "bias");
  check_f32(weights, op, "weights");
  MEGATON_CHECK(y.ndim() >= 1 && bias.ndim() == 1 && bias.dim(0) == y.dim(-1),
                "{}: y {} with bias {} (bias must be [N], N = last dim of y)", op,
                shape_str(y.shape()), shape_str(bias.shape()));
  const int64_t cols = bias.dim(0), rows = cols ? y.numel() / cols : 0;
  MEGATON_CHECK(weights.numel() == rows, "{}: weights {} must have {} elements, one per row", op,
                shape_str(weights.shape()), rows);
  require_cpu(op, {&y, &bias, &weights});
  float* yp = y.f32();
  const float *b = bias.f32(), *w = weights.f32();
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < cols; ++j) yp[t * cols + j] += w[t] * b[j];
}

void weighted_bias_backward(const Tensor& dy, const Tensor& bias, const Tensor& weights,
                            Tensor& dbias, Tensor* dweights) {
  MEGATON_CUDA_DISPATCH(dy, cuda::weighted_bias_backward(dy, bias, weights, dbias, dweights));
  const char* op = "weighted_bias_backward";
  check_f32(dy, op, "dy");
  check_f32(bias, op, "bias");
  check_f32(weights, op, "weights");
  check_f32(dbias, op, "dbias");
  MEGATON_CHECK(dy.ndim() >= 1 && bias.ndim() == 1 && bias.dim(0) == dy.dim(-1) &&
                    dbias.shape() == bias.shape(),
                "{}: dy {} with bias {} and dbias {} (both [N], N = last dim of dy)", op,
                shape_str(dy.shape()), shape_str(bias.shape()), shape_str(dbias.shape()));
  const int64_t cols = bias.dim(0), rows = cols ? dy.numel() / cols : 0;
  MEGATON_CHECK(weights.numel() == rows, "{}: weights {} must have {} elements, one per row", op,
                shape_str(weights.shape()), rows);
  if (dweights) {
    check_f32(*dweights, op, "dweights");
    MEGATON_CHECK(dweights->numel() == rows, "{}: dweights {} must have {} elements", op,
                  shape_str(dweights->shape()), rows);
  }
  require_cpu(op, {&dy, &bias, &weights, &dbias});
  const float *g = dy.f32(), *b = bias.f32(), *w = weights.f32();
  // Columns summed over rows in row order (bias_backward's order), rows' dots apart.
  std::vector<double> acc(cols, 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < cols; ++j) acc[j] += double(w[t]) * g[t * cols + j];
  for (int64_t j = 0; j < cols; ++j) dbias.f32()[j] += float(acc[j]);
  if (!dweights) return;
  float* dw = dweights->f32();
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    double dot = 0.0;
    for (int64_t j = 0; j < cols; ++j) dot += double(g[t * cols + j]) * b[j];
    dw[t] += float(dot);
  }
}

double sum_of_squares(const Tensor& x) {
  MEGATON_CUDA_DISPATCH(x, cuda::sum_of_squares(x));
  // BF16 too (the grad norm of BF16 main grads), each element widened exactly.
  const auto square = [](float v) { return double(v) * v; };
  if (x.defined() && x.dtype() == DType::BF16) {
    require_cpu("sum_of_squares", {&x});
    return cpu::chunked_sum(x.data<uint16_t>(), x.numel(), square);
  }
  check_f32(x, "sum_of_squares", "x");
  require_cpu("sum_of_squares", {&x});
  return cpu::chunked_sum(x.f32(), x.numel(), square);
}

double sum(const Tensor& x) {
  MEGATON_CUDA_DISPATCH(x, cuda::sum(x));
  check_f32(x, "sum", "x");
  require_cpu("sum", {&x});
  return cpu::chunked_sum(x.f32(), x.numel(), [](float v) { return double(v); });
}

void sum(const Tensor& x, Tensor& out) {
  MEGATON_CUDA_DISPATCH(x, cuda::sum(x, out));
  check_f32(x, "sum", "x");
  check_f32(out, "sum", "out");
  require_cpu("sum", {&x, &out});
  MEGATON_CHECK(out.numel() == 1, "sum: out has {} elements (want 1)", out.numel());
  out.f32()[0] = float(cpu::chunked_sum(x.f32(), x.numel(), [](float v) { return double(v); }));
}

void dot(const Tensor& a, const Tensor& b, Tensor& out) {
  MEGATON_CUDA_DISPATCH(a, cuda::dot(a, b, out));
  check_f32(a, "dot", "a");
  check_f32(b, "dot", "b");
  check_f32(out, "dot", "out");
  require_cpu("dot", {&a, &b, &out});
  MEGATON_CHECK(a.numel() == b.numel() && out.numel() == 1,
                "dot: a has {} elements, b {}, out {} (want equal, equal, 1)", a.numel(),
                b.numel(), out.numel());
  double acc = 0.0;
  const float *pa = a.f32(), *pb = b.f32();
  for (int64_t i = 0; i < a.numel(); ++i) acc += double(pa[i]) * double(pb[i]);
  out.f32()[0] = float(acc);
}

}  // namespace megaton::ops
