// SharedExpertMLP forward/backward.
#include "model/shared_experts.h"

#include <cmath>

#include "core/error.h"
#include "model/main_grad.h"
#include "ops/ops.h"

namespace megaton {

SharedExpertMLP::SharedExpertMLP(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                                 const ModelParallel& mp)
    : mlp(prefix, cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.swiglu,
          /*bias=*/false, cfg.init_method_std,
          cfg.scaled_init_method_std(), seed,
          Placement::of(cfg), mp) {
  if (!cfg.moe_shared_expert_gate) return;
  gate_weight = make_param(prefix + ".gate_weight", {1, cfg.hidden_size}, cfg.init_method_std,
                           seed, Placement::of(cfg));
  gate_weight.sequence_parallel = mp.sequence_parallel && mp.tp_size() > 1;
}

Tensor SharedExpertMLP::forward(const Tensor& x) {
  Tensor out = mlp.forward(x);
  if (!gated()) return out;
  saved_.x = x;
  saved_.mlp_out = out;
  saved_.logits = Tensor::empty({x.dim(0), 1}, DType::F32, x.device());
  ops::gemm(x, false, gate_weight.weight, true, saved_.logits);
  Tensor gated_out = empty_like(out, out.shape());
  ops::sigmoid_gate_forward(out, saved_.logits, gated_out);
  return gated_out;
}

Tensor SharedExpertMLP::backward(const Tensor& dy) {
  if (!gated()) return mlp.backward(dy);
  MEGATON_CHECK(saved_.x.defined(), "SharedExpertMLP '{}': backward without a forward",
                gate_weight.name);
  const Saved s = std::exchange(saved_, {});
  Tensor dmlp_out = empty_like(dy, dy.shape());
  Tensor dlogits = Tensor::empty(s.logits.shape(), DType::F32, dy.device());
  ops::sigmoid_gate_backward(dy, s.mlp_out, s.logits, dmlp_out, dlogits);
  Tensor dx = mlp.backward(dmlp_out);
  Tensor dlogits_compute = dlogits;
  if (dy.dtype() != DType::F32) {
    dlogits_compute = empty_like(dy, dlogits.shape());
    ops::cast(dlogits, dlogits_compute);
  }
  // logits = x w^T: dx += dlogits w, dw += dlogits^T x.
  ops::gemm(dlogits_compute, false, gate_weight.weight, false, dx, 1.0f, 1.0f);
  gemm_main_grad(dlogits_compute, true, s.x, false, gate_weight.main_grad);
  return dx;
}

void SharedExpertMLP::collect_params(std::vector<Param*>& out) {
  mlp.collect_params(out);
  if (gated()) out.push_back(&gate_weight);
}

}  // namespace megaton
