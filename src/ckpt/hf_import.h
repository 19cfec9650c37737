// Hugging Face Llama / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE checkpoints -> Megaton names.
#pragma once
#include <map>
#include <string>

#include "core/tensor.h"

namespace megaton::ckpt {

// The shape facts the name mapping needs.
struct HFLayout {
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;  // HF num_key_value_heads
  int64_t kv_channels = 0;       // HF head_dim
  int64_t num_experts = 0;       // 0: dense
};

// Maps HF tensors (fp32) named as in LlamaForCausalLM / MixtralForCausalLM to Megaton
// parameter names ("embedding.word_embeddings.weight", ...). q_proj, k_proj and v_proj
// are interleaved into linear_qkv in Megatron's grouped order (per query group: its
// query heads, its key head, its value head); gate_proj and up_proj (Mixtral w1, w3) are
// stacked into linear_fc1 as [gate; up]. Mixtral experts may be per-expert modules
// ("block_sparse_moe.experts.E.w1") or the fused form of newer transformers
// ("mlp.experts.gate_up_proj" [E, 2F, H], "mlp.experts.down_proj" [E, H, F]); Qwen3-MoE
// experts are "mlp.experts.E.gate_proj/up_proj/down_proj" with the router at "mlp.gate".
// Qwen3's "self_attn.q_norm" / "k_norm" [head_dim] become "self_attention.q_layernorm" /
// "k_layernorm" (the model needs qk_layernorm). A layer with "mlp.gate_proj" is dense
// even when num_experts > 0 (Qwen3-MoE's mlp_only_layers). Only names are mapped: the
// GPTConfig (e.g. qk_layernorm, moe_ffn_hidden_size) is the caller's.
// `prefix` is prepended to every HF name looked up (e.g. "grad." to map gradients).
// Throws megaton::Error naming a missing tensor.
std::map<std::string, Tensor> hf_to_megaton(const std::map<std::string, Tensor>& hf,
                                            const HFLayout& layout,
                                            const std::string& prefix = "");

}  // namespace megaton::ckpt
