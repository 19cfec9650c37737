// Model FLOPs per iteration.
#include "train/flops.h"

#include "core/error.h"
#include "model/layer_spec.h"

namespace megaton {

double num_floating_point_operations(const GPTConfig& c, int64_t tokens) {
  double h = double(c.hidden_size), s = double(c.seq_length);
  double q = double(c.query_projection_size()), kv = double(c.kv_projection_size());
  double attention = 2.0 * h * (q + 2.0 * kv)  // linear_qkv
                     + 2.0 * q * h             // linear_proj
                     + 2.0 * s * q;            // causal QK^T and PV: 2 x (2 s q / 2)
  if (c.multi_latent_attention) {
    // MLA (Megatron's formula without its norm terms): the q projection(s), the kv down
    // and up projections, linear_proj, and causal QK^T over qk + rope dims and PV over v.
    const double n = double(c.num_attention_heads),
                 dq = double(c.qk_head_dim + c.qk_pos_emb_head_dim), v = double(c.v_head_dim),
                 rq = double(c.q_lora_rank), rkv = double(c.kv_lora_rank);
    const double q_proj = rq > 0 ? 2.0 * (h * rq + rq * n * dq) : 2.0 * h * n * dq;
    attention =
        q_proj +
        2.0 * (h * (rkv + double(c.qk_pos_emb_head_dim)) + rkv * n * (double(c.qk_head_dim) + v)) +
        2.0 * n * v * h + s * n * (dq + v);
  }
  auto mlp = [&](double ffn) {
    double fc1 = 2.0 * h * ffn * (c.swiglu ? 2.0 : 1.0);
    return fc1 + 2.0 * ffn * h;
  };
  // A Mamba-2 mixer (Megatron's mamba_layer_flops): in_proj to [z, x, B, C, dt], the scan
  // as 7 d_inner N, out_proj. (Megatron takes d_inner = 2 hidden even when
  // --mamba-num-heads sets another; here it is heads x head_dim.)
  const double d_in = double(c.mamba_d_inner()),
               gn = double(c.mamba_num_groups * c.mamba_state_dim);
  const double mamba = 2.0 * h * (2.0 * d_in + 2.0 * gn + double(c.mamba_num_heads)) +
                       7.0 * d_in * double(c.mamba_state_dim) + 2.0 * d_in * h;
  double per_token = 0;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const LayerSpec spec = decoder_layer_spec(c, layer);
    if (spec.mixer == MixerKind::Mamba)
      per_token += mamba;
    else if (spec.mixer != MixerKind::None)
      per_token += attention;
    if (spec.mlp == MlpKind::MoE)
      per_token += double(c.moe_router_topk) * mlp(double(c.moe_ffn_hidden_size)) +
                   2.0 * h * double(c.num_experts);
    else if (spec.mlp == MlpKind::Dense)
      per_token += mlp(double(c.ffn_hidden_size));
  }
  per_token += 2.0 * h * double(c.padded_vocab_size);
  // Multi-token prediction: each depth one more layer of the last decoder layer's kind,
  // its eh_proj (2h -> h) and its logits (Megatron's mtp term; norms not counted).
  const int64_t last = c.num_layers - 1;
  for (int64_t k = 0; k < c.mtp_num_layers; ++k) {
    per_token += attention + 2.0 * (2.0 * h) * h + 2.0 * h * double(c.padded_vocab_size);
    if (c.is_moe_layer(last))
      per_token += double(c.moe_router_topk) * mlp(double(c.moe_ffn_hidden_size)) +
                   2.0 * h * double(c.num_experts);
    else
      per_token += mlp(double(c.ffn_hidden_size));
  }
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
