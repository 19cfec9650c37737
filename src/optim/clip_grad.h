// Gradient clipping by the global L2 norm of the main gradients.
#pragma once
#include <cstdint>
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

// Elements exactly zero (+0 or -0) over the main grads (Megatron's count_zeros_fp32 behind
// --log-num-zeros-in-grad). grads: F32 or BF16, on one device. F32 tensors are counted
// by ops::multi_tensor_count_zeros in one call; BF16 ones (--main-grads-dtype bf16) are
// widened (exactly: a bf16 is zero iff its fp32 value is) through an fp32 scratch of at
// most 2^24 elements (64 MiB) at a time and counted likewise. Empty list: 0.
int64_t count_zeros_in_grads(const std::vector<Tensor>& grads);

}  // namespace megaton::optim
