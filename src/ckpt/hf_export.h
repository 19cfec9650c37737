// Megaton -> Hugging Face parameter names: the inverse of hf_to_megaton (ckpt/hf_import.h).
#pragma once
#include <map>
#include <string>

#include "ckpt/hf_import.h"
#include "core/tensor.h"

namespace megaton::ckpt {

// How an MoE layer's router and experts are named on the Hugging Face side.
enum class HFExpertNaming {
  // MixtralForCausalLM's checkpoint names: "block_sparse_moe.gate",
  // "block_sparse_moe.experts.<e>.w1" (gate) / "w3" (up) / "w2" (down).
  Mixtral,
  // Qwen3-MoE and DeepSeek-V3: "mlp.gate", "mlp.experts.<e>.gate_proj" / "up_proj" /
  // "down_proj" (and DeepSeek-V3's "mlp.gate.e_score_correction_bias",
  // "mlp.shared_experts.*").
  PerExpertProjections,
};

// Maps Megaton parameter names (without the checkpoint's "model." prefix:
// "embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
// ...) to the names Hugging Face's save_pretrained writes for the families of
// hf_to_megaton, undoing each of its steps:
//   linear_qkv [groups x (q_per_group + 2) x d, H], Megatron's grouped order
//       -> q_proj [heads x d, H], k_proj and v_proj [groups x d, H] (d = kv_channels)
//   linear_fc1 [2F, H] as [gate; up]  -> gate_proj, up_proj [F, H] (Mixtral: w1, w3)
//   linear_fc2 [H, F]                 -> down_proj (Mixtral: w2)
//   local_experts.<e>.*               -> experts.<e>.* (one tensor per expert)
//   router.weight [E, H]              -> gate.weight
//   router.expert_bias [E]            -> gate.e_score_correction_bias (DeepSeek-V3)
//   shared_experts.linear_fc1 / fc2   -> shared_experts.{gate,up}_proj / down_proj
//   q_layernorm / k_layernorm [d]     -> self_attn.q_norm / k_norm (Qwen3)
//   MLA's linears and norms           -> DeepSeek-V3's, one to one (hf_import.h's table)
//   input_layernorm, pre_mlp_layernorm -> input_layernorm, post_attention_layernorm
//   embedding / final_layernorm / output_layer -> model.embed_tokens / model.norm / lm_head
// A hybrid model (its final norm "decoder.final_norm"; its layers of one norm each: a Mamba
// layer's "norm", an attention layer's input_layernorm, an MLP or MoE layer's
// pre_mlp_layernorm) maps to NemotronH's "backbone." names, the inverse of hf_import.h's:
//   embedding / final_norm / output_layer -> backbone.embeddings / backbone.norm_f / lm_head
//                                            (tied embeddings: lm_head a copy of the
//                                            embedding, as NemotronHForCausalLM ties nothing)
//   the layer's norm                      -> backbone.layers.<i>.norm
//   mixer.* (Mamba-2)                     -> mixer.*, one to one
//   linear_qkv / linear_proj              -> mixer.q_proj, k_proj, v_proj / mixer.o_proj
//   linear_fc1 / linear_fc2 (not gated)   -> mixer.up_proj / down_proj (also the experts'
//                                            and the shared expert's)
//   router.weight / router.expert_bias    -> mixer.gate.weight / e_score_correction_bias
// Tensors keep their dtype and values (the splits are copies of rows); shapes are as in
// hf_import.h. A layer is MoE when it holds "mlp.router.weight", MLA when it holds
// "self_attention.linear_kv_down_proj.weight"; the vocabulary rows are taken as given
// (the caller trims the padding). Only `layout`'s num_layers, num_attention_heads,
// num_query_groups and kv_channels are read (the query groups for the QKV split).
// Throws megaton::Error naming the tensor when one a layer needs is missing, when a
// tensor has no Hugging Face counterpart (e.g. a linear bias, learned position
// embeddings, MTP layers: the caller leaves out what it chooses not to export), or when
// linear_qkv's rows do not match the layout.
// `part` maps a part of the model alone (a writer converting one layer at a time):
// kHFWholeModel everything; kHFGlobals the embedding, final norm and output layer; a layer
// index i >= 0 decoder layer i. `megaton` then holds that part's tensors only (each must be
// taken, as for the whole model).
inline constexpr int64_t kHFWholeModel = -1;
inline constexpr int64_t kHFGlobals = -2;
std::map<std::string, Tensor> megaton_to_hf(const std::map<std::string, Tensor>& megaton,
                                            const HFLayout& layout, HFExpertNaming naming,
                                            int64_t part = kHFWholeModel);

}  // namespace megaton::ckpt
