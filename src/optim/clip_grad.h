// Gradient clipping by the global L2 norm of the main gradients.
#pragma once
#include <vector>

#include "model/param.h"

namespace megaton::optim {

// sqrt(sum over params of sum(main_grad^2)), accumulated in fp64. Megatron's
// get_grad_norm_fp32 with norm_type 2 over one rank's params (the distributed version
// all-reduces the squared sum first). NaN or inf if any gradient element is.
double global_grad_norm(const std::vector<Param*>& params);

// The factor Megatron's clip_grad_by_total_norm_fp32 multiplies every main_grad by:
// clip_coeff = max_norm / (total_norm + 1e-6) when that is < 1, otherwise 1 (no
// clipping). A NaN total_norm gives 1 (Megatron's NaN check is separate). max_norm and
// total_norm in the gradients' units (L2 norms). The trainer passes it to
// AdamW::step(lr, grad_scale), which folds it into the update instead of scaling the
// gradients in a pass of their own.
double clip_coefficient(double max_norm, double total_norm);

// Megatron's clip_grad_by_total_norm_fp32: every main_grad multiplied (in fp32) by
// float(clip_coefficient(max_norm, total_norm)) when that is < 1, otherwise nothing
// changes. Returns the coefficient applied (1 when none).
double clip_grad_by_norm(const std::vector<Param*>& params, double max_norm, double total_norm);

}  // namespace megaton::optim
