// The parameter table of a GPTConfig's model (names, shapes, tensor-parallel rules), as the
// model's layers build them (model/gpt.cpp, attention.cpp, mla.cpp, layers.cpp MLP,
// moe.cpp, router.cpp, shared_experts.cpp); tests/train/test_param_layout.cpp checks it
// against a model built under tensor and expert parallelism.
#include "train/param_layout.h"

#include "core/error.h"
#include "model/layer_spec.h"

namespace megaton {

Param ParamSpec::as_param() const {
  Param p;
  p.name = name;
  p.full_shape = full_shape;
  p.tp_split_dim = tp_split_dim;
  p.tp_blocks = tp_blocks;
  p.is_expert = is_expert;
  p.padded_vocab_rows = padded_vocab_rows;
  return p;
}

namespace {

struct Table {
  std::vector<ParamSpec>& out;
  int64_t layer = -1;
  ParamSpec::Stage stage = ParamSpec::Stage::Layer;

  ParamSpec& add(const std::string& name, Shape shape, int split = -1) {
    ParamSpec s;
    s.name = name;
    s.full_shape = std::move(shape);
    s.tp_split_dim = split;
    s.layer = layer;
    s.stage = stage;
    out.push_back(std::move(s));
    return out.back();
  }
  // Linear layers: Megatron's ColumnParallelLinear (rows split) and RowParallelLinear
  // (columns split); weights [out, in].
  void column(const std::string& name, int64_t in, int64_t out_features) {
    add(name + ".weight", {out_features, in}, 0);
  }
  void row(const std::string& name, int64_t in, int64_t out_features) {
    add(name + ".weight", {out_features, in}, 1);
  }
  void replicated(const std::string& name, int64_t in, int64_t out_features) {
    add(name + ".weight", {out_features, in});
  }
  void norm(const std::string& name, int64_t width) { add(name + ".weight", {width}); }
  // A (SwiGLU) MLP: fc1 [gate; up] column-parallel with each half split, fc2 row-parallel.
  void mlp(const std::string& prefix, const GPTConfig& c, int64_t ffn, int64_t expert) {
    const int64_t f1 = c.swiglu ? 2 * ffn : ffn;
    ParamSpec& fc1 = add(prefix + ".linear_fc1.weight", {f1, c.hidden_size}, 0);
    if (c.swiglu) fc1.tp_blocks = swiglu_blocks(f1);
    fc1.expert = expert;
    fc1.is_expert = expert >= 0;
    ParamSpec& fc2 = add(prefix + ".linear_fc2.weight", {c.hidden_size, ffn}, 1);
    fc2.expert = expert;
    fc2.is_expert = expert >= 0;
  }
};

void attention(Table& t, const std::string& a, const GPTConfig& c) {
  const int64_t H = c.hidden_size, n = c.num_attention_heads;
  if (!c.multi_latent_attention) {
    t.column(a + "linear_qkv", H, c.query_projection_size() + 2 * c.kv_projection_size());
    t.row(a + "linear_proj", c.query_projection_size(), H);
    if (c.qk_layernorm) {
      t.norm(a + "q_layernorm", c.kv_channels);
      t.norm(a + "k_layernorm", c.kv_channels);
    }
    return;
  }
  // MLASelfAttention (model/mla.cpp): the down projections replicated, the up projections
  // column-parallel by heads.
  const int64_t q_width = n * (c.qk_head_dim + c.qk_pos_emb_head_dim);
  if (c.q_lora_rank == 0) {
    t.column(a + "linear_q_proj", H, q_width);
  } else {
    t.replicated(a + "linear_q_down_proj", H, c.q_lora_rank);
    t.column(a + "linear_q_up_proj", c.q_lora_rank, q_width);
  }
  t.replicated(a + "linear_kv_down_proj", H, c.kv_lora_rank + c.qk_pos_emb_head_dim);
  t.column(a + "linear_kv_up_proj", c.kv_lora_rank, n * (c.qk_head_dim + c.v_head_dim));
  t.row(a + "linear_proj", n * c.v_head_dim, H);
  if (c.qk_layernorm) {
    if (c.q_lora_rank > 0) t.norm(a + "q_layernorm", c.q_lora_rank);
    t.norm(a + "kv_layernorm", c.kv_lora_rank);
  }
}

// Megatron's MambaMixer (model/mamba_mixer.h): in_proj's [z, x, B, C, dt] and conv1d's
// [x, B, C] blocks each split over TP, the per-head vectors and the gated norm split.
void mamba(Table& t, const std::string& x, const GPTConfig& c) {
  const int64_t d = c.mamba_d_inner(), gn = c.mamba_num_groups * c.mamba_state_dim,
                heads = c.mamba_num_heads;
  t.add(x + "in_proj.weight", {c.mamba_in_proj_size(), c.hidden_size}, 0).tp_blocks = {d, d, gn, gn,
                                                                                       heads};
  t.add(x + "conv1d.weight", {c.mamba_conv_dim(), 1, c.mamba_conv_kernel}, 0).tp_blocks = {d, gn,
                                                                                           gn};
  t.add(x + "conv1d.bias", {c.mamba_conv_dim()}, 0).tp_blocks = {d, gn, gn};
  for (const char* name : {"dt_bias", "A_log", "D"}) t.add(x + name, {heads}, 0);
  t.add(x + "norm.weight", {d}, 0);
  t.row(x + "out_proj", d, c.hidden_size);
}

// A dense or MoE MLP under prefix m + "mlp".
void mlp_block(Table& t, const std::string& m, const GPTConfig& c, int64_t layer) {
  if (!c.is_moe_layer(layer)) {
    t.mlp(m + "mlp", c, c.ffn_hidden_size, -1);
    return;
  }
  const int64_t H = c.hidden_size;
  t.replicated(m + "mlp.router", H, c.num_experts);
  if (c.moe_router_enable_expert_bias)
    t.add(m + "mlp.router.expert_bias", {c.num_experts}).router_state = true;
  if (c.moe_shared_expert_intermediate_size > 0) {
    t.mlp(m + "mlp.shared_experts", c, c.moe_shared_expert_intermediate_size, -1);
    if (c.moe_shared_expert_gate) t.add(m + "mlp.shared_experts.gate_weight", {1, H});
  }
  const int64_t moe_ffn = c.moe_ffn_hidden_size > 0 ? c.moe_ffn_hidden_size : c.ffn_hidden_size;
  for (int64_t e = 0; e < c.num_experts; ++e)
    t.mlp(m + "mlp.experts.local_experts." + std::to_string(e), c, moe_ffn, e);
}

}  // namespace

std::vector<ParamSpec> model_param_specs(const GPTConfig& c) {
  MEGATON_CHECK(c.padded_vocab_size > 0, "model_param_specs: GPTConfig not finalized");
  if (c.position_embedding_type == PositionEmbedding::LearnedAbsolute)
    fail("position-embedding-type learned_absolute is not supported here (RoPE or none only)");
  if (c.normalization != Normalization::RMSNorm)
    fail("normalization LayerNorm is not supported here (RMSNorm models only)");
  if (!c.disable_bias_linear) fail("linear biases are not supported here (disable-bias-linear)");
  if (c.mtp_num_layers > 0) fail("mtp-num-layers is not supported here");
  std::vector<ParamSpec> out;
  Table t{out};
  const int64_t H = c.hidden_size;
  t.stage = ParamSpec::Stage::First;
  ParamSpec& embedding = t.add("embedding.word_embeddings.weight", {c.padded_vocab_size, H}, 0);
  embedding.padded_vocab_rows = true;
  t.stage = ParamSpec::Stage::Layer;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    t.layer = i;
    const std::string m = "decoder.layers." + std::to_string(i) + ".";
    const LayerSpec spec = decoder_layer_spec(c, i);
    if (spec.mixer == MixerKind::Mamba) {
      t.norm(m + "norm", H);
      mamba(t, m + "mixer.", c);
    } else if (spec.mixer != MixerKind::None) {
      t.norm(m + "input_layernorm", H);
      attention(t, m + "self_attention.", c);
    }
    if (spec.mlp == MlpKind::None) continue;
    t.norm(m + "pre_mlp_layernorm", H);
    mlp_block(t, m, c, i);
  }
  t.layer = -1;
  t.stage = ParamSpec::Stage::Last;
  t.norm(final_norm_name(c), H);
  if (c.untie_embeddings_and_output_weights)
    t.add("output_layer.weight", {c.padded_vocab_size, H}, 0).padded_vocab_rows = true;
  return out;
}

}  // namespace megaton
