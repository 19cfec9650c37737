// GPTConfig: the model's shape and numerics, named as Megatron-LM's TransformerConfig.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/cpu_offloading_config.h"
#include "model/fp8_config.h"
#include "model/hybrid_pattern.h"
#include "model/recompute_config.h"
#include "model/rope_scaling.h"

namespace megaton {

enum class Normalization { LayerNorm, RMSNorm };
// --position-embedding-type: learned_absolute, rope, or none (no position information
// but the causal mask and, in a hybrid model, the Mamba layers' order; Nemotron-H).
enum class PositionEmbedding { LearnedAbsolute, Rope, None };
// --rope-type: how multi-latent attention builds its rotary table (Megatron's rope_type).
enum class RopeType { Rope, Yarn };
// The MLP's activation (Megatron's activation_func and gated_linear_unit): GeLU (the
// default, exact erf form), SwiGLU (--swiglu: silu(gate) * up, fc1 twice as wide) or squared
// ReLU (--squared-relu: relu(x)^2, not gated; Nemotron-H). One kind for the dense MLP, the
// MoE experts and the shared expert, as in Megatron.
enum class MlpActivation { Gelu, Swiglu, SquaredRelu };

// Field names are Megatron's argument names with '-' -> '_'. Defaults are Megatron's
// unless noted. Sizes are in elements.
struct GPTConfig {
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t ffn_hidden_size = 0;  // 0: 4 * hidden_size (Megatron's default)
  int64_t num_attention_heads = 0;
  bool group_query_attention = false;
  int64_t num_query_groups = 0;  // 0: num_attention_heads (no GQA)
  int64_t kv_channels = 0;       // 0: hidden_size / num_attention_heads
  int64_t seq_length = 0;
  int64_t max_position_embeddings = 0;  // 0: seq_length
  int64_t vocab_size = 0;               // from the tokenizer, before padding
  int64_t make_vocab_size_divisible_by = 128;
  // --tensor-model-parallel-size: the vocabulary is padded to a multiple of
  // make_vocab_size_divisible_by x this (Megatron), so it changes padded_vocab_size.
  int64_t tensor_model_parallel_size = 1;
  Normalization normalization = Normalization::LayerNorm;
  float norm_epsilon = 1e-5f;
  // --qk-layernorm: a norm of type `normalization` over each head's kv_channels values of
  // the query and the key, after the QKV split and before RoPE (Megatron's q_layernorm /
  // k_layernorm; Qwen3's q_norm / k_norm).
  bool qk_layernorm = false;
  bool swiglu = false;
  // --squared-relu: relu(x)^2 as the MLP activation instead of GeLU (Megatron's
  // activations.squared_relu); refused with swiglu (Megatron asserts not both).
  bool squared_relu = false;
  PositionEmbedding position_embedding_type = PositionEmbedding::LearnedAbsolute;
  float rotary_base = 10000.0f;
  // --rotary-percent (partial RoPE; Megatron's RotaryEmbedding): RoPE rotates the first
  // rotary_dim() channels of every query and key head and passes the rest through. In
  // (0, 1]; read only with position_embedding_type rope (learned positions ignore it, as
  // Megatron does); multi-latent attention takes 1 only (its RoPE dims are its own). A
  // double, as Megatron's float argument, so int(kv_channels * rotary_percent) truncates
  // the same product.
  double rotary_percent = 1.0;
  // --rope-type (MLA only; Megatron's default for MLA is yarn, which with
  // --rotary-scaling-factor 1 is plain RoPE) and YaRN's parameters: factor
  // (--rotary-scaling-factor), --original-max-position-embeddings, --beta-fast,
  // --beta-slow, --mscale, --mscale-all-dim (model/rope_scaling.h).
  RopeType rope_type = RopeType::Rope;
  YarnConfig yarn;

  // Multi-latent attention (DeepSeek-V2/V3; Megatron's MLASelfAttention, model/mla.h):
  // --multi-latent-attention replaces every layer's self attention. q_lora_rank 0: no q
  // compression (Megatron's None: linear_q_proj). Per head: the query and key have
  // qk_head_dim + qk_pos_emb_head_dim values (the latter rotated), the value v_head_dim.
  bool multi_latent_attention = false;
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 32;
  int64_t qk_head_dim = 128;
  int64_t qk_pos_emb_head_dim = 64;
  int64_t v_head_dim = 128;

  // Multi-token prediction (DeepSeek-V3; Megatron's MultiTokenPredictionBlock, model/mtp.h):
  // mtp_num_layers depths after the decoder, each predicting one token further; their
  // mean loss times mtp_loss_scaling_factor joins the objective.
  int64_t mtp_num_layers = 0;
  float mtp_loss_scaling_factor = 0.1f;
  // --calculate-per-token-loss (Megatron's TransformerConfig field): the MTP losses'
  // gradients are weighted as Megatron's process_mtp_loss does in that mode.
  bool calculate_per_token_loss = false;

  // Hybrid models (Megatron's HybridModel, --hybrid-layer-pattern; model/hybrid_pattern.h):
  // empty pattern: a GPT model, every layer attention + MLP. finalize() parses the pattern
  // into hybrid_layers (one symbol per decoder layer) and hybrid_segment_layers (layers of
  // each '|' pipeline segment). The Mamba-2 mixers (Megatron's MambaMixer,
  // model/mamba_mixer.h): mamba_num_heads heads (0: 2 x hidden_size / mamba_head_dim,
  // MambaMixer's expand 2) of mamba_head_dim channels, B and C in mamba_num_groups groups
  // of mamba_state_dim; mamba_conv_kernel taps (MambaMixer's d_conv) and SSD chunks of
  // mamba_chunk_size tokens (its chunk_size), neither a Megatron flag.
  std::string hybrid_layer_pattern;
  std::string hybrid_layers;
  std::vector<int64_t> hybrid_segment_layers;
  int64_t mamba_state_dim = 128;
  int64_t mamba_head_dim = 64;
  int64_t mamba_num_groups = 8;
  int64_t mamba_num_heads = 0;
  int64_t mamba_conv_kernel = 4;
  int64_t mamba_chunk_size = 128;
  bool is_hybrid() const { return !hybrid_layer_pattern.empty(); }
  // Decoder layer `layer`'s symbol (hybrid models, after finalize()).
  char hybrid_symbol(int64_t layer) const { return hybrid_layers[size_t(layer)]; }
  bool has_hybrid_symbol(char symbol) const {
    return hybrid_layers.find(symbol) != std::string::npos;
  }
  // A Mamba mixer's widths (MambaMixer): d_inner = heads x head_dim; in_proj's output
  // [z, x, B, C, dt]; the convolution's channels [x, B, C].
  int64_t mamba_d_inner() const { return mamba_num_heads * mamba_head_dim; }
  int64_t mamba_conv_dim() const {
    return mamba_d_inner() + 2 * mamba_num_groups * mamba_state_dim;
  }
  int64_t mamba_in_proj_size() const {
    return mamba_d_inner() + mamba_conv_dim() + mamba_num_heads;
  }

  bool untie_embeddings_and_output_weights = false;
  float init_method_std = 0.02f;
  // The std of the layers that write into the residual stream (attention's linear_proj,
  // the MLPs' linear_fc2): Megatron's scaled_init_method_normal, init_method_std /
  // sqrt(2 num_layers).
  float scaled_init_method_std() const {
    return init_method_std / std::sqrt(2.0f * float(num_layers));
  }
  bool disable_bias_linear = false;
  float hidden_dropout = 0.1f;
  float attention_dropout = 0.1f;

  // MoE (num_experts == 0: dense model).
  int64_t num_experts = 0;
  int64_t moe_ffn_hidden_size = 0;  // 0: ffn_hidden_size
  int64_t moe_router_topk = 2;
  bool moe_router_pre_softmax = false;
  // --moe-layer-freq: an integer f (layer i is MoE when i % f == 0), or a per-layer
  // pattern such as "[0]*1+[1]*3" (1: MoE), parsed into moe_layer_pattern.
  int64_t moe_layer_freq = 1;
  std::vector<int> moe_layer_pattern;  // empty: use moe_layer_freq
  // Load balancing: one or more of aux_loss, seq_aux_loss, global_aux_loss, sinkhorn,
  // none, with one coefficient each (moe_aux_loss_coeffs, filled by finalize from
  // moe_aux_loss_coeff when --moe-aux-loss-coeff gave one value).
  std::vector<std::string> moe_router_load_balancing_type = {"aux_loss"};
  float moe_aux_loss_coeff = 0.0f;
  std::vector<float> moe_aux_loss_coeffs;
  std::string moe_router_score_function = "softmax";  // softmax | sigmoid | sqrtsoftplus
  float moe_router_topk_scaling_factor = 0.0f;        // 0: none
  std::string moe_router_dtype;                       // "" | fp32 | fp64
  int64_t moe_router_num_groups = 0;                  // 0: no group-limited routing
  int64_t moe_router_group_topk = 0;
  float moe_z_loss_coeff = 0.0f;      // 0: no z-loss
  float moe_input_jitter_eps = 0.0f;  // 0: no jitter
  bool moe_router_enable_expert_bias = false;
  float moe_router_bias_update_rate = 1e-3f;
  bool moe_router_force_load_balancing = false;
  // Token dropping (--moe-expert-capacity-factor; 0: dropless, Megatron's default None).
  float moe_expert_capacity_factor = 0.0f;
  std::string moe_token_drop_policy = "probs";  // probs | position
  bool moe_pad_expert_input_to_capacity = false;
  int64_t moe_shared_expert_intermediate_size = 0;  // 0: no shared expert
  bool moe_shared_expert_gate = false;
  // --moe-shared-expert-overlap: the shared expert's halves run beside the token
  // dispatcher's exchanges (MoELayer); the same numbers, the order of work differs.
  bool moe_shared_expert_overlap = false;
  // --overlap-moe-expert-parallel-comm: each MoE layer's rows in two chunks whose
  // exchanges run beside each other's experts (MoELayer). The expert weight and bias
  // gradients add two partial sums (rounded once more with bf16 main grads), a chunk's
  // GEMM may block differently, and FP8 scales its GEMM inputs per chunk.
  bool overlap_moe_expert_parallel_comm = false;

  // Where and in what precision the model runs. --bf16 keeps fp32 main params and (unless
  // main_grads_dtype below says bf16) main grads and computes in bf16; the compute dtype
  // applies on the GPU (the CPU backend is the fp32 reference and ignores it).
  bool bf16 = false;
  // --fp16: fp16 compute on the GPU where --bf16 computes in bf16, with the same fp32 main
  // params and grads; the loss is scaled (optim/grad_scaler.h). The CPU computes fp32.
  bool fp16 = false;
  // The dtype of the main gradients (the ParamAndGradBuffers' grads): F32, or BF16 with
  // --bf16 and --main-grads-dtype bf16 / --grad-reduce-in-bf16 (Megatron's
  // accumulate_allreduce_grads_in_fp32 off; docs/memory.md "BF16 main gradients"). Unlike
  // the compute dtype it applies on the CPU too: the CPU's fp32 gradients are rounded into
  // bf16 main grads as the GPU's are (model/main_grad.h).
  DType main_grads_dtype = DType::F32;
  // --fp8-format and the other FP8 flags: the transformer layers' linear GEMMs in FP8
  // (model/fp8.h). The output layer, router, attention, norms and the optimizer stay in
  // bf16 / fp32, as in Transformer Engine.
  Fp8Config fp8;
  // --recompute-granularity, --recompute-method, --recompute-num-layers,
  // --recompute-modules: which activations backward recomputes instead of keeping.
  RecomputeConfig recompute;
  // --cpu-offloading, --cpu-offloading-num-layers: the saved activations of the first
  // layers go to host memory between their forward and backward (model/activation_offload.h).
  CpuOffloadingConfig cpu_offloading;
  Device device = Device::CPU;
  // --init-model-with-meta-device (Megatron-FSDP): parameters are made without values;
  // the FSDP buffers and the optimizer draw only what this rank stores (model/param.h
  // ParamInit). Set from the parallel flags by the trainer.
  bool init_model_with_meta_device = false;
  DType compute_dtype() const {
    if (device != Device::CUDA) return DType::F32;
    return bf16 ? DType::BF16 : fp16 ? DType::F16 : DType::F32;
  }

  // Derived values (after finalize()).
  int64_t padded_vocab_size = 0;
  int64_t head_dim() const { return kv_channels; }
  // The channels of each query / key head that RoPE rotates (Megatron's RotaryEmbedding:
  // int(kv_channels * rotary_percent) when rotary_percent < 1, else kv_channels); finalize()
  // makes it even and positive under RoPE.
  int64_t rotary_dim() const {
    return rotary_percent < 1.0 ? int64_t(double(kv_channels) * rotary_percent) : kv_channels;
  }
  int64_t query_projection_size() const { return kv_channels * num_attention_heads; }
  int64_t kv_projection_size() const { return kv_channels * num_query_groups; }
  bool is_moe_layer(int64_t layer) const {
    if (is_hybrid()) return hybrid_symbol(layer) == kHybridMoe;
    if (num_experts == 0) return false;
    if (!moe_layer_pattern.empty()) return moe_layer_pattern[size_t(layer)] != 0;
    return layer % moe_layer_freq == 0;
  }
  int64_t num_moe_layers() const;
  // The coefficient of load-balancing type `type` (0 when it is not enabled).
  float moe_loss_coeff(const std::string& type) const;
  // Whether any aux-loss-style load-balancing loss is enabled with a nonzero coefficient.
  bool use_aux_loss() const;

  // Fills defaults that depend on other fields, pads the vocabulary (Megatron's
  // _vocab_size_with_padding: round up to make_vocab_size_divisible_by x TP) and checks
  // consistency. Throws megaton::Error naming the offending keys, e.g. "hidden-size
  // (100) is not divisible by num-attention-heads (3)".
  void finalize();
  // After finalize(), with --fp8-format: every FP8 GEMM dimension (the micro-batch's tokens,
  // the hidden size, this tensor-parallel rank's attention and MLP widths) must be a
  // multiple of fp8.dimension_multiple() (16; 128 for blockwise). megaton::Error naming the
  // flags otherwise, e.g. "ffn-hidden-size (40) must be divisible by 16 for FP8 GEMMs".
  // The MoE experts' widths per expert-tensor-parallel rank (etp: the resolved
  // --expert-tensor-parallel-size) too; their token rows are padded, not checked.
  void check_fp8_dimensions(int64_t tokens_per_micro_batch, int64_t etp) const;

 private:
  // finalize()'s checks of the MLA, RoPE-type and MTP fields (config_mla.cpp).
  void finalize_mla_mtp();
  // finalize()'s parsing and checks of the hybrid pattern and the Mamba sizes
  // (config_hybrid.cpp; Megatron's arguments.py and MambaMixer.__init__ checks).
  void finalize_hybrid();
};

// The MLP activation cfg asks for: SwiGLU with swiglu, squared ReLU with squared_relu (never
// both: finalize() refuses it), GeLU otherwise.
inline MlpActivation mlp_activation_of(const GPTConfig& cfg) {
  if (cfg.swiglu) return MlpActivation::Swiglu;
  return cfg.squared_relu ? MlpActivation::SquaredRelu : MlpActivation::Gelu;
}

}  // namespace megaton
