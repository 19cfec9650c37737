// The CUDA side of ops/sgd_lion.h (sgd_lion.cu): multi-tensor launches of the SGD and Lion
// updates, reached through the doors in ops/cpu/sgd_lion.cpp, which check every list first
// (the lists are not empty here).
#pragma once
#include <vector>

#include "core/tensor.h"

namespace megaton::ops::cuda {

void multi_tensor_sgd(std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                      std::vector<Tensor>& momentum_bufs, std::vector<Tensor>& copies,
                      const std::vector<float>& weight_decays, float momentum,
                      const Tensor& control);

void multi_tensor_lion(std::vector<Tensor>& mains, const std::vector<Tensor>& grads,
                       std::vector<Tensor>& exp_avgs, std::vector<Tensor>& copies,
                       const std::vector<float>& weight_decays, float beta1, float beta2,
                       const Tensor& control);

}  // namespace megaton::ops::cuda
