// Model FLOPs per iteration: the count behind "throughput per GPU (TFLOP/s/GPU)".
#pragma once
#include <cstdint>

#include "model/config.h"

namespace megaton {

// Floating-point operations of one forward + backward over `tokens` tokens of length
// `seq_length` (Megatron-LM training.py num_floating_point_operations, restated in
// docs/flops.md): per token and layer, 2 x (QKV + attention output projection GEMMs),
// 2 x seq x heads x kv_channels for causal core attention (QK^T and PV, half the
// positions), the MLP (x3/2 for SwiGLU) or, for MoE layers, top-k experts' MLPs plus the
// router; plus the logits 2 x hidden x padded vocab. Backward costs twice the forward,
// so the total is 3 x forward. Only active (routed) expert parameters count.
double num_floating_point_operations(const GPTConfig& cfg, int64_t tokens);

}  // namespace megaton
