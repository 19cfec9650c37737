// Fp8LinearGemms: a linear layer's forward, input-gradient and weight-gradient GEMMs in FP8.
#include "model/fp8_linear.h"

#include "core/error.h"
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

Fp8LinearGemms::Saved Fp8LinearGemms::forward(const Tensor& x, const Param& weight,
                                              bool keep_input, const Sharding& sharding,
                                              Tensor& y) {
  MEGATON_CHECK(enabled_, "Fp8LinearGemms::forward on a layer without FP8");
  const Fp8AmaxGroup none;
  // An input the caller does not keep (recomputed for backward, as fc2's activation) gets
  // its column-wise copy in backward (requantize_columnwise), not now: it would outlive
  // the bf16 tensor the bf16 path leaves unsaved.
  const bool keep_columnwise = wgrad_ && keep_input;
  const Fp8Tensor xq =
      input_.quantize(x, true, keep_columnwise, sharding.input ? sharding.group : none);
  const Fp8Tensor wq = weight.fp8_param
                           ? fp8_weight(weight)
                           : weight_.quantize(weight.weight, true, false,
                                              sharding.weight ? sharding.group : none);
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
  const Fp8AmaxGroup none;
  const Fp8Tensor dyq =
      grad_.quantize(dy, true, wgrad_, sharding.grad_output ? sharding.group : none);
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
    ops::gemm(dy, true, x(), false, main_grad, 1.0f, 1.0f);
    return;
  }
  // dW [out, in] += dy^T [out, T] @ x [T, in]: both operands K(token)-major. Forward kept
  // x^T, or only its scale when the caller recomputes x.
  const Fp8Tensor xq_t =
      saved.x.data_t.defined() ? saved.x : input_.requantize_columnwise(x(), saved.x);
  ops::fp8_gemm(dyq.data_t, dyq.scale_inv_t, xq_t.data_t, xq_t.scale_inv_t, main_grad, 1.0f,
                1.0f);
}

std::vector<std::pair<std::string, Tensor*>> Fp8LinearGemms::state(const std::string& prefix) {
  std::vector<std::pair<std::string, Tensor*>> out;
  if (!enabled_ || !input_.delayed()) return out;
  const std::string base = prefix + "._extra_state.fp8.";
  for (auto [role, q] : {std::pair{"input", &input_}, {"weight", &weight_}, {"grad_output", &grad_}}) {
    out.emplace_back(base + role + ".amax_history", &q->amax_history());
    out.emplace_back(base + role + ".scales", &q->scales());
  }
  return out;
}

}  // namespace megaton
