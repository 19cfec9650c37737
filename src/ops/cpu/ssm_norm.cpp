// Mamba-2's gated RMSNorm (ops/ssm.h; mamba_ssm's RMSNormGated, norm_before_gate = False):
// the doors check the arguments, then run the CUDA kernels (ops/cuda/ssm_norm.cu) for
// device tensors or the fp32 reference here (group sums in fp64).
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/cpu/ssm_checks.h"
#include "ops/dispatch.h"
#include "ops/ssm.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/ssm.h"
#endif

namespace megaton::ops {
namespace {

using ssm_detail::check_cpu;
using ssm_detail::check_f32;
using ssm_detail::check_like;

// y [T, D] with z [T, D] and weight [D] in y's dtype, D divisible by group_size, rstd F32
// [T * D / group_size] on y's device. Returns the number of groups per row.
int64_t check_gated_norm(const Tensor& y, const Tensor& z, const Tensor& weight, int64_t group_size,
                         const Tensor& rstd, const char* op) {
  MEGATON_CHECK(y.defined() && ssm_detail::is_activation_dtype(y.dtype()) && y.ndim() == 2,
                "{}: y must be an allocated float [T, D]", op);
  const int64_t T = y.dim(0), D = y.dim(1);
  MEGATON_CHECK(group_size > 0 && D % group_size == 0,
                "{}: group_size {} must be positive and divide D = {}", op, group_size, D);
  check_like(z, y, y.shape(), op, "z");
  check_like(weight, y, {D}, op, "weight");
  const int64_t groups = D / group_size;
  check_f32(rstd, {T * groups}, y.device(), op, "rstd");
  return groups;
}

}  // namespace

void gated_rmsnorm_forward(const Tensor& y, const Tensor& z, const Tensor& weight,
                           int64_t group_size, float eps, Tensor& out, Tensor& rstd) {
  const char* op = "gated_rmsnorm_forward";
  const int64_t groups = check_gated_norm(y, z, weight, group_size, rstd, op);
  check_like(out, y, y.shape(), op, "out");
  MEGATON_CHECK(eps >= 0.0f, "{}: eps {} must be >= 0", op, eps);
  MEGATON_CUDA_DISPATCH(y, cuda::gated_rmsnorm_forward(y, z, weight, group_size, eps, out, rstd));
  check_cpu(y, op);
  const int64_t T = y.dim(0), D = y.dim(1);
  const float *ys = y.f32(), *zs = z.f32(), *w = weight.f32();
  float *os = out.f32(), *rs = rstd.f32();
  std::vector<double> gate(static_cast<size_t>(group_size));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = t * D + g * group_size;
      double squares = 0;
      for (int64_t j = 0; j < group_size; ++j) {
        gate[size_t(j)] = double(ys[at + j]) * ssm_detail::silu(zs[at + j]);
        squares += gate[size_t(j)] * gate[size_t(j)];
      }
      const double r = 1.0 / std::sqrt(squares / double(group_size) + double(eps));
      for (int64_t j = 0; j < group_size; ++j)
        os[at + j] = float(gate[size_t(j)] * r * w[g * group_size + j]);
      rs[t * groups + g] = float(r);
    }
}

// With g = y silu(z), r = (mean(g^2) + eps)^(-1/2) and e = dout * weight:
// dg_j = r e_j - g_j r^3 mean_k(e_k g_k), dy = dg silu(z), dz = dg y silu'(z).
void gated_rmsnorm_backward(const Tensor& dout, const Tensor& y, const Tensor& z,
                            const Tensor& weight, const Tensor& rstd, int64_t group_size,
                            Tensor& dy, Tensor& dz, Tensor& dweight_acc) {
  const char* op = "gated_rmsnorm_backward";
  const int64_t groups = check_gated_norm(y, z, weight, group_size, rstd, op);
  check_like(dout, y, y.shape(), op, "dout");
  check_like(dy, y, y.shape(), op, "dy");
  check_like(dz, y, y.shape(), op, "dz");
  check_f32(dweight_acc, weight.shape(), y.device(), op, "dweight_acc");
  MEGATON_CUDA_DISPATCH(
      y, cuda::gated_rmsnorm_backward(dout, y, z, weight, rstd, group_size, dy, dz, dweight_acc));
  check_cpu(y, op);
  const int64_t T = y.dim(0), D = y.dim(1);
  const float *douts = dout.f32(), *ys = y.f32(), *zs = z.f32(), *w = weight.f32();
  const float* rs = rstd.f32();
  std::vector<double> dw(size_t(D), 0.0), gate(static_cast<size_t>(group_size));
  std::vector<double> dys(static_cast<size_t>(T * D)), dzs(static_cast<size_t>(T * D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = t * D + g * group_size;
      const double r = rs[t * groups + g];
      double eg = 0;
      for (int64_t j = 0; j < group_size; ++j) {
        gate[size_t(j)] = double(ys[at + j]) * ssm_detail::silu(zs[at + j]);
        eg += double(douts[at + j]) * w[g * group_size + j] * gate[size_t(j)];
        dw[size_t(g * group_size + j)] += double(douts[at + j]) * gate[size_t(j)] * r;
      }
      const double c = r * r * r * eg / double(group_size);
      for (int64_t j = 0; j < group_size; ++j) {
        const double dgate =
            r * double(douts[at + j]) * w[g * group_size + j] - c * gate[size_t(j)];
        dys[size_t(at + j)] = dgate * ssm_detail::silu(zs[at + j]);
        dzs[size_t(at + j)] = dgate * ys[at + j] * ssm_detail::silu_grad(zs[at + j]);
      }
    }
  // Written after every read, so dy or dz may share memory with an input.
  float *dyo = dy.f32(), *dzo = dz.f32(), *dwa = dweight_acc.f32();
  for (size_t i = 0; i < dys.size(); ++i) {
    dyo[i] = float(dys[i]);
    dzo[i] = float(dzs[i]);
  }
  for (int64_t j = 0; j < D; ++j) dwa[j] += float(dw[size_t(j)]);
}

}  // namespace megaton::ops
