// Linear, Norm and MLP forward/backward on top of the op catalogue.
#include "model/layers.h"

#include <cmath>
#include <cstring>
#include <functional>

#include "core/rng.h"
#include "model/main_grad.h"
#include "model/tensor_parallel.h"
#include "ops/fp8.h"
#include "ops/ops.h"

namespace megaton {

static uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

static Param place(const std::string& name, Tensor host_fp32, bool no_weight_decay,
                   Placement where) {
  Param p;
  p.name = name;
  p.no_weight_decay = no_weight_decay;
  p.full_shape = host_fp32.shape();
  p.main_param = host_fp32.to(where.device);
  if (where.dtype == DType::F32) {
    p.weight = p.main_param;
  } else {
    p.weight = Tensor::empty(host_fp32.shape(), where.dtype, where.device);
    ops::cast(p.main_param, p.weight);
  }
  return p;
}

// A parameter of `shape` on this rank without values (--init-model-with-meta-device).
static Param place_meta(const std::string& name, const Shape& shape, bool no_weight_decay,
                        Placement where, const ParamInit& init) {
  Param p;
  p.name = name;
  p.no_weight_decay = no_weight_decay;
  p.full_shape = shape;
  p.main_param = Tensor::unallocated(shape, DType::F32, where.device);
  p.weight = where.dtype == DType::F32 ? p.main_param
                                       : Tensor::unallocated(shape, where.dtype, where.device);
  p.init = init;
  return p;
}

static ParamInit normal_init(const std::string& name, float std, uint64_t seed, int rank,
                             int size) {
  ParamInit init;
  init.kind = ParamInit::Kind::Normal;
  init.seed = seed;
  init.stream = fnv1a(name);
  init.std = std;
  init.tp_rank = rank;
  init.tp_size = size;
  return init;
}

Param make_param(const std::string& name, const Shape& shape, float std, uint64_t seed,
                 Placement where) {
  const ParamInit init = normal_init(name, std, seed, 0, 1);
  if (where.meta_device) return place_meta(name, shape, false, where, init);
  // On the host, whatever the placement, so every device starts from the same values;
  // fill_normal is Philox(seed).normal(stream, i) per element over a thread team (the
  // serial loop took most of a large model's start-up).
  Tensor w = Tensor::empty(shape);
  ops::fill_normal(w, seed, init.stream);
  ops::scale_(w, std);
  Param p = place(name, w, false, where);
  p.init = init;
  return p;
}

Tensor shard_of(const Tensor& full, int split_dim, int rank, int size, bool swiglu_halves) {
  MEGATON_CHECK(split_dim == 0 || split_dim == 1, "shard_of: split dim {}", split_dim);
  MEGATON_CHECK(!swiglu_halves || split_dim == 0, "shard_of: SwiGLU halves split along dim 0");
  const Tensor host = full.device() == Device::CPU ? full : full.to(Device::CPU);
  const int64_t rows = host.dim(0), cols = host.numel() / std::max<int64_t>(rows, 1);
  const int64_t n = split_dim == 0 ? rows : cols;
  const int64_t parts = swiglu_halves ? 2 * size : size;
  MEGATON_CHECK(n % parts == 0, "shard_of: dim {} of {} not divisible into {} parts", split_dim,
                shape_str(host.shape()), parts);
  Shape shape = host.shape();
  shape[split_dim] = n / size;
  Tensor out = Tensor::empty(shape, host.dtype());
  const size_t elem = dtype_size(host.dtype());
  const auto* src = static_cast<const char*>(host.raw());
  auto* dst = static_cast<char*>(out.raw());
  if (split_dim == 0) {
    const int64_t chunk = n / parts;  // rows per copied block
    const int64_t row_bytes = cols * int64_t(elem);
    int64_t at = 0;
    for (int64_t half = 0; half < (swiglu_halves ? 2 : 1); ++half) {
      const int64_t first = half * (n / 2) * (swiglu_halves ? 1 : 0) + rank * chunk;
      std::memcpy(dst + at, src + first * row_bytes, size_t(chunk * row_bytes));
      at += chunk * row_bytes;
    }
  } else {
    const int64_t width = cols / size;
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + r * width * int64_t(elem), src + (r * cols + rank * width) * int64_t(elem),
                  size_t(width * int64_t(elem)));
  }
  return out;
}

Param make_param_sharded(const std::string& name, const Shape& full_shape, float std, uint64_t seed,
                         Placement where, int split_dim, int rank, int size, bool swiglu_halves) {
  if (size == 1) return make_param(name, full_shape, std, seed, where);
  Param p;
  if (where.meta_device) {
    Shape shape = full_shape;
    MEGATON_CHECK(split_dim == 0 || split_dim == 1, "make_param_sharded: split dim {}", split_dim);
    shape[size_t(split_dim)] /= size;
    p = place_meta(name, shape, false, where, normal_init(name, std, seed, rank, size));
  } else {
    Param full = make_param(name, full_shape, std, seed, Placement{Device::CPU, DType::F32});
    p = place(name, shard_of(full.main_param, split_dim, rank, size, swiglu_halves), false, where);
    p.init = normal_init(name, std, seed, rank, size);
  }
  p.tp_split_dim = split_dim;
  p.swiglu_halves = swiglu_halves;
  p.full_shape = full_shape;
  return p;
}

Param make_constant_param(const std::string& name, const Shape& shape, float value,
                          bool no_weight_decay, Placement where) {
  ParamInit init;
  init.kind = ParamInit::Kind::Constant;
  init.value = value;
  if (where.meta_device) return place_meta(name, shape, no_weight_decay, where, init);
  Tensor w = Tensor::empty(shape);
  w.fill(value);
  Param p = place(name, w, no_weight_decay, where);
  p.init = init;
  return p;
}

Tensor initial_values(const Param& p, int64_t offset, int64_t numel) {
  const ParamInit& init = p.init;
  const int64_t local = p.weight.numel();
  MEGATON_CHECK(init.kind != ParamInit::Kind::None, "initial_values: '{}' has no recipe", p.name);
  MEGATON_CHECK(offset >= 0 && numel >= 0 && offset + numel <= local,
                "initial_values: elements [{}, {}) of '{}' ({} elements)", offset, offset + numel,
                p.name, local);
  Tensor out = Tensor::empty({numel});
  float* y = out.f32();
  if (init.kind == ParamInit::Kind::Constant) {
    out.fill(init.value);
    return out;
  }
  // Local element j -> element of the full tensor, as shard_of cuts it.
  const Shape& full = p.full_shape;
  const int64_t full_rows = full.empty() ? 1 : full[0];
  int64_t full_numel = 1;
  for (int64_t d : full) full_numel *= d;
  const int64_t full_cols = full_rows > 0 ? full_numel / full_rows : 0;
  const int dim = init.tp_size > 1 ? p.tp_split_dim : -1;
  const int64_t local_rows = dim == 0 ? full_rows / init.tp_size : full_rows;
  const int64_t local_cols = dim == 1 ? full_cols / init.tp_size : full_cols;
  const int64_t half = local_rows / 2;  // rows of each SwiGLU half on this rank
  auto full_index = [&](int64_t j) -> int64_t {
    const int64_t r = j / std::max<int64_t>(local_cols, 1),
                  c = j % std::max<int64_t>(local_cols, 1);
    if (dim == 1) return r * full_cols + int64_t(init.tp_rank) * local_cols + c;
    if (dim != 0) return j;
    if (!p.swiglu_halves) return (int64_t(init.tp_rank) * local_rows + r) * full_cols + c;
    const int64_t second = r >= half ? 1 : 0;
    const int64_t row =
        second * (full_rows / 2) + int64_t(init.tp_rank) * half + (r - second * half);
    return row * full_cols + c;
  };
  const Philox rng(init.seed);
#pragma omp parallel for schedule(static) if (numel >= 65536)
  for (int64_t k = 0; k < numel; ++k)
    y[k] = rng.normal(init.stream, uint64_t(full_index(offset + k))) * init.std;
  return out;
}

void write_initial_values(const Param& p, int64_t offset, Tensor dst) {
  const Tensor values = initial_values(p, offset, dst.numel()).to(dst.device());
  if (dst.dtype() == DType::F32)
    dst.copy_from(values);
  else
    ops::cast(values, dst);
}

Tensor main_param_values(const Param& p, int64_t offset, int64_t numel) {
  MEGATON_CHECK(p.main_param.defined(), "main_param_values: '{}' has no main param", p.name);
  if (!p.main_param.storage_released())
    return p.main_param.view({p.main_param.numel()}).rows(offset, numel);
  return initial_values(p, offset, numel).to(p.weight.device());
}

void refresh_compute_weight(Param& p) {
  // An FP8 weight (--fp8-param-gather) is requantized by the distributed optimizer.
  MEGATON_CHECK(!p.fp8_param, "refresh_compute_weight on the FP8 weight '{}'", p.name);
  if (p.weight.raw() == p.main_param.raw()) return;
  // An offloaded main param (--optimizer-cpu-offload) is on the host: cast there, then copy.
  if (p.main_param.device() != p.weight.device())
    p.weight.copy_from(p.main_param.dtype() == p.weight.dtype()
                           ? p.main_param
                           : p.main_param.to(p.weight.dtype()));
  else
    ops::cast(p.main_param, p.weight);
}

Linear::Linear(const std::string& name, int64_t in_features, int64_t out_features, bool bias_on,
               float init_std, uint64_t seed, Placement where, TensorParallelMode mode,
               const ModelParallel& mp, bool swiglu_halves)
    : mode_(mp.tp_size() > 1 ? mode : TensorParallelMode::None), mp_(mp) {
  const int tp = mp.tp_size(), rank = mp.tp_rank();
  const Shape full = {out_features, in_features};
  switch (mode_) {
    case TensorParallelMode::None:
      weight = make_param(name + ".weight", full, init_std, seed, where);
      if (bias_on) bias = make_constant_param(name + ".bias", {out_features}, 0.0f, true, where);
      break;
    case TensorParallelMode::Column:
      weight = make_param_sharded(name + ".weight", full, init_std, seed, where, 0, rank, tp,
                                  swiglu_halves);
      if (bias_on) {  // zeros: the slice is zeros too
        bias = make_constant_param(name + ".bias", {out_features / tp}, 0.0f, true, where);
        bias.tp_split_dim = 0;
        bias.swiglu_halves = swiglu_halves;
        bias.full_shape = {out_features};
      }
      break;
    case TensorParallelMode::Row:
      weight = make_param_sharded(name + ".weight", full, init_std, seed, where, 1, rank, tp);
      if (bias_on) {
        bias = make_constant_param(name + ".bias", {out_features}, 0.0f, true, where);
        bias.sequence_parallel = mp.sequence_parallel;
      }
      break;
  }
}

Tensor Linear::forward(const Tensor& x, bool save_input) {
  // Column-parallel under SP: every rank's token rows (re-gathered in backward).
  const Tensor x_full =
      mode_ == TensorParallelMode::Column && mp_.sequence_parallel ? gather_sequence(x, mp_) : x;
  Tensor y = empty_like(x, {x_full.dim(0), weight.weight.dim(0)});
  saved_ = {};
  // The bias in the GEMM's epilogue, except under FP8, after the row-parallel sum, or when
  // the caller adds it (skip_bias_add).
  const bool add_bias = bias.weight.defined() && !skip_bias_add_;
  const bool bias_in_gemm = add_bias && !fp8_.enabled() && mode_ != TensorParallelMode::Row;
  if (fp8_.enabled()) {
    saved_.fp8 = fp8_.forward(x_full, weight, save_input, fp8_sharding(), y);
    // A bf16 weight gradient (--no-fp8-wgrad) reads the input itself.
    if (save_input && !saved_.fp8.x.data_t.defined()) saved_.x = x;
  } else {
    if (save_input) saved_.x = x;
    if (bias_in_gemm)
      ops::gemm_bias(x_full, false, weight.weight, true, bias.weight, y);
    else
      ops::gemm(x_full, false, weight.weight, true, y);
  }
  if (mode_ == TensorParallelMode::Row) {
    if (mp_.sequence_parallel)
      y = reduce_scatter_sequence(y, mp_);
    else
      all_reduce_tensor_parallel(y, mp_);
  }
  if (add_bias && !bias_in_gemm) ops::bias_add_(y, bias.weight);
  return y;
}

Tensor Linear::backward(const Tensor& dy) { return backward_saved(dy, take_saved()); }

Tensor Linear::backward(const Tensor& dy, const Tensor& x) {
  Saved saved = take_saved();
  // The given input serves wherever forward kept no FP8 column-wise copy of it: the bf16
  // weight gradient, or the FP8 one after requantizing (backward_saved).
  if (!saved.fp8.x.data_t.defined()) saved.x = x;
  return backward_saved(dy, saved);
}

Tensor Linear::backward(const Tensor& dy,
                        const std::function<Tensor(const Tensor& dx)>& make_input) {
  MEGATON_CHECK(mode_ != TensorParallelMode::Column || mp_.tp_size() == 1,
                "Linear '{}': an input made from dx needs the complete dx (column-parallel "
                "under tensor parallelism has a partial one)",
                weight.name);
  return backward_saved(dy, take_saved(), make_input);
}

Tensor Linear::backward_saved(const Tensor& dy, const Saved& saved,
                              const std::function<Tensor(const Tensor& dx)>& make_input) {
  MEGATON_CHECK(saved.x.defined() || saved.fp8.x.data_t.defined() || make_input,
                "Linear '{}': backward without a saved input", weight.name);
  const bool sp = mp_.sequence_parallel;
  // The bias gradient from this rank's rows of dy (a partial sum under SP for Row).
  if (bias.weight.defined())
    accumulate_main_grad(bias.main_grad, [&](Tensor& g) { ops::bias_backward(dy, g); });
  const Tensor dy_full = mode_ == TensorParallelMode::Row && sp ? gather_sequence(dy, mp_) : dy;
  Tensor dx = empty_like(dy, {dy_full.dim(0), weight.weight.dim(1)});
  // The weight gradient's input, asked for after dx is written: every rank's rows of x
  // under SP for Column.
  const auto x_full = [&] {
    const Tensor x = saved.x.defined() ? saved.x : make_input(dx);
    return mode_ == TensorParallelMode::Column && sp ? gather_sequence(x, mp_) : x;
  };
  if (fp8_.enabled()) {
    fp8_.backward(dy_full, weight, saved.fp8, x_full, fp8_sharding(), dx, weight.main_grad);
  } else {
    ops::gemm(dy_full, false, weight.weight, false, dx);
    gemm_main_grad(dy_full, true, x_full(), false, weight.main_grad);
  }
  if (mode_ == TensorParallelMode::Column) {
    if (sp)
      dx = reduce_scatter_sequence(dx, mp_);
    else
      all_reduce_tensor_parallel(dx, mp_);
  }
  return dx;
}

void Linear::enable_fp8(const Fp8Config& config) {
  MEGATON_CHECK(config.enabled, "Linear '{}': enable_fp8 without an FP8 format", weight.name);
  fp8_ = Fp8LinearGemms(config, weight.weight.device());
  fp8_.adopt_weight(weight);
}

std::vector<std::pair<std::string, Tensor*>> Linear::fp8_state() {
  std::string prefix = weight.name;
  if (prefix.ends_with(".weight")) prefix.resize(prefix.size() - 7);
  return fp8_.state(prefix);
}

// The weight shards, the row-parallel input (input features split) and the
// column-parallel output gradient (output features split) differ between tensor-parallel
// ranks; the others are the same on every rank.
Fp8LinearGemms::Sharding Linear::fp8_sharding() const {
  Fp8LinearGemms::Sharding s;
  if (mp_.tp_size() <= 1) return s;
  s.group = {mp_.comm, &mp_.tp()};
  s.weight = mode_ != TensorParallelMode::None;
  s.input = mode_ == TensorParallelMode::Row;
  s.grad_output = mode_ == TensorParallelMode::Column;
  return s;
}

Tensor Linear::forward_inference(const Tensor& x) const {
  MEGATON_CHECK(mode_ == TensorParallelMode::None,
                "Linear '{}': forward_inference runs on one tensor-parallel rank", weight.name);
  Tensor y = empty_like(x, {x.dim(0), weight.weight.dim(0)});
  // Rounded as forward rounds: the bias in the epilogue, or (a bias the training forward
  // leaves to the caller's bias_dropout_add) added after the GEMM.
  if (bias.weight.defined() && !skip_bias_add_) {
    ops::gemm_bias(x, false, weight.weight, true, bias.weight, y);
  } else {
    ops::gemm(x, false, weight.weight, true, y);
    if (bias.weight.defined()) ops::bias_add_(y, bias.weight);
  }
  return y;
}

void Linear::collect_params(std::vector<Param*>& out) {
  out.push_back(&weight);
  if (bias.weight.defined()) out.push_back(&bias);
}

Norm::Norm(const std::string& name, int64_t hidden, Normalization kind, float eps, Placement where,
           bool sequence_parallel)
    : weight(make_constant_param(name + ".weight", {hidden}, 1.0f, true, where)),
      kind_(kind),
      eps_(eps) {
  if (kind == Normalization::LayerNorm)
    bias = make_constant_param(name + ".bias", {hidden}, 0.0f, true, where);
  weight.sequence_parallel = bias.sequence_parallel = sequence_parallel;
}

Tensor Norm::forward(const Tensor& x) {
  Saved& s = saved_;
  s.x = x;
  Tensor y = empty_like(x, x.shape());
  s.rstd = Tensor::empty({x.dim(0)}, DType::F32, x.device());
  if (kind_ == Normalization::RMSNorm) {
    s.mean = Tensor();
    ops::rmsnorm_forward(x, weight.weight, eps_, y, s.rstd);
  } else {
    s.mean = Tensor::empty({x.dim(0)}, DType::F32, x.device());
    ops::layernorm_forward(x, weight.weight, bias.weight, eps_, y, s.mean, s.rstd);
  }
  return y;
}

Tensor Norm::forward_inference(const Tensor& x) const {
  Tensor y = empty_like(x, x.shape());
  // The statistics are written but not kept.
  Tensor rstd = Tensor::empty({x.dim(0)}, DType::F32, x.device());
  if (kind_ == Normalization::RMSNorm) {
    ops::rmsnorm_forward(x, weight.weight, eps_, y, rstd);
  } else {
    Tensor mean = Tensor::empty({x.dim(0)}, DType::F32, x.device());
    ops::layernorm_forward(x, weight.weight, bias.weight, eps_, y, mean, rstd);
  }
  return y;
}

Tensor Norm::recompute_output() const {
  MEGATON_CHECK(saved_.x.defined(), "Norm '{}': recompute_output without a saved input",
                weight.name);
  // forward_add's y is the plain norm of the sum it kept (ops.h), so one path serves both.
  return forward_inference(saved_.x);
}

Tensor Norm::forward_add(Tensor& x, const Tensor& residual) {
  Saved& s = saved_;
  Tensor y = empty_like(x, x.shape());
  s.rstd = Tensor::empty({x.dim(0)}, DType::F32, x.device());
  if (kind_ == Normalization::RMSNorm) {
    s.mean = Tensor();
    ops::add_rmsnorm_forward(x, residual, weight.weight, eps_, x, y, s.rstd);
  } else {
    s.mean = Tensor::empty({x.dim(0)}, DType::F32, x.device());
    ops::add_layernorm_forward(x, residual, weight.weight, bias.weight, eps_, x, y, s.mean, s.rstd);
  }
  s.x = x;
  return y;
}

Tensor Norm::backward(const Tensor& dy, const Tensor& dresidual) {
  MEGATON_CHECK(saved_.x.defined(), "Norm '{}': backward without a saved input", weight.name);
  const Saved s = take_saved();
  Tensor dx = empty_like(dy, dy.shape());
  accumulate_main_grads({&weight.main_grad, &bias.main_grad}, [&](std::vector<Tensor>& g) {
    if (kind_ == Normalization::RMSNorm)
      ops::rmsnorm_backward(dy, s.x, weight.weight, s.rstd, dx, g[0], dresidual);
    else
      ops::layernorm_backward(dy, s.x, weight.weight, s.mean, s.rstd, dx, g[0], g[1], dresidual);
  });
  return dx;
}

void Norm::collect_params(std::vector<Param*>& out) {
  out.push_back(&weight);
  if (bias.weight.defined()) out.push_back(&bias);
}

MLP::MLP(const std::string& prefix, int64_t hidden, int64_t ffn, bool swiglu, bool bias,
         float init_std, float output_std, uint64_t seed, Placement where, const ModelParallel& mp)
    : linear_fc1(prefix + ".linear_fc1", hidden, swiglu ? 2 * ffn : ffn, bias, init_std, seed,
                 where, TensorParallelMode::Column, mp, swiglu),
      linear_fc2(prefix + ".linear_fc2", ffn, hidden, bias, output_std, seed, where,
                 TensorParallelMode::Row, mp),
      swiglu_(swiglu) {}

Tensor mlp_activation(const Tensor& fc1_out, bool swiglu) {
  const int64_t ffn = swiglu ? fc1_out.dim(-1) / 2 : fc1_out.dim(-1);
  Tensor act = empty_like(fc1_out, {fc1_out.dim(0), ffn});
  if (swiglu)
    ops::swiglu_forward(fc1_out, act);
  else
    ops::gelu_forward(fc1_out, act);
  return act;
}

Tensor mlp_activation_backward(const Tensor& dact, const Tensor& fc1_out, bool swiglu,
                               Tensor* act) {
  Tensor dfc1 = empty_like(dact, fc1_out.shape());
  if (swiglu)
    ops::swiglu_backward(dact, fc1_out, dfc1, act);
  else
    ops::gelu_backward(dact, fc1_out, dfc1, act);
  return dfc1;
}

Tensor mlp_activation_weighted(const Tensor& fc1_out, const Tensor& probs, bool swiglu) {
  const int64_t ffn = swiglu ? fc1_out.dim(-1) / 2 : fc1_out.dim(-1);
  Tensor act = empty_like(fc1_out, {fc1_out.dim(0), ffn});
  if (swiglu)
    ops::weighted_swiglu_forward(fc1_out, probs, act);
  else
    ops::weighted_gelu_forward(fc1_out, probs, act);
  return act;
}

Tensor mlp_activation_weighted_backward(const Tensor& dact, const Tensor& fc1_out,
                                        const Tensor& probs, bool swiglu, Tensor& dprobs,
                                        Tensor* act) {
  Tensor dfc1 = empty_like(dact, fc1_out.shape());
  dprobs = Tensor::empty({fc1_out.dim(0)}, DType::F32, dact.device());
  if (swiglu)
    ops::weighted_swiglu_backward(dact, fc1_out, probs, dfc1, dprobs, act);
  else
    ops::weighted_gelu_backward(dact, fc1_out, probs, dfc1, dprobs, act);
  return dfc1;
}

// The activation output (the input of linear_fc2, [T, ffn]) is not kept: backward
// recomputes it from fc1's output, saving ffn x T activations per layer. (Megatron keeps it
// in a dense MLP and offers its recompute for the experts only, recompute module moe_act.)
// The recompute costs no pass of its own: the activation's backward, which reads fc1's
// output anyway, writes it (fc2's weight gradient is computed after its input gradient for
// this). docs/memory.md, "Activation recomputation".
Tensor MLP::forward(const Tensor& x) {
  Saved& s = saved_;
  s = {};
  s.held = true;
  // fc1 keeps its input itself unless the input is not kept at all or must remake fc1's
  // output (then the MLP keeps x: under FP8, fc1 would keep x^T only).
  if (keep_input_ && !keep_fc1_out_) s.x = x;
  const Tensor fc1_out = linear_fc1.forward(x, keep_input_ && keep_fc1_out_);
  if (keep_fc1_out_) s.fc1_out = fc1_out;
  return linear_fc2.forward(mlp_activation(fc1_out, swiglu_), /*save_input=*/false);
}

Tensor MLP::backward(const Tensor& dy, const std::function<Tensor()>& input) {
  MEGATON_CHECK(saved_.held, "MLP '{}': backward without a forward", linear_fc1.weight.name);
  Saved s = std::exchange(saved_, {});
  // The forward's input, where fc1 did not keep it: kept here, or made again by `input`.
  Tensor x = s.x;
  auto forward_input = [&]() -> const Tensor& {
    if (!x.defined()) {
      MEGATON_CHECK(bool(input), "MLP '{}': backward needs the forward's input, not kept",
                    linear_fc1.weight.name);
      x = input();
    }
    return x;
  };
  // fc1's output, remade from the input (the mlp recompute): the same GEMM, the same bits.
  const Tensor fc1_out =
      s.fc1_out.defined() ? s.fc1_out : linear_fc1.forward(forward_input(), false);
  Tensor dfc1;  // the activation's backward, inside fc2's backward or after it
  const Tensor dact = linear_fc2.backward(dy, [&](const Tensor& dact) {
    Tensor act = empty_like(dact, dact.shape());
    dfc1 = mlp_activation_backward(dact, fc1_out, swiglu_, &act);
    return act;
  });
  if (!dfc1.defined()) dfc1 = mlp_activation_backward(dact, fc1_out, swiglu_);  // not asked
  if (keep_input_ && keep_fc1_out_) return linear_fc1.backward(dfc1);
  return linear_fc1.backward(dfc1, forward_input());
}

Tensor MLP::forward_inference(const Tensor& x) const {
  const Tensor fc1_out = linear_fc1.forward_inference(x);
  return linear_fc2.forward_inference(mlp_activation(fc1_out, swiglu_));
}

MLP::Activations MLP::take_saved() {
  return {std::exchange(saved_, {}), linear_fc1.take_saved(), linear_fc2.take_saved()};
}

void MLP::restore_saved(Activations&& saved) {
  saved_ = std::move(saved.mlp);
  linear_fc1.restore_saved(std::move(saved.linear_fc1));
  linear_fc2.restore_saved(std::move(saved.linear_fc2));
}

void MLP::collect_params(std::vector<Param*>& out) {
  linear_fc1.collect_params(out);
  linear_fc2.collect_params(out);
}

}  // namespace megaton
