// SelfAttention forward/backward.
#include "model/attention.h"

#include <cmath>

#include "ops/ops.h"

namespace megaton {

SelfAttention::SelfAttention(const std::string& prefix, const GPTConfig& cfg, int64_t layer,
                             uint64_t seed)
    : linear_qkv(prefix + ".linear_qkv", cfg.hidden_size,
                 cfg.query_projection_size() + 2 * cfg.kv_projection_size(),
                 !cfg.disable_bias_linear, cfg.init_method_std, seed, Placement::of(cfg)),
      linear_proj(prefix + ".linear_proj", cfg.query_projection_size(), cfg.hidden_size,
                  !cfg.disable_bias_linear,
                  cfg.init_method_std / std::sqrt(2.0f * float(cfg.num_layers)), seed,
                  Placement::of(cfg)),
      cfg_(cfg),
      layer_(layer) {}

// Copies between the grouped qkv rows [T, ng, qpg + 2, d] and separate q [T, np, d],
// k, v [T, ng, d]: three strided row copies per query group. to_qkv = false splits,
// true packs (for the gradient).
static void split_or_pack_qkv(Tensor& qkv, Tensor& q, Tensor& k, Tensor& v, int64_t ng,
                              int64_t qpg, int64_t d, bool to_qkv) {
  int64_t tokens = qkv.dim(0), qkv_pitch = ng * (qpg + 2) * d;
  for (int64_t g = 0; g < ng; ++g) {
    int64_t group = g * (qpg + 2) * d;
    struct Part { Tensor& t; int64_t offset, pitch, width, qkv_offset; };
    Part parts[] = {{q, g * qpg * d, ng * qpg * d, qpg * d, group},
                    {k, g * d, ng * d, d, group + qpg * d},
                    {v, g * d, ng * d, d, group + (qpg + 1) * d}};
    for (Part& p : parts) {
      if (to_qkv)
        copy_rows_2d(qkv, p.qkv_offset, qkv_pitch, p.t, p.offset, p.pitch, tokens, p.width);
      else
        copy_rows_2d(p.t, p.offset, p.pitch, qkv, p.qkv_offset, qkv_pitch, tokens, p.width);
    }
  }
}

Tensor SelfAttention::forward(const Tensor& x, int64_t batch, int64_t seq,
                              const ForwardContext& ctx) {
  int64_t np = cfg_.num_attention_heads, ng = cfg_.num_query_groups, d = cfg_.kv_channels;
  Tensor qkv = linear_qkv.forward(x);
  q_ = empty_like(qkv, {batch, seq, np, d});
  k_ = empty_like(qkv, {batch, seq, ng, d});
  v_ = empty_like(qkv, {batch, seq, ng, d});
  split_or_pack_qkv(qkv, q_, k_, v_, ng, np / ng, d, false);
  if (cfg_.position_embedding_type == PositionEmbedding::Rope) {
    ops::rope_forward(q_, q_, cfg_.rotary_base);
    ops::rope_forward(k_, k_, cfg_.rotary_base);
  }
  out_ = empty_like(qkv, {batch, seq, np, d});
  lse_ = Tensor::empty({batch, np, seq}, DType::F32, qkv.device());
  dropout_p_ = ctx.training ? cfg_.attention_dropout : 0.0f;
  seed_ = ctx.seed;
  stream_ = ctx.stream(layer_, 0);
  ops::attention_forward(q_, k_, v_, out_, lse_, dropout_p_, seed_, stream_);
  return linear_proj.forward(out_.view({batch * seq, np * d}));
}

Tensor SelfAttention::backward(const Tensor& dy) {
  int64_t np = cfg_.num_attention_heads, ng = cfg_.num_query_groups, d = cfg_.kv_channels;
  Tensor dout = linear_proj.backward(dy).view(out_.shape());
  Tensor dq = empty_like(q_, q_.shape()), dk = empty_like(k_, k_.shape()),
         dv = empty_like(v_, v_.shape());
  ops::attention_backward(dout, q_, k_, v_, out_, lse_, dq, dk, dv, dropout_p_, seed_, stream_);
  if (cfg_.position_embedding_type == PositionEmbedding::Rope) {
    ops::rope_backward(dq, dq, cfg_.rotary_base);
    ops::rope_backward(dk, dk, cfg_.rotary_base);
  }
  Tensor dqkv = empty_like(dy, {dy.dim(0), (np + 2 * ng) * d});
  split_or_pack_qkv(dqkv, dq, dk, dv, ng, np / ng, d, true);
  q_ = k_ = v_ = out_ = lse_ = Tensor();
  return linear_qkv.backward(dqkv);
}

void SelfAttention::collect_params(std::vector<Param*>& out) {
  linear_qkv.collect_params(out);
  linear_proj.collect_params(out);
}

}  // namespace megaton
