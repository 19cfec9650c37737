// AdamW optimizer state and step.
#include "optim/adamw.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <set>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "ops/adam_f16_main_param.h"
#include "ops/adam_precision.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"

namespace megaton::optim {

DType precision_aware_dtype(const std::string& key, const std::string& value,
                            const std::vector<std::string>& allowed) {
  if (std::find(allowed.begin(), allowed.end(), value) == allowed.end())
    fail("option '{}' must be one of {} (got '{}')", key, fmt::join(allowed, ", "), value);
  if (value == "bf16") return DType::BF16;
  if (value == "fp16") return DType::F16;
  if (value == "fp8") return DType::F8E4M3;
  return DType::F32;
}

namespace {
// The flag value naming a dtype (Megatron's spelling).
const char* flag_dtype_name(DType d) {
  switch (d) {
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "fp16";
    case DType::F8E4M3:
      return "fp8";
    default:
      return "fp32";
  }
}
}  // namespace

void check_precision_aware_config(const AdamWConfig& c) {
  const std::pair<const char*, DType> flags[] = {{"main-params-dtype", c.main_params_dtype},
                                                 {"main-grads-dtype", c.main_grads_dtype},
                                                 {"exp-avg-dtype", c.exp_avg_dtype},
                                                 {"exp-avg-sq-dtype", c.exp_avg_sq_dtype}};
  for (auto [key, dtype] : flags) {
    if (dtype == DType::F32) continue;
    // Megatron's OptimizerConfig: "<field> can only be fp32 when not using
    // precision-aware optimizer".
    if (!c.use_precision_aware_optimizer)
      fail("option '{}' {} needs --use-precision-aware-optimizer (only fp32 without it)", key,
           flag_dtype_name(dtype));
  }
}

void check_main_params_dtype(const AdamWConfig& c, DType compute_dtype) {
  if (c.main_params_dtype != DType::F16) return;
  // The host update (OptimizerOffload) keeps fp32 main params and has no absmax pass.
  if (c.optimizer_cpu_offload)
    fail(
        "option 'main-params-dtype' fp16 with --optimizer-cpu-offload is not supported in "
        "Megaton yet (the host update keeps fp32 main params); use --main-params-dtype fp32");
  // Transformer Engine's fp16 master is a copy beside the model's bf16/fp16 weights; an
  // fp32 weight is its own main param.
  if (compute_dtype != DType::BF16 && compute_dtype != DType::F16)
    fail(
        "option 'main-params-dtype' fp16 needs bf16 or fp16 weights (--bf16 or --fp16 on the "
        "GPU; this run's weights are {}, their own main params); use --main-params-dtype fp32",
        compute_dtype == DType::F32 ? "fp32" : dtype_name(compute_dtype));
}

bool scaled_moment_dtype(DType d) { return d == DType::F16 || d == DType::F8E4M3; }

ops::MomentRoundingKey moment_rounding_key(const Param& p, int tp_rank, int tp_size,
                                           int64_t offset) {
  ops::MomentRoundingKey key;
  key.param_key = ops::moment_rounding_param_key(p.name.data(), p.name.size());
  key.offset = offset;
  if (p.tp_split_dim < 0 || tp_size <= 1) return key;
  // The layout of tensor_parallel_ckpt.cpp's unshard: rows of full_shape[0], the rest
  // flattened into columns.
  MEGATON_CHECK(!p.full_shape.empty() && tp_rank >= 0 && tp_rank < tp_size,
                "param '{}': rounding key of slice {} of {} without a full shape", p.name, tp_rank,
                tp_size);
  int64_t full_numel = 1;
  for (int64_t d : p.full_shape) full_numel *= d;
  const int64_t rows = p.full_shape[0];
  const int64_t cols = full_numel / std::max<int64_t>(rows, 1);
  if (p.tp_split_dim == 0) {
    // The key maps runs of equal length at a fixed stride: stacked blocks (tp_blocks) of
    // one size (a SwiGLU fc1's halves). Blocks of different sizes (a Mamba in_proj's) have
    // no such form: their rounding is keyed by the local offset (not layout-invariant).
    const std::vector<TpRowRun> runs = tp_row_runs(p.tp_blocks, rows, tp_rank, tp_size);
    bool uniform = true;
    for (const TpRowRun& run : runs) uniform = uniform && run.count == runs[0].count;
    if (!uniform) return key;
    key.base = runs[0].full_first * cols;
    if (runs.size() > 1) {
      key.run = runs[0].count * cols;
      key.stride = (runs[1].full_first - runs[0].full_first) * cols;
    }
  } else {
    MEGATON_CHECK(p.tp_split_dim == 1, "param '{}': rounding key of a split along dim {}", p.name,
                  p.tp_split_dim);
    const int64_t width = cols / tp_size;
    key.run = width;
    key.stride = cols;
    key.base = tp_rank * width;
  }
  return key;
}

bool stores_param_remainder(const AdamWConfig& config, const Param& p) {
  if (p.main_param_remainder.defined()) return true;
  return config.store_param_remainders && config.main_params_dtype == DType::F32 &&
         p.weight.defined() && p.weight.dtype() == DType::BF16 && p.main_param.defined() &&
         p.main_param.dtype() == DType::F32 && !p.main_param.same_data(p.weight) &&
         p.main_param.device() == p.weight.device();  // not an offloaded (host) main param
}

bool stores_f16_main_param(const AdamWConfig& config, const Param& p) {
  if (p.main_param_f16.defined()) return true;
  return config.main_params_dtype == DType::F16 && p.weight.defined() &&
         (p.weight.dtype() == DType::BF16 || p.weight.dtype() == DType::F16) &&
         p.main_param.defined() && p.main_param.dtype() == DType::F32 &&
         !p.main_param.same_data(p.weight) && p.main_param.device() == p.weight.device();
}

Tensor main_param_value(const Param& p) {
  if (p.main_param.defined()) return p.main_param;
  if (p.main_param_f16.defined()) {
    Tensor out = Tensor::empty(p.main_param_f16.shape(), DType::F32, p.main_param_f16.device());
    ops::f16_main_param_dequantize(p.main_param_f16, p.main_param_scale, out);
    return out;
  }
  if (!p.main_param_remainder.defined()) return p.weight;
  Tensor out = Tensor::empty(p.weight.shape(), DType::F32, p.weight.device());
  ops::join_param_remainders(p.weight, p.main_param_remainder, out);
  return out;
}

AdamW::AdamW(std::vector<Param*> params, AdamWConfig config, Device state_device)
    : params_(std::move(params)), config_(config) {
  const auto moment_dtype_ok = [](DType d) {
    return d == DType::F32 || d == DType::BF16 || scaled_moment_dtype(d);
  };
  MEGATON_CHECK(moment_dtype_ok(config_.exp_avg_dtype) && moment_dtype_ok(config_.exp_avg_sq_dtype),
                "AdamW moments must be F32, BF16, F16 or F8_E4M3, got {} and {}",
                dtype_name(config_.exp_avg_dtype), dtype_name(config_.exp_avg_sq_dtype));
  scaled_moments_ =
      scaled_moment_dtype(config_.exp_avg_dtype) || scaled_moment_dtype(config_.exp_avg_sq_dtype);
  // The host update has no absmax pass or reduction over ranks for scaled moments.
  if (scaled_moments_ && config_.optimizer_cpu_offload)
    fail(
        "option 'optimizer-cpu-offload' with --exp-avg-dtype {} --exp-avg-sq-dtype {} is not "
        "supported in Megaton yet (fp16 and fp8 moments are updated on the device only); use "
        "bf16 or fp32 moments",
        flag_dtype_name(config_.exp_avg_dtype), flag_dtype_name(config_.exp_avg_sq_dtype));
  if (config_.main_params_dtype == DType::F16 && config_.optimizer_cpu_offload)
    check_main_params_dtype(config_, DType::BF16);  // (the offload's refusal)
  std::set<std::string> names;
  exp_avg_.reserve(params_.size());
  exp_avg_sq_.reserve(params_.size());
  for (Param* p : params_) MEGATON_CHECK(p != nullptr, "null Param in the optimizer's list");
  offloaded_.assign(params_.size(), 0);
  if (config_.optimizer_cpu_offload) {
    MEGATON_CHECK(
        config_.optimizer_offload_fraction >= 0 && config_.optimizer_offload_fraction <= 1,
        "optimizer offload fraction {}", config_.optimizer_offload_fraction);
    offloaded_ = choose_offloaded_params(params_, config_.optimizer_offload_fraction);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    // An offloaded param's main param goes to the host whole (OptimizerOffload below).
    if (!offloaded_[i] && stores_param_remainder(config_, *p) &&
        !p->main_param_remainder.defined()) {
      // Before this param's moments are allocated, so the fp32 main param is free first.
      p->main_param_remainder = Tensor::empty(p->weight.shape(), DType::I16, p->weight.device());
      ops::split_param_remainders(p->main_param, p->weight, p->main_param_remainder);
      p->main_param = Tensor();
    }
    if (!offloaded_[i] && stores_f16_main_param(config_, *p) && !p->main_param_f16.defined()) {
      p->main_param_f16 = Tensor::empty(p->weight.shape(), DType::F16, p->weight.device());
      p->main_param_scale = Tensor::zeros({1}, DType::F32, p->weight.device());
      ops::f16_main_param_quantize(
          p->main_param, ops::f16_main_param_scale(ops::f16_main_param_absmax(p->main_param)),
          p->main_param_f16, p->main_param_scale);
      p->main_param = Tensor();
    }
    if (p->main_param_f16.defined()) {
      f16_main_params_ = true;
      MEGATON_CHECK(
          p->weight.defined() &&
              (p->weight.dtype() == DType::BF16 || p->weight.dtype() == DType::F16) &&
              !p->main_param.defined() && !p->main_param_remainder.defined() &&
              p->main_param_f16.dtype() == DType::F16 &&
              p->main_param_f16.shape() == p->weight.shape() && p->main_param_scale.defined() &&
              p->main_param_scale.dtype() == DType::F32 && p->main_param_scale.numel() == 1,
          "param '{}': a main_param_f16 needs a BF16 or F16 weight of its shape, an "
          "F32 [1] main_param_scale and no other main param",
          p->name);
    } else if (p->main_param_remainder.defined()) {
      MEGATON_CHECK(p->weight.defined() && p->weight.dtype() == DType::BF16 &&
                        !p->main_param.defined() && p->main_param_remainder.dtype() == DType::I16 &&
                        p->main_param_remainder.shape() == p->weight.shape(),
                    "param '{}': a main_param_remainder needs a BF16 weight of its shape and "
                    "no main_param",
                    p->name);
    } else {
      const Tensor& master = p->main_param.defined() ? p->main_param : p->weight;
      MEGATON_CHECK(
          master.defined() && master.dtype() == DType::F32 && master.shape() == p->weight.shape(),
          "param '{}' needs an fp32 main_param (or fp32 weight)", p->name);
    }
    // A BF16 main grad (--main-grads-dtype bf16) is widened to fp32 as the update reads it.
    MEGATON_CHECK(p->main_grad.defined() &&
                      (p->main_grad.dtype() == DType::F32 || p->main_grad.dtype() == DType::BF16) &&
                      p->main_grad.shape() == p->weight.shape(),
                  "param '{}': main_grad {} {} does not match weight {}", p->name,
                  dtype_name(p->main_grad.dtype()), shape_str(p->main_grad.shape()),
                  shape_str(p->weight.shape()));
    MEGATON_CHECK(names.insert(p->name).second, "two params named '{}'", p->name);
    // (An offloaded param's moments are made on the host by OptimizerOffload.)
    exp_avg_.push_back(offloaded_[i] ? Tensor()
                                     : Tensor::zeros(p->weight.shape(), config_.exp_avg_dtype,
                                                     p->weight.device()));
    exp_avg_sq_.push_back(offloaded_[i] ? Tensor()
                                        : Tensor::zeros(p->weight.shape(), config_.exp_avg_sq_dtype,
                                                        p->weight.device()));
    rounding_keys_.push_back(moment_rounding_key(*p, 0, 1, 0));
  }
  if (config_.optimizer_cpu_offload)
    offload_ =
        std::make_unique<OptimizerOffload>(params_, offloaded_, config_, exp_avg_, exp_avg_sq_);
  const Device device = params_.empty() ? state_device : params_[0]->weight.device();
  state_ = Tensor::zeros({2}, DType::I64, device);
  if (scaled_states()) {
    // Scale 0 with zero moments: the first absmax pass sets them (TE starts its scales at 1
    // over zero states: the same values).
    const int64_t n = int64_t(params_.size());
    if (scaled_moments_)
      moment_scale_ = Tensor::zeros({std::max<int64_t>(n, 1), 2}, DType::F32, device);
    own_absmax_ = Tensor::zeros({std::max<int64_t>(n, 1), 3}, DType::F32, device);
    MomentAbsmaxSlots slots;
    for (int64_t i = 0; i < n; ++i) {
      if (scaled_moments_) scale_rows_.push_back(moment_scale_.rows(i, 1).view({2}));
      slots.rows.push_back(own_absmax_.rows(i, 1).view({3}));
    }
    slots.storage = {own_absmax_};
    absmax_ = std::move(slots);
  }
}

void AdamW::set_moment_absmax_slots(MomentAbsmaxSlots slots) {
  MEGATON_CHECK(slots.rows.size() == params_.size(), "{} absmax slots for {} params",
                slots.rows.size(), params_.size());
  for (const Tensor& row : slots.rows)
    MEGATON_CHECK(row.defined() && row.dtype() == DType::F32 && row.numel() == 3,
                  "an absmax slot must be F32 [3]");
  absmax_ = std::move(slots);
}

void AdamW::absmax_pass(SplitLists& s, float lr, int64_t step, float grad_scale,
                        const Tensor& control) {
  if (!scaled_states()) return;
  // Rows of params this rank does not update stay 0 (the identity of the max).
  for (Tensor& t : absmax_.storage) t.zero();
  if (scaled_moments_)
    for (Lists* l : {&s.fp32, &s.remainder, &s.f16})
      if (!l->grads.empty())
        ops::multi_tensor_adamw_moment_absmax(l->grads, l->exp_avg, l->exp_avg_sq, l->scales,
                                              config_.adam_beta1, config_.adam_beta2, grad_scale,
                                              control);
  const Lists& f = s.f16;
  if (!f.masters.empty())
    ops::multi_tensor_adamw_f16_main_param_absmax(
        f.masters, f.grads, f.exp_avg, f.exp_avg_sq, f.scales, f.main_scales, f.weight_decays, lr,
        config_.adam_beta1, config_.adam_beta2, config_.adam_eps, step, grad_scale, control);
  if (absmax_.reduce) absmax_.reduce();
}

Tensor AdamW::moment_scales(size_t i) const {
  MEGATON_CHECK(scaled_moments_ && i < scale_rows_.size(), "moment scales of param {} of {}", i,
                scale_rows_.size());
  return scale_rows_[i];
}

AdamW::SplitLists AdamW::lists() const {
  // Rebuilt on every step (handles only, no copies of data): the trainer may have
  // reassigned a Param's tensors since the last step.
  SplitLists out;
  const std::vector<float> decays = weight_decays();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (offloaded_[i]) continue;  // updated on the host (OptimizerOffload)
    const Param* p = params_[i];
    const bool remainder = p->main_param_remainder.defined();
    const bool f16 = p->main_param_f16.defined();
    Lists& l = remainder ? out.remainder : f16 ? out.f16 : out.fp32;
    if (remainder) {
      l.masters.push_back(p->weight);
      l.copies.push_back(p->main_param_remainder);
    } else if (f16) {
      l.masters.push_back(p->main_param_f16);
      l.copies.push_back(p->weight);
      l.main_scales.scale.push_back(p->main_param_scale.view({1}));
      l.main_scales.absmax.push_back(absmax_.rows[i].rows(2, 1));
    } else {
      const Tensor& master = p->main_param.defined() ? p->main_param : p->weight;
      l.masters.push_back(master);
      // The compute copy (bf16 in a bf16 run) follows the updated fp32 master.
      l.copies.push_back(master.raw() != p->weight.raw() ? p->weight : Tensor());
    }
    l.grads.push_back(p->main_grad);
    l.exp_avg.push_back(exp_avg_[i]);
    l.exp_avg_sq.push_back(exp_avg_sq_[i]);
    l.weight_decays.push_back(decays[i]);
    l.keys.push_back(rounding_keys_[i]);
    if (scaled_moments_) {
      l.scales.scale.push_back(scale_rows_[i]);
      l.scales.absmax.push_back(absmax_.rows[i].rows(0, 2));
    }
  }
  return out;
}

AdamW::~AdamW() = default;

std::vector<float> AdamW::weight_decays() const {
  std::vector<float> out;
  for (const Param* p : params_) out.push_back(p->no_weight_decay ? 0.0f : config_.weight_decay);
  return out;
}

void AdamW::step(const Tensor& control) {
  // The offloaded params' grads and the control values go to the host first; their update
  // runs there while the device runs its own (queued below).
  if (offload_) offload_->start(control);
  SplitLists s = lists();
  absmax_pass(s, 0.0f, 1, 1.0f, control);
  Lists& f = s.fp32;
  if (!f.masters.empty())
    ops::multi_tensor_adamw(f.masters, f.grads, f.exp_avg, f.exp_avg_sq, f.copies, f.weight_decays,
                            config_.adam_beta1, config_.adam_beta2, config_.adam_eps, control,
                            f.keys, f.scales);
  Lists& r = s.remainder;
  if (!r.masters.empty())
    ops::multi_tensor_adamw_param_remainder(r.masters, r.copies, r.grads, r.exp_avg, r.exp_avg_sq,
                                            r.weight_decays, config_.adam_beta1, config_.adam_beta2,
                                            config_.adam_eps, control, r.keys, r.scales);
  Lists& h = s.f16;
  if (!h.masters.empty())
    ops::multi_tensor_adamw_f16_main_param(h.masters, h.copies, h.grads, h.exp_avg, h.exp_avg_sq,
                                           h.weight_decays, 0.0f, config_.adam_beta1,
                                           config_.adam_beta2, config_.adam_eps, 1, 1.0f, control,
                                           h.keys, h.scales, h.main_scales);
  if (offload_)
    offload_->finish(weight_decays(), rounding_keys_, exp_avg_, exp_avg_sq_, config_.adam_beta1,
                     config_.adam_beta2, config_.adam_eps, 0.0f, 0, 1.0f);
}

int64_t AdamW::step_count() const { return state_.to(Device::CPU).i64()[0]; }

void AdamW::step(float lr, float grad_scale) {
  const int64_t step = step_count() + 1;
  set_step_count(step);
  if (offload_) offload_->start(Tensor());
  SplitLists s = lists();
  absmax_pass(s, lr, step, grad_scale, Tensor());
  Lists& f = s.fp32;
  if (!f.masters.empty())
    ops::multi_tensor_adamw(f.masters, f.grads, f.exp_avg, f.exp_avg_sq, f.copies, f.weight_decays,
                            lr, config_.adam_beta1, config_.adam_beta2, config_.adam_eps, step,
                            grad_scale, f.keys, f.scales);
  Lists& r = s.remainder;
  if (!r.masters.empty())
    ops::multi_tensor_adamw_param_remainder(r.masters, r.copies, r.grads, r.exp_avg, r.exp_avg_sq,
                                            r.weight_decays, lr, config_.adam_beta1,
                                            config_.adam_beta2, config_.adam_eps, step, grad_scale,
                                            r.keys, r.scales);
  Lists& h = s.f16;
  if (!h.masters.empty())
    ops::multi_tensor_adamw_f16_main_param(h.masters, h.copies, h.grads, h.exp_avg, h.exp_avg_sq,
                                           h.weight_decays, lr, config_.adam_beta1,
                                           config_.adam_beta2, config_.adam_eps, step, grad_scale,
                                           Tensor(), h.keys, h.scales, h.main_scales);
  if (offload_)
    offload_->finish(weight_decays(), rounding_keys_, exp_avg_, exp_avg_sq_, config_.adam_beta1,
                     config_.adam_beta2, config_.adam_eps, lr, step, grad_scale);
}

void AdamW::set_step_count(int64_t count) {
  MEGATON_CHECK(count >= 0, "optimizer step count {}", count);
  Tensor host = state_.to(Device::CPU);
  host.i64()[0] = count;
  state_.copy_from(host);
}

void AdamW::set_rounding_keys(std::vector<ops::MomentRoundingKey> keys) {
  MEGATON_CHECK(keys.size() == params_.size(), "{} rounding keys for {} params", keys.size(),
                params_.size());
  rounding_keys_ = std::move(keys);
}

std::vector<std::pair<std::string, Tensor*>> AdamW::state_tensors() {
  std::vector<std::pair<std::string, Tensor*>> out;
  out.reserve(2 * params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i]->name + ".exp_avg", &exp_avg_[i]);
    out.emplace_back(params_[i]->name + ".exp_avg_sq", &exp_avg_sq_[i]);
  }
  return out;
}

}  // namespace megaton::optim
