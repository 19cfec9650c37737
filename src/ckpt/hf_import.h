// Hugging Face Llama / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE / DeepSeek-V3 / NemotronH
// checkpoints -> Megaton names.
#pragma once
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace megaton::ckpt {

// The shape facts the name mapping needs.
struct HFLayout {
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  // HF num_key_value_heads and head_dim: the q/k/v_proj interleave; unused by MLA layers.
  int64_t num_query_groups = 0;
  int64_t kv_channels = 0;
  int64_t num_experts = 0;  // 0: dense
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
// DeepSeek-V3 (DeepseekV3ForCausalLM): a layer with "self_attn.kv_a_proj_with_mqa" is
// multi-latent attention, mapped one to one (same row layouts, interleaved RoPE on both
// sides) to Megatron's local-spec MLASelfAttention names under "self_attention.":
//   q_a_proj [q_lora_rank, H]                 -> linear_q_down_proj
//   q_a_layernorm [q_lora_rank]               -> q_layernorm
//   q_b_proj [n*(nope+rope), q_lora_rank]     -> linear_q_up_proj
//   q_proj [n*(nope+rope), H]                 -> linear_q_proj (q_lora_rank None)
//   kv_a_proj_with_mqa [kv_lora_rank+rope, H] -> linear_kv_down_proj
//   kv_a_layernorm [kv_lora_rank]             -> kv_layernorm
//   kv_b_proj [n*(nope+v), kv_lora_rank]      -> linear_kv_up_proj
//   o_proj [H, n*v]                           -> linear_proj
// (the model needs multi_latent_attention and qk_layernorm, which is what creates the two
// norms in Megatron). Its MoE layers: "mlp.gate.weight" -> "mlp.router.weight",
// "mlp.gate.e_score_correction_bias" [E] -> "mlp.router.expert_bias" (not a parameter:
// TopKRouter::expert_bias, needs moe_router_enable_expert_bias; absent from gradients),
// experts as Qwen3-MoE's (per-expert or fused), "mlp.shared_experts.{gate,up}_proj" ->
// "mlp.shared_experts.linear_fc1" as [gate; up], "down_proj" -> "linear_fc2"; its first
// first_k_dense_replace layers are dense ("mlp.gate_proj").
// NemotronH (NemotronHForCausalLM, "backbone." names; a hybrid model of Mamba-2, attention,
// MLP and MoE layers, each "norm" + "mixer"): each layer's kind is read from its tensors
// and mapped to Megatron's hybrid names (model/mamba_mixer.h; the Mamba tensors one to
// one, attention as above, up_proj / down_proj to linear_fc1 / linear_fc2, the final norm
// to "decoder.final_norm").
// `prefix` is prepended to every HF name looked up (e.g. "grad." to map gradients).
// `used` (when given) receives the HF names the mapping read, so a caller can tell which
// tensors of the checkpoint it left out.
// Throws megaton::Error naming a missing tensor.
// The same mapping as a plan, one entry per Megaton tensor, made on demand (megaton convert
// reading a Hugging Face model by mmap, one tensor at a time). `has` says whether the
// checkpoint holds an HF name; make(get) returns the Megaton tensor (F32) from the inputs
// `get` returns (any of BF16, F16, F32; views are fine). `inputs`: the HF names make reads.
// Throws megaton::Error naming the first missing tensor, as hf_to_megaton.
using HFHas = std::function<bool(const std::string&)>;
using HFGet = std::function<Tensor(const std::string&)>;
struct HFMappedTensor {
  std::string name;  // Megaton's
  std::vector<std::string> inputs;
  std::function<Tensor(const HFGet&)> make;
};
std::vector<HFMappedTensor> hf_mapping(const HFLayout& layout, const HFHas& has,
                                       const std::string& prefix = "");

std::map<std::string, Tensor> hf_to_megaton(const std::map<std::string, Tensor>& hf,
                                            const HFLayout& layout, const std::string& prefix = "",
                                            std::set<std::string>* used = nullptr);

}  // namespace megaton::ckpt
