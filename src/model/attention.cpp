// SelfAttention forward/backward.
#include "model/attention.h"

#include <cmath>
#include <utility>

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
  Saved& s = saved_;
  s.q = empty_like(qkv, {batch, seq, np, d});
  s.k = empty_like(qkv, {batch, seq, ng, d});
  s.v = empty_like(qkv, {batch, seq, ng, d});
  // Megatron's grouped [T, ng, np/ng + 2, d] rows -> q, k, v, with RoPE on q and k.
  ops::qkv_split_rope(qkv, batch, ng, s.q, s.k, s.v, uses_rope(cfg_), cfg_.rotary_base);
  s.out = empty_like(qkv, {batch, seq, np, d});
  s.lse = Tensor::empty({batch, np, seq}, DType::F32, qkv.device());
  s.dropout_p = ctx.training ? cfg_.attention_dropout : 0.0f;
  s.seed = ctx.seed;
  s.stream = ctx.stream(layer_, 0);
  ops::attention_forward(s.q, s.k, s.v, s.out, s.lse, s.dropout_p, s.seed, s.stream);
  return linear_proj.forward(s.out.view({batch * seq, np * d}));
}

Tensor SelfAttention::backward(const Tensor& dy) {
  MEGATON_CHECK(saved_.q.defined(), "SelfAttention of layer {}: backward without a forward",
                layer_);
  const Saved s = std::exchange(saved_, {});
  // This rank's heads and query groups (all of them without tensor parallelism).
  const int64_t np = cfg_.num_attention_heads / mp_.tp_size(),
                ng = cfg_.num_query_groups / mp_.tp_size(), d = cfg_.kv_channels;
  Tensor dout = linear_proj.backward(dy).view(s.out.shape());
  Tensor dq = empty_like(s.q, s.q.shape()), dk = empty_like(s.k, s.k.shape()),
         dv = empty_like(s.v, s.v.shape());
  ops::attention_backward(dout, s.q, s.k, s.v, s.out, s.lse, dq, dk, dv, s.dropout_p, s.seed,
                          s.stream);
  Tensor dqkv = empty_like(dy, {s.q.dim(0) * s.q.dim(1), (np + 2 * ng) * d});
  ops::qkv_pack_rope_backward(dq, dk, dv, ng, uses_rope(cfg_), cfg_.rotary_base, dqkv);
  return linear_qkv.backward(dqkv);
}

SelfAttention::Activations SelfAttention::take_saved() {
  return {std::exchange(saved_, {}), linear_qkv.take_saved(), linear_proj.take_saved()};
}

void SelfAttention::restore_saved(Activations&& saved) {
  saved_ = std::move(saved.attention);
  linear_qkv.restore_saved(std::move(saved.linear_qkv));
  linear_proj.restore_saved(std::move(saved.linear_proj));
}

void SelfAttention::collect_params(std::vector<Param*>& out) {
  linear_qkv.collect_params(out);
  linear_proj.collect_params(out);
}

}  // namespace megaton
