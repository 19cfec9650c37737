// RMSNorm and LayerNorm forward/backward on the CPU. Row statistics and the backward's
// row reductions are accumulated in fp64; outputs are stored in fp32.
#include <algorithm>
#include <cmath>
#include <utility>

#include "ops/cpu/norm_weight_grads.h"
#include "ops/dispatch.h"
#include "ops/norm_checks.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

constexpr int64_t kParallelMin = 1 << 14;  // elements; smaller work stays on one thread

void check_f32(const Tensor& t, const char* op, const char* name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.dtype() == DType::F32, "{}: {} must be F32, got {}", op, name,
                dtype_name(t.dtype()));
  // A CUDA backend dispatches on the device after the checks; this binary has only CPU.
  MEGATON_CHECK(t.device() == Device::CPU, "{}: no CUDA backend in this build ({})", op, name);
}

// The weight gradients are summed after dx is written, so dx must not be dy or x.
void check_not_aliased(const Tensor& dx, const Tensor& dy, const Tensor& x, const char* op) {
  MEGATON_CHECK(dx.numel() == 0 || (dx.raw() != dy.raw() && dx.raw() != x.raw()),
                "{}: dx must not share memory with dy or x", op);
}

// x is [T, H] (leading dimensions merged). Returns {T, H}.
std::pair<int64_t, int64_t> rows_cols(const Tensor& x, const char* op) {
  check_f32(x, op, "x");
  MEGATON_CHECK(x.ndim() >= 1, "{}: x must be [T, H], got a scalar", op);
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i) rows *= x.dim(i);
  return {rows, x.dim(-1)};
}

void check_same_shape(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  check_f32(t, op, name);
  MEGATON_CHECK(t.shape() == x.shape(), "{}: {} {} must have the shape of x {}", op, name,
                shape_str(t.shape()), shape_str(x.shape()));
}

void check_vector(const Tensor& t, int64_t n, const char* op, const char* name) {
  check_f32(t, op, name);
  MEGATON_CHECK(t.numel() == n && t.ndim() >= 1, "{}: {} {} must have {} elements", op, name,
                shape_str(t.shape()), n);
}


namespace cpu {

void rmsnorm_forward(const float* x, const float* weight, float eps, float* y, float* rstd,
                     int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * cols;
    double ss = 0;
    for (int64_t j = 0; j < cols; ++j) ss += double(xr[j]) * xr[j];
    double r = 1.0 / std::sqrt(ss / double(cols) + double(eps));
    float* yr = y + t * cols;
    for (int64_t j = 0; j < cols; ++j) yr[j] = float(xr[j] * r * weight[j]);
    rstd[t] = float(r);
  }
}

// y = x r w with r = (mean(x^2) + eps)^(-1/2), dr/dx_i = -r^3 x_i / H, so with g = dy * w:
// dx_i = r (g_i - x_i r^2 mean_j(g_j x_j)).
void rmsnorm_backward(const float* dy, const float* x, const float* weight, const float* rstd,
                      const float* dres, float* dx, float* dweight, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float* dyr = dy + t * cols;
    const float* xr = x + t * cols;
    double r = rstd[t], gx = 0;
    for (int64_t j = 0; j < cols; ++j) gx += double(dyr[j]) * weight[j] * xr[j];
    double c = r * r * gx / double(cols);
    float* dxr = dx + t * cols;
    const float* dresr = dres ? dres + t * cols : nullptr;
    for (int64_t j = 0; j < cols; ++j) {
      float v = float(r * (double(dyr[j]) * weight[j] - xr[j] * c));
      dxr[j] = dresr ? v + dresr[j] : v;  // as add_ after the unfused op
    }
  }
  norm_math::weight_grads(dy, x, nullptr, rstd, dweight, nullptr, rows, cols);
}

void layernorm_forward(const float* x, const float* weight, const float* bias, float eps, float* y,
                       float* mean, float* rstd, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * cols;
    double s = 0;
    for (int64_t j = 0; j < cols; ++j) s += xr[j];
    double mu = s / double(cols), var = 0;  // two passes: no cancellation for large means
    for (int64_t j = 0; j < cols; ++j) var += (xr[j] - mu) * (xr[j] - mu);
    double r = 1.0 / std::sqrt(var / double(cols) + double(eps));  // biased variance, as torch
    float* yr = y + t * cols;
    for (int64_t j = 0; j < cols; ++j)
      yr[j] = float((xr[j] - mu) * r * weight[j] + (bias ? bias[j] : 0.0f));
    mean[t] = float(mu);
    rstd[t] = float(r);
  }
}

// xhat = (x - mean) r, g = dy * w: dx = r (g - mean(g) - xhat mean(g xhat)).
void layernorm_backward(const float* dy, const float* x, const float* weight, const float* mean,
                        const float* rstd, const float* dres, float* dx, float* dweight,
                        float* dbias, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t t = 0; t < rows; ++t) {
    const float* dyr = dy + t * cols;
    const float* xr = x + t * cols;
    double mu = mean[t], r = rstd[t], g_sum = 0, gx_sum = 0;
    for (int64_t j = 0; j < cols; ++j) {
      double g = double(dyr[j]) * weight[j];
      g_sum += g;
      gx_sum += g * ((xr[j] - mu) * r);
    }
    double g_mean = g_sum / double(cols), gx_mean = gx_sum / double(cols);
    float* dxr = dx + t * cols;
    const float* dresr = dres ? dres + t * cols : nullptr;
    for (int64_t j = 0; j < cols; ++j) {
      double g = double(dyr[j]) * weight[j], xhat = (xr[j] - mu) * r;
      float v = float(r * (g - g_mean - xhat * gx_mean));
      dxr[j] = dresr ? v + dresr[j] : v;
    }
  }
  norm_math::weight_grads(dy, x, mean, rstd, dweight, dbias, rows, cols);
}

// sum = x + residual (sum may be x or residual).
void add(const float* x, const float* residual, float* sum, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) sum[i] = x[i] + residual[i];
}

}  // namespace cpu

// dresidual, when given: x's shape, F32; dx may be its buffer, not part of it.
const float* residual_grad(const Tensor& dresidual, const Tensor& x, const Tensor& dx,
                           const char* op) {
  if (!dresidual.defined()) return nullptr;
  check_same_shape(dresidual, x, op, "dresidual");
  detail::check_residual_grad_aliasing(dx, dresidual, op);
  return dresidual.f32();
}
}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& weight, float eps, Tensor& y, Tensor& rstd) {
  MEGATON_CUDA_DISPATCH(x, cuda::rmsnorm_forward(x, weight, eps, y, rstd));
  const char* op = "rmsnorm_forward";
  auto [rows, cols] = rows_cols(x, op);
  check_vector(weight, cols, op, "weight");
  check_same_shape(y, x, op, "y");
  check_vector(rstd, rows, op, "rstd");
  cpu::rmsnorm_forward(x.f32(), weight.f32(), eps, y.f32(), rstd.f32(), rows, cols);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      Tensor& dx, Tensor& dweight, const Tensor& dresidual) {
  MEGATON_CUDA_DISPATCH(dy, cuda::rmsnorm_backward(dy, x, weight, rstd, dx, dweight, dresidual));
  const char* op = "rmsnorm_backward";
  auto [rows, cols] = rows_cols(x, op);
  check_same_shape(dy, x, op, "dy");
  check_vector(weight, cols, op, "weight");
  check_vector(rstd, rows, op, "rstd");
  check_same_shape(dx, x, op, "dx");
  check_vector(dweight, cols, op, "dweight");
  check_not_aliased(dx, dy, x, op);
  const float* dres = residual_grad(dresidual, x, dx, op);
  cpu::rmsnorm_backward(dy.f32(), x.f32(), weight.f32(), rstd.f32(), dres, dx.f32(), dweight.f32(),
                        rows, cols);
}

void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       Tensor& y, Tensor& mean, Tensor& rstd) {
  MEGATON_CUDA_DISPATCH(x, cuda::layernorm_forward(x, weight, bias, eps, y, mean, rstd));
  const char* op = "layernorm_forward";
  auto [rows, cols] = rows_cols(x, op);
  check_vector(weight, cols, op, "weight");
  if (bias.defined()) check_vector(bias, cols, op, "bias");
  check_same_shape(y, x, op, "y");
  check_vector(mean, rows, op, "mean");
  check_vector(rstd, rows, op, "rstd");
  cpu::layernorm_forward(x.f32(), weight.f32(), bias.defined() ? bias.f32() : nullptr, eps, y.f32(),
                         mean.f32(), rstd.f32(), rows, cols);
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dweight, Tensor& dbias,
                        const Tensor& dresidual) {
  MEGATON_CUDA_DISPATCH(
      dy, cuda::layernorm_backward(dy, x, weight, mean, rstd, dx, dweight, dbias, dresidual));
  const char* op = "layernorm_backward";
  auto [rows, cols] = rows_cols(x, op);
  check_same_shape(dy, x, op, "dy");
  check_vector(weight, cols, op, "weight");
  check_vector(mean, rows, op, "mean");
  check_vector(rstd, rows, op, "rstd");
  check_same_shape(dx, x, op, "dx");
  check_vector(dweight, cols, op, "dweight");
  if (dbias.defined()) check_vector(dbias, cols, op, "dbias");
  check_not_aliased(dx, dy, x, op);
  const float* dres = residual_grad(dresidual, x, dx, op);
  cpu::layernorm_backward(dy.f32(), x.f32(), weight.f32(), mean.f32(), rstd.f32(), dres, dx.f32(),
                          dweight.f32(), dbias.defined() ? dbias.f32() : nullptr, rows, cols);
}

void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& weight, float eps,
                         Tensor& sum, Tensor& y, Tensor& rstd) {
  MEGATON_CUDA_DISPATCH(x, cuda::add_rmsnorm_forward(x, residual, weight, eps, sum, y, rstd));
  const char* op = "add_rmsnorm_forward";
  auto [rows, cols] = rows_cols(x, op);
  check_same_shape(residual, x, op, "residual");
  check_same_shape(sum, x, op, "sum");
  check_vector(weight, cols, op, "weight");
  check_same_shape(y, x, op, "y");
  check_vector(rstd, rows, op, "rstd");
  detail::check_fused_add_aliasing(x, residual, sum, y, op);
  cpu::add(x.f32(), residual.f32(), sum.f32(), x.numel());  // checked: nothing is half-done
  rmsnorm_forward(sum, weight, eps, y, rstd);
}

void add_layernorm_forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                           const Tensor& bias, float eps, Tensor& sum, Tensor& y, Tensor& mean,
                           Tensor& rstd) {
  MEGATON_CUDA_DISPATCH(
      x, cuda::add_layernorm_forward(x, residual, weight, bias, eps, sum, y, mean, rstd));
  const char* op = "add_layernorm_forward";
  auto [rows, cols] = rows_cols(x, op);
  check_same_shape(residual, x, op, "residual");
  check_same_shape(sum, x, op, "sum");
  check_vector(weight, cols, op, "weight");
  if (bias.defined()) check_vector(bias, cols, op, "bias");
  check_same_shape(y, x, op, "y");
  check_vector(mean, rows, op, "mean");
  check_vector(rstd, rows, op, "rstd");
  detail::check_fused_add_aliasing(x, residual, sum, y, op);
  cpu::add(x.f32(), residual.f32(), sum.f32(), x.numel());
  layernorm_forward(sum, weight, bias, eps, y, mean, rstd);
}

}  // namespace megaton::ops
