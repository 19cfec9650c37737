// InferenceContext: the key/value cache of generation (Megatron's inference context).
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace megaton {

// The keys and values of the tokens a generation has run through the model so far, per
// layer, and how many there are (Megatron's InferenceParams / StaticInferenceContext:
// key_value_memory_dict, sequence_len_offset, max_sequence_length). Inference only: the
// training path never sees it. Filled by GPTModel::prefill and GPTModel::decode_step.
//
// Layout per layer: key and value [max_sequence_length, num_query_groups, kv_channels],
// row p = the token at position p, after RoPE (and --qk-layernorm), in the model's compute
// dtype on its device. It is Megatron's [max_sequence_length, batch, groups, head dim]
// with a batch of one: a new token's key is one contiguous row (the append is one copy),
// and a prefill's keys [n, groups, d] are the first n rows, one copy. Multi-latent attention
// caches [max_sequence_length, num_attention_heads, qk_head_dim + qk_pos_emb_head_dim] keys
// and [.., num_attention_heads, v_head_dim] values (the expanded form; Megatron's
// --cache-mla-latents compressed cache is not built). A hybrid model's Mamba layer holds
// its generation states instead (model/mamba_mixer.h: key = the conv state, value = the
// SSM state); its MLP layers hold none (undefined tensors).
class InferenceContext {
 public:
  // One key and one value tensor per layer of cfg (finalize()d), uninitialised: rows at or
  // past sequence_len_offset are never read. InternalError when max_sequence_length < 1.
  InferenceContext(const GPTConfig& cfg, int64_t max_sequence_length);

  struct LayerCache {
    Tensor key, value;  // [max_sequence_length, num_query_groups, kv_channels] (MLA: above)
  };
  // Index: the layer number (0-based).
  std::vector<LayerCache> key_value_memory_dict;
  // Positions (rows) per layer: the longest context the cache holds.
  int64_t max_sequence_length = 0;
  // Tokens in the cache: the position of the next token.
  int64_t sequence_len_offset = 0;

  // Whether n more tokens fit.
  bool fits(int64_t n) const { return sequence_len_offset + n <= max_sequence_length; }
};

// The longest context a model of cfg can attend over: max_position_embeddings with
// learned absolute positions (the table's rows), seq_length with RoPE (the length it was
// trained at; RoPE itself has no table to run out of).
int64_t max_inference_positions(const GPTConfig& cfg);

}  // namespace megaton
