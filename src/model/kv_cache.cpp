// InferenceContext allocation.
#include "model/kv_cache.h"

namespace megaton {

InferenceContext::InferenceContext(const GPTConfig& cfg, int64_t max_sequence_length_in)
    : max_sequence_length(max_sequence_length_in) {
  MEGATON_CHECK(max_sequence_length >= 1, "InferenceContext: max_sequence_length {} must be >= 1",
                max_sequence_length);
  const Shape shape{max_sequence_length, cfg.num_query_groups, cfg.kv_channels};
  key_value_memory_dict.reserve(size_t(cfg.num_layers));
  for (int64_t layer = 0; layer < cfg.num_layers; ++layer)
    key_value_memory_dict.push_back({Tensor::empty(shape, cfg.compute_dtype(), cfg.device),
                                     Tensor::empty(shape, cfg.compute_dtype(), cfg.device)});
}

int64_t max_inference_positions(const GPTConfig& cfg) {
  return cfg.position_embedding_type == PositionEmbedding::LearnedAbsolute
             ? cfg.max_position_embeddings
             : cfg.seq_length;
}

}  // namespace megaton
