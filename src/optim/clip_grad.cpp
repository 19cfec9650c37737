// Global gradient norm and clipping (Megatron-LM optimizer/clip_grads.py).
#include "optim/clip_grad.h"

#include <cmath>

#include "core/error.h"
#include "ops/ops.h"

namespace megaton::optim {

double global_grad_norm(const std::vector<Param*>& params) {
  double sum_sq = 0.0;
  for (const Param* p : params) {
    MEGATON_CHECK(p->main_grad.defined(), "param '{}' has no main_grad", p->name);
    sum_sq += ops::sum_of_squares(p->main_grad);
  }
  return std::sqrt(sum_sq);
}

double clip_grad_by_norm(const std::vector<Param*>& params, double max_norm, double total_norm) {
  double clip_coeff = max_norm / (total_norm + 1.0e-6);
  if (!(clip_coeff < 1.0)) return 1.0;
  for (Param* p : params) ops::scale_(p->main_grad, float(clip_coeff));
  return clip_coeff;
}

}  // namespace megaton::optim
