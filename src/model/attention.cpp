// SelfAttention forward/backward.
#include "model/attention.h"

#include <cmath>
#include <utility>

#include "model/core_attention.h"
#include "model/main_grad.h"
#include "ops/muon.h"
#include "ops/ops.h"

namespace megaton {

static bool uses_rope(const GPTConfig& cfg) {
  return cfg.position_embedding_type == PositionEmbedding::Rope;
}

// The per-token RoPE positions of packed documents (--reset-position-ids), or undefined.
static Tensor position_ids(const std::shared_ptr<const PackedSeqParams>& packed) {
  return packed ? packed->position_ids : Tensor();
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
                  cfg.scaled_init_method_std(), seed,
                  Placement::of(cfg), TensorParallelMode::Row, mp),
      cfg_(cfg),
      mp_(mp),
      layer_(layer) {
  // Muon orthogonalises Q, K and V apart (Megatron's is_qkv / qkv_split_shapes). A rank
  // holds whole query groups (dist/grid.cpp requires tp | num_query_groups), so its slice
  // splits as the whole weight does.
  linear_qkv.weight.qkv_split_rows =
      ops::qkv_split_shapes(cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels);
  if (cfg.qk_layernorm) {
    // Replicated over TP but each rank normalises its own heads: the gradient is a partial
    // sum over the tensor-parallel group, summed after backward (with or without
    // --sequence-parallel) as for the sequence-parallel norms.
    const bool tp_partial_grad = mp.tp_size() > 1;
    q_layernorm =
        std::make_unique<Norm>(prefix + ".q_layernorm", cfg.kv_channels, cfg.normalization,
                               cfg.norm_epsilon, Placement::of(cfg), tp_partial_grad);
    k_layernorm =
        std::make_unique<Norm>(prefix + ".k_layernorm", cfg.kv_channels, cfg.normalization,
                               cfg.norm_epsilon, Placement::of(cfg), tp_partial_grad);
  }
}

ops::QkNorm SelfAttention::qk_norm() const {
  // The Norm objects were built from these two config values.
  ops::QkNorm norm;
  norm.type = cfg_.normalization == Normalization::LayerNorm ? ops::QkNormType::LayerNorm
                                                             : ops::QkNormType::RMSNorm;
  norm.eps = cfg_.norm_epsilon;
  norm.q_weight = q_layernorm->weight.weight;
  norm.k_weight = k_layernorm->weight.weight;
  norm.q_bias = q_layernorm->bias.weight;  // undefined for RMSNorm
  norm.k_bias = k_layernorm->bias.weight;
  return norm;
}

Tensor SelfAttention::forward(const Tensor& x, int64_t batch, int64_t seq,
                              const ForwardContext& ctx) {
  // This rank's heads and query groups (all of them without tensor parallelism).
  const int64_t np = cfg_.num_attention_heads / mp_.tp_size(),
                ng = cfg_.num_query_groups / mp_.tp_size(), d = cfg_.kv_channels;
  Tensor qkv = linear_qkv.forward(x, keep_qkv_input_);
  Saved& s = saved_;
  s.packed = ctx.packed_seq_params;
  const Tensor positions = position_ids(s.packed);
  s.q = empty_like(qkv, {batch, seq, np, d});
  s.k = empty_like(qkv, {batch, seq, ng, d});
  s.v = empty_like(qkv, {batch, seq, ng, d});
  if (!q_layernorm) {
    // Megatron's grouped [T, ng, np/ng + 2, d] rows -> q, k, v, with RoPE on q and k.
    ops::qkv_split_rope(qkv, batch, ng, s.q, s.k, s.v, uses_rope(cfg_), cfg_.rotary_base,
                        positions, cfg_.rotary_dim());
  } else {
    // Split, normalise each query and key head, then RoPE (Megatron: q_layernorm /
    // k_layernorm before apply_rotary_pos_emb), in one pass. It keeps the split q and k and
    // the norms' statistics for backward.
    ops::QkNormSaved& n = s.qk_norm;
    n.q_input = empty_like(qkv, s.q.shape());
    n.k_input = empty_like(qkv, s.k.shape());
    n.q_rstd = Tensor::empty({batch * seq * np}, DType::F32, qkv.device());
    n.k_rstd = Tensor::empty({batch * seq * ng}, DType::F32, qkv.device());
    if (cfg_.normalization == Normalization::LayerNorm) {
      n.q_mean = Tensor::empty({batch * seq * np}, DType::F32, qkv.device());
      n.k_mean = Tensor::empty({batch * seq * ng}, DType::F32, qkv.device());
    }
    ops::qkv_split_norm_rope(qkv, batch, ng, qk_norm(), uses_rope(cfg_), cfg_.rotary_base, s.q, s.k,
                             s.v, n, positions, cfg_.rotary_dim());
  }
  s.out = empty_like(qkv, {batch, seq, np, d});
  s.lse = Tensor::empty(core_attention_lse_shape(s.packed.get(), batch, seq, np), DType::F32,
                        qkv.device());
  s.dropout_p = ctx.training ? cfg_.attention_dropout : 0.0f;
  s.seed = ctx.seed;
  s.stream = ctx.stream(layer_, 0);
  core_attention_forward(s.q, s.k, s.v, s.out, s.lse, s.packed.get(), s.dropout_p, s.seed,
                         s.stream);
  Tensor y = linear_proj.forward(s.out.view({batch * seq, np * d}), keep_core_attn_out_);
  if (!keep_core_attn_out_) s.out = s.lse = Tensor();  // remade in backward (core_attn)
  return y;
}

Tensor SelfAttention::backward(const Tensor& dy, const std::function<Tensor()>& qkv_input) {
  MEGATON_CHECK(saved_.q.defined(), "SelfAttention of layer {}: backward without a forward",
                layer_);
  MEGATON_CHECK(keep_qkv_input_ || qkv_input,
                "SelfAttention of layer {}: backward needs linear_qkv's input, not kept", layer_);
  Saved s = std::exchange(saved_, {});
  // This rank's heads and query groups (all of them without tensor parallelism).
  const int64_t np = cfg_.num_attention_heads / mp_.tp_size(),
                ng = cfg_.num_query_groups / mp_.tp_size(), d = cfg_.kv_channels;
  Tensor dout;
  if (s.out.defined()) {
    dout = linear_proj.backward(dy).view(s.out.shape());
  } else {
    // core_attn recompute: the attention forward again from the kept q, k, v (the same
    // kernel, inputs and dropout key: the same bits), then linear_proj's backward with it.
    s.out = empty_like(s.q, s.q.shape());
    s.lse = Tensor::empty(core_attention_lse_shape(s.packed.get(), s.q.dim(0), s.q.dim(1), np),
                          DType::F32, s.q.device());
    core_attention_forward(s.q, s.k, s.v, s.out, s.lse, s.packed.get(), s.dropout_p, s.seed,
                           s.stream);
    dout = linear_proj.backward(dy, s.out.view({s.q.dim(0) * s.q.dim(1), np * d}))
               .view(s.out.shape());
  }
  Tensor dq = empty_like(s.q, s.q.shape()), dk = empty_like(s.k, s.k.shape()),
         dv = empty_like(s.v, s.v.shape());
  core_attention_backward(dout, s.q, s.k, s.v, s.out, s.lse, s.packed.get(), dq, dk, dv,
                          s.dropout_p, s.seed, s.stream);
  const Tensor positions = position_ids(s.packed);
  Tensor dqkv = empty_like(dy, {s.q.dim(0) * s.q.dim(1), (np + 2 * ng) * d});
  if (!q_layernorm) {
    ops::qkv_pack_rope_backward(dq, dk, dv, ng, uses_rope(cfg_), cfg_.rotary_base, dqkv, positions,
                                cfg_.rotary_dim());
  } else {
    // Inverse RoPE, the norms' backward and the pack in one pass; the norms' weight (and
    // bias) gradients accumulate into their main grads, which the trainer reduces over
    // tensor parallelism after backward (Param::sequence_parallel, set by Norm).
    accumulate_main_grads({&q_layernorm->weight.main_grad, &k_layernorm->weight.main_grad,
                           &q_layernorm->bias.main_grad, &k_layernorm->bias.main_grad},
                          [&](std::vector<Tensor>& g) {
                            ops::QkNormGrads grads{g[0], g[1], g[2], g[3]};
                            ops::qkv_pack_norm_rope_backward(dq, dk, dv, s.qk_norm, ng, qk_norm(),
                                                             uses_rope(cfg_), cfg_.rotary_base,
                                                             dqkv, grads, positions,
                                                             cfg_.rotary_dim());
                          });
    s.qk_norm = {};  // freed before linear_qkv's backward, as the unfused norms' inputs were
  }
  s = {};  // q, k, v, the output and the statistics are used up
  if (keep_qkv_input_) return linear_qkv.backward(dqkv);
  return linear_qkv.backward(dqkv, qkv_input());
}

Tensor SelfAttention::forward_inference(const Tensor& x, int64_t first_position,
                                        Tensor& key_cache, Tensor& value_cache) const {
  MEGATON_CHECK(mp_.tp_size() == 1, "SelfAttention of layer {}: inference runs on one rank",
                layer_);
  const int64_t n = x.dim(0), np = cfg_.num_attention_heads, ng = cfg_.num_query_groups,
                d = cfg_.kv_channels;
  const Shape cache_shape{key_cache.dim(0), ng, d};
  MEGATON_CHECK(key_cache.shape() == cache_shape && value_cache.shape() == cache_shape,
                "SelfAttention of layer {}: caches {} and {}, expected {}", layer_,
                shape_str(key_cache.shape()), shape_str(value_cache.shape()),
                shape_str(cache_shape));
  MEGATON_CHECK(first_position >= 0 && first_position + n <= key_cache.dim(0),
                "SelfAttention of layer {}: positions [{}, {}) outside the cache's {}", layer_,
                first_position, first_position + n, key_cache.dim(0));
  const Tensor qkv = linear_qkv.forward_inference(x);
  Tensor q = empty_like(qkv, {1, n, np, d}), k = empty_like(qkv, {1, n, ng, d}),
         v = empty_like(qkv, {1, n, ng, d});
  // The split alone: the fused RoPE of the training path rotates by the position within
  // the micro-batch, here the positions start at first_position.
  ops::qkv_split_rope(qkv, 1, ng, q, k, v, /*apply_rope=*/false, cfg_.rotary_base);
  if (q_layernorm) {
    q = q_layernorm->forward_inference(q.view({n * np, d})).view(q.shape());
    k = k_layernorm->forward_inference(k.view({n * ng, d})).view(k.shape());
  }
  if (uses_rope(cfg_)) {
    ops::rope_forward(q, q, cfg_.rotary_base, first_position, cfg_.rotary_dim());
    ops::rope_forward(k, k, cfg_.rotary_base, first_position, cfg_.rotary_dim());
  }
  Tensor key_rows = key_cache.rows(first_position, n), value_rows = value_cache.rows(first_position, n);
  key_rows.copy_from(k);
  value_rows.copy_from(v);
  Tensor out = empty_like(qkv, {n, np, d});
  ops::attention_kv_cache(q.view({n, np, d}), key_cache, value_cache, first_position, out);
  return linear_proj.forward_inference(out.view({n, np * d}));
}

SelfAttention::Activations SelfAttention::take_saved() {
  Activations out;
  out.attention = std::exchange(saved_, {});
  out.linear_qkv = linear_qkv.take_saved();
  out.linear_proj = linear_proj.take_saved();
  return out;
}

void SelfAttention::restore_saved(Activations&& saved) {
  saved_ = std::move(saved.attention);
  linear_qkv.restore_saved(std::move(saved.linear_qkv));
  linear_proj.restore_saved(std::move(saved.linear_proj));
}

void SelfAttention::collect_params(std::vector<Param*>& out) {
  linear_qkv.collect_params(out);
  linear_proj.collect_params(out);
  if (q_layernorm) {
    q_layernorm->collect_params(out);
    k_layernorm->collect_params(out);
  }
}

}  // namespace megaton
