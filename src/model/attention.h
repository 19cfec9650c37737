// SelfAttention: Megatron's fused QKV projection, RoPE, causal GQA attention, output proj.
#pragma once
#include <functional>
#include <memory>

#include "model/layer_spec.h"
#include "model/layers.h"
#include "model/parallel.h"
#include "ops/ops.h"

namespace megaton {

// linear_qkv weight [(np/ng + 2) * ng * d, H] in Megatron's grouped layout: for each
// query group g, the rows of its np/ng query heads, then its key head, then its value
// head (np = num_attention_heads, ng = num_query_groups, d = kv_channels). Query head
// h belongs to group h / (np / ng).
//
// With --qk-layernorm (cfg.qk_layernorm), q_layernorm and k_layernorm (Norm of
// cfg.normalization over d = kv_channels, eps cfg.norm_epsilon, weights [d] initialised to
// 1) normalise every query and key head after the split and before RoPE, as Megatron's
// SelfAttention and Hugging Face Qwen3 do. Their weights are replicated on the
// tensor-parallel ranks, which normalise different heads: they are marked
// Param::sequence_parallel, so their gradients are summed over TP after backward
// (Megatron's finalize_model_grads all-reduces q/k_layernorm grads likewise). Training runs
// the split, the two norms and RoPE as one op each way (ops::qkv_split_norm_rope and
// ops::qkv_pack_norm_rope_backward, reading the norms' weights and accumulating into their
// main_grad); inference runs the Norm objects and RoPE one after the other.
class SelfAttention {
 public:
  SelfAttention(const std::string& prefix, const GPTConfig& cfg, int64_t layer, uint64_t seed,
                const ModelParallel& mp = {});
  // x [B*S, H] -> [B*S, H] (under sequence parallelism this rank's [B*S/tp, H] rows;
  // batch and seq are always the full micro-batch's). With ctx.packed_seq_params, RoPE
  // rotates each token by its position id (--reset-position-ids) and the documents attend
  // within themselves only (--reset-attention-mask: ops::attention_varlen_forward over the
  // B*S rows).
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, const ForwardContext& ctx);
  // What forward keeps for backward (the recompute flags, set by the owning layer; both
  // true by default). keep_qkv_input false: linear_qkv keeps no copy of its input,
  // backward's `qkv_input` callback makes it again (the layernorm recompute).
  // keep_core_attn_out false: the attention output and log-sum-exp are not kept (nor by
  // linear_proj), backward runs the attention forward again from q, k, v (the core_attn
  // recompute).
  void set_recompute(bool keep_qkv_input, bool keep_core_attn_out) {
    keep_qkv_input_ = keep_qkv_input;
    keep_core_attn_out_ = keep_core_attn_out;
  }
  // InternalError when nothing was saved, or when linear_qkv's input is needed and
  // qkv_input is not given.
  Tensor backward(const Tensor& dy, const std::function<Tensor()>& qkv_input = {});
  // Inference with a KV cache (generation; one rank, no dropout, nothing saved): the n
  // tokens of x [n, H] (compute dtype) sit at absolute positions first_position ..
  // first_position + n - 1 (RoPE rotates by them). Their keys and values (after RoPE and
  // the q/k norms) are written to rows [first_position, first_position + n) of key_cache
  // and value_cache ([max_positions, num_query_groups, kv_channels], compute dtype; see
  // InferenceContext), then every query attends to the cache rows at or before its own
  // position (ops::attention_kv_cache). Returns [n, H]. InternalError under tensor
  // parallelism or when the positions do not fit the cache.
  Tensor forward_inference(const Tensor& x, int64_t first_position, Tensor& key_cache,
                           Tensor& value_cache) const;
  void collect_params(std::vector<Param*>& out);

  struct Saved {
    Tensor q, k, v;                 // [B, S, heads, d] after RoPE (this rank's heads, groups)
    // attention output [B, S, np, d] and the log-sum-exp of the scores [B, np, S] fp32
    // ([B*S, np] with packed documents: ops::attention_varlen_forward's layout); undefined
    // when recomputed (keep_core_attn_out false)
    Tensor out;
    Tensor lse;
    float dropout_p = 0;            // attention dropout of this forward
    uint64_t seed = 0, stream = 0;  // its mask's Philox key and stream
    // The micro-batch's packed documents (ForwardContext::packed_seq_params), or null: the
    // backward's RoPE positions and attention boundaries.
    std::shared_ptr<const PackedSeqParams> packed;
    // With qk_layernorm: q and k as split, before the norms ([B, S, np | ng, d], compute
    // dtype) and the norms' per-head statistics (fp32 [B*S*np | ng]), what the unfused
    // norms kept. Empty without qk_layernorm.
    ops::QkNormSaved qk_norm;
  };
  // The attention's saved state with its linears'.
  struct Activations {
    Saved attention;
    Linear::Saved linear_qkv, linear_proj;
  };
  Activations take_saved();
  void restore_saved(Activations&& saved);

  Linear linear_qkv, linear_proj;
  std::unique_ptr<Norm> q_layernorm, k_layernorm;  // null without qk_layernorm

 private:
  // The q/k norms' parameters as the fused ops take them (qk_layernorm only).
  ops::QkNorm qk_norm() const;

  const GPTConfig& cfg_;
  ModelParallel mp_;
  int64_t layer_;
  bool keep_qkv_input_ = true, keep_core_attn_out_ = true;
  Saved saved_;
};

// SelfAttention as a layer's mixer (model/layer_spec.h; attention_mixer.cpp).
std::unique_ptr<Mixer> make_self_attention_mixer(const std::string& prefix, const GPTConfig& cfg,
                                                 int64_t layer, uint64_t seed,
                                                 const ModelParallel& mp);

}  // namespace megaton
