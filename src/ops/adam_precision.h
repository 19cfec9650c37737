// multi_tensor_adamw with the stochastic-rounding keys of bf16 Adam moments (the
// precision-aware optimizer, ops/adam_precision_math.h).
#pragma once
#include <vector>

#include "core/tensor.h"
#include "ops/adam_precision_math.h"

namespace megaton::ops {

// ops.h's multi_tensor_adamw (host scalars), where a BF16 moment is stored by stochastic
// rounding (bf16_round_stochastic) with the random bits of MomentRoundingStream:
//   rounding_keys: one per tensor of the lists (the same length), rounding_keys[i] naming
//                  the parameter params[i] belongs to and where its elements sit in it
//                  (MomentRoundingKey), so that the bits do not depend on how parameters
//                  are split over ranks or listed. Unused by tensors whose two moments
//                  are F32 (the fp32-state update, bitwise as ops.h's).
//   step:          also the random bits' counter (each step draws new bits).
// The same bits on the CPU and the GPU. grads may be F32 or BF16 (--main-grads-dtype bf16)
// in every multi_tensor_adamw overload, these and ops.h's: a BF16 main grad is widened to
// fp32 as it is read (exact), so its update is bitwise that of an F32 grad holding the
// same values; nothing else depends on the grads' dtype.
// The ops.h overloads (no keys) key tensor i by {param_key = i, offset 0, run 0, base 0}:
// deterministic, but the bits then follow the list's order; optim::AdamW always passes its params' keys. Checks as ops.h's, plus the
// list length of rounding_keys and each key's values (>= 0): InternalError.
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys);
// ops.h's multi_tensor_adamw reading its step from control (adamw_step_control's), with
// rounding keys as above; the step count control[kAdamStep] is the random bits' counter.
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control,
                        const std::vector<MomentRoundingKey>& rounding_keys);

// The keys the ops.h overloads use for a list of n tensors (tensor i keyed by i).
std::vector<MomentRoundingKey> list_order_rounding_keys(size_t n);

// rounding_keys' checks: n entries, every value >= 0, stride >= run when run > 0.
// InternalError naming `op` and the entry.
void check_rounding_keys(const std::vector<MomentRoundingKey>& rounding_keys, size_t n,
                         const char* op);

}  // namespace megaton::ops
