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
// so the total is 3 x forward. Only active (routed) expert parameters count. A hybrid
// model counts each layer's parts (model/layer_spec.h): a Mamba-2 mixer as Megatron's
// mamba_layer_flops, 2 x hidden x (2 d_inner + 2 groups x state + heads) for in_proj +
// 7 x d_inner x state for the scan + 2 x d_inner x hidden for out_proj; attention or MLP
// layers alone their one part.
double num_floating_point_operations(const GPTConfig& cfg, int64_t tokens);

// The log line's "throughput per GPU (TFLOP/s/GPU)": one iteration's model FLOPs (of the
// whole global batch) over its time in ms and over the job's processes (GPUs, or CPU
// ranks), in 1e12 FLOP/s, as Megatron-LM training_log divides by args.world_size. Throws
// InternalError unless ms_per_iteration > 0 and world_size >= 1.
double throughput_per_gpu_tflops(double flops_per_iteration, double ms_per_iteration,
                                 int64_t world_size);

}  // namespace megaton
