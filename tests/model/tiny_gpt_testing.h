// Tiny random GPT models in the variants generation must handle (dense / MoE, learned
// absolute / RoPE positions, partial RoPE, GQA, --qk-layernorm, tied / untied output,
// LayerNorm / RMSNorm, GeLU / SwiGLU, with / without biases), for the KV-cache tests on CPU
// and GPU.
#pragma once
#include <ostream>
#include <string>
#include <vector>

#include "common/testing.h"
#include "model/gpt.h"
#include "ops/ops.h"

namespace megaton::testing {

struct TinyGptVariant {
  std::string name;
  bool moe = false;
  bool rope = false;
  bool gqa = false;           // 4 query heads in 2 groups (else 4 groups)
  bool qk_layernorm = false;
  bool untie = false;
  bool rmsnorm = false;
  bool swiglu = false;
  bool bias = true;
  bool shared_expert = false;  // MoE only
  // Multi-latent attention (with qk_layernorm: its q/kv latent norms) with q LoRA and
  // YaRN; no GQA.
  bool mla = false;
  // --rotary-percent with RoPE: 0.5 rotates 4 of each head's 8 channels.
  double rotary_percent = 1.0;
  int64_t seq_length = 8;
  int64_t max_position_embeddings = 0;  // 0: seq_length
};

// GoogleTest prints a parameter by its name.
inline void PrintTo(const TinyGptVariant& v, std::ostream* os) { *os << v.name; }

inline std::vector<TinyGptVariant> tiny_gpt_variants() {
  std::vector<TinyGptVariant> v;
  // GPT-2 style: learned positions, LayerNorm, GeLU, biases, tied output, MHA; a position
  // table longer than seq_length (the window is the table's).
  v.push_back({.name = "dense_learned_layernorm_gelu_bias_tied", .seq_length = 6,
               .max_position_embeddings = 10});
  // Llama style: RoPE, RMSNorm, SwiGLU, no biases, untied, GQA.
  v.push_back({.name = "dense_rope_rmsnorm_swiglu_gqa_untied", .rope = true, .gqa = true,
               .untie = true, .rmsnorm = true, .swiglu = true, .bias = false});
  // Qwen3 style attention: q/k norms before RoPE, with LayerNorm and biases.
  v.push_back({.name = "dense_rope_qk_layernorm_gqa_bias", .rope = true, .gqa = true,
               .qk_layernorm = true});
  // Mixtral style MoE.
  v.push_back({.name = "moe_rope_rmsnorm_swiglu_gqa_untied", .moe = true, .rope = true,
               .gqa = true, .untie = true, .rmsnorm = true, .swiglu = true, .bias = false});
  // MoE with learned positions, q/k norms, GeLU, biases, tied output and a shared expert.
  v.push_back({.name = "moe_learned_qk_layernorm_gelu_bias_tied_shared", .moe = true,
               .qk_layernorm = true, .shared_expert = true});
  // DeepSeek-V3 style: MLA with q LoRA, latent norms and YaRN, MoE with a shared expert.
  v.push_back({.name = "mla_moe_yarn_rmsnorm_swiglu_shared", .moe = true, .rope = true,
               .qk_layernorm = true, .untie = true, .rmsnorm = true, .swiglu = true,
               .bias = false, .shared_expert = true, .mla = true});
  // Partial RoPE (GPT-NeoX / Pythia style: --rotary-percent), with and without q/k norms.
  v.push_back({.name = "dense_partial_rope_rmsnorm_swiglu_gqa", .rope = true, .gqa = true,
               .rmsnorm = true, .swiglu = true, .bias = false, .rotary_percent = 0.5});
  v.push_back({.name = "dense_partial_rope_qk_layernorm_bias", .rope = true,
               .qk_layernorm = true, .rotary_percent = 0.5});
  return v;
}

// A finalize()d config: 2 layers, hidden 32, 4 heads of 8, vocabulary 100 (padded to 128).
// init_method_std 0.2 by default: logits far from uniform and attention far from flat, so
// greedy choices are clear and a wrong key or query shows.
inline GPTConfig tiny_gpt_config(const TinyGptVariant& v, Device device = Device::CPU,
                                 bool bf16 = false, float init_method_std = 0.2f) {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.num_attention_heads = 4;
  c.group_query_attention = v.gqa;
  c.num_query_groups = v.gqa ? 2 : 4;
  c.seq_length = v.seq_length;
  c.max_position_embeddings = v.max_position_embeddings;
  c.vocab_size = 100;
  c.normalization = v.rmsnorm ? Normalization::RMSNorm : Normalization::LayerNorm;
  c.qk_layernorm = v.qk_layernorm;
  c.swiglu = v.swiglu;
  c.position_embedding_type = v.rope ? PositionEmbedding::Rope : PositionEmbedding::LearnedAbsolute;
  c.rotary_percent = v.rotary_percent;
  c.untie_embeddings_and_output_weights = v.untie;
  c.disable_bias_linear = !v.bias;
  c.hidden_dropout = c.attention_dropout = 0.1f;  // inference must not apply them
  c.init_method_std = init_method_std;
  if (v.moe) {
    c.num_experts = 4;
    c.moe_ffn_hidden_size = 24;
    c.moe_router_topk = 2;
    c.moe_aux_loss_coeff = 0.01f;  // a training-only loss: must not matter here
    if (v.shared_expert) c.moe_shared_expert_intermediate_size = 16;
  }
  if (v.mla) {
    // Every width a multiple of 16 (the FP8 GEMMs) and the value head (8) unlike the query
    // / key head (16 + 16). YaRN with factor 4 over an original context of 4 positions: the
    // ramp and both mscales take part, mscale != mscale_all_dim (Megatron's bug #1429).
    c.multi_latent_attention = true;
    c.q_lora_rank = 16;
    c.kv_lora_rank = 16;
    c.qk_head_dim = 16;
    c.qk_pos_emb_head_dim = 16;
    c.v_head_dim = 8;
    c.rope_type = RopeType::Yarn;
    c.yarn.factor = 4;
    c.yarn.original_max_position_embeddings = 4;
    c.yarn.mscale = 1.0;
    c.yarn.mscale_all_dim = 0.707;
  }
  c.device = device;
  c.bf16 = bf16;
  c.finalize();
  return c;
}

// Adds N(0, noise_std^2) noise (drawn on the host from `seed`, so a CPU and a GPU model
// get the same values) to every parameter: norm weights and biases start as constants, and
// a test must not run on zeros. With round_bf16 the fp32 main params are rounded to bf16
// values, so a bf16 GPU model and an fp32 CPU model compute with the same weights.
inline void randomize_params(GPTModel& model, uint64_t seed, bool round_bf16 = false,
                             float noise_std = 0.05f) {
  uint64_t stream = 0;
  for (Param* p : model.params()) {
    Tensor host = p->main_param.to(Device::CPU).clone();
    const Tensor noise = randn(host.shape(), seed + 1000 * ++stream, noise_std);
    ops::add_(host, noise);
    if (round_bf16) host = host.to(DType::BF16).to(DType::F32);
    p->main_param.copy_from(host);
    refresh_compute_weight(*p);
  }
}

}  // namespace megaton::testing
