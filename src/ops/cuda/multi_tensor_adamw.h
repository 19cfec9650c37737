// multi_tensor_adamw's CUDA overloads with rounding keys (ops/adam_precision.h), defined
// in multi_tensor_adamw.cu (cuda_ops.h has those without), and the fp32 main params kept as
// bf16 weights plus int16 remainders (ops/param_remainder.h), in param_remainder.cu.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"

namespace megaton::ops::cuda {

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys,
                        const AdamMomentScales& scales);
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control,
                        const std::vector<MomentRoundingKey>& rounding_keys,
                        const AdamMomentScales& scales);
// ops/adam_precision.h's multi_tensor_adamw_moment_absmax (checked by its door); control:
// null or adamw_step_control's on the GPU.
void multi_tensor_adamw_moment_absmax(const std::vector<Tensor>& grads,
                                      const std::vector<Tensor>& exp_avg,
                                      const std::vector<Tensor>& exp_avg_sq,
                                      const AdamMomentScales& scales, float beta1, float beta2,
                                      float grad_scale, const float* control);

// ops/param_remainder.h's ops; their doors (ops/cpu/param_remainder.cpp) check every
// argument. control: null (the host scalars lr, step, grad_scale) or adamw_step_control's
// F32 [kAdamControlSize] on the GPU, whose values the kernel reads instead.
void split_param_remainders(const Tensor& master, Tensor& weight, Tensor& remainder);
void join_param_remainders(const Tensor& weight, const Tensor& remainder, Tensor& master);
void multi_tensor_adamw_param_remainder(
    std::vector<Tensor>& params, std::vector<Tensor>& remainders, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const float* control,
    const std::vector<MomentRoundingKey>& rounding_keys, const AdamMomentScales& scales);

}  // namespace megaton::ops::cuda
