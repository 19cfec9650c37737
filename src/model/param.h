// Param: one trainable tensor with its fp32 main gradient.
#pragma once
#include <string>

#include "core/tensor.h"

namespace megaton {

// A model parameter on the model's device. `weight` is the compute copy the layers use
// (bf16 in a bf16 GPU run, else fp32); `main_param` is the fp32 master copy the optimizer
// updates (the same tensor as `weight` when the compute dtype is fp32); `main_grad`
// (fp32, same shape) accumulates gradients over micro-batches and is zeroed by the
// trainer before each step. `name` follows the checkpoint key
// (e.g. "decoder.layers.0.self_attention.linear_qkv.weight").
struct Param {
  std::string name;
  Tensor weight;
  Tensor main_param;
  Tensor main_grad;
  // Megatron applies no weight decay to biases and normalization weights.
  bool no_weight_decay = false;
  // An expert's weight (MoE experts, not the router): its gradient is reduced over the
  // expert-data-parallel group and it lives in the expert ParamAndGradBuffer.
  bool is_expert = false;
};

}  // namespace megaton
