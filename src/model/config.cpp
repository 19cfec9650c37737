// GPTConfig defaults and validation.
#include "model/config.h"

#include <algorithm>

#include "core/error.h"

namespace megaton {

bool GPTConfig::use_aux_loss() const {
  return num_experts > 0 && moe_aux_loss_coeff != 0.0f &&
         std::find(moe_router_load_balancing_type.begin(), moe_router_load_balancing_type.end(),
                   "aux_loss") != moe_router_load_balancing_type.end();
}

void GPTConfig::finalize() {
  auto positive = [](const char* key, int64_t v) {
    if (v <= 0) fail("{} must be positive (got {})", key, v);
  };
  positive("num-layers", num_layers);
  positive("hidden-size", hidden_size);
  positive("num-attention-heads", num_attention_heads);
  positive("seq-length", seq_length);
  positive("vocab size (from the tokenizer)", vocab_size);
  positive("make-vocab-size-divisible-by", make_vocab_size_divisible_by);
  if (ffn_hidden_size == 0) ffn_hidden_size = 4 * hidden_size;
  if (kv_channels == 0) {
    if (hidden_size % num_attention_heads != 0)
      fail("hidden-size ({}) is not divisible by num-attention-heads ({}); set kv-channels",
           hidden_size, num_attention_heads);
    kv_channels = hidden_size / num_attention_heads;
  }
  if (!group_query_attention) num_query_groups = num_attention_heads;
  if (num_query_groups == 0) num_query_groups = num_attention_heads;
  if (num_attention_heads % num_query_groups != 0)
    fail("num-attention-heads ({}) is not divisible by num-query-groups ({})",
         num_attention_heads, num_query_groups);
  if (max_position_embeddings == 0) max_position_embeddings = seq_length;
  if (position_embedding_type == PositionEmbedding::LearnedAbsolute &&
      seq_length > max_position_embeddings)
    fail("seq-length ({}) exceeds max-position-embeddings ({})", seq_length,
         max_position_embeddings);
  if (position_embedding_type == PositionEmbedding::Rope && kv_channels % 2 != 0)
    fail("kv-channels ({}) must be even for rope", kv_channels);
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
    for (const auto& t : moe_router_load_balancing_type)
      if (t != "aux_loss" && t != "none")
        fail("moe-router-load-balancing-type '{}' is not supported yet (supported: aux_loss, "
             "none)", t);
  }
}

}  // namespace megaton
