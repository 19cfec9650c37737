// MLASelfAttention: DeepSeek-V2/V3's multi-latent attention, as Megatron-LM's
// MLASelfAttention (megatron/core/transformer/multi_latent_attention.py, local spec) and
// Hugging Face's DeepseekV3Attention compute it. docs/research/deepseek-v3.md section 1
// gives the sources; docs/design-notes.md "Multi-latent attention" the design.
//
// With n heads (n / tp on a tensor-parallel rank), qk = qk_head_dim, rope =
// qk_pos_emb_head_dim, v = v_head_dim, r_q = q_lora_rank, r_kv = kv_lora_rank, H hidden:
//   q      = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))   [T, n (qk + rope)]
//            (linear_q_proj(x) when q_lora_rank is 0, Megatron's None)
//   [c_kv | k_pe] = linear_kv_down_proj(x)                          [T, r_kv + rope]
//   kv     = linear_kv_up_proj(kv_layernorm(c_kv))                  [T, n (qk + v)]
//   query  = [q_nope | rope(q_pe)], key = [k_nope | rope(k_pe)] (k_pe shared by the heads),
//   value  = kv's v part (ops::mla_qkv_rope; RoPE interleaved, YaRN frequencies and cos/sin
//            scale from --rope-type / --rotary-scaling-factor ..., model/rope_scaling.h)
//   out    = causal attention with softmax scale yarn_softmax_scale (qk + rope head dim,
//            value head dim v)                                     [T, n v]
//   y      = linear_proj(out)                                       [T, H]
// q_layernorm / kv_layernorm exist with --qk-layernorm (Megatron's rule; DeepSeek-V3 runs
// with it), of cfg.normalization with cfg.norm_epsilon.
//
// Tensor parallelism (Megatron's local spec with the TE spec's replicated down
// projections): linear_q_proj / linear_q_up_proj / linear_kv_up_proj are column-parallel
// (each rank holds its heads' rows), linear_proj row-parallel; the down projections and the
// two norms are replicated and run on this rank's rows of x. Under sequence parallelism
// those are T / tp rows: their weights' gradients are then partial sums, marked
// Param::sequence_parallel (summed over TP after backward), and k_pe is all-gathered over
// the sequence before the attention (its gradient reduce-scattered). Without SP every rank
// holds every row and computes the same down projections: their gradients are already
// whole (unlike SelfAttention's per-head q/k norms, MLA's norms normalise the latent, not
// a head), and only k_pe's gradient, fed by this rank's heads, is all-reduced.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "model/layer_spec.h"
#include "model/layers.h"
#include "model/parallel.h"

namespace megaton {

class MLASelfAttention {
 public:
  MLASelfAttention(const std::string& prefix, const GPTConfig& cfg, int64_t layer,
                   uint64_t seed, const ModelParallel& mp = {});
  // What forward keeps (set by the owning layer). keep_input false: the down projections
  // keep no copy of x, backward's `input` callback remakes it (the layernorm recompute).
  // keep_core_attn_out false: the attention output is remade in backward (core_attn).
  // keep_up_proj_out false: query, key and value are not kept; backward runs the up
  // projections and the RoPE assembly again from their kept inputs (Megatron's
  // --recompute-modules mla_up_proj).
  void set_recompute(bool keep_input, bool keep_core_attn_out, bool keep_up_proj_out);
  // x [T, H] (under SP this rank's [T / tp, H] rows; batch and seq the micro-batch's)
  // -> [T, H] (the same rows), linear_proj's bias left to the caller. With
  // ctx.packed_seq_params: RoPE at the tokens' position ids, attention within documents
  // (as SelfAttention::forward).
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, const ForwardContext& ctx);
  // dy [T, H] -> dx [T, H]; accumulates main_grads. InternalError without a forward, or
  // when x is needed and `input` is not given.
  Tensor backward(const Tensor& dy, const std::function<Tensor()>& input = {});
  // Generation with a cache (one rank): x [n, H] at positions first_position .. + n - 1;
  // key_cache [max, heads, qk + rope] and value_cache [max, heads, v] (InferenceContext).
  Tensor forward_inference(const Tensor& x, int64_t first_position, Tensor& key_cache,
                           Tensor& value_cache) const;
  void collect_params(std::vector<Param*>& out);
  std::vector<Linear*> linears();

  struct Saved {
    bool held = false;
    int64_t batch = 0, seq = 0;
    // The attention's operands [B, S, n/tp, qk + rope | v] (undefined when recomputed by
    // mla_up_proj), output [B, S, n/tp, v] and log-sum-exp [B, n/tp, S] (undefined under
    // core_attn recompute).
    Tensor query, key, value, out, lse;
    // mla_up_proj recompute: the up projections' inputs and this rank's k_pe rows (without
    // q LoRA, linear_q_proj's output q itself: its input is the layer's).
    Tensor q_up_input, kv_up_input, k_pe, q;
    float dropout_p = 0;
    uint64_t seed = 0, stream = 0;
    // The micro-batch's packed documents (ForwardContext::packed_seq_params) or null: the
    // RoPE positions and attention boundaries of the backward and its recompute. With
    // documents lse is [B*S, n/tp] (ops::attention_varlen_forward's layout).
    std::shared_ptr<const PackedSeqParams> packed;
  };
  struct Activations {
    Saved attention;
    Linear::Saved q_proj, q_down, q_up, kv_down, kv_up, proj;
    Norm::Saved q_norm, kv_norm;
  };
  Activations take_saved();
  void restore_saved(Activations&& saved);

  // linear_q_proj without q LoRA; linear_q_down_proj and linear_q_up_proj with it.
  std::unique_ptr<Linear> linear_q_proj, linear_q_down_proj, linear_q_up_proj;
  Linear linear_kv_down_proj, linear_kv_up_proj, linear_proj;
  std::unique_ptr<Norm> q_layernorm, kv_layernorm;  // null without --qk-layernorm

 private:
  // q [T, n/tp (qk + rope)], kv [T, n/tp (qk + v)] and this rank's k_pe rows -> the
  // attention's query, key and value (k_pe gathered over the sequence under SP).
  // RoPE positions: s.packed's position ids when it has them.
  void assemble_qkv(const Tensor& q, const Tensor& kv, const Tensor& k_pe_rows, int64_t batch,
                    int64_t seq, Saved& s) const;
  int64_t local_heads() const;

  const GPTConfig& cfg_;
  ModelParallel mp_;
  int64_t layer_;
  std::vector<float> inv_freq_;     // qk_pos_emb_head_dim / 2 frequencies (YaRN or RoPE)
  float rope_scale_ = 1, softmax_scale_ = 0;
  bool keep_input_ = true, keep_core_attn_out_ = true, keep_up_proj_out_ = true;
  Saved saved_;
};

// MLASelfAttention as a layer's mixer (model/layer_spec.h).
std::unique_ptr<Mixer> make_mla_mixer(const std::string& prefix, const GPTConfig& cfg,
                                      int64_t layer, uint64_t seed, const ModelParallel& mp);

}  // namespace megaton
