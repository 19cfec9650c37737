// MLASelfAttention forward/backward (model/mla.h) and its Mixer adapter.
#include "model/mla.h"

#include "model/attention_mixer.h"

#include <cmath>
#include <utility>

#include "model/core_attention.h"
#include "model/rope_scaling.h"
#include "model/saved_tensors.h"
#include "model/tensor_parallel.h"
#include "ops/mla.h"
#include "ops/ops.h"

namespace megaton {

namespace {

// RoPE's frequencies for the MLA's rope part: Megatron's RotaryEmbedding (fp32, as
// ops::rope_forward computes them) for --rope-type rope, YaRN's otherwise.
std::vector<float> mla_inv_freq(const GPTConfig& cfg) {
  const int64_t dim = cfg.qk_pos_emb_head_dim;
  std::vector<float> out(size_t(dim / 2));
  if (cfg.rope_type == RopeType::Rope) {
    for (int64_t i = 0; i < dim / 2; ++i)
      out[size_t(i)] = 1.0f / std::pow(cfg.rotary_base, float(2 * i) / float(dim));
  } else {
    const std::vector<double> f = yarn_inv_freq(dim, double(cfg.rotary_base), cfg.yarn);
    for (size_t i = 0; i < f.size(); ++i) out[i] = float(f[i]);
  }
  return out;
}

// A replicated linear fed by this rank's rows under SP: its gradient is a partial sum.
void mark_sequence_parallel(Linear& linear, const ModelParallel& mp) {
  const bool partial = mp.sequence_parallel && mp.tp_size() > 1;
  linear.weight.sequence_parallel = partial;
  if (linear.bias.weight.defined()) linear.bias.sequence_parallel = partial;
}

}  // namespace

MLASelfAttention::MLASelfAttention(const std::string& prefix, const GPTConfig& cfg,
                                   int64_t layer, uint64_t seed, const ModelParallel& mp)
    : linear_kv_down_proj(prefix + ".linear_kv_down_proj", cfg.hidden_size,
                          cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, false, cfg.init_method_std,
                          seed, Placement::of(cfg), TensorParallelMode::None, mp),
      linear_kv_up_proj(prefix + ".linear_kv_up_proj", cfg.kv_lora_rank,
                        cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim), false,
                        cfg.init_method_std, seed, Placement::of(cfg),
                        TensorParallelMode::Column, mp),
      linear_proj(prefix + ".linear_proj", cfg.num_attention_heads * cfg.v_head_dim,
                  cfg.hidden_size, !cfg.disable_bias_linear, cfg.scaled_init_method_std(), seed,
                  Placement::of(cfg), TensorParallelMode::Row, mp),
      cfg_(cfg),
      mp_(mp),
      layer_(layer),
      inv_freq_(mla_inv_freq(cfg)) {
  const int64_t q_width = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim);
  const Placement where = Placement::of(cfg);
  if (cfg.q_lora_rank == 0) {
    linear_q_proj = std::make_unique<Linear>(prefix + ".linear_q_proj", cfg.hidden_size, q_width,
                                             false, cfg.init_method_std, seed, where,
                                             TensorParallelMode::Column, mp);
  } else {
    linear_q_down_proj = std::make_unique<Linear>(prefix + ".linear_q_down_proj",
                                                  cfg.hidden_size, cfg.q_lora_rank, false,
                                                  cfg.init_method_std, seed, where,
                                                  TensorParallelMode::None, mp);
    mark_sequence_parallel(*linear_q_down_proj, mp);
    linear_q_up_proj = std::make_unique<Linear>(prefix + ".linear_q_up_proj", cfg.q_lora_rank,
                                                q_width, false, cfg.init_method_std, seed, where,
                                                TensorParallelMode::Column, mp);
  }
  mark_sequence_parallel(linear_kv_down_proj, mp);
  if (cfg.qk_layernorm) {
    const bool partial = mp.sequence_parallel && mp.tp_size() > 1;
    if (cfg.q_lora_rank > 0)
      q_layernorm = std::make_unique<Norm>(prefix + ".q_layernorm", cfg.q_lora_rank,
                                           cfg.normalization, cfg.norm_epsilon, where, partial);
    kv_layernorm = std::make_unique<Norm>(prefix + ".kv_layernorm", cfg.kv_lora_rank,
                                          cfg.normalization, cfg.norm_epsilon, where, partial);
  }
  if (cfg.rope_type == RopeType::Yarn) {
    rope_scale_ = float(yarn_cos_sin_scale(cfg.yarn));
    softmax_scale_ =
        float(yarn_softmax_scale(cfg.yarn, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim));
  } else {
    softmax_scale_ = float(1.0 / std::sqrt(double(cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)));
  }
}

int64_t MLASelfAttention::local_heads() const {
  return cfg_.num_attention_heads / mp_.tp_size();
}

void MLASelfAttention::set_recompute(bool keep_input, bool keep_core_attn_out,
                                     bool keep_up_proj_out) {
  keep_input_ = keep_input;
  keep_core_attn_out_ = keep_core_attn_out;
  keep_up_proj_out_ = keep_up_proj_out;
}

void MLASelfAttention::assemble_qkv(const Tensor& q, const Tensor& kv, const Tensor& k_pe_rows,
                                    int64_t batch, int64_t seq, Saved& s) const {
  const int64_t n = local_heads(), qk = cfg_.qk_head_dim, rope = cfg_.qk_pos_emb_head_dim,
                v = cfg_.v_head_dim;
  // Every position's k_pe: all-gathered over the sequence under SP.
  const Tensor k_pe = mp_.sequence_parallel ? gather_sequence(k_pe_rows, mp_) : k_pe_rows;
  s.query = empty_like(q, {batch, seq, n, qk + rope});
  s.key = empty_like(q, {batch, seq, n, qk + rope});
  s.value = empty_like(q, {batch, seq, n, v});
  ops::mla_qkv_rope(q.view({batch, seq, n, qk + rope}), kv.view({batch, seq, n, qk + v}),
                    k_pe.view({batch, seq, rope}), qk, inv_freq_, rope_scale_, s.query, s.key,
                    s.value, 0, s.packed ? s.packed->position_ids : Tensor());
}

Tensor MLASelfAttention::forward(const Tensor& x, int64_t batch, int64_t seq,
                                 const ForwardContext& ctx) {
  const int64_t n = local_heads(), v = cfg_.v_head_dim, rows = x.dim(0);
  Saved& s = saved_;
  s = {};
  s.held = true;
  s.batch = batch;
  s.seq = seq;
  s.packed = ctx.packed_seq_params;
  // The query's projection(s).
  Tensor q_up_input;
  Tensor q;
  if (linear_q_proj) {
    q = linear_q_proj->forward(x, keep_input_);
  } else {
    Tensor c_q = linear_q_down_proj->forward(x, keep_input_);
    q_up_input = q_layernorm ? q_layernorm->forward(c_q) : c_q;
    q = linear_q_up_proj->forward(q_up_input, keep_up_proj_out_);
  }
  // The key/value latent and the shared RoPE key, this rank's rows.
  Tensor kv_down = linear_kv_down_proj.forward(x, keep_input_);
  Tensor c_kv = empty_like(kv_down, {rows, cfg_.kv_lora_rank});
  Tensor k_pe = empty_like(kv_down, {rows, cfg_.qk_pos_emb_head_dim});
  std::vector<Tensor> parts{c_kv, k_pe};
  ops::split_columns(kv_down, parts);
  kv_down = Tensor();
  Tensor kv_up_input = kv_layernorm ? kv_layernorm->forward(c_kv) : c_kv;
  Tensor kv = linear_kv_up_proj.forward(kv_up_input, keep_up_proj_out_);
  assemble_qkv(q, kv, k_pe, batch, seq, s);
  if (!keep_up_proj_out_) {  // mla_up_proj: remade in backward from these
    if (linear_q_proj) s.q = q;
    else s.q_up_input = q_up_input;
    s.kv_up_input = kv_up_input;
    s.k_pe = k_pe;
  }
  q = kv = Tensor();
  s.out = empty_like(s.query, {batch, seq, n, v});
  s.lse = Tensor::empty(core_attention_lse_shape(s.packed.get(), batch, seq, n), DType::F32,
                        s.query.device());
  s.dropout_p = ctx.training ? cfg_.attention_dropout : 0.0f;
  s.seed = ctx.seed;
  s.stream = ctx.stream(layer_, 0);
  core_attention_forward(s.query, s.key, s.value, s.out, s.lse, s.packed.get(), s.dropout_p, s.seed,
                         s.stream, softmax_scale_);
  Tensor y = linear_proj.forward(s.out.view({batch * seq, n * v}), keep_core_attn_out_);
  if (!keep_core_attn_out_) s.out = s.lse = Tensor();
  if (!keep_up_proj_out_) s.query = s.key = s.value = Tensor();
  return y;
}

Tensor MLASelfAttention::backward(const Tensor& dy, const std::function<Tensor()>& input) {
  MEGATON_CHECK(saved_.held, "MLASelfAttention of layer {}: backward without a forward",
                layer_);
  MEGATON_CHECK(keep_input_ || input,
                "MLASelfAttention of layer {}: backward needs the input, not kept", layer_);
  Saved s = std::exchange(saved_, {});
  const int64_t n = local_heads(), qk = cfg_.qk_head_dim, rope = cfg_.qk_pos_emb_head_dim,
                v = cfg_.v_head_dim;
  const int64_t rows = dy.dim(0);
  if (!s.query.defined()) {
    // mla_up_proj recompute: the up projections again from their kept inputs (the same
    // GEMMs on the same operands: the forward's bits), keeping nothing new.
    const Tensor q = linear_q_proj ? s.q : linear_q_up_proj->forward(s.q_up_input, false);
    const Tensor kv = linear_kv_up_proj.forward(s.kv_up_input, false);
    assemble_qkv(q, kv, s.k_pe, s.batch, s.seq, s);
  }
  const int64_t batch = s.batch, seq = s.seq;
  Tensor dout;
  if (s.out.defined()) {
    dout = linear_proj.backward(dy).view(s.out.shape());
  } else {
    s.out = empty_like(s.query, {batch, seq, n, v});
    s.lse = Tensor::empty(core_attention_lse_shape(s.packed.get(), batch, seq, n), DType::F32,
                          s.query.device());
    core_attention_forward(s.query, s.key, s.value, s.out, s.lse, s.packed.get(), s.dropout_p,
                           s.seed, s.stream, softmax_scale_);
    dout = linear_proj.backward(dy, s.out.view({batch * seq, n * v})).view(s.out.shape());
  }
  Tensor dquery = empty_like(s.query, s.query.shape()), dkey = empty_like(s.key, s.key.shape()),
         dvalue = empty_like(s.value, s.value.shape());
  core_attention_backward(dout, s.query, s.key, s.value, s.out, s.lse, s.packed.get(), dquery, dkey,
                          dvalue, s.dropout_p, s.seed, s.stream, softmax_scale_);
  s.query = s.key = s.value = s.out = s.lse = dout = Tensor();
  Tensor dq = empty_like(dquery, {batch * seq, n * (qk + rope)});
  Tensor dkv = empty_like(dquery, {batch * seq, n * (qk + v)});
  Tensor dk_pe = empty_like(dquery, {batch * seq, rope});
  Tensor dq4 = dq.view({batch, seq, n, qk + rope}), dkv4 = dkv.view({batch, seq, n, qk + v}),
         dk_pe3 = dk_pe.view({batch, seq, rope});
  ops::mla_qkv_rope_backward(dquery, dkey, dvalue, qk, inv_freq_, rope_scale_, dq4, dkv4, dk_pe3, 0,
                             s.packed ? s.packed->position_ids : Tensor());
  dquery = dkey = dvalue = Tensor();
  // k_pe's gradient from this rank's heads: summed over TP (reduce-scattered to this
  // rank's rows under SP).
  if (mp_.sequence_parallel) dk_pe = reduce_scatter_sequence(dk_pe, mp_);
  else all_reduce_tensor_parallel(dk_pe, mp_);
  const Tensor x = keep_input_ ? Tensor() : input();
  auto down_backward = [&](Linear& linear, const Tensor& d) {
    return keep_input_ ? linear.backward(d) : linear.backward(d, x);
  };
  auto up_backward = [&](Linear& linear, const Tensor& d, const Tensor& up_input) {
    return up_input.defined() ? linear.backward(d, up_input) : linear.backward(d);
  };
  // The key/value path.
  Tensor dc_kv = up_backward(linear_kv_up_proj, dkv, s.kv_up_input);
  dkv = Tensor();
  if (kv_layernorm) dc_kv = kv_layernorm->backward(dc_kv);
  Tensor dkv_down = empty_like(dc_kv, {rows, cfg_.kv_lora_rank + rope});
  ops::concat_columns({dc_kv, dk_pe}, dkv_down);
  dc_kv = dk_pe = Tensor();
  Tensor dx = down_backward(linear_kv_down_proj, dkv_down);
  dkv_down = Tensor();
  // The query path.
  Tensor dx_q;
  if (linear_q_proj) {
    dx_q = down_backward(*linear_q_proj, dq);
  } else {
    Tensor dc_q = up_backward(*linear_q_up_proj, dq, s.q_up_input);
    if (q_layernorm) dc_q = q_layernorm->backward(dc_q);
    dx_q = down_backward(*linear_q_down_proj, dc_q);
  }
  ops::add_(dx, dx_q);
  return dx;
}

Tensor MLASelfAttention::forward_inference(const Tensor& x, int64_t first_position,
                                           Tensor& key_cache, Tensor& value_cache) const {
  MEGATON_CHECK(mp_.tp_size() == 1, "MLASelfAttention of layer {}: inference runs on one rank",
                layer_);
  const int64_t n_tok = x.dim(0), n = cfg_.num_attention_heads, qk = cfg_.qk_head_dim,
                rope = cfg_.qk_pos_emb_head_dim, v = cfg_.v_head_dim;
  MEGATON_CHECK(key_cache.shape() == Shape({key_cache.dim(0), n, qk + rope}) &&
                    value_cache.shape() == Shape({key_cache.dim(0), n, v}),
                "MLASelfAttention of layer {}: caches {} and {}, expected [max, {}, {}] and "
                "[max, {}, {}]",
                layer_, shape_str(key_cache.shape()), shape_str(value_cache.shape()), n,
                qk + rope, n, v);
  MEGATON_CHECK(first_position >= 0 && first_position + n_tok <= key_cache.dim(0),
                "MLASelfAttention of layer {}: positions [{}, {}) outside the cache's {}",
                layer_, first_position, first_position + n_tok, key_cache.dim(0));
  Tensor q;
  if (linear_q_proj) {
    q = linear_q_proj->forward_inference(x);
  } else {
    Tensor c_q = linear_q_down_proj->forward_inference(x);
    if (q_layernorm) c_q = q_layernorm->forward_inference(c_q);
    q = linear_q_up_proj->forward_inference(c_q);
  }
  Tensor kv_down = linear_kv_down_proj.forward_inference(x);
  Tensor c_kv = empty_like(kv_down, {n_tok, cfg_.kv_lora_rank});
  Tensor k_pe = empty_like(kv_down, {n_tok, rope});
  std::vector<Tensor> parts{c_kv, k_pe};
  ops::split_columns(kv_down, parts);
  if (kv_layernorm) c_kv = kv_layernorm->forward_inference(c_kv);
  const Tensor kv = linear_kv_up_proj.forward_inference(c_kv);
  Tensor query = empty_like(q, {1, n_tok, n, qk + rope});
  Tensor key = key_cache.rows(first_position, n_tok).view({1, n_tok, n, qk + rope});
  Tensor value = value_cache.rows(first_position, n_tok).view({1, n_tok, n, v});
  ops::mla_qkv_rope(q.view({1, n_tok, n, qk + rope}), kv.view({1, n_tok, n, qk + v}),
                    k_pe.view({1, n_tok, rope}), qk, inv_freq_, rope_scale_, query, key, value,
                    first_position);
  Tensor out = empty_like(q, {n_tok, n, v});
  ops::attention_kv_cache(query.view({n_tok, n, qk + rope}), key_cache, value_cache,
                          first_position, out, softmax_scale_);
  return linear_proj.forward_inference(out.view({n_tok, n * v}));
}

std::vector<Linear*> MLASelfAttention::linears() {
  std::vector<Linear*> out;
  for (Linear* l : {linear_q_proj.get(), linear_q_down_proj.get(), linear_q_up_proj.get()})
    if (l) out.push_back(l);
  out.push_back(&linear_kv_down_proj);
  out.push_back(&linear_kv_up_proj);
  out.push_back(&linear_proj);
  return out;
}

void MLASelfAttention::collect_params(std::vector<Param*>& out) {
  // Megatron's registration order: q, kv, norms after their projections, then proj.
  if (linear_q_proj) linear_q_proj->collect_params(out);
  if (linear_q_down_proj) linear_q_down_proj->collect_params(out);
  if (q_layernorm) q_layernorm->collect_params(out);
  if (linear_q_up_proj) linear_q_up_proj->collect_params(out);
  linear_kv_down_proj.collect_params(out);
  if (kv_layernorm) kv_layernorm->collect_params(out);
  linear_kv_up_proj.collect_params(out);
  linear_proj.collect_params(out);
}

MLASelfAttention::Activations MLASelfAttention::take_saved() {
  Activations a;
  a.attention = std::exchange(saved_, {});
  if (linear_q_proj) a.q_proj = linear_q_proj->take_saved();
  if (linear_q_down_proj) a.q_down = linear_q_down_proj->take_saved();
  if (linear_q_up_proj) a.q_up = linear_q_up_proj->take_saved();
  a.kv_down = linear_kv_down_proj.take_saved();
  a.kv_up = linear_kv_up_proj.take_saved();
  a.proj = linear_proj.take_saved();
  if (q_layernorm) a.q_norm = q_layernorm->take_saved();
  if (kv_layernorm) a.kv_norm = kv_layernorm->take_saved();
  return a;
}

void MLASelfAttention::restore_saved(Activations&& a) {
  saved_ = std::move(a.attention);
  if (linear_q_proj) linear_q_proj->restore_saved(std::move(a.q_proj));
  if (linear_q_down_proj) linear_q_down_proj->restore_saved(std::move(a.q_down));
  if (linear_q_up_proj) linear_q_up_proj->restore_saved(std::move(a.q_up));
  linear_kv_down_proj.restore_saved(std::move(a.kv_down));
  linear_kv_up_proj.restore_saved(std::move(a.kv_up));
  linear_proj.restore_saved(std::move(a.proj));
  if (q_layernorm) q_layernorm->restore_saved(std::move(a.q_norm));
  if (kv_layernorm) kv_layernorm->restore_saved(std::move(a.kv_norm));
}

static void for_each_tensor(MLASelfAttention::Activations& a, const SavedTensorVisitor& fn) {
  MLASelfAttention::Saved& s = a.attention;
  for (Tensor* t : {&s.query, &s.key, &s.value, &s.out, &s.lse, &s.q_up_input, &s.kv_up_input,
                    &s.k_pe, &s.q})
    fn(*t);
  for (Linear::Saved* l : {&a.q_proj, &a.q_down, &a.q_up, &a.kv_down, &a.kv_up, &a.proj})
    megaton::for_each_tensor(*l, fn);
  megaton::for_each_tensor(a.q_norm, fn);
  megaton::for_each_tensor(a.kv_norm, fn);
}

static std::vector<Linear*> mixer_linears(MLASelfAttention& a) { return a.linears(); }

// layernorm: the down projections' input; core_attn: the attention output; mla_up_proj: the
// up projections' outputs and the RoPE assembly.
static void apply_recompute(MLASelfAttention& a, const RecomputeConfig& rc) {
  a.set_recompute(!rc.selective(kRecomputeLayernorm), !rc.selective(kRecomputeCoreAttn),
                  !rc.selective(kRecomputeMlaUpProj));
}

std::unique_ptr<Mixer> make_mla_mixer(const std::string& prefix, const GPTConfig& cfg,
                                      int64_t layer, uint64_t seed, const ModelParallel& mp) {
  return std::make_unique<AttentionMixer<MLASelfAttention>>(prefix, cfg, layer, seed, mp);
}

}  // namespace megaton
