// SharedExpertMLP forward/backward.
#include "model/shared_experts.h"

#include <cmath>

#include "core/error.h"
#include "model/main_grad.h"
#include "ops/ops.h"

namespace megaton {

SharedExpertMLP::SharedExpertMLP(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                                 const ModelParallel& mp)
    : mlp(prefix, cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, mlp_activation_of(cfg),
          /*bias=*/false, cfg.init_method_std, cfg.scaled_init_method_std(), seed,
          Placement::of(cfg), mp) {
  if (!cfg.moe_shared_expert_gate) return;
  gate_weight = make_param(prefix + ".gate_weight", {1, cfg.hidden_size}, cfg.init_method_std, seed,
                           Placement::of(cfg));
  gate_weight.sequence_parallel = mp.sequence_parallel && mp.tp_size() > 1;
}

Tensor SharedExpertMLP::forward(const Tensor& x) {
  forward_begin(x);
  return forward_end();
}

void SharedExpertMLP::forward_begin(const Tensor& x) {
  mlp.forward_fc1(x);
  if (!gated()) return;
  saved_.x = x;
  saved_.logits = Tensor::empty({x.dim(0), 1}, DType::F32, x.device());
  ops::gemm(x, false, gate_weight.weight, true, saved_.logits);
}

Tensor SharedExpertMLP::forward_end() {
  Tensor out = mlp.forward_fc2();
  if (!gated()) return out;
  saved_.mlp_out = out;
  Tensor gated_out = empty_like(out, out.shape());
  ops::sigmoid_gate_forward(out, saved_.logits, gated_out);
  return gated_out;
}

Tensor SharedExpertMLP::backward(const Tensor& dy) {
  backward_begin(dy);
  return backward_end();
}

void SharedExpertMLP::backward_begin(const Tensor& dy) {
  if (!gated()) return mlp.backward_fc2(dy);
  MEGATON_CHECK(saved_.x.defined(), "SharedExpertMLP '{}': backward without a forward",
                gate_weight.name);
  const Saved s = std::exchange(saved_, {});
  Tensor dmlp_out = empty_like(dy, dy.shape());
  Tensor dlogits = Tensor::empty(s.logits.shape(), DType::F32, dy.device());
  ops::sigmoid_gate_backward(dy, s.mlp_out, s.logits, dmlp_out, dlogits);
  mlp.backward_fc2(dmlp_out);
  backward_dlogits_ = dlogits;
  if (dy.dtype() != DType::F32) {
    backward_dlogits_ = empty_like(dy, dlogits.shape());
    ops::cast(dlogits, backward_dlogits_);
  }
  backward_x_ = s.x;
}

Tensor SharedExpertMLP::backward_end() {
  Tensor dx = mlp.backward_fc1();
  if (!gated()) return dx;
  MEGATON_CHECK(backward_dlogits_.defined(),
                "SharedExpertMLP '{}': backward_end without backward_begin", gate_weight.name);
  const Tensor x = std::exchange(backward_x_, Tensor());
  const Tensor dlogits = std::exchange(backward_dlogits_, Tensor());
  // logits = x w^T: dx += dlogits w, dw += dlogits^T x.
  ops::gemm(dlogits, false, gate_weight.weight, false, dx, 1.0f, 1.0f);
  gemm_main_grad(dlogits, true, x, false, gate_weight.main_grad);
  return dx;
}

void SharedExpertMLP::collect_params(std::vector<Param*>& out) {
  mlp.collect_params(out);
  if (gated()) out.push_back(&gate_weight);
}

}  // namespace megaton
