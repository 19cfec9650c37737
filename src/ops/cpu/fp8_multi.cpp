// The multi-tensor FP8 ops of ops/fp8.h (fp8_amax_multi, fp8_update_scale_multi,
// fp8_delayed_scaling_update_multi, fp8_quantize_multi): door checks, CUDA dispatch, and
// the CPU path.
//
// The door refuses what the single-tensor op would refuse for any entry, lists of unequal
// lengths, tensors on more than one device, and what the one-launch GPU kernels need to be
// uniform (fp8_quantize_multi: one input dtype and one FP8 dtype for all entries;
// fp8_delayed_scaling_update_multi: one history length). The CPU has no launches to save:
// entry by entry it is the single-tensor op, the reference the GPU kernels
// (ops/cuda/fp8_multi.cu) must match bit for bit.
#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "ops/cpu/fp8_checks.h"
#include "ops/dispatch.h"
#include "ops/fp8.h"

namespace megaton::ops {
namespace {

using fp8_checks::check_input;
// The single-tensor ops check the rule again on the CPU path; the GPU path has only this.
using fp8_checks::check_rule;
using fp8_checks::is_fp8;

// "name[i]", for messages.
std::string entry_name(const char* name, size_t i) { return fmt::format("{}[{}]", name, i); }

void check_length(const std::vector<Tensor>& list, size_t want, const char* op, const char* name,
                  const char* first_name) {
  MEGATON_CHECK(list.size() == want, "{}: {} has {} entries, {} has {}", op, name, list.size(),
                first_name, want);
}

void check_f32_scalar(const Tensor& t, const char* op, const std::string& name) {
  MEGATON_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MEGATON_CHECK(t.dtype() == DType::F32 && t.shape() == Shape({1}),
                "{}: {} must be F32 [1], got {} {}", op, name, dtype_name(t.dtype()),
                shape_str(t.shape()));
}

// Every defined tensor of the lists on `device`.
void check_device(Device device, const char* op,
                  std::initializer_list<std::pair<const char*, const std::vector<Tensor>*>> lists) {
  for (const auto& [name, list] : lists)
    for (size_t i = 0; i < list->size(); ++i) {
      const Tensor& t = (*list)[i];
      MEGATON_CHECK(!t.defined() || t.device() == device,
                    "{}: {}[{}] is on the {}, the first entry's tensors on the {}", op, name, i,
                    t.device() == Device::CPU ? "CPU" : "GPU",
                    device == Device::CPU ? "CPU" : "GPU");
    }
}

// [rows, cols] of x viewed as fp8.h says ([numel / C, C], C the last dimension).
Shape matrix_of(const Tensor& x, const char* op, const std::string& name) {
  MEGATON_CHECK(x.ndim() >= 1, "{}: {} must have rank >= 1, got shape {}", op, name,
                shape_str(x.shape()));
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i) rows *= x.dim(i);
  return {rows, x.dim(-1)};
}

}  // namespace

void fp8_amax_multi(const std::vector<Tensor>& x, const std::vector<Tensor>& amax) {
  const char* op = "fp8_amax_multi";
  check_length(amax, x.size(), op, "amax", "x");
  for (size_t i = 0; i < x.size(); ++i) {
    check_input(x[i], op, entry_name("x", i));
    check_f32_scalar(amax[i], op, entry_name("amax", i));
  }
  if (x.empty()) return;
  check_device(x[0].device(), op, {{"x", &x}, {"amax", &amax}});
  MEGATON_CUDA_DISPATCH(x[0], cuda::fp8_amax_multi(x, amax));
  for (size_t i = 0; i < x.size(); ++i) {
    Tensor amax_i = amax[i];
    fp8_amax(x[i], amax_i);
  }
}

void fp8_update_scale_multi(const std::vector<Tensor>& amax, const Fp8ScaleRule& rule,
                            const std::vector<Tensor>& scale,
                            const std::vector<Tensor>& scale_inv) {
  const char* op = "fp8_update_scale_multi";
  check_rule(rule, op);
  check_length(scale, amax.size(), op, "scale", "amax");
  check_length(scale_inv, amax.size(), op, "scale_inv", "amax");
  for (size_t i = 0; i < amax.size(); ++i) {
    check_f32_scalar(amax[i], op, entry_name("amax", i));
    check_f32_scalar(scale[i], op, entry_name("scale", i));
    check_f32_scalar(scale_inv[i], op, entry_name("scale_inv", i));
  }
  if (amax.empty()) return;
  check_device(amax[0].device(), op,
               {{"amax", &amax}, {"scale", &scale}, {"scale_inv", &scale_inv}});
  MEGATON_CUDA_DISPATCH(amax[0], cuda::fp8_update_scale_multi(amax, rule, scale, scale_inv));
  for (size_t i = 0; i < amax.size(); ++i) {
    Tensor scale_i = scale[i], scale_inv_i = scale_inv[i];
    fp8_update_scale(amax[i], rule, scale_i, scale_inv_i);
  }
}

void fp8_delayed_scaling_update_multi(const std::vector<Tensor>& amax_history,
                                      const Fp8ScaleRule& rule, bool max_algo,
                                      const std::vector<Tensor>& scale,
                                      const std::vector<Tensor>& scale_inv) {
  const char* op = "fp8_delayed_scaling_update_multi";
  check_rule(rule, op);
  check_length(scale, amax_history.size(), op, "scale", "amax_history");
  check_length(scale_inv, amax_history.size(), op, "scale_inv", "amax_history");
  for (size_t i = 0; i < amax_history.size(); ++i) {
    const Tensor& h = amax_history[i];
    MEGATON_CHECK(
        h.defined() && h.dtype() == DType::F32 && h.ndim() == 2 && h.dim(0) >= 1 && h.dim(1) == 1,
        "{}: amax_history[{}] must be F32 [L, 1] with L >= 1, got {} {}", op, i,
        h.defined() ? dtype_name(h.dtype()) : "undefined", shape_str(h.shape()));
    MEGATON_CHECK(h.dim(0) == amax_history[0].dim(0),
                  "{}: amax_history[{}] has {} rows, amax_history[0] {} (one L for all)", op, i,
                  h.dim(0), amax_history[0].dim(0));
    check_f32_scalar(scale[i], op, entry_name("scale", i));
    check_f32_scalar(scale_inv[i], op, entry_name("scale_inv", i));
  }
  if (amax_history.empty()) return;
  check_device(amax_history[0].device(), op,
               {{"amax_history", &amax_history}, {"scale", &scale}, {"scale_inv", &scale_inv}});
  MEGATON_CUDA_DISPATCH(amax_history[0], cuda::fp8_delayed_scaling_update_multi(
                                             amax_history, rule, max_algo, scale, scale_inv));
  for (size_t i = 0; i < amax_history.size(); ++i) {
    Tensor history_i = amax_history[i], scale_i = scale[i], scale_inv_i = scale_inv[i];
    fp8_delayed_scaling_update(history_i, rule, max_algo, scale_i, scale_inv_i);
  }
}

void fp8_quantize_multi(const std::vector<Tensor>& x, const std::vector<Tensor>& scale,
                        const std::vector<Tensor>& out, const std::vector<Tensor>& out_t,
                        const std::vector<Tensor>& amax) {
  const char* op = "fp8_quantize_multi";
  check_length(scale, x.size(), op, "scale", "x");
  check_length(out, x.size(), op, "out", "x");
  check_length(out_t, x.size(), op, "out_t", "x");
  check_length(amax, x.size(), op, "amax", "x");
  for (size_t i = 0; i < x.size(); ++i) {
    check_input(x[i], op, entry_name("x", i));
    MEGATON_CHECK(x[i].dtype() == x[0].dtype(), "{}: x[{}] is {}, x[0] {} (one dtype for all)", op,
                  i, dtype_name(x[i].dtype()), dtype_name(x[0].dtype()));
    check_f32_scalar(scale[i], op, entry_name("scale", i));
    MEGATON_CHECK(out[i].defined() && is_fp8(out[i].dtype()),
                  "{}: out[{}] must be F8E4M3 or F8E5M2, got {}", op, i,
                  out[i].defined() ? dtype_name(out[i].dtype()) : "undefined");
    MEGATON_CHECK(out[i].dtype() == out[0].dtype(),
                  "{}: out[{}] is {}, out[0] {} (one FP8 dtype for all)", op, i,
                  dtype_name(out[i].dtype()), dtype_name(out[0].dtype()));
    const Shape mx = matrix_of(x[i], op, entry_name("x", i));
    MEGATON_CHECK(matrix_of(out[i], op, entry_name("out", i)) == mx,
                  "{}: out[{}] {} must be [{}, {}] like x[{}] {}", op, i, shape_str(out[i].shape()),
                  mx[0], mx[1], i, shape_str(x[i].shape()));
    if (out_t[i].defined())
      MEGATON_CHECK(out_t[i].dtype() == out[i].dtype() && out_t[i].shape() == Shape({mx[1], mx[0]}),
                    "{}: out_t[{}] must be {} [{}, {}], got {} {}", op, i,
                    dtype_name(out[i].dtype()), mx[1], mx[0], dtype_name(out_t[i].dtype()),
                    shape_str(out_t[i].shape()));
    if (amax[i].defined()) check_f32_scalar(amax[i], op, entry_name("amax", i));
  }
  if (x.empty()) return;
  check_device(x[0].device(), op,
               {{"x", &x}, {"scale", &scale}, {"out", &out}, {"out_t", &out_t}, {"amax", &amax}});
  MEGATON_CUDA_DISPATCH(x[0], cuda::fp8_quantize_multi(x, scale, out, out_t, amax));
  for (size_t i = 0; i < x.size(); ++i) {
    Tensor out_i = out[i], out_t_i = out_t[i], amax_i = amax[i];
    fp8_quantize(x[i], scale[i], out_i, out_t_i, amax_i);
  }
}

}  // namespace megaton::ops
