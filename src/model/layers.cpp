// Linear, Norm and MLP forward/backward on top of the op catalogue.
#include "model/layers.h"

#include <cmath>
#include <functional>

#include "model/main_grad.h"
#include "model/tensor_parallel.h"
#include "model/tp_comm_overlap.h"
#include "ops/fp8.h"
#include "ops/ops.h"

namespace megaton {

Linear::Linear(const std::string& name, int64_t in_features, int64_t out_features, bool bias_on,
               float init_std, uint64_t seed, Placement where, TensorParallelMode mode,
               const ModelParallel& mp, const std::vector<int64_t>& tp_blocks)
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
                                  tp_blocks);
      if (bias_on) {  // zeros: the slice is zeros too
        bias = make_constant_param(name + ".bias", {out_features / tp}, 0.0f, true, where);
        bias.tp_split_dim = 0;
        bias.tp_blocks = tp_blocks;
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
  // --tp-comm-overlap: the sequence all-gather (Column) or reduce-scatter (Row) beside the
  // GEMM (model/tp_comm_overlap.h); not for FP8 GEMMs yet.
  const bool overlap = mp_.sequence_parallel && mp_.tp_comm_overlap && !fp8_.enabled() &&
                       mode_ != TensorParallelMode::None;
  // Column-parallel under SP: every rank's token rows (re-gathered in backward).
  const bool gather = mode_ == TensorParallelMode::Column && mp_.sequence_parallel;
  const Tensor x_full = gather && !overlap ? gather_sequence(x, mp_) : x;
  const int64_t rows = gather ? x.dim(0) * mp_.tp_size() : x.dim(0);
  Tensor y;
  if (!(overlap && mode_ == TensorParallelMode::Row))
    y = empty_like(x, {rows, weight.weight.dim(0)});
  saved_ = {};
  // The bias in the GEMM's epilogue, except under FP8, after the row-parallel sum, or when
  // the caller adds it (skip_bias_add).
  const bool add_bias = bias.weight.defined() && !skip_bias_add_;
  const bool bias_in_gemm = add_bias && !fp8_.enabled() && mode_ != TensorParallelMode::Row;
  // (A plain lambda: the overlap helpers wrap it in a RowGemm only when they run.)
  const auto gemm = [&](const Tensor& in, Tensor out) {
    if (bias_in_gemm)
      ops::gemm_bias(in, false, weight.weight, true, bias.weight, out);
    else
      ops::gemm(in, false, weight.weight, true, out);
  };
  if (fp8_.enabled()) {
    saved_.fp8 = fp8_.forward(x_full, weight, save_input, fp8_sharding(), y);
    // A bf16 weight gradient (--no-fp8-wgrad) reads the input itself.
    if (save_input && !saved_.fp8.x.data_t.defined()) saved_.x = x;
  } else {
    if (save_input) saved_.x = x;
    if (overlap && gather) {
      Tensor gathered = empty_like(x, {rows, x.dim(1)});
      gemm_all_gathered_rows(x, gathered, y, gemm, mp_);
    } else if (overlap && mode_ == TensorParallelMode::Row) {
      y = gemm_reduce_scattered_rows(x, weight.weight.dim(0), gemm, mp_, tp_comm_overlap_splits());
    } else {
      gemm(x_full, y);
    }
  }
  if (mode_ == TensorParallelMode::Row && !overlap) {
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
  if (!fp8_.enabled() && sp && saved.x.defined()) {
    if (mode_ == TensorParallelMode::Column) return column_backward_overlapped(dy, saved.x);
    if (mode_ == TensorParallelMode::Row && mp_.tp_comm_overlap)
      return row_backward_overlapped(dy, saved.x);
  }
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

Tensor Linear::column_backward_overlapped(const Tensor& dy, const Tensor& x) {
  // Megatron's LinearWithGradAccumulationAndAsyncCommunication: the all-gather of x runs
  // beside the dgrad GEMM, the reduce-scatter of dx beside the wgrad GEMM.
  const int tp = mp_.tp_size();
  Tensor x_full = empty_like(x, {x.dim(0) * tp, x.dim(1)});
  std::unique_ptr<dist::CommWork> gathered = mp_.comm->all_gather_async(x, x_full, mp_.tp());
  Tensor dx = empty_like(dy, {dy.dim(0), weight.weight.dim(1)});
  ops::gemm(dy, false, weight.weight, false, dx);
  MEGATON_CHECK(dx.dim(0) % tp == 0,
                "sequence parallel: {} token rows are not divisible by tensor-parallel size {}",
                dx.dim(0), tp);
  Tensor dx_local = empty_like(dx, {dx.dim(0) / tp, dx.dim(1)});
  std::unique_ptr<dist::CommWork> scattered =
      mp_.comm->reduce_scatter_async(dx, dx_local, mp_.tp());
  gathered->wait();
  gemm_main_grad(dy, true, x_full, false, weight.main_grad);
  scattered->wait();
  return dx_local;
}

Tensor Linear::row_backward_overlapped(const Tensor& dy, const Tensor& x) {
  // The all-gather of dy beside the dgrad GEMM of this rank's own rows.
  Tensor dy_full = empty_like(dy, {dy.dim(0) * mp_.tp_size(), dy.dim(1)});
  Tensor dx = empty_like(dy, {dy_full.dim(0), weight.weight.dim(1)});
  gemm_all_gathered_rows(
      dy, dy_full, dx,
      [&](const Tensor& in, Tensor out) { ops::gemm(in, false, weight.weight, false, out); }, mp_);
  gemm_main_grad(dy_full, true, x, false, weight.main_grad);
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
// ranks; under context parallelism every input and output gradient holds only this CP
// rank's tokens (Fp8LinearGemms::Sharding).
Fp8LinearGemms::Sharding Linear::fp8_sharding() const {
  Fp8LinearGemms::Sharding s;
  auto over = [&](dist::GroupKind kind) { return Fp8AmaxGroup{mp_.comm, &mp_.group(kind)}; };
  const bool split = mode_ != TensorParallelMode::None && mp_.tp_size() > 1;
  if (split) s.weight = over(dist::GroupKind::TP);
  // Over TP x CP where TP splits the features, else over CP (a group of one without CP).
  auto tokens = [&](bool features_split) {
    return over(features_split && split ? dist::GroupKind::TP_CP : dist::GroupKind::CP);
  };
  s.input = tokens(mode_ == TensorParallelMode::Row);
  s.grad_output = tokens(mode_ == TensorParallelMode::Column);
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

MLP::MLP(const std::string& prefix, int64_t hidden, int64_t ffn, MlpActivation activation,
         bool bias, float init_std, float output_std, uint64_t seed, Placement where,
         const ModelParallel& mp)
    : linear_fc1(
          prefix + ".linear_fc1", hidden, activation == MlpActivation::Swiglu ? 2 * ffn : ffn, bias,
          init_std, seed, where, TensorParallelMode::Column, mp,
          activation == MlpActivation::Swiglu ? swiglu_blocks(2 * ffn) : std::vector<int64_t>{}),
      linear_fc2(prefix + ".linear_fc2", ffn, hidden, bias, output_std, seed, where,
                 TensorParallelMode::Row, mp),
      activation_(activation) {}

Tensor mlp_activation(const Tensor& fc1_out, MlpActivation activation) {
  const bool gated = activation == MlpActivation::Swiglu;
  const int64_t ffn = gated ? fc1_out.dim(-1) / 2 : fc1_out.dim(-1);
  Tensor act = empty_like(fc1_out, {fc1_out.dim(0), ffn});
  switch (activation) {
    case MlpActivation::Swiglu:
      ops::swiglu_forward(fc1_out, act);
      break;
    case MlpActivation::Gelu:
      ops::gelu_forward(fc1_out, act);
      break;
    case MlpActivation::SquaredRelu:
      ops::squared_relu_forward(fc1_out, act);
      break;
  }
  return act;
}

Tensor mlp_activation_backward(const Tensor& dact, const Tensor& fc1_out, MlpActivation activation,
                               Tensor* act) {
  Tensor dfc1 = empty_like(dact, fc1_out.shape());
  switch (activation) {
    case MlpActivation::Swiglu:
      ops::swiglu_backward(dact, fc1_out, dfc1, act);
      break;
    case MlpActivation::Gelu:
      ops::gelu_backward(dact, fc1_out, dfc1, act);
      break;
    case MlpActivation::SquaredRelu:
      ops::squared_relu_backward(dact, fc1_out, dfc1, act);
      break;
  }
  return dfc1;
}

Tensor mlp_activation_weighted(const Tensor& fc1_out, const Tensor& probs,
                               MlpActivation activation) {
  const bool gated = activation == MlpActivation::Swiglu;
  const int64_t ffn = gated ? fc1_out.dim(-1) / 2 : fc1_out.dim(-1);
  Tensor act = empty_like(fc1_out, {fc1_out.dim(0), ffn});
  switch (activation) {
    case MlpActivation::Swiglu:
      ops::weighted_swiglu_forward(fc1_out, probs, act);
      break;
    case MlpActivation::Gelu:
      ops::weighted_gelu_forward(fc1_out, probs, act);
      break;
    case MlpActivation::SquaredRelu:
      ops::weighted_squared_relu_forward(fc1_out, probs, act);
      break;
  }
  return act;
}

Tensor mlp_activation_weighted_backward(const Tensor& dact, const Tensor& fc1_out,
                                        const Tensor& probs, MlpActivation activation,
                                        Tensor& dprobs, Tensor* act) {
  Tensor dfc1 = empty_like(dact, fc1_out.shape());
  dprobs = Tensor::empty({fc1_out.dim(0)}, DType::F32, dact.device());
  switch (activation) {
    case MlpActivation::Swiglu:
      ops::weighted_swiglu_backward(dact, fc1_out, probs, dfc1, dprobs, act);
      break;
    case MlpActivation::Gelu:
      ops::weighted_gelu_backward(dact, fc1_out, probs, dfc1, dprobs, act);
      break;
    case MlpActivation::SquaredRelu:
      ops::weighted_squared_relu_backward(dact, fc1_out, probs, dfc1, dprobs, act);
      break;
  }
  return dfc1;
}

// The activation output (the input of linear_fc2, [T, ffn]) is not kept: backward
// recomputes it from fc1's output, saving ffn x T activations per layer. (Megatron keeps it
// in a dense MLP and offers its recompute for the experts only, recompute module moe_act.)
// The recompute costs no pass of its own: the activation's backward, which reads fc1's
// output anyway, writes it (fc2's weight gradient is computed after its input gradient for
// this). docs/memory.md, "Activation recomputation".
Tensor MLP::forward(const Tensor& x) {
  forward_fc1(x);
  return forward_fc2();
}

void MLP::forward_fc1(const Tensor& x) {
  Saved& s = saved_;
  s = {};
  s.held = true;
  // fc1 keeps its input itself unless the input is not kept at all or must remake fc1's
  // output (then the MLP keeps x: under FP8, fc1 would keep x^T only).
  if (keep_input_ && !keep_fc1_out_) s.x = x;
  const Tensor fc1_out = linear_fc1.forward(x, keep_input_ && keep_fc1_out_);
  if (keep_fc1_out_) s.fc1_out = fc1_out;
  between_ = {};
  between_.fc1_out = fc1_out;
}

Tensor MLP::forward_fc2() {
  MEGATON_CHECK(between_.fc1_out.defined(), "MLP '{}': forward_fc2 without forward_fc1",
                linear_fc1.weight.name);
  const Tensor fc1_out = std::exchange(between_.fc1_out, Tensor());
  return linear_fc2.forward(mlp_activation(fc1_out, activation_), /*save_input=*/false);
}

const Tensor& MLP::forward_input(Between& b) const {
  if (!b.x.defined()) {
    MEGATON_CHECK(bool(b.input), "MLP '{}': backward needs the forward's input, not kept",
                  linear_fc1.weight.name);
    b.x = b.input();
  }
  return b.x;
}

Tensor MLP::backward(const Tensor& dy, const std::function<Tensor()>& input) {
  backward_fc2(dy, input);
  return backward_fc1();
}

void MLP::backward_fc2(const Tensor& dy, const std::function<Tensor()>& input) {
  MEGATON_CHECK(saved_.held, "MLP '{}': backward without a forward", linear_fc1.weight.name);
  Saved s = std::exchange(saved_, {});
  Between& b = between_;
  b = {};
  // The forward's input, where fc1 did not keep it: kept here, or made again by `input`.
  b.x = s.x;
  b.input = input;
  // fc1's output, remade from the input (the mlp recompute): the same GEMM, the same bits.
  const Tensor fc1_out =
      s.fc1_out.defined() ? s.fc1_out : linear_fc1.forward(forward_input(b), false);
  Tensor dfc1;  // the activation's backward, inside fc2's backward or after it
  const Tensor dact = linear_fc2.backward(dy, [&](const Tensor& dact) {
    Tensor act = empty_like(dact, dact.shape());
    dfc1 = mlp_activation_backward(dact, fc1_out, activation_, &act);
    return act;
  });
  if (!dfc1.defined()) dfc1 = mlp_activation_backward(dact, fc1_out, activation_);  // not asked
  b.dfc1 = std::move(dfc1);
}

Tensor MLP::backward_fc1() {
  MEGATON_CHECK(between_.dfc1.defined(), "MLP '{}': backward_fc1 without backward_fc2",
                linear_fc1.weight.name);
  Between b = std::exchange(between_, {});
  if (keep_input_ && keep_fc1_out_) return linear_fc1.backward(b.dfc1);
  return linear_fc1.backward(b.dfc1, forward_input(b));
}

Tensor MLP::forward_inference(const Tensor& x) const {
  const Tensor fc1_out = linear_fc1.forward_inference(x);
  return linear_fc2.forward_inference(mlp_activation(fc1_out, activation_));
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
