// GPTConfig's checks of multi-latent attention, the RoPE type and multi-token prediction
// (Megatron's MLATransformerConfig.__post_init__ and arguments.py checks).
#include "core/error.h"
#include "model/config.h"

namespace megaton {

void GPTConfig::finalize_mla_mtp() {
  const YarnConfig& y = yarn;
  if (y.factor <= 0) fail("rotary-scaling-factor must be positive (got {})", y.factor);
  if (y.original_max_position_embeddings <= 0)
    fail("original-max-position-embeddings must be positive (got {})",
         y.original_max_position_embeddings);
  if (y.beta_fast <= 0 || y.beta_slow <= 0 || y.beta_fast <= y.beta_slow)
    fail("beta-fast ({}) must be larger than beta-slow ({}), both positive", y.beta_fast,
         y.beta_slow);
  if (y.mscale < 0 || y.mscale_all_dim < 0)
    fail("mscale ({}) and mscale-all-dim ({}) must be >= 0", y.mscale, y.mscale_all_dim);
  if (rope_type == RopeType::Yarn && !multi_latent_attention)
    fail("rope-type yarn needs multi-latent-attention (Megatron allows only rope otherwise)");
  if (rope_type == RopeType::Rope && y.factor != 1.0)
    fail("rotary-scaling-factor ({}) applies to rope-type yarn; rope-type rope takes none",
         y.factor);

  if (multi_latent_attention) {
    if (group_query_attention)
      fail("multi-latent-attention does not take group-query-attention (MLA has no query "
           "groups; Megatron refuses it too)");
    if (position_embedding_type != PositionEmbedding::Rope)
      fail("multi-latent-attention needs position-embedding-type rope (its decoupled RoPE)");
    if (q_lora_rank < 0) fail("q-lora-rank must be >= 0 (got {})", q_lora_rank);
    auto positive = [](const char* key, int64_t v) {
      if (v <= 0) fail("{} must be positive with multi-latent-attention (got {})", key, v);
    };
    positive("kv-lora-rank", kv_lora_rank);
    positive("qk-head-dim", qk_head_dim);
    positive("qk-pos-emb-head-dim", qk_pos_emb_head_dim);
    positive("v-head-dim", v_head_dim);
    if (qk_pos_emb_head_dim % 2 != 0)
      fail("qk-pos-emb-head-dim ({}) must be even for rope", qk_pos_emb_head_dim);
    // The interleaved RoPE kernels take at most 256 frequency pairs.
    if (qk_pos_emb_head_dim > 512)
      fail("qk-pos-emb-head-dim ({}) must be at most 512", qk_pos_emb_head_dim);
    if (tensor_model_parallel_size > 1 && num_attention_heads % tensor_model_parallel_size != 0)
      fail("num-attention-heads ({}) is not divisible by tensor-model-parallel-size ({})",
           num_attention_heads, tensor_model_parallel_size);
  } else if (q_lora_rank != 0 || kv_lora_rank != 32 || qk_head_dim != 128 ||
             qk_pos_emb_head_dim != 64 || v_head_dim != 128) {
    // Set in code or by flags without the switch: say so rather than ignore them.
    fail("q-lora-rank, kv-lora-rank, qk-head-dim, qk-pos-emb-head-dim and v-head-dim need "
         "multi-latent-attention");
  }

  if (mtp_num_layers < 0) fail("mtp-num-layers must be >= 0 (got {})", mtp_num_layers);
  if (mtp_num_layers > 0) {
    if (position_embedding_type != PositionEmbedding::Rope)
      fail("mtp-num-layers needs position-embedding-type rope (Megatron refuses learned "
           "absolute positions with MTP)");
    if (mtp_loss_scaling_factor < 0)
      fail("mtp-loss-scaling-factor must be >= 0 (got {})", mtp_loss_scaling_factor);
  }
}

}  // namespace megaton
