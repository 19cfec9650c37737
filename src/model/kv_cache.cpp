// InferenceContext allocation.
#include "model/kv_cache.h"

#include "model/layer_spec.h"
#include "model/mamba_mixer.h"

namespace megaton {

InferenceContext::InferenceContext(const GPTConfig& cfg, int64_t max_sequence_length_in)
    : max_sequence_length(max_sequence_length_in) {
  MEGATON_CHECK(max_sequence_length >= 1, "InferenceContext: max_sequence_length {} must be >= 1",
                max_sequence_length);
  // Multi-latent attention caches every head's key (qk + rope values) and value (v values).
  const bool mla = cfg.multi_latent_attention;
  const Shape key_shape = mla ? Shape{max_sequence_length, cfg.num_attention_heads,
                                      cfg.qk_head_dim + cfg.qk_pos_emb_head_dim}
                              : Shape{max_sequence_length, cfg.num_query_groups, cfg.kv_channels};
  const Shape value_shape =
      mla ? Shape{max_sequence_length, cfg.num_attention_heads, cfg.v_head_dim} : key_shape;
  key_value_memory_dict.reserve(size_t(cfg.num_layers));
  for (int64_t layer = 0; layer < cfg.num_layers; ++layer) {
    const LayerSpec spec = decoder_layer_spec(cfg, layer);
    if (spec.mixer == MixerKind::Mamba)  // conv and SSM states, zero before the prefill
      key_value_memory_dict.push_back(
          {Tensor::zeros(mamba_conv_state_shape(cfg), cfg.compute_dtype(), cfg.device),
           Tensor::zeros(mamba_ssm_state_shape(cfg), DType::F32, cfg.device)});
    else if (spec.mixer == MixerKind::None)  // an MLP layer: no cache
      key_value_memory_dict.push_back({});
    else
      key_value_memory_dict.push_back(
          {Tensor::empty(key_shape, cfg.compute_dtype(), cfg.device),
           Tensor::empty(value_shape, cfg.compute_dtype(), cfg.device)});
  }
}

// (No position embedding: seq_length as with RoPE.)
int64_t max_inference_positions(const GPTConfig& cfg) {
  return cfg.position_embedding_type == PositionEmbedding::LearnedAbsolute
             ? cfg.max_position_embeddings
             : cfg.seq_length;
}

}  // namespace megaton
