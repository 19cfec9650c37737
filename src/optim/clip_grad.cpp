// Global gradient norm and clipping (Megatron-LM optimizer/clip_grads.py).
#include "optim/clip_grad.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/ops.h"

namespace megaton::optim {

namespace {

std::vector<Tensor> main_grads(const std::vector<Param*>& params) {
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (const Param* p : params) {
    MEGATON_CHECK(p->main_grad.defined(), "param '{}' has no main_grad", p->name);
    grads.push_back(p->main_grad);
  }
  return grads;
}

}  // namespace

double global_grad_norm(const std::vector<Param*>& params) {
  // One fp64 sum over every main_grad: a single host synchronization on the GPU.
  return std::sqrt(ops::multi_tensor_sum_of_squares(main_grads(params)));
}

double clip_coefficient(double max_norm, double total_norm) {
  const double clip_coeff = max_norm / (total_norm + 1.0e-6);
  // Written so that a NaN coefficient (NaN norm) also gives 1.
  return clip_coeff < 1.0 ? clip_coeff : 1.0;
}

double clip_grad_by_norm(const std::vector<Param*>& params, double max_norm, double total_norm) {
  const double clip_coeff = clip_coefficient(max_norm, total_norm);
  if (clip_coeff == 1.0) return 1.0;
  std::vector<Tensor> grads = main_grads(params);
  ops::multi_tensor_scale_(grads, float(clip_coeff));
  return clip_coeff;
}

}  // namespace megaton::optim
