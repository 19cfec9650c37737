// The CUDA side of ops/adam_f16_main_param.h (fp16 main params with a per-tensor scale),
// defined in adam_f16_main_param.cu; checked by the doors in ops/cpu/adam_f16_main_param.cpp.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "ops/adam_f16_main_param.h"

namespace megaton::ops::cuda {

void multi_tensor_adamw_f16_main_param_absmax(
    const std::vector<Tensor>& masters, const std::vector<Tensor>& grads,
    const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
    const AdamMomentScales& moment_scales, const AdamMainParamScales& main_scales,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const Tensor& control);

void multi_tensor_adamw_f16_main_param(
    std::vector<Tensor>& masters, std::vector<Tensor>& copies, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const Tensor& control,
    const std::vector<MomentRoundingKey>& rounding_keys, const AdamMomentScales& moment_scales,
    const AdamMainParamScales& main_scales);

}  // namespace megaton::ops::cuda
