// Fp8LinearGemms: a linear layer's forward, input-gradient and weight-gradient GEMMs in FP8.
#include "model/fp8_linear.h"

#include "core/error.h"
#include "model/main_grad.h"
#include "ops/ops.h"

namespace megaton {

Fp8LinearGemms::Fp8LinearGemms(const Fp8Config& config, Device device)
    : enabled_(true),
      wgrad_(config.wgrad),
      // Fast accumulation in the forward GEMM of the per-tensor recipes, as Transformer
      // Engine (recipe.py: fp8_gemm_fprop use_split_accumulator=False).
      fast_forward_(config.recipe != Fp8Recipe::Blockwise),
      param_gather_(config.param_gather),
      input_(config, Fp8Role::Input, device),
      weight_(config, Fp8Role::Weight, device),
      grad_(config, Fp8Role::GradOutput, device) {
  MEGATON_CHECK(config.enabled, "Fp8LinearGemms without an FP8 format");
}

void Fp8LinearGemms::adopt_weight(Param& weight) const {
  if (!param_gather_) return;
  weight.fp8_param = true;
  weight.fp8_scales = Tensor::empty({2}, DType::F32, weight.weight.device());
  weight.fp8_scales.fill(1.0f);
}

namespace {
// The per-tensor quantization of an FP8 weight (--fp8-param-gather): its bytes as the
// row-wise copy, Param::fp8_scales as the factors.
Fp8Tensor fp8_weight(const Param& weight) {
  const Tensor& w = weight.weight;
  MEGATON_CHECK(weight.fp8_scales.defined(), "FP8 weight '{}' without fp8_scales", weight.name);
  return {w.view({w.numel() / w.dim(-1), w.dim(-1)}), weight.fp8_scales.rows(0, 1), Tensor(),
          Tensor(), weight.fp8_scales.rows(1, 1)};
}
}  // namespace

Fp8LinearGemms::Saved Fp8LinearGemms::forward(const Tensor& x, const Param& weight, bool keep_input,
                                              const Sharding& sharding, Tensor& y) {
  MEGATON_CHECK(enabled_, "Fp8LinearGemms::forward on a layer without FP8");
  // An input the caller does not keep (recomputed for backward, as fc2's activation) gets
  // its column-wise copy in backward (requantize_columnwise), not now: it would outlive
  // the bf16 tensor the bf16 path leaves unsaved.
  const bool keep_columnwise = wgrad_ && keep_input;
  const Fp8Tensor xq = input_.quantize(x, true, keep_columnwise, sharding.input);
  const Fp8Tensor wq = weight.fp8_param
                           ? fp8_weight(weight)
                           : weight_.quantize(weight.weight, true, false, sharding.weight);
  ops::fp8_gemm(xq.data, xq.scale_inv, wq.data, wq.scale_inv, y, 1.0f, 0.0f, fast_forward_);
  Saved saved;
  saved.w = {Tensor(), wq.scale_inv, Tensor(), Tensor(), wq.scale};
  if (keep_columnwise) saved.x = {Tensor(), Tensor(), xq.data_t, xq.scale_inv_t, Tensor()};
  else if (wgrad_) saved.x = {Tensor(), xq.scale_inv, Tensor(), Tensor(), xq.scale};
  return saved;
}

void Fp8LinearGemms::backward(const Tensor& dy, const Param& weight, const Saved& saved,
                              const std::function<Tensor()>& x, const Sharding& sharding,
                              Tensor& dx, Tensor& main_grad) {
  MEGATON_CHECK(saved.defined(), "Fp8LinearGemms::backward without a forward");
  const Fp8Tensor dyq = grad_.quantize(dy, true, wgrad_, sharding.grad_output);
  // dx [T, in] = dy [T, out] @ W [out, in]: W^T [in, out] is the K-major operand.
  Fp8Tensor wq_t;
  if (weight.fp8_param) {  // the same bytes transposed, the same scale
    const Tensor& w = weight.weight;
    wq_t.data_t = Tensor::empty({w.dim(-1), w.numel() / w.dim(-1)}, w.dtype(), w.device());
    ops::fp8_transpose(w, wq_t.data_t);
    wq_t.scale_inv_t = saved.w.scale_inv;
  } else {
    wq_t = weight_.requantize_columnwise(weight.weight, saved.w);
  }
  ops::fp8_gemm(dyq.data, dyq.scale_inv, wq_t.data_t, wq_t.scale_inv_t, dx);
  if (!wgrad_) {
    gemm_main_grad(dy, true, x(), false, main_grad);
    return;
  }
  // dW [out, in] += dy^T [out, T] @ x [T, in]: both operands K(token)-major. Forward kept
  // x^T, or only its scale when the caller recomputes x.
  const Fp8Tensor xq_t =
      saved.x.data_t.defined() ? saved.x : input_.requantize_columnwise(x(), saved.x);
  ops::fp8_gemm(dyq.data_t, dyq.scale_inv_t, xq_t.data_t, xq_t.scale_inv_t, main_grad, 1.0f, 1.0f);
}

Fp8GroupedLinearGemms::Fp8GroupedLinearGemms(const Fp8Config& config, Device device, int64_t groups)
    : per_tensor_(config.recipe != Fp8Recipe::Blockwise) {
  for (int64_t g = 0; g < groups; ++g) gemms_.emplace_back(config, device);
}

void Fp8GroupedLinearGemms::adopt_weights(const std::vector<Param*>& weights) const {
  MEGATON_CHECK(weights.size() == gemms_.size(), "Fp8GroupedLinearGemms: {} weights for {} groups",
                weights.size(), gemms_.size());
  for (size_t g = 0; g < gemms_.size(); ++g) gemms_[g].adopt_weight(*weights[g]);
}

namespace {
// The groups with rows, and their row views.
struct ActiveGroups {
  std::vector<size_t> index;   // group numbers
  std::vector<int64_t> start;  // first row
  std::vector<int64_t> rows;
};
ActiveGroups active_groups(const std::vector<int64_t>& group_rows) {
  ActiveGroups a;
  int64_t start = 0;
  for (size_t g = 0; g < group_rows.size(); ++g) {
    if (group_rows[g] > 0) {
      a.index.push_back(g);
      a.start.push_back(start);
      a.rows.push_back(group_rows[g]);
    }
    start += group_rows[g];
  }
  return a;
}
// ops::fp8_grouped_gemm with a[i] and b[i] the row-wise copies (data, scale_inv) or, where
// a_t / b_t, the column-wise ones (data_t, scale_inv_t) of the quantized operands.
void grouped_fp8_gemm(const std::vector<Fp8Tensor>& a, bool a_t, const std::vector<Fp8Tensor>& b,
                      bool b_t, const std::vector<Tensor>& c, float beta = 0.0f,
                      bool fast_accumulation = false) {
  std::vector<Tensor> ad, as, bd, bs;
  for (size_t i = 0; i < a.size(); ++i) {
    ad.push_back(a_t ? a[i].data_t : a[i].data);
    as.push_back(a_t ? a[i].scale_inv_t : a[i].scale_inv);
    bd.push_back(b_t ? b[i].data_t : b[i].data);
    bs.push_back(b_t ? b[i].scale_inv_t : b[i].scale_inv);
  }
  ops::fp8_grouped_gemm(ad, as, bd, bs, c, 1.0f, beta, fast_accumulation);
}
std::vector<Tensor> group_views(const Tensor& t, const ActiveGroups& a) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < a.index.size(); ++i) out.push_back(t.rows(a.start[i], a.rows[i]));
  return out;
}
}  // namespace

Fp8GroupedLinearGemms::Saved Fp8GroupedLinearGemms::forward(
    const Tensor& x, const std::vector<int64_t>& group_rows,
    const std::vector<const Param*>& weights, bool keep_input,
    const Fp8LinearGemms::Sharding& sharding, Tensor& y) {
  MEGATON_CHECK(group_rows.size() == gemms_.size() && weights.size() == gemms_.size(),
                "Fp8GroupedLinearGemms::forward: {} groups, {} row counts, {} weights",
                gemms_.size(), group_rows.size(), weights.size());
  Saved saved;
  saved.groups.resize(gemms_.size());
  const ActiveGroups a = active_groups(group_rows);
  if (!per_tensor_) {
    for (size_t i = 0; i < a.index.size(); ++i) {
      Tensor y_g = y.rows(a.start[i], a.rows[i]);
      saved.groups[a.index[i]] = gemms_[a.index[i]].forward(
          x.rows(a.start[i], a.rows[i]), *weights[a.index[i]], keep_input, sharding, y_g);
    }
    return saved;
  }
  if (a.index.empty()) return saved;
  const bool wgrad = gemms_[0].wgrad_;
  const bool keep_columnwise = wgrad && keep_input;
  std::vector<Fp8Quantizer*> inputs, weight_quantizers;
  std::vector<Tensor> weight_values;
  for (size_t g : a.index) {
    inputs.push_back(&gemms_[g].input_);
    weight_quantizers.push_back(&gemms_[g].weight_);
    weight_values.push_back(weights[g]->weight);
  }
  const std::vector<Fp8Tensor> xq = Fp8Quantizer::quantize_multi(inputs, group_views(x, a), true,
                                                                 keep_columnwise, sharding.input);
  std::vector<Fp8Tensor> wq;
  if (weights[a.index[0]]->fp8_param) {
    for (size_t g : a.index) wq.push_back(fp8_weight(*weights[g]));
  } else {
    wq = Fp8Quantizer::quantize_multi(weight_quantizers, weight_values, true, false,
                                      sharding.weight);
  }
  grouped_fp8_gemm(xq, false, wq, false, group_views(y, a), 0.0f, gemms_[0].fast_forward_);
  for (size_t i = 0; i < a.index.size(); ++i) {
    Fp8LinearGemms::Saved& s = saved.groups[a.index[i]];
    s.w = {Tensor(), wq[i].scale_inv, Tensor(), Tensor(), wq[i].scale};
    if (keep_columnwise)
      s.x = {Tensor(), Tensor(), xq[i].data_t, xq[i].scale_inv_t, Tensor()};
    else if (wgrad)
      s.x = {Tensor(), xq[i].scale_inv, Tensor(), Tensor(), xq[i].scale};
  }
  return saved;
}

void Fp8GroupedLinearGemms::backward(const Tensor& dy, const std::vector<int64_t>& group_rows,
                                     const std::vector<Param*>& weights, const Saved& saved,
                                     const std::function<Tensor()>& x,
                                     const Fp8LinearGemms::Sharding& sharding, Tensor& dx) {
  MEGATON_CHECK(group_rows.size() == gemms_.size() && weights.size() == gemms_.size() &&
                    saved.groups.size() == gemms_.size(),
                "Fp8GroupedLinearGemms::backward: {} groups, {} row counts, {} weights, {} saved",
                gemms_.size(), group_rows.size(), weights.size(), saved.groups.size());
  const ActiveGroups a = active_groups(group_rows);
  Tensor whole_x;  // x(), evaluated once when needed
  const auto x_rows = [&](size_t i) {
    if (!whole_x.defined()) whole_x = x();
    return whole_x.rows(a.start[i], a.rows[i]);
  };
  if (!per_tensor_) {
    for (size_t i = 0; i < a.index.size(); ++i) {
      const size_t g = a.index[i];
      Tensor dx_g = dx.rows(a.start[i], a.rows[i]);
      gemms_[g].backward(
          dy.rows(a.start[i], a.rows[i]), *weights[g], saved.groups[g], [&] { return x_rows(i); },
          sharding, dx_g, weights[g]->main_grad);
    }
    return;
  }
  if (a.index.empty()) return;
  const bool wgrad = gemms_[0].wgrad_;
  std::vector<Fp8Quantizer*> grads;
  std::vector<const Fp8Quantizer*> weight_quantizers, inputs;
  std::vector<Tensor> weight_values;
  std::vector<Fp8Tensor> w_saved, x_saved;
  for (size_t g : a.index) {
    MEGATON_CHECK(saved.groups[g].defined(),
                  "Fp8GroupedLinearGemms::backward: group {} has no forward", g);
    grads.push_back(&gemms_[g].grad_);
    weight_quantizers.push_back(&gemms_[g].weight_);
    inputs.push_back(&gemms_[g].input_);
    weight_values.push_back(weights[g]->weight);
    w_saved.push_back(saved.groups[g].w);
    x_saved.push_back(saved.groups[g].x);
  }
  const std::vector<Fp8Tensor> dyq =
      Fp8Quantizer::quantize_multi(grads, group_views(dy, a), true, wgrad, sharding.grad_output);
  // dx_g = dy_g @ W_g: W_g^T [in, out] is the K-major operand.
  std::vector<Fp8Tensor> wq_t;
  if (weights[a.index[0]]->fp8_param) {
    for (size_t i = 0; i < a.index.size(); ++i) {
      const Tensor& w = weight_values[i];
      Fp8Tensor t;
      t.data_t = Tensor::empty({w.dim(-1), w.numel() / w.dim(-1)}, w.dtype(), w.device());
      ops::fp8_transpose(w, t.data_t);
      t.scale_inv_t = w_saved[i].scale_inv;
      wq_t.push_back(t);
    }
  } else {
    wq_t = Fp8Quantizer::requantize_columnwise_multi(weight_quantizers, weight_values, w_saved);
  }
  grouped_fp8_gemm(dyq, false, wq_t, true, group_views(dx, a));
  if (!wgrad) {
    for (size_t i = 0; i < a.index.size(); ++i)
      gemm_main_grad(dy.rows(a.start[i], a.rows[i]), true, x_rows(i), false,
                     weights[a.index[i]]->main_grad);
    return;
  }
  // dW_g += dy_g^T @ x_g: both operands K(token)-major. Forward kept x_g^T, or only its
  // scale when the caller recomputes x.
  std::vector<Fp8Tensor> xq_t;
  if (x_saved[0].data_t.defined()) {
    xq_t = x_saved;
  } else {
    std::vector<Tensor> xs;
    for (size_t i = 0; i < a.index.size(); ++i) xs.push_back(x_rows(i));
    xq_t = Fp8Quantizer::requantize_columnwise_multi(inputs, xs, x_saved);
  }
  std::vector<Tensor> grads_out;
  for (size_t g : a.index) grads_out.push_back(weights[g]->main_grad);
  grouped_fp8_gemm(dyq, true, xq_t, true, grads_out, 1.0f);
}

std::vector<std::pair<std::string, Tensor*>> Fp8LinearGemms::state(const std::string& prefix) {
  std::vector<std::pair<std::string, Tensor*>> out;
  if (!enabled_ || !input_.delayed()) return out;
  const std::string base = prefix + "._extra_state.fp8.";
  for (auto [role, q] :
       {std::pair{"input", &input_}, {"weight", &weight_}, {"grad_output", &grad_}}) {
    out.emplace_back(base + role + ".amax_history", &q->amax_history());
    out.emplace_back(base + role + ".scales", &q->scales());
  }
  return out;
}

}  // namespace megaton
