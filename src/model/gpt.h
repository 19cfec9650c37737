// GPTModel: embedding -> transformer layers -> final norm -> output layer -> cross entropy.
#pragma once
#include <memory>
#include <optional>

#include "model/attention.h"
#include "model/param_buffer.h"
#include "model/moe.h"

namespace megaton {

// One pre-norm transformer layer (Megatron's TransformerLayer):
//   h = x + dropout(attention(input_layernorm(x)))
//   y = h + dropout(mlp_or_moe(pre_mlp_layernorm(h)))
class TransformerLayer {
 public:
  TransformerLayer(const GPTConfig& cfg, int64_t layer, uint64_t seed, const ModelParallel& mp = {});
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, const ForwardContext& ctx);
  Tensor backward(const Tensor& dy);
  void collect_params(std::vector<Param*>& out);

  Norm input_layernorm;
  SelfAttention self_attention;
  Norm pre_mlp_layernorm;
  std::unique_ptr<MLP> mlp;        // dense layer
  std::unique_ptr<MoELayer> moe;   // MoE layer (params under "...mlp.")

 private:
  // Hidden dropout of branch `site` (1: attention, 2: MLP); identity when p == 0.
  Tensor dropout(const Tensor& x, int site) const;
  Tensor dropout_grad(const Tensor& dy, int site) const;

  const GPTConfig& cfg_;
  ModelParallel mp_;
  int64_t layer_;
  float dropout_p_ = 0;
  uint64_t seed_ = 0;
  ForwardContext ctx_;
};

// Loss of one micro-batch: per-token losses and the router losses of this forward.
struct MicroBatchLoss {
  Tensor losses;          // [B*S] cross entropy per token (fp32)
  double aux_loss = 0;    // sum over MoE layers of the aux loss (with its coefficient)
};

// The GPT model (Megatron's GPTModel at TP = PP = 1). Parameter names match Megatron
// core's local spec ("embedding.word_embeddings.weight", "decoder.layers.0....",
// "decoder.final_layernorm.weight", "output_layer.weight").
class GPTModel {
 public:
  // cfg must be finalize()d. seed keys every initial weight (Philox, by parameter name).
  // dense_shards / expert_shards: the shard count of the dense and expert
  // ParamAndGradBuffers (the data-parallel and expert-data-parallel sizes under the
  // distributed optimizer, else 1).
  // mp: the parallel layout (default: one rank).
  GPTModel(const GPTConfig& cfg, uint64_t seed, const ModelParallel& mp = {},
           int64_t dense_shards = 1, int64_t expert_shards = 1);
  const ModelParallel& model_parallel() const { return mp_; }

  // tokens, labels [B, S] int32 -> per-token losses. Saves activations for backward.
  MicroBatchLoss forward(const Tensor& tokens, const Tensor& labels, const ForwardContext& ctx);
  // Logits [B*S, padded_vocab] (fp32, on the host) for tokens [B, S] (no labels; used by
  // generation and tests).
  Tensor logits(const Tensor& tokens);
  // dlosses [B*S]: d(total loss)/d(per-token loss). aux_grad_scale scales the injected
  // MoE aux-loss gradient (1 / number of micro-batches). Accumulates main_grads.
  void backward(const Tensor& dlosses, float aux_grad_scale);

  // Zeroes every main_grad (one memset per buffer: they are views into the buffers).
  void zero_grad() {
    for (ParamAndGradBuffer& b : buffers_) b.grads().zero();
  }
  // The dense parameters' buffer, then the experts' (MoE models only).
  std::vector<ParamAndGradBuffer>& buffers() { return buffers_; }

  // Every parameter, in a fixed order (embedding, layers, final norm, output layer).
  const std::vector<Param*>& params() const { return params_; }
  const GPTConfig& config() const { return cfg_; }
  int64_t num_parameters() const;
  std::vector<std::unique_ptr<TransformerLayer>>& layers() { return layers_; }

 private:
  Tensor forward_hidden(const Tensor& tokens, const ForwardContext& ctx);

  GPTConfig cfg_;
  ModelParallel mp_;
  Param word_embeddings;
  Param position_embeddings;  // learned_absolute only
  std::vector<std::unique_ptr<TransformerLayer>> layers_;
  Norm final_layernorm;
  Param output_layer;         // untied only
  std::vector<Param*> params_;
  // Weights and main_grads, contiguous (Megatron's param and grad buffers).
  std::vector<ParamAndGradBuffer> buffers_;

  // Saved for backward.
  Tensor tokens_, labels_, final_hidden_, logits_, lse_;
  int64_t batch_ = 0, seq_ = 0;
  float emb_dropout_p_ = 0;
  uint64_t emb_seed_ = 0, emb_stream_ = 0;
};

}  // namespace megaton
