// GPTConfig: the model's shape and numerics, named as Megatron-LM's TransformerConfig.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace megaton {

enum class Normalization { LayerNorm, RMSNorm };
enum class PositionEmbedding { LearnedAbsolute, Rope };

// Field names are Megatron's argument names with '-' -> '_'. Defaults are Megatron's
// unless noted. Sizes are in elements.
struct GPTConfig {
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t ffn_hidden_size = 0;      // 0: 4 * hidden_size (Megatron's default)
  int64_t num_attention_heads = 0;
  bool group_query_attention = false;
  int64_t num_query_groups = 0;     // 0: num_attention_heads (no GQA)
  int64_t kv_channels = 0;          // 0: hidden_size / num_attention_heads
  int64_t seq_length = 0;
  int64_t max_position_embeddings = 0;  // 0: seq_length
  int64_t vocab_size = 0;               // from the tokenizer, before padding
  int64_t make_vocab_size_divisible_by = 128;
  // --tensor-model-parallel-size: the vocabulary is padded to a multiple of
  // make_vocab_size_divisible_by x this (Megatron), so it changes padded_vocab_size.
  int64_t tensor_model_parallel_size = 1;
  Normalization normalization = Normalization::LayerNorm;
  float norm_epsilon = 1e-5f;
  bool swiglu = false;
  PositionEmbedding position_embedding_type = PositionEmbedding::LearnedAbsolute;
  float rotary_base = 10000.0f;
  bool untie_embeddings_and_output_weights = false;
  float init_method_std = 0.02f;
  bool disable_bias_linear = false;
  float hidden_dropout = 0.1f;
  float attention_dropout = 0.1f;

  // MoE (num_experts == 0: dense model).
  int64_t num_experts = 0;
  int64_t moe_ffn_hidden_size = 0;  // 0: ffn_hidden_size
  int64_t moe_router_topk = 2;
  bool moe_router_pre_softmax = false;
  int64_t moe_layer_freq = 1;       // every moe_layer_freq-th layer is MoE (layer i: i % f == 0)
  std::vector<std::string> moe_router_load_balancing_type = {"aux_loss"};
  float moe_aux_loss_coeff = 0.0f;

  // Where and in what precision the model runs. --bf16 keeps fp32 main params and main
  // grads and computes in bf16; it applies on the GPU (the CPU backend is the fp32
  // reference and ignores it).
  bool bf16 = false;
  Device device = Device::CPU;
  DType compute_dtype() const {
    return device == Device::CUDA && bf16 ? DType::BF16 : DType::F32;
  }

  // Derived values (after finalize()).
  int64_t padded_vocab_size = 0;
  int64_t head_dim() const { return kv_channels; }
  int64_t query_projection_size() const { return kv_channels * num_attention_heads; }
  int64_t kv_projection_size() const { return kv_channels * num_query_groups; }
  bool is_moe_layer(int64_t layer) const {
    return num_experts > 0 && layer % moe_layer_freq == 0;
  }
  bool use_aux_loss() const;

  // Fills defaults that depend on other fields, pads the vocabulary (Megatron's
  // _vocab_size_with_padding: round up to make_vocab_size_divisible_by x TP) and checks
  // consistency. Throws megaton::Error naming the offending keys, e.g. "hidden-size
  // (100) is not divisible by num-attention-heads (3)".
  void finalize();
};

}  // namespace megaton
