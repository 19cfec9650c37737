// multi_tensor_adamw's CUDA overloads with rounding keys (ops/adam_precision.h), defined
// in multi_tensor_adamw.cu; cuda_ops.h has those without.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "ops/adam_precision_math.h"

namespace megaton::ops::cuda {

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys);
void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control,
                        const std::vector<MomentRoundingKey>& rounding_keys);

}  // namespace megaton::ops::cuda
