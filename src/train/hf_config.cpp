// Hugging Face config.json -> Megatron's model flags (the families of ckpt/hf_import.h);
// the other way is hf_config_export.cpp.
#include "train/hf_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>

#include "core/error.h"

namespace megaton {

const char* hf_model_type(HFFamily family) {
  switch (family) {
    case HFFamily::Llama:
      return "llama";
    case HFFamily::Qwen3:
      return "qwen3";
    case HFFamily::Mixtral:
      return "mixtral";
    case HFFamily::Qwen3Moe:
      return "qwen3_moe";
    case HFFamily::DeepseekV3:
      return "deepseek_v3";
    case HFFamily::NemotronH:
      return "nemotron_h";
  }
  return "?";
}

const char* hf_architecture(HFFamily family) {
  switch (family) {
    case HFFamily::Llama:
      return "LlamaForCausalLM";
    case HFFamily::Qwen3:
      return "Qwen3ForCausalLM";
    case HFFamily::Mixtral:
      return "MixtralForCausalLM";
    case HFFamily::Qwen3Moe:
      return "Qwen3MoeForCausalLM";
    case HFFamily::DeepseekV3:
      return "DeepseekV3ForCausalLM";
    case HFFamily::NemotronH:
      return "NemotronHForCausalLM";
  }
  return "?";
}

namespace {

using nlohmann::json;

// Typed reads of config.json keys; every error names the file and the key. A key holding
// null counts as absent (HF writes e.g. "q_lora_rank": null).
struct ConfigReader {
  const json& c;
  const std::string& source;

  bool present(const char* key) const { return c.contains(key) && !c[key].is_null(); }
  int64_t integer(const char* key) const {
    if (!present(key)) fail("{}: '{}' is missing", source, key);
    if (!c[key].is_number_integer() || c[key].get<int64_t>() < 0)
      fail("{}: '{}' must be a non-negative integer (got {})", source, key, c[key].dump());
    return c[key].get<int64_t>();
  }
  int64_t integer(const char* key, int64_t fallback) const {
    return present(key) ? integer(key) : fallback;
  }
  double number(const json& where, const char* key, double fallback) const {
    if (!where.contains(key) || where[key].is_null()) return fallback;
    if (!where[key].is_number())
      fail("{}: '{}' must be a number (got {})", source, key, where[key].dump());
    return where[key].get<double>();
  }
  double number(const char* key, double fallback) const { return number(c, key, fallback); }
  bool boolean(const char* key, bool fallback) const {
    if (!present(key)) return fallback;
    if (!c[key].is_boolean())
      fail("{}: '{}' must be true or false (got {})", source, key, c[key].dump());
    return c[key].get<bool>();
  }
  std::string string(const json& where, const char* key, const std::string& fallback) const {
    if (!where.contains(key) || where[key].is_null()) return fallback;
    if (!where[key].is_string())
      fail("{}: '{}' must be a string (got {})", source, key, where[key].dump());
    return where[key].get<std::string>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    return string(c, key, fallback);
  }
};

std::string num(double v) { return fmt::format("{}", v); }
std::string num(int64_t v) { return std::to_string(v); }

// --moe-layer-freq for a per-layer MoE choice: 1 when every layer is MoE, else the explicit
// pattern "[1,0,...]" Megatron's parser reads.
std::string layer_pattern(const std::vector<int>& moe) {
  if (std::all_of(moe.begin(), moe.end(), [](int m) { return m == 1; })) return "1";
  return fmt::format("[{}]", fmt::join(moe, ","));
}

// The RoPE settings: transformers 5 writes "rope_parameters" (theta inside), 4.x
// "rope_theta" and "rope_scaling". Returns the scaling object (null for plain RoPE).
json rope_settings(const ConfigReader& r, double default_theta, RawOptions& f) {
  json rope = r.present("rope_parameters") ? r.c["rope_parameters"]
              : r.present("rope_scaling")  ? r.c["rope_scaling"]
                                           : json::object();
  if (!rope.is_object()) fail("{}: 'rope_parameters' must be an object", r.source);
  double theta = r.number("rope_theta", default_theta);
  theta = r.number(rope, "rope_theta", theta);
  f["position-embedding-type"] = {"rope"};
  f["rotary-base"] = {num(theta)};
  const std::string type = r.string(rope, "rope_type", r.string(rope, "type", "default"));
  const double partial =
      r.number(rope, "partial_rotary_factor", r.number("partial_rotary_factor", 1.0));
  if (partial != 1.0)
    fail("{}: partial_rotary_factor {} is not supported by the conversion (give the full head)",
         r.source, partial);
  if (type == "default") return json();
  return rope;
}

// The shape, norm, activation and RoPE flags every family shares.
void common_flags(const ConfigReader& r, HFImport& out, double default_theta) {
  RawOptions& f = out.flags;
  const int64_t layers = r.integer("num_hidden_layers"), hidden = r.integer("hidden_size"),
                heads = r.integer("num_attention_heads");
  if (heads == 0 || hidden == 0 || layers == 0)
    fail("{}: num_hidden_layers, hidden_size and num_attention_heads must be positive", r.source);
  f["num-layers"] = {num(layers)};
  f["hidden-size"] = {num(hidden)};
  f["ffn-hidden-size"] = {num(r.integer("intermediate_size"))};
  f["num-attention-heads"] = {num(heads)};
  const int64_t max_positions = r.integer("max_position_embeddings");
  f["max-position-embeddings"] = {num(max_positions)};
  // The context a run trains on is its own --seq-length; this is generation's window.
  f["seq-length"] = {num(std::min<int64_t>(max_positions, 4096))};
  f["normalization"] = {"RMSNorm"};
  f["norm-epsilon"] = {num(r.number("rms_norm_eps", 1e-6))};
  const std::string act = r.string("hidden_act", "silu");
  if (act != "silu")
    fail("{}: hidden_act '{}' is not supported (Megaton's --swiglu is SiLU-gated)", r.source, act);
  f["swiglu"] = {"true"};
  f["disable-bias-linear"] = {"true"};
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (r.boolean(key, false))
      fail("{}: '{}' true is not supported (Megaton's converted models have no linear biases)",
           r.source, key);
  f["hidden-dropout"] = {"0.0"};
  f["attention-dropout"] = {num(r.number("attention_dropout", 0.0))};
  out.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  if (!out.tie_word_embeddings) f["untie-embeddings-and-output-weights"] = {"true"};
  out.vocab_size = r.integer("vocab_size");
  if (out.vocab_size == 0) fail("{}: vocab_size must be positive", r.source);
  out.layout.num_layers = layers;
  out.layout.num_attention_heads = heads;
  const json rope = rope_settings(r, default_theta, f);
  if (!rope.is_null() && out.family != HFFamily::DeepseekV3)
    fail(
        "{}: RoPE scaling '{}' is not supported (Llama 3.1's llama3 scaling, linear and "
        "dynamic scaling have no Megaton counterpart)",
        r.source, r.string(rope, "rope_type", r.string(rope, "type", "?")));
}

// Grouped-query attention with q/k/v_proj (every family but DeepSeek-V3).
void attention_flags(const ConfigReader& r, HFImport& out) {
  const int64_t heads = out.layout.num_attention_heads;
  const int64_t groups = r.integer("num_key_value_heads", heads);
  const int64_t hidden = r.integer("hidden_size");
  if (groups == 0 || heads % groups != 0)
    fail("{}: num_attention_heads ({}) is not divisible by num_key_value_heads ({})", r.source,
         heads, groups);
  const int64_t head_dim = r.integer("head_dim", hidden / heads);
  out.flags["group-query-attention"] = {"true"};
  out.flags["num-query-groups"] = {num(groups)};
  out.flags["kv-channels"] = {num(head_dim)};
  out.layout.num_query_groups = groups;
  out.layout.kv_channels = head_dim;
}

void sliding_window_warning(const ConfigReader& r, HFImport& out) {
  const bool on = out.family == HFFamily::Mixtral ? r.present("sliding_window")
                                                  : r.boolean("use_sliding_window", false);
  if (on)
    out.warnings.push_back(fmt::format(
        "{}: sliding_window {} is ignored: Megaton attends over the whole sequence (the same "
        "for sequences up to the window)",
        r.source, r.present("sliding_window") ? r.c["sliding_window"].dump() : "?"));
}

void mixtral_flags(const ConfigReader& r, HFImport& out) {
  const int64_t experts = r.integer("num_local_experts");
  out.flags["num-experts"] = {num(experts)};
  out.flags["moe-router-topk"] = {num(r.integer("num_experts_per_tok"))};
  // Mixtral's experts are intermediate_size wide; every layer is MoE. Its router (softmax
  // over all, top-k, renormalised) is Megatron's default (softmax over the top-k logits).
  out.flags["moe-ffn-hidden-size"] = {num(r.integer("intermediate_size"))};
  out.layout.num_experts = experts;
}

void qwen3_moe_flags(const ConfigReader& r, HFImport& out) {
  // transformers 5 writes num_local_experts (its attribute map), 4.x num_experts.
  const int64_t experts = r.present("num_experts") ? r.integer("num_experts")
                                                   : r.integer("num_local_experts"),
                layers = out.layout.num_layers;
  out.flags["num-experts"] = {num(experts)};
  out.flags["moe-router-topk"] = {num(r.integer("num_experts_per_tok"))};
  out.flags["moe-ffn-hidden-size"] = {num(r.integer("moe_intermediate_size"))};
  // norm_topk_prob false: softmax over all experts, top-k, not renormalised (Megatron's
  // --moe-router-pre-softmax).
  if (!r.boolean("norm_topk_prob", true)) out.flags["moe-router-pre-softmax"] = {"true"};
  // transformers' Qwen3MoeDecoderLayer: MoE when not in mlp_only_layers, there are experts
  // and (layer + 1) % decoder_sparse_step == 0.
  const int64_t step = r.integer("decoder_sparse_step", 1);
  std::vector<int> moe(size_t(layers), 0);
  for (int64_t i = 0; i < layers; ++i)
    moe[size_t(i)] = experts > 0 && step > 0 && (i + 1) % step == 0;
  if (r.present("mlp_only_layers")) {
    if (!r.c["mlp_only_layers"].is_array()) fail("{}: 'mlp_only_layers' must be a list", r.source);
    for (const json& l : r.c["mlp_only_layers"]) {
      if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= layers)
        fail("{}: 'mlp_only_layers' holds {}, not a layer of {}", r.source, l.dump(), layers);
      moe[size_t(l.get<int64_t>())] = 0;
    }
  }
  if (std::none_of(moe.begin(), moe.end(), [](int m) { return m == 1; }))
    fail("{}: no layer is MoE (decoder_sparse_step, mlp_only_layers): convert it as qwen3",
         r.source);
  out.flags["moe-layer-freq"] = {layer_pattern(moe)};
  out.layout.num_experts = experts;
}

void deepseek_v3_flags(const ConfigReader& r, HFImport& out) {
  RawOptions& f = out.flags;
  const int64_t heads = out.layout.num_attention_heads, layers = out.layout.num_layers;
  if (r.integer("num_key_value_heads", heads) != heads)
    fail(
        "{}: num_key_value_heads ({}) must equal num_attention_heads ({}) for multi-latent "
        "attention",
        r.source, r.integer("num_key_value_heads"), heads);
  f["multi-latent-attention"] = {"true"};
  // HF always has q_a_layernorm / kv_a_layernorm: Megatron makes them under --qk-layernorm.
  f["qk-layernorm"] = {"true"};
  if (r.integer("q_lora_rank", 0) > 0) f["q-lora-rank"] = {num(r.integer("q_lora_rank"))};
  f["kv-lora-rank"] = {num(r.integer("kv_lora_rank"))};
  f["qk-head-dim"] = {num(r.integer("qk_nope_head_dim"))};
  f["qk-pos-emb-head-dim"] = {num(r.integer("qk_rope_head_dim"))};
  f["v-head-dim"] = {num(r.integer("v_head_dim"))};
  if (!r.boolean("rope_interleave", true))
    fail("{}: rope_interleave false is not supported (Megatron's MLA rotates interleaved pairs)",
         r.source);
  // HF's latent norms use eps 1e-6 always, Megatron's --norm-epsilon.
  if (r.number("rms_norm_eps", 1e-6) != 1e-6)
    out.warnings.push_back(fmt::format(
        "{}: rms_norm_eps {} != 1e-6: Megaton's q/kv latent norms use it, transformers' 1e-6",
        r.source, r.number("rms_norm_eps", 1e-6)));
  const json rope_cfg = r.present("rope_parameters") ? r.c["rope_parameters"]
                        : r.present("rope_scaling")  ? r.c["rope_scaling"]
                                                     : json::object();
  const std::string type = r.string(rope_cfg, "rope_type", r.string(rope_cfg, "type", "default"));
  if (type == "yarn") {
    f["rope-type"] = {"yarn"};
    f["rotary-scaling-factor"] = {num(r.number(rope_cfg, "factor", 1.0))};
    f["original-max-position-embeddings"] = {
        num(int64_t(r.number(rope_cfg, "original_max_position_embeddings", 4096)))};
    f["beta-fast"] = {num(r.number(rope_cfg, "beta_fast", 32.0))};
    f["beta-slow"] = {num(r.number(rope_cfg, "beta_slow", 1.0))};
    f["mscale"] = {num(r.number(rope_cfg, "mscale", 1.0))};
    f["mscale-all-dim"] = {num(r.number(rope_cfg, "mscale_all_dim", 0.0))};
    if (rope_cfg.contains("truncate") && rope_cfg["truncate"].is_boolean() &&
        !rope_cfg["truncate"].get<bool>())
      fail("{}: YaRN with truncate false is not supported (Megatron rounds the correction range)",
           r.source);
  } else if (type == "default") {
    f["rope-type"] = {"rope"};
  } else {
    fail("{}: RoPE scaling '{}' is not supported for deepseek_v3 (yarn or none)", r.source, type);
  }
  if (r.integer("num_nextn_predict_layers", 0) > 0)
    out.warnings.push_back(fmt::format(
        "{}: the {} multi-token prediction layer(s) (model.layers.{}.*) are not converted",
        r.source, r.integer("num_nextn_predict_layers"), layers));
  const int64_t experts = r.integer("n_routed_experts", 0);
  if (experts == 0) return;  // dense
  f["num-experts"] = {num(experts)};
  const int64_t topk = r.integer("num_experts_per_tok");
  f["moe-router-topk"] = {num(topk)};
  const int64_t moe_ffn = r.integer("moe_intermediate_size");
  f["moe-ffn-hidden-size"] = {num(moe_ffn)};
  if (const int64_t shared = r.integer("n_shared_experts", 0); shared > 0)
    f["moe-shared-expert-intermediate-size"] = {num(shared * moe_ffn)};
  const std::string scoring = r.string("scoring_func", "sigmoid");
  if (scoring != "sigmoid")
    fail("{}: scoring_func '{}' is not supported for deepseek_v3 (sigmoid)", r.source, scoring);
  f["moe-router-score-function"] = {"sigmoid"};
  // DeepseekV3's router always adds e_score_correction_bias to choose the experts.
  f["moe-router-enable-expert-bias"] = {"true"};
  if (topk > 1 && !r.boolean("norm_topk_prob", true))
    fail(
        "{}: norm_topk_prob false is not supported with a sigmoid router (Megatron "
        "renormalises sigmoid top-k)",
        r.source);
  f["moe-router-topk-scaling-factor"] = {num(r.number("routed_scaling_factor", 1.0))};
  const int64_t groups = r.integer("n_group", 1), group_topk = r.integer("topk_group", 1);
  if (groups > 1) {
    f["moe-router-num-groups"] = {num(groups)};
    f["moe-router-group-topk"] = {num(group_topk)};
    if (topk != 2 * group_topk)
      out.warnings.push_back(fmt::format(
          "{}: transformers scores an expert group by the sum of its best 2 scores, Megatron "
          "by its best num_experts_per_tok / topk_group ({} / {}): the routing may differ",
          r.source, topk, group_topk));
  }
  const int64_t dense = r.integer("first_k_dense_replace", 0),
                freq = r.integer("moe_layer_freq", 1);
  std::vector<int> moe(size_t(layers), 0);
  for (int64_t i = 0; i < layers; ++i) moe[size_t(i)] = i >= dense && freq > 0 && i % freq == 0;
  out.flags["moe-layer-freq"] = {layer_pattern(moe)};
  out.layout.num_experts = experts;
}

// NemotronH's layer symbols (Megatron's M * - E): "layers_block_type" (transformers 5, also
// its attribute name "layer_types"; with the legacy type names remap_legacy_layer_types
// accepts) or "hybrid_override_pattern" (older configs; transformers reads it only without
// the list).
std::string nemotron_h_pattern(const ConfigReader& r) {
  for (const char* key : {"layers_block_type", "layer_types"}) {
    if (!r.present(key)) continue;
    const json& list = r.c[key];
    if (!list.is_array() || list.empty())
      fail("{}: '{}' must be a non-empty list of layer types", r.source, key);
    std::string pattern;
    for (const json& t : list) {
      const std::string type = t.is_string() ? t.get<std::string>() : "";
      if (type == "linear_attention" || type == "mamba")
        pattern += 'M';
      else if (type == "full_attention" || type == "attention")
        pattern += '*';
      else if (type == "mlp")
        pattern += '-';
      else if (type == "moe")
        pattern += 'E';
      else
        fail("{}: '{}' holds {}, not a layer type (linear_attention, full_attention, mlp, moe)",
             r.source, key, t.dump());
    }
    return pattern;
  }
  const std::string pattern = r.string("hybrid_override_pattern", "");
  if (pattern.empty())
    fail("{}: 'layers_block_type' (or 'hybrid_override_pattern') is missing", r.source);
  const size_t bad = pattern.find_first_not_of("M*-E");
  if (bad != std::string::npos)
    fail("{}: 'hybrid_override_pattern' '{}' holds '{}', not a layer symbol (M * - E)", r.source,
         pattern, pattern[bad]);
  return pattern;
}

// NemotronH (transformers' NemotronHConfig; docs/golden.md "nemotron_h_tiny" has the
// field-by-field correspondence with Megatron's hybrid model).
void nemotron_h_flags(const ConfigReader& r, HFImport& out) {
  RawOptions& f = out.flags;
  const std::string pattern = nemotron_h_pattern(r);
  const int64_t layers = int64_t(pattern.size());
  if (r.present("num_hidden_layers") && r.integer("num_hidden_layers") != layers)
    out.warnings.push_back(fmt::format(
        "{}: num_hidden_layers {} is not the {} layers of the layer types: the layer types are "
        "used (as transformers does)",
        r.source, r.integer("num_hidden_layers"), layers));
  const int64_t hidden = r.integer("hidden_size"), heads = r.integer("num_attention_heads");
  if (heads == 0 || hidden == 0)
    fail("{}: hidden_size and num_attention_heads must be positive", r.source);
  // The pattern gives the layer count, as in Megatron (no --num-layers).
  f["hybrid-layer-pattern"] = {pattern};
  f["hidden-size"] = {num(hidden)};
  f["ffn-hidden-size"] = {num(r.integer("intermediate_size"))};
  f["num-attention-heads"] = {num(heads)};
  const int64_t max_positions = r.integer("max_position_embeddings");
  f["max-position-embeddings"] = {num(max_positions)};
  f["seq-length"] = {num(std::min<int64_t>(max_positions, 4096))};
  // NemotronH's attention has no positional encoding: the Mamba layers order the tokens.
  f["position-embedding-type"] = {"none"};
  f["normalization"] = {"RMSNorm"};
  const double eps = r.number("layer_norm_epsilon", 1e-5);
  f["norm-epsilon"] = {num(eps)};
  if (eps != 1e-5 && pattern.find('M') != std::string::npos)
    out.warnings.push_back(fmt::format(
        "{}: layer_norm_epsilon {} is also the Mamba gated norm's epsilon in transformers; "
        "Megatron's (and Megaton's) gated norm uses 1e-5",
        r.source, eps));
  const std::string act = r.string("mlp_hidden_act", "relu2");
  if (act != "relu2")
    fail("{}: mlp_hidden_act '{}' is not supported (relu2: Megatron's --squared-relu)", r.source,
         act);
  f["squared-relu"] = {"true"};
  f["disable-bias-linear"] = {"true"};
  for (const char* key : {"use_bias", "mlp_bias", "attention_bias"})
    if (r.boolean(key, false))
      fail("{}: '{}' true is not supported (Megatron's hybrid layers have no linear biases)",
           r.source, key);
  f["hidden-dropout"] = {num(r.number("hidden_dropout", 0.0))};
  f["attention-dropout"] = {num(r.number("attention_dropout", 0.0))};
  out.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  if (!out.tie_word_embeddings) f["untie-embeddings-and-output-weights"] = {"true"};
  out.vocab_size = r.integer("vocab_size");
  if (out.vocab_size == 0) fail("{}: vocab_size must be positive", r.source);
  out.layout.num_layers = layers;
  out.layout.num_attention_heads = heads;
  // Required: without them transformers takes NemotronHConfig's defaults (8 and 128), not
  // the other families' (num_attention_heads, hidden_size / num_attention_heads).
  r.integer("num_key_value_heads");
  r.integer("head_dim");
  attention_flags(r, out);

  // The Mamba-2 mixer. transformers' __post_init__ also reads the legacy keys mamba_n_groups,
  // mamba_d_conv and mamba_conv_bias (they win over the current names).
  const auto key = [&r](const char* legacy, const char* current) {
    return r.present(legacy) ? legacy : current;
  };
  f["mamba-num-heads"] = {num(r.integer("mamba_num_heads"))};
  f["mamba-head-dim"] = {num(r.integer("mamba_head_dim"))};
  f["mamba-num-groups"] = {num(r.integer(key("mamba_n_groups", "n_groups")))};
  f["mamba-state-dim"] = {num(r.integer("ssm_state_size"))};
  const char* conv_key = key("mamba_d_conv", "conv_kernel");
  if (const int64_t conv = r.integer(conv_key, 4); conv != 4)
    fail("{}: '{}' {} is not supported (Megatron's MambaMixer has d_conv 4)", r.source, conv_key,
         conv);
  const char* conv_bias_key = key("mamba_conv_bias", "use_conv_bias");
  if (!r.boolean(conv_bias_key, true))
    fail("{}: '{}' false is not supported (Megatron's MambaMixer's conv1d has a bias)", r.source,
         conv_bias_key);
  if (const std::string m = r.string("mamba_hidden_act", "silu"); m != "silu")
    fail("{}: mamba_hidden_act '{}' is not supported (Megatron's MambaMixer uses silu)", r.source,
         m);
  if (pattern.find('M') != std::string::npos) {
    const char* dt_key = key("mamba_dt_min", "time_step_min");
    out.warnings.push_back(fmt::format(
        "{}: transformers clamps the Mamba dt below at {} {}; Megatron (and Megaton) does not: "
        "the two differ where a trained dt falls below it",
        r.source, dt_key, r.number(dt_key, 1e-3)));
  }
  if (r.integer("num_nextn_predict_layers", 0) > 0)
    out.warnings.push_back(
        fmt::format("{}: the {} multi-token prediction layer(s) (mtp.*) are not converted",
                    r.source, r.integer("num_nextn_predict_layers")));

  if (pattern.find('E') == std::string::npos) return;  // no MoE layer: the MoE keys are unused
  if (r.present("moe_latent_size"))
    fail("{}: 'moe_latent_size' {} is not supported (Megaton's MoE has no latent projection)",
         r.source, r.c["moe_latent_size"].dump());
  const int64_t experts = r.present("n_routed_experts") ? r.integer("n_routed_experts")
                                                        : r.integer("num_local_experts");
  const int64_t topk = r.integer("num_experts_per_tok");
  f["num-experts"] = {num(experts)};
  f["moe-router-topk"] = {num(topk)};
  f["moe-ffn-hidden-size"] = {num(r.integer("moe_intermediate_size"))};
  // NemotronHMoE always has one shared expert of this width (n_shared_experts is unused).
  f["moe-shared-expert-intermediate-size"] = {
      num(r.integer("moe_shared_expert_intermediate_size"))};
  // NemotronHTopkRouter: sigmoid scores, e_score_correction_bias added to choose the experts.
  f["moe-router-score-function"] = {"sigmoid"};
  f["moe-router-enable-expert-bias"] = {"true"};
  // Megatron renormalises sigmoid top-k exactly when k > 1; transformers when norm_topk_prob.
  const bool renormalise = r.boolean("norm_topk_prob", true);
  if (renormalise != (topk > 1))
    fail(
        "{}: norm_topk_prob {} with num_experts_per_tok {} is not supported (Megatron "
        "renormalises the sigmoid top-k exactly when it is more than 1)",
        r.source, renormalise, topk);
  f["moe-router-topk-scaling-factor"] = {num(r.number("routed_scaling_factor", 1.0))};
  const int64_t groups = r.integer("n_group", 1), group_topk = r.integer("topk_group", 1);
  if (groups > 1) {
    f["moe-router-num-groups"] = {num(groups)};
    f["moe-router-group-topk"] = {num(group_topk)};
    if (topk != 2 * group_topk)
      out.warnings.push_back(fmt::format(
          "{}: transformers scores an expert group by the sum of its best 2 scores, Megatron "
          "by its best num_experts_per_tok / topk_group ({} / {}): the routing may differ",
          r.source, topk, group_topk));
  }
  out.layout.num_experts = experts;
}

}  // namespace

HFImport hf_import_config(const nlohmann::json& config, const std::string& source) {
  if (!config.is_object()) fail("{}: not a JSON object", source);
  const ConfigReader r{config, source};
  const std::string type = r.string("model_type", "");
  HFImport out;
  if (type.empty()) fail("{}: 'model_type' is missing", source);
  if (type == "llama")
    out.family = HFFamily::Llama;
  else if (type == "qwen3")
    out.family = HFFamily::Qwen3;
  else if (type == "mixtral")
    out.family = HFFamily::Mixtral;
  else if (type == "qwen3_moe")
    out.family = HFFamily::Qwen3Moe;
  else if (type == "deepseek_v3")
    out.family = HFFamily::DeepseekV3;
  else if (type == "nemotron_h")
    out.family = HFFamily::NemotronH;
  else if (type == "qwen2")
    fail(
        "{}: model_type 'qwen2' is not supported: its q/k/v_proj biases need Megatron's "
        "--add-qkv-bias, which Megaton does not have",
        source);
  else
    fail(
        "{}: model_type '{}' is not supported (llama, qwen3, mixtral, qwen3_moe, deepseek_v3, "
        "nemotron_h)",
        source, type);
  if (out.family == HFFamily::NemotronH) {
    nemotron_h_flags(r, out);
    return out;
  }
  // transformers' defaults of rope_theta where a config omits it.
  common_flags(r, out, out.family == HFFamily::Mixtral ? 1e6 : 10000.0);
  if (out.family == HFFamily::DeepseekV3) {
    deepseek_v3_flags(r, out);
    return out;
  }
  attention_flags(r, out);
  if (out.family == HFFamily::Qwen3 || out.family == HFFamily::Qwen3Moe)
    out.flags["qk-layernorm"] = {"true"};
  sliding_window_warning(r, out);
  if (out.family == HFFamily::Mixtral) mixtral_flags(r, out);
  if (out.family == HFFamily::Qwen3Moe) qwen3_moe_flags(r, out);
  return out;
}

}  // namespace megaton
