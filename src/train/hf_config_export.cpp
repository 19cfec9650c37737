// A Megaton model -> Hugging Face config.json (train/hf_config.h's family rule).
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "core/error.h"
#include "train/hf_config.h"

namespace megaton {

using nlohmann::json;

namespace {

// A float field written to JSON as its shortest decimal (1e-06, not 9.99999997e-07).
double shortest(float v) { return std::stod(fmt::format("{}", v)); }

[[noreturn]] void cannot(HFFamily family, const std::string& what) {
  fail("cannot export to Hugging Face {}: {}", hf_model_type(family), what);
}

HFFamily family_of(const GPTConfig& c) {
  if (c.is_hybrid()) return HFFamily::NemotronH;
  if (c.multi_latent_attention) return HFFamily::DeepseekV3;
  if (c.num_experts > 0) return c.qk_layernorm ? HFFamily::Qwen3Moe : HFFamily::Mixtral;
  return c.qk_layernorm ? HFFamily::Qwen3 : HFFamily::Llama;
}

// The router settings only deepseek_v3 can express.
void check_plain_softmax_router(const GPTConfig& c, HFFamily family) {
  if (c.moe_router_score_function != "softmax")
    cannot(family, fmt::format("--moe-router-score-function {} (its router is softmax)",
                               c.moe_router_score_function));
  if (c.moe_router_enable_expert_bias) cannot(family, "--moe-router-enable-expert-bias");
  if (c.moe_router_num_groups > 0)
    cannot(family, "--moe-router-num-groups (group-limited routing)");
  if (c.moe_router_topk_scaling_factor != 0.0f && c.moe_router_topk_scaling_factor != 1.0f)
    cannot(family, "--moe-router-topk-scaling-factor");
  if (c.moe_shared_expert_intermediate_size > 0)
    cannot(family, "--moe-shared-expert-intermediate-size (it has no shared expert)");
}

void rope_json(json& out, double theta, const json& scaling) {
  out["rope_theta"] = theta;
  out["rope_scaling"] = scaling;
  json params = scaling.is_null() ? json{{"rope_type", "default"}} : scaling;
  params["rope_theta"] = theta;
  out["rope_parameters"] = params;
}

// NemotronHConfig for a hybrid model (the inverse of hf_config.cpp's nemotron_h_flags;
// docs/golden.md "nemotron_h_tiny" has the correspondence).
void nemotron_h_config(const GPTConfig& c, HFExport& out) {
  const HFFamily family = HFFamily::NemotronH;
  if (c.position_embedding_type != PositionEmbedding::None)
    cannot(family, "--position-embedding-type other than none (its attention has no positions)");
  if (c.normalization != Normalization::RMSNorm)
    cannot(family, "--normalization LayerNorm (its models use RMSNorm)");
  if (!c.squared_relu) cannot(family, "an MLP without --squared-relu (its MLPs are relu2)");
  if (!c.disable_bias_linear) cannot(family, "linear biases (give --disable-bias-linear)");
  if (c.has_hybrid_symbol(kHybridMla))
    cannot(family, "+ (multi-latent attention) layers in --hybrid-layer-pattern");
  if (c.qk_layernorm) cannot(family, "--qk-layernorm (its attention has no q/k norms)");
  if (c.mamba_conv_kernel != 4)
    cannot(family, fmt::format("a Mamba convolution of {} taps", c.mamba_conv_kernel));
  json& j = out.config;
  json types = json::array();
  for (const char symbol : c.hybrid_layers)
    types.push_back(symbol == kHybridMamba       ? "linear_attention"
                    : symbol == kHybridAttention ? "full_attention"
                    : symbol == kHybridMoe       ? "moe"
                                                 : "mlp");
  j["layers_block_type"] = types;                  // transformers 5
  j["hybrid_override_pattern"] = c.hybrid_layers;  // older (remote-code) loaders
  j["num_hidden_layers"] = int64_t(c.hybrid_layers.size());
  j["head_dim"] = c.kv_channels;
  j["num_key_value_heads"] = c.num_query_groups;
  j["layer_norm_epsilon"] = shortest(c.norm_epsilon);
  j["hidden_dropout"] = shortest(c.hidden_dropout);
  j["mlp_hidden_act"] = "relu2";
  j["mlp_bias"] = false;
  j["use_bias"] = false;
  j["mamba_num_heads"] = c.mamba_num_heads;
  j["mamba_head_dim"] = c.mamba_head_dim;
  j["n_groups"] = c.mamba_num_groups;
  j["ssm_state_size"] = c.mamba_state_dim;
  j["conv_kernel"] = c.mamba_conv_kernel;
  j["use_conv_bias"] = true;
  j["mamba_hidden_act"] = "silu";
  j["mamba_proj_bias"] = false;
  // Unused by transformers' model (d_inner is mamba_num_heads x mamba_head_dim).
  j["expand"] = c.mamba_d_inner() % c.hidden_size == 0 ? c.mamba_d_inner() / c.hidden_size : 2;
  // NemotronHConfig's defaults, or the source model's (carried_keys).
  j["chunk_size"] = c.mamba_chunk_size;
  j["time_step_min"] = 0.001;
  j["time_step_max"] = 0.1;
  j["time_step_floor"] = 1e-4;
  j["mamba_ssm_cache_dtype"] = "float32";
  j["use_mamba_kernels"] = true;
  j["rescale_prenorm_residual"] = true;
  j["residual_in_fp32"] = false;
  j["num_logits_to_keep"] = 1;
  j["num_nextn_predict_layers"] = 0;
  j["mtp_layers_block_type"] = {"full_attention", "moe"};
  j["sliding_window"] = nullptr;
  j["output_router_logits"] = false;
  out.carried_keys = {"chunk_size",           "time_step_min",
                      "time_step_max",        "time_step_floor",
                      "time_step_limit",      "mamba_ssm_cache_dtype",
                      "use_mamba_kernels",    "rescale_prenorm_residual",
                      "residual_in_fp32",     "num_logits_to_keep",
                      "n_shared_experts",     "moe_shared_expert_overlap",
                      "mtp_layers_block_type"};
  if (c.has_hybrid_symbol(kHybridMamba)) {
    out.warnings.push_back(
        "transformers clamps the Mamba dt below at time_step_min (config.json's); Megaton, as "
        "Megatron, does not: the two differ where the model's dt falls below it");
    if (c.norm_epsilon != 1e-5f)
      out.warnings.push_back(fmt::format(
          "--norm-epsilon {}: transformers' Mamba gated norm uses it (layer_norm_epsilon), "
          "Megaton's, as Megatron's, 1e-5",
          c.norm_epsilon));
  }
  if (!c.has_hybrid_symbol(kHybridMoe)) return;
  if (c.moe_router_score_function != "sigmoid")
    cannot(family, fmt::format("--moe-router-score-function {} (its router is sigmoid)",
                               c.moe_router_score_function));
  if (c.moe_shared_expert_intermediate_size <= 0)
    cannot(family, "MoE without --moe-shared-expert-intermediate-size (it has a shared expert)");
  if (c.moe_shared_expert_gate) cannot(family, "--moe-shared-expert-gate");
  j["n_routed_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.moe_router_topk;
  j["moe_intermediate_size"] =
      c.moe_ffn_hidden_size > 0 ? c.moe_ffn_hidden_size : c.ffn_hidden_size;
  j["moe_shared_expert_intermediate_size"] = c.moe_shared_expert_intermediate_size;
  j["moe_latent_size"] = nullptr;
  j["n_shared_experts"] = 1;
  j["moe_shared_expert_overlap"] = true;
  j["n_group"] = c.moe_router_num_groups > 0 ? c.moe_router_num_groups : 1;
  j["topk_group"] = c.moe_router_num_groups > 0 ? c.moe_router_group_topk : 1;
  j["routed_scaling_factor"] =
      c.moe_router_topk_scaling_factor > 0 ? shortest(c.moe_router_topk_scaling_factor) : 1.0;
  // Megatron renormalises the sigmoid top-k exactly when k > 1.
  j["norm_topk_prob"] = c.moe_router_topk > 1;
  // Its router always adds e_score_correction_bias: zeros without an expert bias.
  out.zero_expert_bias = !c.moe_router_enable_expert_bias;
  if (c.moe_router_num_groups > 0 && c.moe_router_topk != 2 * c.moe_router_group_topk)
    out.warnings.push_back(fmt::format(
        "transformers scores an expert group by the sum of its best 2 scores, Megatron by "
        "its best topk / group-topk ({} / {}): the routing may differ",
        c.moe_router_topk, c.moe_router_group_topk));
}

}  // namespace

HFExport hf_export_config(const GPTConfig& c, int64_t vocab_size) {
  HFExport out;
  const HFFamily family = family_of(c);
  out.family = family;
  if (family == HFFamily::NemotronH) {
    json& j = out.config;
    j["architectures"] = {hf_architecture(family)};
    j["model_type"] = hf_model_type(family);
    j["vocab_size"] = vocab_size;
    j["hidden_size"] = c.hidden_size;
    j["intermediate_size"] = c.ffn_hidden_size;
    j["num_attention_heads"] = c.num_attention_heads;
    j["max_position_embeddings"] = c.max_position_embeddings;
    j["tie_word_embeddings"] = !c.untie_embeddings_and_output_weights;
    j["attention_bias"] = false;
    j["attention_dropout"] = shortest(c.attention_dropout);
    j["initializer_range"] = shortest(c.init_method_std);
    j["use_cache"] = true;
    out.layout = {c.num_layers, c.num_attention_heads, c.num_query_groups, c.kv_channels,
                  c.num_experts};
    nemotron_h_config(c, out);
    return out;
  }
  if (c.position_embedding_type != PositionEmbedding::Rope)
    cannot(family, "--position-embedding-type learned_absolute (its models use RoPE)");
  if (c.normalization != Normalization::RMSNorm)
    cannot(family, "--normalization LayerNorm (its models use RMSNorm)");
  if (!c.swiglu) cannot(family, "an MLP without --swiglu (its MLPs are SiLU-gated)");
  if (!c.disable_bias_linear) cannot(family, "linear biases (give --disable-bias-linear)");
  if (c.rotary_percent != 1.0) cannot(family, "--rotary-percent below 1 (partial RoPE)");
  if (c.mtp_num_layers > 0)
    out.warnings.push_back(fmt::format(
        "the {} multi-token prediction depth(s) (mtp.*) are not exported", c.mtp_num_layers));
  const int64_t heads = c.num_attention_heads;
  json& j = out.config;
  j["architectures"] = {hf_architecture(family)};
  j["model_type"] = hf_model_type(family);
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.ffn_hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = heads;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = shortest(c.norm_epsilon);
  j["tie_word_embeddings"] = !c.untie_embeddings_and_output_weights;
  j["attention_bias"] = false;
  j["attention_dropout"] = shortest(c.attention_dropout);
  j["initializer_range"] = shortest(c.init_method_std);
  j["use_cache"] = true;
  out.layout = {c.num_layers, heads, c.num_query_groups, c.kv_channels, c.num_experts};
  const double theta = shortest(c.rotary_base);
  std::vector<int> moe(size_t(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) moe[size_t(i)] = c.is_moe_layer(i) ? 1 : 0;
  const int64_t moe_ffn = c.moe_ffn_hidden_size > 0 ? c.moe_ffn_hidden_size : c.ffn_hidden_size;
  if (family != HFFamily::DeepseekV3) {
    j["num_key_value_heads"] = c.num_query_groups;
    j["head_dim"] = c.kv_channels;
    rope_json(j, theta, json());
  }
  switch (family) {
    case HFFamily::Llama:
      j["mlp_bias"] = false;
      j["pretraining_tp"] = 1;
      break;
    case HFFamily::Qwen3:
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
      j["max_window_layers"] = c.num_layers;
      break;
    case HFFamily::Mixtral:
      check_plain_softmax_router(c, family);
      if (c.moe_router_pre_softmax)
        cannot(family, "--moe-router-pre-softmax (it renormalises the top-k)");
      if (std::find(moe.begin(), moe.end(), 0) != moe.end())
        cannot(family, "dense layers (--moe-layer-freq): every Mixtral layer is MoE");
      j["intermediate_size"] = moe_ffn;
      j["num_local_experts"] = c.num_experts;
      j["num_experts_per_tok"] = c.moe_router_topk;
      j["router_aux_loss_coef"] = shortest(c.moe_aux_loss_coeff);
      j["router_jitter_noise"] = 0.0;
      j["output_router_logits"] = false;
      j["sliding_window"] = nullptr;
      out.naming = ckpt::HFExpertNaming::Mixtral;
      break;
    case HFFamily::Qwen3Moe: {
      check_plain_softmax_router(c, family);
      json dense = json::array();
      for (int64_t i = 0; i < c.num_layers; ++i)
        if (!moe[size_t(i)]) dense.push_back(i);
      j["num_experts"] = c.num_experts;        // transformers 4
      j["num_local_experts"] = c.num_experts;  // transformers 5
      j["num_experts_per_tok"] = c.moe_router_topk;
      j["moe_intermediate_size"] = moe_ffn;
      j["norm_topk_prob"] = !c.moe_router_pre_softmax;
      j["decoder_sparse_step"] = 1;
      j["mlp_only_layers"] = dense;
      j["router_aux_loss_coef"] = shortest(c.moe_aux_loss_coeff);
      j["output_router_logits"] = false;
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
      j["max_window_layers"] = c.num_layers;
      break;
    }
    case HFFamily::NemotronH:
      break;  // nemotron_h_config above
    case HFFamily::DeepseekV3: {
      if (!c.qk_layernorm)
        cannot(family, "multi-latent attention without --qk-layernorm (its q/kv latent norms)");
      j["num_key_value_heads"] = heads;
      j["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json();
      j["kv_lora_rank"] = c.kv_lora_rank;
      j["qk_nope_head_dim"] = c.qk_head_dim;
      j["qk_rope_head_dim"] = c.qk_pos_emb_head_dim;
      j["v_head_dim"] = c.v_head_dim;
      j["head_dim"] = c.qk_pos_emb_head_dim;
      j["rope_interleave"] = true;
      j["num_nextn_predict_layers"] = 0;
      j["output_router_logits"] = false;
      json scaling;
      if (c.rope_type == RopeType::Yarn)
        scaling = {{"type", "yarn"},
                   {"rope_type", "yarn"},
                   {"factor", c.yarn.factor},
                   {"original_max_position_embeddings", c.yarn.original_max_position_embeddings},
                   {"beta_fast", c.yarn.beta_fast},
                   {"beta_slow", c.yarn.beta_slow},
                   {"mscale", c.yarn.mscale},
                   {"mscale_all_dim", c.yarn.mscale_all_dim}};
      rope_json(j, theta, scaling);
      // Dense layers first, then MoE: first_k_dense_replace.
      const int64_t first_moe = std::find(moe.begin(), moe.end(), 1) - moe.begin();
      if (std::find(moe.begin() + first_moe, moe.end(), 0) != moe.end())
        cannot(family,
               "a dense layer after an MoE layer (--moe-layer-freq): its dense layers "
               "are the first first_k_dense_replace");
      j["first_k_dense_replace"] = first_moe;
      j["moe_layer_freq"] = 1;
      if (c.num_experts == 0) {
        j["n_routed_experts"] = 1;  // unused: every layer is dense
        j["num_experts_per_tok"] = 1;
        j["moe_intermediate_size"] = c.ffn_hidden_size;
        j["n_shared_experts"] = 1;
        j["n_group"] = 1;
        j["topk_group"] = 1;
        j["routed_scaling_factor"] = 1.0;
        j["norm_topk_prob"] = true;
        j["topk_method"] = "noaux_tc";
        break;
      }
      if (c.moe_router_score_function != "sigmoid")
        cannot(family, fmt::format("--moe-router-score-function {} (its router is sigmoid)",
                                   c.moe_router_score_function));
      if (c.moe_shared_expert_intermediate_size <= 0 ||
          c.moe_shared_expert_intermediate_size % moe_ffn != 0)
        cannot(family, fmt::format("--moe-shared-expert-intermediate-size {}: it needs shared "
                                   "experts, a multiple of --moe-ffn-hidden-size ({})",
                                   c.moe_shared_expert_intermediate_size, moe_ffn));
      if (c.moe_shared_expert_gate) cannot(family, "--moe-shared-expert-gate");
      j["n_routed_experts"] = c.num_experts;
      j["num_experts_per_tok"] = c.moe_router_topk;
      j["moe_intermediate_size"] = moe_ffn;
      j["n_shared_experts"] = c.moe_shared_expert_intermediate_size / moe_ffn;
      j["n_group"] = c.moe_router_num_groups > 0 ? c.moe_router_num_groups : 1;
      j["topk_group"] = c.moe_router_num_groups > 0 ? c.moe_router_group_topk : 1;
      j["routed_scaling_factor"] =
          c.moe_router_topk_scaling_factor > 0 ? shortest(c.moe_router_topk_scaling_factor) : 1.0;
      j["norm_topk_prob"] = true;
      j["topk_method"] = "noaux_tc";
      j["scoring_func"] = "sigmoid";
      out.zero_expert_bias = !c.moe_router_enable_expert_bias;
      if (c.moe_router_num_groups > 0 && c.moe_router_topk != 2 * c.moe_router_group_topk)
        out.warnings.push_back(fmt::format(
            "transformers scores an expert group by the sum of its best 2 scores, Megatron by "
            "its best topk / group-topk ({} / {}): the routing may differ",
            c.moe_router_topk, c.moe_router_group_topk));
      break;
    }
  }
  if (family == HFFamily::DeepseekV3 && c.num_experts > 0 && c.moe_router_pre_softmax)
    cannot(family, "--moe-router-pre-softmax");
  return out;
}

}  // namespace megaton
