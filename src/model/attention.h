// SelfAttention: Megatron's fused QKV projection, RoPE, causal GQA attention, output proj.
#pragma once
#include "model/layers.h"
#include "model/parallel.h"

namespace megaton {

// linear_qkv weight [(np/ng + 2) * ng * d, H] in Megatron's grouped layout: for each
// query group g, the rows of its np/ng query heads, then its key head, then its value
// head (np = num_attention_heads, ng = num_query_groups, d = kv_channels). Query head
// h belongs to group h / (np / ng).
class SelfAttention {
 public:
  SelfAttention(const std::string& prefix, const GPTConfig& cfg, int64_t layer, uint64_t seed,
                const ModelParallel& mp = {});
  // x [B*S, H] -> [B*S, H] (under sequence parallelism this rank's [B*S/tp, H] rows;
  // batch and seq are always the full micro-batch's).
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, const ForwardContext& ctx);
  // InternalError when nothing was saved.
  Tensor backward(const Tensor& dy);
  void collect_params(std::vector<Param*>& out);

  struct Saved {
    Tensor q, k, v;                 // [B, S, heads, d] after RoPE (this rank's heads, groups)
    Tensor out;                     // attention output [B, S, np, d]
    Tensor lse;                     // log-sum-exp of the scores [B, np, S] fp32
    float dropout_p = 0;            // attention dropout of this forward
    uint64_t seed = 0, stream = 0;  // its mask's Philox key and stream
  };
  // The attention's saved state with its linears'.
  struct Activations {
    Saved attention;
    Linear::Saved linear_qkv, linear_proj;
  };
  Activations take_saved();
  void restore_saved(Activations&& saved);

  Linear linear_qkv, linear_proj;

 private:
  const GPTConfig& cfg_;
  ModelParallel mp_;
  int64_t layer_;
  Saved saved_;
};

}  // namespace megaton
