// fp16 main params with a per-tensor scale (--main-params-dtype fp16; Transformer Engine's
// FusedAdam with master_weight_dtype torch.float16): quantize / dequantize, and the AdamW
// update over them (its absmax pass, then the update that writes the compute weight from
// the new fp32 value and re-quantizes the main param). Element math and sources:
// ops/adam_f16_main_param_math.h. CPU and CUDA give the same bits.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "ops/adam_precision.h"

namespace megaton::ops {

// The scales of fp16 main params, one entry per tensor of the lists, on their device:
//   scale[i]:  F32 [1]: value = stored * scale. The update reads it and then writes
//              absmax / 32752 (not when a control tensor skips the step).
//   absmax[i]: F32 [1]: max |new value| of the parameter, written (max-combined: the
//              caller zeroes it first) by multi_tensor_adamw_f16_main_param_absmax, then
//              reduced by the caller over the ranks holding other pieces of the same
//              parameter, then read by the update.
struct AdamMainParamScales {
  std::vector<Tensor> scale;
  std::vector<Tensor> absmax;
};

// stored = value * (1 / scale) rounded to nearest even, scale_out = scale:
//   value:  F32, n elements (read);  stored: F16, n elements (written);
//   scale:  f16_main_param_scale(absmax of the whole parameter value belongs to: the
//           caller reduces it over ranks holding other pieces), or a checkpoint's;
//   scale_out: F32 [1] (written).
// Any device (a GPU tensor goes through the host: for construction and loading only).
// InternalError on dtype, size or device mismatch.
void f16_main_param_quantize(const Tensor& value, float scale, Tensor& stored, Tensor& scale_out);

// The scale of an fp16 main param whose values have absolute maximum absmax: absmax / 32752.
float f16_main_param_scale(float absmax);

// value = float(stored) * scale: stored F16, scale F32 [1], value F32 with stored's numel
// (written). Any device (through the host on the GPU). InternalError on mismatch.
void f16_main_param_dequantize(const Tensor& stored, const Tensor& scale, Tensor& value);

// max |x| of an F32 tensor (host synchronization on the GPU): NaN if any element is NaN.
float f16_main_param_absmax(const Tensor& value);

// The first pass of an fp16-main-param update: main_scales.absmax[i][0] =
// max(itself, max |new main param|) over tensor i's elements, the new value being the
// update's own bits (adamw_precision_update of the stored value times scale[i]).
//   masters:   F16, n_i elements (read);  grads: F32 or BF16, n_i (read)
//   exp_avg, exp_avg_sq: F32, BF16, F16 or F8E4M3, n_i (read; scaled ones with
//              moment_scales, of which only the old scales are read)
//   weight_decays, lr, beta1, beta2, eps, step (>= 1), grad_scale: as multi_tensor_adamw;
//   control:   undefined (host scalars), or adamw_step_control's F32 [kAdamControlSize] on
//              the lists' device (its lr, step, step size and grad scale are read; a
//              skipped step still writes absmax, which the update then ignores).
// InternalError on list lengths, dtypes, sizes, devices.
void multi_tensor_adamw_f16_main_param_absmax(
    const std::vector<Tensor>& masters, const std::vector<Tensor>& grads,
    const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
    const AdamMomentScales& moment_scales, const AdamMainParamScales& main_scales,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const Tensor& control);

// The AdamW update of fp16 main params (ops/adam_precision.h's multi_tensor_adamw with
// rounding keys): for each element, the main param's fp32 value (stored * scale[i]) and
// the moments updated in fp32 (adamw_precision_update); the compute weight copies[i]
// (BF16 or F16, n_i elements) written from the new fp32 value rounded to nearest even;
// the main param stored as the new value times 1 / (absmax[i] / 32752) rounded to nearest
// even; the moments stored as multi_tensor_adamw stores them (stochastic rounding for
// BF16/F16/F8E4M3 with rounding_keys[i] and step). After every tensor: scale[i] =
// absmax[i] / 32752 and the scaled moments' new scales. Nothing changes when control skips.
// Arguments as multi_tensor_adamw_f16_main_param_absmax's (which must have filled and the
// caller reduced main_scales.absmax at this step); InternalError on any mismatch.
void multi_tensor_adamw_f16_main_param(
    std::vector<Tensor>& masters, std::vector<Tensor>& copies, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const Tensor& control,
    const std::vector<MomentRoundingKey>& rounding_keys, const AdamMomentScales& moment_scales,
    const AdamMainParamScales& main_scales);

}  // namespace megaton::ops
