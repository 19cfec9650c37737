// Model flags: the transformer's shape, norms, positions, embeddings and dropout
// (Megatron's "network size", "regularization" and transformer configuration flags).
#include "core/error.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

void parse_model(const ArgReader& r, TrainArgs& a) {
  GPTConfig& m = a.model;
  r.get("num-layers", m.num_layers);
  r.get("hidden-size", m.hidden_size);
  r.get("ffn-hidden-size", m.ffn_hidden_size);
  r.get("num-attention-heads", m.num_attention_heads);
  r.get("group-query-attention", m.group_query_attention);
  r.get("num-query-groups", m.num_query_groups);
  r.get("kv-channels", m.kv_channels);
  r.get("seq-length", m.seq_length);
  r.get("max-position-embeddings", m.max_position_embeddings);
  r.get("make-vocab-size-divisible-by", m.make_vocab_size_divisible_by);
  std::string norm = "LayerNorm";
  r.get("normalization", norm);
  if (norm == "LayerNorm")
    m.normalization = Normalization::LayerNorm;
  else if (norm == "RMSNorm")
    m.normalization = Normalization::RMSNorm;
  else
    fail("option 'normalization' must be LayerNorm or RMSNorm (got '{}')", norm);
  r.get("norm-epsilon", m.norm_epsilon);
  r.get("qk-layernorm", m.qk_layernorm);
  r.get("swiglu", m.swiglu);
  r.get("squared-relu", m.squared_relu);  // GPTConfig::finalize refuses it with swiglu
  std::string pos = "learned_absolute";
  r.get("position-embedding-type", pos);
  if (r.on("use-rotary-position-embeddings")) {  // Megatron's deprecated name
    if (r.has("position-embedding-type") && pos != "rope")
      fail("use-rotary-position-embeddings contradicts position-embedding-type {}", pos);
    pos = "rope";
  }
  if (pos == "learned_absolute")
    m.position_embedding_type = PositionEmbedding::LearnedAbsolute;
  else if (pos == "rope")
    m.position_embedding_type = PositionEmbedding::Rope;
  else if (pos == "none")
    m.position_embedding_type = PositionEmbedding::None;
  else
    fail("option 'position-embedding-type' must be learned_absolute, rope or none (got '{}')",
         pos);
  r.get("rotary-base", m.rotary_base);
  // Partial RoPE; GPTConfig::finalize checks it against kv-channels and MLA.
  r.get("rotary-percent", m.rotary_percent);
  // Multi-latent attention and its RoPE (--rope-type: Megatron's default is yarn for MLA,
  // rope otherwise).
  r.get("multi-latent-attention", m.multi_latent_attention);
  r.get("q-lora-rank", m.q_lora_rank);
  if (r.has("q-lora-rank")) check_positive("q-lora-rank", double(m.q_lora_rank));
  r.get("kv-lora-rank", m.kv_lora_rank);
  r.get("qk-head-dim", m.qk_head_dim);
  r.get("qk-pos-emb-head-dim", m.qk_pos_emb_head_dim);
  r.get("v-head-dim", m.v_head_dim);
  std::string rope_type = m.multi_latent_attention ? "yarn" : "rope";
  r.get("rope-type", rope_type);
  if (rope_type == "rope")
    m.rope_type = RopeType::Rope;
  else if (rope_type == "yarn")
    m.rope_type = RopeType::Yarn;
  else
    fail("option 'rope-type' must be rope or yarn (got '{}')", rope_type);
  if (r.has("rope-type") && rope_type == "yarn" && !r.has("rotary-scaling-factor"))
    fail("rope-type yarn needs rotary-scaling-factor (YaRN's context extension factor)");
  r.get("mtp-num-layers", m.mtp_num_layers);
  r.get("mtp-loss-scaling-factor", m.mtp_loss_scaling_factor);
  YarnConfig& y = m.yarn;
  r.get("rotary-scaling-factor", y.factor);
  r.get("original-max-position-embeddings", y.original_max_position_embeddings);
  r.get("beta-fast", y.beta_fast);
  r.get("beta-slow", y.beta_slow);
  r.get("mscale", y.mscale);
  r.get("mscale-all-dim", y.mscale_all_dim);
  // Megatron's deprecated --no-position-embedding: no learned position embedding. A RoPE
  // model (or one with none) has none anyway; with learned positions Megatron refuses it.
  if (r.on("no-position-embedding")) {
    if (m.position_embedding_type == PositionEmbedding::LearnedAbsolute)
      fail(
          "no-position-embedding with learned positions is not supported: give "
          "position-embedding-type rope or none (Megatron refuses it too)");
    a.no_effect.push_back(
        "--no-position-embedding: a RoPE model or one with position-embedding-type none has "
        "no learned position embedding");
  }
  r.get("untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights);
  r.get("init-method-std", m.init_method_std);
  r.get("disable-bias-linear", m.disable_bias_linear);
  r.get("hidden-dropout", m.hidden_dropout);
  r.get("attention-dropout", m.attention_dropout);
  // Sizes that default when unset (0) must be positive when given.
  for (auto [key, value] : {std::pair{"ffn-hidden-size", m.ffn_hidden_size},
                            {"num-query-groups", m.num_query_groups},
                            {"kv-channels", m.kv_channels},
                            {"max-position-embeddings", m.max_position_embeddings}})
    if (r.has(key)) check_positive(key, double(value));
  check_positive("norm-epsilon", m.norm_epsilon);
  check_positive("rotary-base", m.rotary_base);
  check_positive("init-method-std", m.init_method_std);
  check_fraction("hidden-dropout", m.hidden_dropout);
  check_fraction("attention-dropout", m.attention_dropout);
}

}  // namespace

std::vector<OptionSpec> model_megatron_rules();

ArgGroup model_flags() {
  ArgGroup g{"model", "model", {}, parse_model};
  g.flags = {
      flag("num-layers", "number of transformer layers"),
      flag("hidden-size", "transformer hidden size"),
      flag("ffn-hidden-size", "MLP hidden size (default 4 x hidden-size)"),
      flag("num-attention-heads", "attention heads"),
      toggle("group-query-attention", "use grouped-query attention"),
      flag("num-query-groups", "key/value head groups with group-query-attention"),
      flag("kv-channels", "head dimension (default hidden-size / num-attention-heads)"),
      flag("seq-length", "tokens per sample"),
      flag("max-position-embeddings",
           "positions of learned_absolute embeddings (default seq-length)"),
      flag("make-vocab-size-divisible-by", "pad the vocabulary up to a multiple of this"),
      flag("normalization", "LayerNorm or RMSNorm"),
      flag("norm-epsilon", "epsilon of the norms"),
      toggle("qk-layernorm",
             "normalize each query and key head before RoPE (Qwen3's q_norm/k_norm)"),
      toggle("swiglu", "SwiGLU MLP instead of GeLU"),
      toggle("squared-relu", "squared ReLU (relu(x)^2) MLP activation instead of GeLU"),
      flag("position-embedding-type", "learned_absolute, rope or none"),
      toggle("use-rotary-position-embeddings",
             "Megatron's older name of "
             "--position-embedding-type rope"),
      toggle("no-position-embedding",
             "with RoPE or none: no effect (there is no learned position "
             "embedding); refused with learned_absolute, as in Megatron"),
      flag("rotary-base", "RoPE base"),
      flag("rotary-percent",
           "partial RoPE: rotate the first int(kv-channels x rotary-percent) channels of each "
           "query/key head (in (0, 1], that count even; default 1; 1 only with "
           "multi-latent-attention)"),
      flag("rope-type",
           "rope or yarn: multi-latent attention's rotary table (default yarn with "
           "multi-latent-attention, which at rotary-scaling-factor 1 is plain RoPE)"),
      toggle("multi-latent-attention",
             "DeepSeek-V2/V3 multi-latent attention instead of self attention"),
      flag("q-lora-rank", "MLA: rank of the query's low-rank compression (default none)"),
      flag("kv-lora-rank", "MLA: rank of the key/value compression (default 32)"),
      flag("qk-head-dim", "MLA: query/key head dim without the RoPE part (default 128)"),
      flag("qk-pos-emb-head-dim", "MLA: the query/key RoPE part's head dim (default 64)"),
      flag("v-head-dim", "MLA: value head dim (default 128)"),
      flag("rotary-scaling-factor", "YaRN: the context extension factor (default 1)"),
      own(flag("original-max-position-embeddings",
               "YaRN: the context the model was trained on (MLATransformerConfig's field; "
               "default 4096)")),
      own(flag("beta-fast", "YaRN: rotations where interpolation starts (default 32)")),
      own(flag("beta-slow", "YaRN: rotations where interpolation is full (default 1)")),
      flag("mscale", "YaRN: the RoPE part's attention temperature (default 1.0)"),
      flag("mtp-num-layers",
           "multi-token prediction depths after the decoder, on the last pipeline stage "
           "(default none)"),
      flag("mtp-loss-scaling-factor",
           "weight of the MTP depths' mean loss in the objective (default 0.1)"),
      flag("mscale-all-dim", "YaRN: the softmax temperature of the whole head (default 0.0)"),
      toggle("untie-embeddings-and-output-weights", "separate output layer"),
      flag("init-method-std", "std of the normal weight init"),
      toggle("disable-bias-linear", "no biases in linear layers"),
      flag("hidden-dropout", "dropout after attention, MLP and embedding"),
      flag("attention-dropout", "dropout on attention probabilities"),
  };
  for (OptionSpec& s : model_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
