// Gradient clipping by the global L2 norm of the main gradients.
#pragma once
#include <vector>

#include "model/param.h"

namespace megaton::optim {

// sqrt(sum over params of sum(main_grad^2)), accumulated in fp64. Megatron's
// get_grad_norm_fp32 with norm_type 2 over one rank's params (the distributed version
// all-reduces the squared sum first). NaN or inf if any gradient element is.
double global_grad_norm(const std::vector<Param*>& params);

// Megatron's clip_grad_by_total_norm_fp32: clip_coeff = max_norm / (total_norm + 1e-6);
// when clip_coeff < 1 every main_grad is multiplied by it (in fp32), otherwise nothing
// changes. A NaN total_norm gives no clipping (Megatron's NaN check is separate).
// Returns the coefficient applied (1 when none).
double clip_grad_by_norm(const std::vector<Param*>& params, double max_norm, double total_norm);

}  // namespace megaton::optim
