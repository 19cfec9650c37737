// GPTConfig defaults and validation.
#include "model/config.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace megaton {

namespace {
// Megatron's recompute_modules names with their bits, in RecomputeModule's order.
constexpr std::pair<const char*, uint32_t> kRecomputeModules[] = {
    {"core_attn", kRecomputeCoreAttn},
    {"moe_act", kRecomputeMoeAct},
    {"layernorm", kRecomputeLayernorm},
    {"mlp", kRecomputeMlp},
    {"moe", kRecomputeMoe},
    {"shared_experts", kRecomputeSharedExperts},
    {"mla_up_proj", kRecomputeMlaUpProj},
};
}  // namespace

uint32_t recompute_module_bit(const std::string& name) {
  for (const auto& [module, bit] : kRecomputeModules)
    if (name == module) return bit;
  return 0;
}

std::string recompute_module_names(uint32_t modules) {
  std::string out;
  for (const auto& [module, bit] : kRecomputeModules) {
    if ((modules & bit) == 0) continue;
    if (!out.empty()) out += ",";
    out += module;
  }
  return out;
}

float GPTConfig::moe_loss_coeff(const std::string& type) const {
  if (num_experts == 0) return 0.0f;
  for (size_t i = 0; i < moe_router_load_balancing_type.size(); ++i)
    if (moe_router_load_balancing_type[i] == type)
      return i < moe_aux_loss_coeffs.size() ? moe_aux_loss_coeffs[i] : moe_aux_loss_coeff;
  return 0.0f;
}

bool GPTConfig::use_aux_loss() const {
  return moe_loss_coeff("aux_loss") != 0.0f || moe_loss_coeff("seq_aux_loss") != 0.0f ||
         moe_loss_coeff("global_aux_loss") != 0.0f;
}

int64_t GPTConfig::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers; ++l) n += is_moe_layer(l);
  return n;
}

void GPTConfig::finalize() {
  auto positive = [](const char* key, int64_t v) {
    if (v <= 0) fail("{} must be positive (got {})", key, v);
  };
  finalize_hybrid();
  positive("num-layers", num_layers);
  positive("hidden-size", hidden_size);
  positive("num-attention-heads", num_attention_heads);
  positive("seq-length", seq_length);
  positive("vocab size (from the tokenizer)", vocab_size);
  positive("make-vocab-size-divisible-by", make_vocab_size_divisible_by);
  if (ffn_hidden_size == 0) ffn_hidden_size = 4 * hidden_size;
  // Megatron (core_transformer_config_from_args): `assert not args.swiglu` under squared_relu.
  if (squared_relu && swiglu)
    fail("squared-relu and swiglu are two MLP activations: give one (Megatron refuses both)");
  if (kv_channels == 0 && multi_latent_attention) {
    kv_channels = v_head_dim;  // unused by MLA, whose head dims are its own fields
  } else if (kv_channels == 0) {
    if (hidden_size % num_attention_heads != 0)
      fail("hidden-size ({}) is not divisible by num-attention-heads ({}); set kv-channels",
           hidden_size, num_attention_heads);
    kv_channels = hidden_size / num_attention_heads;
  }
  if (!group_query_attention) num_query_groups = num_attention_heads;
  if (num_query_groups == 0) num_query_groups = num_attention_heads;
  if (num_attention_heads % num_query_groups != 0)
    fail("num-attention-heads ({}) is not divisible by num-query-groups ({})", num_attention_heads,
         num_query_groups);
  if (max_position_embeddings == 0) max_position_embeddings = seq_length;
  // The recompute flags are checked by the argument parser; a config built in code gets
  // the checks full granularity needs to be well defined (RecomputeConfig::full_group_start).
  if (recompute.granularity == RecomputeGranularity::Full &&
      (recompute.method == RecomputeMethod::None || recompute.num_layers < 1))
    fail(
        "recompute-granularity full needs recompute-method uniform or block and "
        "recompute-num-layers >= 1");
  if (position_embedding_type == PositionEmbedding::LearnedAbsolute &&
      seq_length > max_position_embeddings)
    fail("seq-length ({}) exceeds max-position-embeddings ({})", seq_length,
         max_position_embeddings);
  finalize_mla_mtp();
  if (!(rotary_percent > 0.0 && rotary_percent <= 1.0))
    fail("rotary-percent must be in (0, 1] (got {})", rotary_percent);
  if (multi_latent_attention && rotary_percent < 1.0)
    fail(
        "rotary-percent {} with multi-latent-attention is not supported: its RoPE part has "
        "its own dims (qk-pos-emb-head-dim)",
        rotary_percent);
  if (!multi_latent_attention && position_embedding_type == PositionEmbedding::Rope) {
    if (rotary_percent == 1.0 && kv_channels % 2 != 0)
      fail("kv-channels ({}) must be even for rope", kv_channels);
    // Rotate-half pairs channel i with i + R/2: an odd R has no such pairing (Megatron's
    // arange(0, R, 2) gives (R + 1) / 2 frequencies and it rotates R + 1 channels).
    const int64_t r = rotary_dim();
    if (rotary_percent < 1.0 && (r <= 0 || r % 2 != 0))
      fail(
          "rotary-percent {} gives a rotary dim of {} = int(kv-channels {} x rotary-percent): "
          "it must be even and positive",
          rotary_percent, r, kv_channels);
  }
  if (hidden_dropout < 0 || hidden_dropout >= 1)
    fail("hidden-dropout must be in [0, 1) (got {})", hidden_dropout);
  if (attention_dropout < 0 || attention_dropout >= 1)
    fail("attention-dropout must be in [0, 1) (got {})", attention_dropout);
  if (init_method_std <= 0) fail("init-method-std must be positive (got {})", init_method_std);
  positive("tensor-model-parallel-size", tensor_model_parallel_size);
  int64_t m = make_vocab_size_divisible_by * tensor_model_parallel_size;
  padded_vocab_size = (vocab_size + m - 1) / m * m;
  const int64_t tp = tensor_model_parallel_size;
  if (tp > 1 && ffn_hidden_size % tp != 0)
    fail("ffn-hidden-size ({}) is not divisible by tensor-model-parallel-size ({})",
         ffn_hidden_size, tp);

  if (num_experts < 0) fail("num-experts must be >= 0 (got {})", num_experts);
  if (num_experts > 0) {
    if (moe_ffn_hidden_size == 0) moe_ffn_hidden_size = ffn_hidden_size;
    if (moe_router_topk <= 0 || moe_router_topk > num_experts)
      fail("moe-router-topk ({}) must be between 1 and num-experts ({})", moe_router_topk,
           num_experts);
    if (moe_layer_freq <= 0) fail("moe-layer-freq must be positive (got {})", moe_layer_freq);
    if (!moe_layer_pattern.empty()) {
      if (int64_t(moe_layer_pattern.size()) != num_layers)
        fail("moe-layer-freq pattern has {} entries for num-layers {}", moe_layer_pattern.size(),
             num_layers);
      for (int v : moe_layer_pattern)
        if (v != 0 && v != 1) fail("moe-layer-freq pattern entries must be 0 or 1 (got {})", v);
    }
    const std::vector<std::string>& types = moe_router_load_balancing_type;
    for (const auto& t : types)
      if (t != "aux_loss" && t != "seq_aux_loss" && t != "global_aux_loss" && t != "sinkhorn" &&
          t != "none")
        fail(
            "moe-router-load-balancing-type '{}' must be aux_loss, seq_aux_loss, "
            "global_aux_loss, sinkhorn or none",
            t);
    if (!moe_aux_loss_coeffs.empty() && moe_aux_loss_coeffs.size() != types.size())
      fail("moe-aux-loss-coeff has {} values for {} moe-router-load-balancing-type values",
           moe_aux_loss_coeffs.size(), types.size());
    if (moe_aux_loss_coeffs.empty()) moe_aux_loss_coeffs.assign(types.size(), moe_aux_loss_coeff);
    const bool sinkhorn = std::find(types.begin(), types.end(), "sinkhorn") != types.end();
    if (sinkhorn && (types.size() != 1 || moe_aux_loss_coeffs[0] != 0.0f))
      fail("moe-router-load-balancing-type sinkhorn takes no other type and moe-aux-loss-coeff 0");
    // Megatron's sinkhorn router has no group limit, scaling factor or expert bias.
    if (sinkhorn && (moe_router_num_groups > 0 || moe_router_topk_scaling_factor != 0.0f ||
                     moe_router_enable_expert_bias))
      fail(
          "moe-router-load-balancing-type sinkhorn takes no moe-router-num-groups, "
          "moe-router-topk-scaling-factor or moe-router-enable-expert-bias");
    const std::string& f = moe_router_score_function;
    if (f != "softmax" && f != "sigmoid" && f != "sqrtsoftplus")
      fail("moe-router-score-function must be softmax, sigmoid or sqrtsoftplus (got '{}')", f);
    // Megatron's TransformerConfig checks.
    if (moe_router_topk == 1 && f == "softmax" && !moe_router_pre_softmax && !sinkhorn)
      fail("moe-router-topk 1 with the softmax score function needs moe-router-pre-softmax");
    if (moe_router_enable_expert_bias && f == "softmax")
      fail(
          "moe-router-enable-expert-bias needs moe-router-score-function sigmoid or "
          "sqrtsoftplus");
    if (moe_router_num_groups > 0) {
      if (num_experts % moe_router_num_groups != 0)
        fail("num-experts ({}) is not divisible by moe-router-num-groups ({})", num_experts,
             moe_router_num_groups);
      if (moe_router_group_topk <= 0 || moe_router_group_topk > moe_router_num_groups)
        fail("moe-router-group-topk ({}) must be between 1 and moe-router-num-groups ({})",
             moe_router_group_topk, moe_router_num_groups);
      if (moe_router_topk < moe_router_group_topk)
        fail("moe-router-topk ({}) is smaller than moe-router-group-topk ({})", moe_router_topk,
             moe_router_group_topk);
    } else if (moe_router_group_topk > 0) {
      fail("moe-router-group-topk needs moe-router-num-groups");
    }
    if (!moe_router_dtype.empty() && moe_router_dtype != "fp32" && moe_router_dtype != "fp64")
      fail("moe-router-dtype must be fp32 or fp64 (got '{}')", moe_router_dtype);
    if (moe_z_loss_coeff < 0) fail("moe-z-loss-coeff must be >= 0 (got {})", moe_z_loss_coeff);
    if (moe_expert_capacity_factor < 0)
      fail("moe-expert-capacity-factor must be positive (got {})", moe_expert_capacity_factor);
    if (moe_token_drop_policy != "probs" && moe_token_drop_policy != "position")
      fail("moe-token-drop-policy must be probs or position (got '{}')", moe_token_drop_policy);
    if (moe_pad_expert_input_to_capacity && moe_expert_capacity_factor == 0)
      fail("moe-pad-expert-input-to-capacity needs moe-expert-capacity-factor");
    if (sinkhorn && moe_expert_capacity_factor > 0)
      fail("moe-expert-capacity-factor is not supported with the sinkhorn router");
    if (moe_input_jitter_eps < 0 || moe_input_jitter_eps >= 1)
      fail("moe-input-jitter-eps must be in [0, 1) (got {})", moe_input_jitter_eps);
    if (moe_shared_expert_intermediate_size < 0)
      fail("moe-shared-expert-intermediate-size must be >= 0 (got {})",
           moe_shared_expert_intermediate_size);
    if (moe_shared_expert_gate && moe_shared_expert_intermediate_size == 0)
      fail(
          "moe-shared-expert-gate needs a shared expert (moe-shared-expert-intermediate-size > 0)");
  }
}

void GPTConfig::check_fp8_dimensions(int64_t tokens_per_micro_batch, int64_t etp) const {
  if (!fp8.enabled) return;
  const int64_t multiple = fp8.dimension_multiple();
  const int64_t tp = tensor_model_parallel_size;
  const auto check = [&](const std::string& what, int64_t value) {
    if (value % multiple != 0)
      fail("{} ({}) must be divisible by {} for FP8 GEMMs{}", what, value, multiple,
           fp8.recipe == Fp8Recipe::Blockwise ? " under --fp8-recipe blockwise" : "");
  };
  check("micro-batch-size x seq-length", tokens_per_micro_batch);
  check("hidden-size", hidden_size);
  const std::string per_rank = tp > 1 ? fmt::format(" / tensor-model-parallel-size {}", tp) : "";
  if (multi_latent_attention) {
    // MLA's projections (model/mla.h): the replicated down projections' widths, the
    // column-parallel up projections' and linear_proj's per rank.
    const int64_t heads = num_attention_heads / tp, dq = qk_head_dim + qk_pos_emb_head_dim;
    if (q_lora_rank > 0) check("q-lora-rank", q_lora_rank);
    check("kv-lora-rank", kv_lora_rank);
    check("kv-lora-rank + qk-pos-emb-head-dim", kv_lora_rank + qk_pos_emb_head_dim);
    check("num-attention-heads x (qk-head-dim + qk-pos-emb-head-dim)" + per_rank, heads * dq);
    check("num-attention-heads x (qk-head-dim + v-head-dim)" + per_rank,
          heads * (qk_head_dim + v_head_dim));
    check("num-attention-heads x v-head-dim" + per_rank, heads * v_head_dim);
  } else if (!is_hybrid() || has_hybrid_symbol(kHybridAttention)) {
    check("num-attention-heads x kv-channels" + per_rank, query_projection_size() / tp);
    check("num-query-groups x kv-channels" + per_rank, kv_projection_size() / tp);
  }
  // A hybrid model's Mamba mixers (MambaMixer asserts in_proj's width for FP8 too):
  // in_proj's output [z, x, B, C, dt] and out_proj's input d_inner, per rank.
  if (is_hybrid() && has_hybrid_symbol(kHybridMamba)) {
    check(
        "in_proj's width 2 x mamba-num-heads x mamba-head-dim + 2 x mamba-num-groups x "
        "mamba-state-dim + mamba-num-heads" +
            per_rank,
        mamba_in_proj_size() / tp);
    check("mamba-num-heads x mamba-head-dim" + per_rank, mamba_d_inner() / tp);
  }
  // Dense layers (their fc1 / fc2 run in FP8); counted without a loop over num_layers.
  const bool dense_layers =
      is_hybrid()
          ? has_hybrid_symbol(kHybridMlp)
          : num_experts == 0 ||
                (moe_layer_pattern.empty()
                     ? moe_layer_freq > 1
                     : std::count(moe_layer_pattern.begin(), moe_layer_pattern.end(), 0) > 0);
  if (dense_layers) check("ffn-hidden-size" + per_rank, ffn_hidden_size / tp);
  const bool moe_layers = num_experts > 0 && (!is_hybrid() || has_hybrid_symbol(kHybridMoe));
  if (moe_layers && moe_shared_expert_intermediate_size > 0)
    check("moe-shared-expert-intermediate-size" + per_rank,
          moe_shared_expert_intermediate_size / tp);
  if (moe_layers)
    check("moe-ffn-hidden-size" +
              (etp > 1 ? fmt::format(" / expert-tensor-parallel-size {}", etp) : std::string()),
          moe_ffn_hidden_size / std::max<int64_t>(etp, 1));
}

}  // namespace megaton
