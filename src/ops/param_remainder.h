// fp32 main params kept as the bf16 weight plus an int16 remainder (Transformer Engine's
// FusedAdam store_param_remainders, Megatron's OptimizerConfig.store_param_remainders): the
// split, the join and the AdamW update over such pairs. The bit rule and its source are in
// ops/param_remainder_math.h. CPU and CUDA give the same bits.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"

namespace megaton::ops {

// Splits fp32 main params into their bf16 weights and int16 remainders:
//   master:    F32, any shape, n elements (read only)
//   weight:    BF16, n elements (written: the main param rounded, ties away from zero)
//   remainder: I16, n elements (written: the main param's low 16 bits), or undefined to
//              write the weight only (the weight a rank holds outside its optimizer shard)
// All on one device. A mismatch of dtype, size or device: InternalError.
void split_param_remainders(const Tensor& master, Tensor& weight, Tensor& remainder);

// The fp32 main params of (weight, remainder) pairs, split_param_remainders' inverse:
//   weight: BF16, n elements; remainder: I16, n elements (read only)
//   master: F32, n elements (written; bitwise the tensor that was split)
// All on one device. A mismatch of dtype, size or device: InternalError.
void join_param_remainders(const Tensor& weight, const Tensor& remainder, Tensor& master);

// ops/adam_precision.h's multi_tensor_adamw (rounding keys, host scalars) over main params
// stored as (weight, remainder) pairs. For each tensor i of the lists:
//   params[i]:     BF16, n_i elements: the compute weight, read and written
//   remainders[i]: I16, n_i elements: its remainder, read and written
//   grads[i]:      F32 or BF16 (--main-grads-dtype bf16), n_i elements: the main grad,
//                  widened to fp32 and times grad_scale as it is read
//   exp_avg[i], exp_avg_sq[i]: F32, BF16, F16 or F8E4M3, n_i elements, read and written
//                  (BF16 stored by stochastic rounding with rounding_keys[i]; F16 and
//                  F8E4M3 scaled by `scales`, as ops/adam_precision.h's multi_tensor_adamw)
//   weight_decays[i]: decoupled weight decay (0 for biases and norms)
// Each element: the fp32 main param joined, the precision-aware update
// (ops/adam_precision_math.h: fp32 arithmetic with explicit fused multiply-adds, for F32
// moments too, so that CPU and GPU agree bitwise), split back
// (adamw_param_remainder_update). The main param after the step is therefore bitwise the
// one that update gives an fp32 main param; the weight is that main param rounded as
// split_param_remainders rounds (ties away from zero, where an fp32 master's bf16 copy is
// rounded to nearest even). lr, betas, eps, step (>= 1) and grad_scale (finite) as in
// ops.h's multi_tensor_adamw; step is also the random bits' counter. Lists of one length
// and tensors of one device, every check before any update: InternalError otherwise.
void multi_tensor_adamw_param_remainder(
    std::vector<Tensor>& params, std::vector<Tensor>& remainders, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys,
    const AdamMomentScales& scales = {});

// The same update with its step decided on the device: control is adamw_step_control's
// (F32 [kAdamControlSize] on the params' device): nothing changes when control[kAdamSkip]
// is nonzero, otherwise the update above with control's learning rate, step count, step
// size, bias correction and gradient scale (no host synchronization on the GPU).
void multi_tensor_adamw_param_remainder(
    std::vector<Tensor>& params, std::vector<Tensor>& remainders, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float beta1, float beta2, float eps,
    const Tensor& control, const std::vector<MomentRoundingKey>& rounding_keys,
    const AdamMomentScales& scales = {});

}  // namespace megaton::ops
