// The MLP kinds of a decoder layer (model/layer_spec.h): a dense MLP and an MoE layer.
#pragma once
#include <memory>
#include <string>

#include "model/layer_spec.h"

namespace megaton {

// Megatron's MLP under "<prefix>.linear_fc1/linear_fc2": ffn_hidden_size, swiglu, biases
// unless disable_bias_linear, fc2 initialised with the scaled init.
std::unique_ptr<MlpBlock> make_dense_mlp_block(const std::string& prefix, const GPTConfig& cfg,
                                               uint64_t seed, const ModelParallel& mp);
// Megatron's MoELayer under "<prefix>.router/experts/shared_experts" (model/moe.h).
std::unique_ptr<MlpBlock> make_moe_mlp_block(const std::string& prefix, const GPTConfig& cfg,
                                             int64_t layer, uint64_t seed,
                                             const ModelParallel& mp);

}  // namespace megaton
