// SelfAttention forward/backward.
#include "model/attention.h"

#include <cmath>

#include "ops/ops.h"

namespace megaton {

static bool uses_rope(const GPTConfig& cfg) {
  return cfg.position_embedding_type == PositionEmbedding::Rope;
}

SelfAttention::SelfAttention(const std::string& prefix, const GPTConfig& cfg, int64_t layer,
                             uint64_t seed, const ModelParallel& mp)
    // Column-parallel QKV: the grouped layout keeps each query group's rows together, so
    // rank r holds query groups [r ng/tp, (r+1) ng/tp) with their heads; row-parallel proj.
    : linear_qkv(prefix + ".linear_qkv", cfg.hidden_size,
                 cfg.query_projection_size() + 2 * cfg.kv_projection_size(),
                 !cfg.disable_bias_linear, cfg.init_method_std, seed, Placement::of(cfg),
                 TensorParallelMode::Column, mp),
      linear_proj(prefix + ".linear_proj", cfg.query_projection_size(), cfg.hidden_size,
                  !cfg.disable_bias_linear,
                  cfg.init_method_std / std::sqrt(2.0f * float(cfg.num_layers)), seed,
                  Placement::of(cfg), TensorParallelMode::Row, mp),
      cfg_(cfg),
      mp_(mp),
      layer_(layer) {}

Tensor SelfAttention::forward(const Tensor& x, int64_t batch, int64_t seq,
                              const ForwardContext& ctx) {
  // This rank's heads and query groups (all of them without tensor parallelism).
  const int64_t np = cfg_.num_attention_heads / mp_.tp_size(),
                ng = cfg_.num_query_groups / mp_.tp_size(), d = cfg_.kv_channels;
  Tensor qkv = linear_qkv.forward(x);
  q_ = empty_like(qkv, {batch, seq, np, d});
  k_ = empty_like(qkv, {batch, seq, ng, d});
  v_ = empty_like(qkv, {batch, seq, ng, d});
  // Megatron's grouped [T, ng, np/ng + 2, d] rows -> q, k, v, with RoPE on q and k.
  ops::qkv_split_rope(qkv, batch, ng, q_, k_, v_, uses_rope(cfg_), cfg_.rotary_base);
  out_ = empty_like(qkv, {batch, seq, np, d});
  lse_ = Tensor::empty({batch, np, seq}, DType::F32, qkv.device());
  dropout_p_ = ctx.training ? cfg_.attention_dropout : 0.0f;
  seed_ = ctx.seed;
  stream_ = ctx.stream(layer_, 0);
  ops::attention_forward(q_, k_, v_, out_, lse_, dropout_p_, seed_, stream_);
  return linear_proj.forward(out_.view({batch * seq, np * d}));
}

Tensor SelfAttention::backward(const Tensor& dy) {
  // This rank's heads and query groups (all of them without tensor parallelism).
  const int64_t np = cfg_.num_attention_heads / mp_.tp_size(),
                ng = cfg_.num_query_groups / mp_.tp_size(), d = cfg_.kv_channels;
  Tensor dout = linear_proj.backward(dy).view(out_.shape());
  Tensor dq = empty_like(q_, q_.shape()), dk = empty_like(k_, k_.shape()),
         dv = empty_like(v_, v_.shape());
  ops::attention_backward(dout, q_, k_, v_, out_, lse_, dq, dk, dv, dropout_p_, seed_, stream_);
  Tensor dqkv = empty_like(dy, {q_.dim(0) * q_.dim(1), (np + 2 * ng) * d});
  ops::qkv_pack_rope_backward(dq, dk, dv, ng, uses_rope(cfg_), cfg_.rotary_base, dqkv);
  q_ = k_ = v_ = out_ = lse_ = Tensor();
  return linear_qkv.backward(dqkv);
}

void SelfAttention::collect_params(std::vector<Param*>& out) {
  linear_qkv.collect_params(out);
  linear_proj.collect_params(out);
}

}  // namespace megaton
