// Param: one trainable tensor with its fp32 main gradient.
#pragma once
#include <string>

#include "core/tensor.h"

namespace megaton {

// A model parameter. `weight` is the fp32 main parameter (on CPU it is also the compute
// copy); `main_grad` (same shape, fp32) accumulates gradients over micro-batches and is
// zeroed by the trainer after each optimizer step. `name` follows the checkpoint key
// (e.g. "decoder.layers.0.self_attention.linear_qkv.weight").
struct Param {
  std::string name;
  Tensor weight;
  Tensor main_grad;
  // Megatron applies no weight decay to biases and normalization weights.
  bool no_weight_decay = false;
};

}  // namespace megaton
