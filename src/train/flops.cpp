// Model FLOPs per iteration.
#include "train/flops.h"

#include "core/error.h"

namespace megaton {

double num_floating_point_operations(const GPTConfig& c, int64_t tokens) {
  double h = double(c.hidden_size), s = double(c.seq_length);
  double q = double(c.query_projection_size()), kv = double(c.kv_projection_size());
  double attention = 2.0 * h * (q + 2.0 * kv)  // linear_qkv
                     + 2.0 * q * h             // linear_proj
                     + 2.0 * s * q;            // causal QK^T and PV: 2 x (2 s q / 2)
  auto mlp = [&](double ffn) {
    double fc1 = 2.0 * h * ffn * (c.swiglu ? 2.0 : 1.0);
    return fc1 + 2.0 * ffn * h;
  };
  double per_token = 0;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    per_token += attention;
    if (c.is_moe_layer(layer))
      per_token += double(c.moe_router_topk) * mlp(double(c.moe_ffn_hidden_size)) +
                   2.0 * h * double(c.num_experts);
    else
      per_token += mlp(double(c.ffn_hidden_size));
  }
  per_token += 2.0 * h * double(c.padded_vocab_size);
  return 3.0 * per_token * double(tokens);
}

double throughput_per_gpu_tflops(double flops_per_iteration, double ms_per_iteration,
                                 int64_t world_size) {
  MEGATON_CHECK(ms_per_iteration > 0 && world_size >= 1,
                "throughput_per_gpu_tflops: {} ms per iteration on {} processes", ms_per_iteration,
                world_size);
  return flops_per_iteration / (ms_per_iteration / 1e3) / double(world_size) / 1e12;
}

}  // namespace megaton
