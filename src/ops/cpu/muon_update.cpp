// Muon's elementwise ops (ops/muon.h): the momentum EMA (plain, and with the step's
// control tensor), the step's tail muon_apply and copy_columns. The doors check the
// arguments, then run the CUDA implementation (ops/cuda/muon.h) for device tensors or the
// CPU reference here.
#include <cmath>
#include <cstring>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/adam_precision_math.h"
#include "ops/cpu/optimizer_elementwise.h"
#include "ops/dispatch.h"
#include "ops/muon.h"
#include "ops/ops.h"
#ifdef MEGATON_WITH_CUDA
#include "ops/cuda/muon.h"
#endif

namespace megaton::ops {
namespace {

using cpu_optimizer::check_control;
using cpu_optimizer::describe;
using cpu_optimizer::device_name;
using cpu_optimizer::load;
using cpu_optimizer::product;

void store(Tensor& t, int64_t i, float v) {
  if (t.dtype() == DType::BF16)
    t.data<uint16_t>()[i] = float_to_bf16(v);
  else
    t.f32()[i] = v;
}

// Whether two tensors' bytes overlap.
bool overlaps(const Tensor& x, const Tensor& y) {
  if (x.nbytes() == 0 || y.nbytes() == 0) return false;
  auto* x0 = static_cast<const char*>(x.raw());
  auto* y0 = static_cast<const char*>(y.raw());
  return x0 < y0 + y.nbytes() && y0 < x0 + x.nbytes();
}

// The checks both momentum overloads share; `any_dtype`: grad and update may be BF16.
void check_momentum(const Tensor& momentum, const Tensor& grad, float beta, const Tensor& update,
                    bool any_dtype) {
  const char* op = "muon_momentum_update";
  MEGATON_CHECK(
      grad.defined() && (grad.dtype() == DType::F32 || (any_dtype && grad.dtype() == DType::BF16)),
      "{}: grad is {}, expected F32{}", op, describe(grad), any_dtype ? " or BF16" : "");
  for (auto [t, name] :
       {std::pair<const Tensor*, const char*>{&momentum, "momentum"}, {&update, "update"}}) {
    const bool dtype_ok =
        t->defined() &&
        (t->dtype() == DType::F32 || (any_dtype && t == &update && t->dtype() == DType::BF16));
    const bool shape_ok = any_dtype ? t->numel() == grad.numel() : t->shape() == grad.shape();
    MEGATON_CHECK(dtype_ok && shape_ok && t->device() == grad.device(),
                  "{}: {} is {}; grad is {} (F32{}, {} on its device)", op, name, describe(*t),
                  describe(grad), any_dtype && t == &update ? " or BF16" : "",
                  any_dtype ? "its numel" : "its shape");
  }
  MEGATON_CHECK(beta >= 0.0f && beta <= 1.0f, "{}: beta {} is not in [0, 1]", op, beta);
  MEGATON_CHECK(!overlaps(momentum, grad) && !overlaps(momentum, update),
                "{}: momentum must not share memory with grad or update", op);
  MEGATON_CHECK(
      !overlaps(update, grad) || (update.same_data(grad) && update.dtype() == grad.dtype()),
      "{}: update overlaps grad without being it (same memory and dtype)", op);
}

// The CPU EMA (fp64, rounded once) on g = grad * scale (fp32).
void momentum_cpu(Tensor& momentum, const Tensor& grad, float beta, bool nesterov, Tensor& update,
                  float scale) {
  const double mu = beta, w = 1.0 - mu;
  float* m = momentum.f32();
  for (int64_t i = 0; i < grad.numel(); ++i) {
    const double gi = product(load(grad, i), scale);  // read before update[i] (grad's) is written
    m[i] = float(mu * double(m[i]) + w * gi);
    store(update, i, nesterov ? float(w * gi + mu * double(m[i])) : m[i]);
  }
}

struct ApplyList {
  std::vector<Tensor>& mains;
  const std::vector<Tensor>& updates;
  std::vector<Tensor>& copies;
  const std::vector<float>& weight_decays;
  const std::vector<float>& scales;
};

void check_apply(const ApplyList& l, const Tensor& control) {
  const char* op = "muon_apply";
  const size_t n = l.mains.size();
  MEGATON_CHECK(l.updates.size() == n && l.copies.size() == n && l.weight_decays.size() == n &&
                    l.scales.size() == n,
                "{}: lists of different lengths: mains {}, updates {}, copies {}, "
                "weight_decays {}, scales {}",
                op, n, l.updates.size(), l.copies.size(), l.weight_decays.size(), l.scales.size());
  const Device device = n > 0 && l.mains[0].defined() ? l.mains[0].device() : control.device();
  check_control(control, device, op);
  for (size_t i = 0; i < n; ++i) {
    const Tensor& main = l.mains[i];
    MEGATON_CHECK(main.defined() && main.dtype() == DType::F32 && main.device() == device,
                  "{}: mains[{}] is {}, expected F32 on {}", op, i, describe(main),
                  device_name(device));
    const Tensor& u = l.updates[i];
    MEGATON_CHECK(u.defined() && (u.dtype() == DType::F32 || u.dtype() == DType::BF16) &&
                      u.numel() == main.numel() && u.device() == device,
                  "{}: updates[{}] is {}, expected F32 or BF16 with {} elements on {}", op, i,
                  describe(u), main.numel(), device_name(device));
    const Tensor& copy = l.copies[i];
    MEGATON_CHECK(!copy.defined() || ((copy.dtype() == DType::F32 || copy.dtype() == DType::BF16 ||
                                       copy.dtype() == DType::F16) &&
                                      copy.numel() == main.numel() && copy.device() == device),
                  "{}: copies[{}] is {}, expected undefined or F32, BF16 or F16 with {} elements "
                  "on {}",
                  op, i, describe(copy), main.numel(), device_name(device));
  }
}

}  // namespace

void muon_momentum_update(Tensor& momentum, const Tensor& grad, float beta, bool nesterov,
                          Tensor& update) {
  check_momentum(momentum, grad, beta, update, false);
  MEGATON_CUDA_DISPATCH(
      grad, cuda::muon_momentum_update(momentum, grad, beta, nesterov, update, nullptr));
  MEGATON_CHECK(grad.device() == Device::CPU, "muon_momentum_update: no CUDA backend here");
  momentum_cpu(momentum, grad, beta, nesterov, update, 1.0f);
}

void muon_momentum_update(Tensor& momentum, const Tensor& grad, float beta, bool nesterov,
                          Tensor& update, const Tensor& control) {
  check_momentum(momentum, grad, beta, update, true);
  check_control(control, grad.device(), "muon_momentum_update");
  if (grad.numel() == 0) return;
  MEGATON_CUDA_DISPATCH(
      grad, cuda::muon_momentum_update(momentum, grad, beta, nesterov, update, control.f32()));
  MEGATON_CHECK(grad.device() == Device::CPU, "muon_momentum_update: no CUDA backend here");
  const float* c = control.f32();
  if (c[kAdamSkip] != 0.0f) {
    std::memset(update.raw(), 0, update.nbytes());  // +0 in F32 and BF16
    return;
  }
  momentum_cpu(momentum, grad, beta, nesterov, update, c[kAdamGradScale]);
}

void muon_apply(std::vector<Tensor>& mains, const std::vector<Tensor>& updates,
                std::vector<Tensor>& copies, const std::vector<float>& weight_decays,
                const std::vector<float>& scales, const Tensor& control) {
  check_apply({mains, updates, copies, weight_decays, scales}, control);
  if (mains.empty()) return;
  MEGATON_CUDA_DISPATCH(mains[0],
                        cuda::muon_apply(mains, updates, copies, weight_decays, scales, control));
  MEGATON_CHECK(mains[0].device() == Device::CPU, "muon_apply: no CUDA backend here");
  const float* c = control.f32();
  if (c[kAdamSkip] != 0.0f) return;
  const float lr = c[kAdamLr];
  for (size_t i = 0; i < mains.size(); ++i) {
    // The GPU's factors: adamw_decay's fp64 1 - lr * wd, and fp64 lr * scale, each rounded.
    const float decay = adam_precision_decay(lr, weight_decays[i]);
    const float step = float(double(lr) * double(scales[i]));
    float* p = mains[i].f32();
    for (int64_t j = 0; j < mains[i].numel(); ++j)
      p[j] = std::fma(-step, load(updates[i], j), product(p[j], decay));
    if (copies[i].defined()) cast(mains[i], copies[i]);
  }
}

void copy_columns(const Tensor& src, int64_t src_col0, Tensor& dst, int64_t dst_col0,
                  int64_t cols) {
  const char* op = "copy_columns";
  MEGATON_CHECK(src.defined() && dst.defined() && src.ndim() == 2 && dst.ndim() == 2 &&
                    src.dtype() == dst.dtype() && src.device() == dst.device() &&
                    src.dim(0) == dst.dim(0),
                "{}: src {} and dst {} must be 2-d with equal rows, one dtype and device", op,
                describe(src), describe(dst));
  MEGATON_CHECK(cols >= 0 && src_col0 >= 0 && dst_col0 >= 0 && src_col0 + cols <= src.dim(1) &&
                    dst_col0 + cols <= dst.dim(1),
                "{}: columns [{}, {}) of src {} to [{}, {}) of dst {} fall outside", op, src_col0,
                src_col0 + cols, shape_str(src.shape()), dst_col0, dst_col0 + cols,
                shape_str(dst.shape()));
  const bool disjoint_in_one = src.same_data(dst) && src.shape() == dst.shape() &&
                               (src_col0 + cols <= dst_col0 || dst_col0 + cols <= src_col0);
  MEGATON_CHECK(!overlaps(src, dst) || disjoint_in_one,
                "{}: src and dst overlap in memory (only disjoint column ranges of one tensor may)",
                op);
  const int64_t rows = src.dim(0);
  if (rows == 0 || cols == 0) return;
  MEGATON_CUDA_DISPATCH(src, cuda::copy_columns(src, src_col0, dst, dst_col0, cols));
  MEGATON_CHECK(src.device() == Device::CPU, "copy_columns: no CUDA backend here");
  const size_t elem = dtype_size(src.dtype()), row_bytes = size_t(cols) * elem;
  const auto* from = static_cast<const char*>(src.raw()) + size_t(src_col0) * elem;
  auto* to = static_cast<char*>(dst.raw()) + size_t(dst_col0) * elem;
  const size_t src_pitch = size_t(src.dim(1)) * elem, dst_pitch = size_t(dst.dim(1)) * elem;
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(to + size_t(r) * dst_pitch, from + size_t(r) * src_pitch, row_bytes);
}

}  // namespace megaton::ops
