// multi_tensor_adamw with the stochastic-rounding keys of bf16 Adam moments (the
// precision-aware optimizer, ops/adam_precision_math.h).
#pragma once
#include <vector>

#include "core/tensor.h"
#include "ops/adam_precision_math.h"
#include "ops/adam_scaled_state_math.h"

namespace megaton::ops {

// The per-tensor fp32 scales of moments stored in F16 or F8E4M3 (--exp-avg-dtype /
// --exp-avg-sq-dtype fp16|fp8: ops/adam_scaled_state_math.h), one entry per tensor of the
// lists, each on the lists' device (views are fine):
//   scale[i]:  F32 [2], {exp_avg's scale, exp_avg_sq's}: the stored values times it are the
//              moments. The update reads it, then writes the new scales (unless a control
//              tensor skips the step); entries of F32 and BF16 moments are left as they are.
//   absmax[i]: F32 [2], the absolute maxima of the new moments: written by
//              multi_tensor_adamw_moment_absmax, then (the caller's part) reduced with a max
//              over the ranks that hold other pieces of the same parameter, then read by the
//              update: new scale = absmax / range (kF16StateRange, kF8E4M3StateRange).
// Empty vectors: no list entry may have an F16 or F8E4M3 moment (InternalError).
struct AdamMomentScales {
  std::vector<Tensor> scale;
  std::vector<Tensor> absmax;
  bool empty() const { return scale.empty(); }
};

// The first pass of an update with scaled moments: for each tensor i whose exp_avg (or
// exp_avg_sq) is F16 or F8E4M3, scales.absmax[i][0] (or [1]) = max |new value| over its
// elements, the new value being adamw_precision_moments' (the update's own bits) of the
// stored moment times scales.scale[i]; entries of F32 and BF16 moments are not written.
//   grads, exp_avg, exp_avg_sq: as multi_tensor_adamw's (read only).
//   grad_scale: the host path's; control: undefined, or adamw_step_control's (its
//   kAdamGradScale is read instead; a skipped step still writes absmax, which the update
//   then ignores).
// A NaN anywhere makes the absmax NaN (the max is taken on |x|'s bits, so it is the same in
// any order and on every device). InternalError on list lengths, dtypes, sizes, devices.
void multi_tensor_adamw_moment_absmax(const std::vector<Tensor>& grads,
                                      const std::vector<Tensor>& exp_avg,
                                      const std::vector<Tensor>& exp_avg_sq,
                                      const AdamMomentScales& scales, float beta1, float beta2,
                                      float grad_scale, const Tensor& control);

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
// deterministic, but the bits then follow the list's order; optim::AdamW always passes its
// params' keys. Checks as ops.h's, plus the list length of rounding_keys and each key's
// values (>= 0): InternalError.
// Moments may also be F16 or F8E4M3 (scaled: ops/adam_scaled_state_math.h) when `scales`
// is given and multi_tensor_adamw_moment_absmax has filled (and the caller reduced)
// scales.absmax for these lists at this step: they are read as stored * scale, updated as
// BF16 ones are (fp32 arithmetic), stored as value / new scale rounded stochastically with
// the same random bits, and the new scales written to scales.scale after every tensor is
// updated (not at all when control skips the step).
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys,
                        const AdamMomentScales& scales = {});
// ops.h's multi_tensor_adamw reading its step from control (adamw_step_control's), with
// rounding keys as above; the step count control[kAdamStep] is the random bits' counter.
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control,
                        const std::vector<MomentRoundingKey>& rounding_keys,
                        const AdamMomentScales& scales = {});

// The AdamStateKind of a moment's dtype (F32, BF16, F16, F8E4M3); InternalError naming op
// otherwise.
AdamStateKind adam_state_kind(DType dtype, const char* op);

// The checks of scales against the lists (both devices): empty, or one F32 [2] scale and
// absmax per tensor on `device`; every F16 or F8E4M3 moment needs them. InternalError.
void check_moment_scales(const AdamMomentScales& scales, const std::vector<Tensor>& exp_avg,
                         const std::vector<Tensor>& exp_avg_sq, Device device, const char* op);

// The keys the ops.h overloads use for a list of n tensors (tensor i keyed by i).
std::vector<MomentRoundingKey> list_order_rounding_keys(size_t n);

// rounding_keys' checks: n entries, every value >= 0, stride >= run when run > 0.
// InternalError naming `op` and the entry.
void check_rounding_keys(const std::vector<MomentRoundingKey>& rounding_keys, size_t n,
                         const char* op);

}  // namespace megaton::ops
