// GPTModel and TransformerLayer forward/backward.
#include "model/gpt.h"

#include <cmath>

#include "ops/ops.h"

namespace megaton {

TransformerLayer::TransformerLayer(const GPTConfig& cfg, int64_t layer, uint64_t seed,
                                   const ModelParallel& mp)
    : input_layernorm("decoder.layers." + std::to_string(layer) + ".input_layernorm",
                      cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, Placement::of(cfg)),
      self_attention("decoder.layers." + std::to_string(layer) + ".self_attention", cfg, layer,
                     seed, mp),
      pre_mlp_layernorm("decoder.layers." + std::to_string(layer) + ".pre_mlp_layernorm",
                        cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, Placement::of(cfg)),
      cfg_(cfg),
      mp_(mp),
      layer_(layer) {
  std::string prefix = "decoder.layers." + std::to_string(layer) + ".mlp";
  if (cfg.is_moe_layer(layer)) {
    moe = std::make_unique<MoELayer>(prefix, cfg, seed, mp);
  } else {
    float output_std = cfg.init_method_std / std::sqrt(2.0f * float(cfg.num_layers));
    mlp = std::make_unique<MLP>(prefix, cfg.hidden_size, cfg.ffn_hidden_size, cfg.swiglu,
                                !cfg.disable_bias_linear, cfg.init_method_std, output_std, seed,
                                Placement::of(cfg));
  }
}

Tensor TransformerLayer::forward(const Tensor& x, int64_t batch, int64_t seq,
                                 const ForwardContext& ctx) {
  ctx_ = ctx;
  dropout_p_ = ctx.training ? cfg_.hidden_dropout : 0.0f;
  Tensor h = dropout(self_attention.forward(input_layernorm.forward(x), batch, seq, ctx), 1);
  ops::add_(h, x);
  Tensor normed = pre_mlp_layernorm.forward(h);
  Tensor y = dropout(moe ? moe->forward(normed, ctx) : mlp->forward(normed), 2);
  ops::add_(y, h);
  return y;
}

Tensor TransformerLayer::backward(const Tensor& dy) {
  // dh = dy + d(mlp branch)
  Tensor dm = dropout_grad(dy, 2);
  Tensor dnormed = moe ? moe->backward(dm) : mlp->backward(dm);
  Tensor dh = pre_mlp_layernorm.backward(dnormed);
  ops::add_(dh, dy);
  Tensor dx = input_layernorm.backward(self_attention.backward(dropout_grad(dh, 1)));
  ops::add_(dx, dh);
  return dx;
}

Tensor TransformerLayer::dropout(const Tensor& x, int site) const {
  if (dropout_p_ == 0.0f) return x;  // the branch output is fresh: no copy needed
  Tensor y = empty_like(x, x.shape());
  ops::dropout_forward(x, y, dropout_p_, ctx_.seed, ctx_.stream(layer_, site));
  return y;
}

Tensor TransformerLayer::dropout_grad(const Tensor& dy, int site) const {
  if (dropout_p_ == 0.0f) return dy;
  Tensor dx = empty_like(dy, dy.shape());
  ops::dropout_backward(dy, dx, dropout_p_, ctx_.seed, ctx_.stream(layer_, site));
  return dx;
}

void TransformerLayer::collect_params(std::vector<Param*>& out) {
  input_layernorm.collect_params(out);
  self_attention.collect_params(out);
  pre_mlp_layernorm.collect_params(out);
  if (moe) moe->collect_params(out);
  else mlp->collect_params(out);
}

GPTModel::GPTModel(const GPTConfig& cfg, uint64_t seed, const ModelParallel& mp,
                   int64_t dense_shards, int64_t expert_shards)
    : cfg_(cfg),
      mp_(mp),
      word_embeddings(make_param("embedding.word_embeddings.weight",
                                 {cfg.padded_vocab_size, cfg.hidden_size}, cfg.init_method_std,
                                 seed, Placement::of(cfg))),
      final_layernorm("decoder.final_layernorm", cfg.hidden_size, cfg.normalization,
                      cfg.norm_epsilon, Placement::of(cfg)) {
  MEGATON_CHECK(cfg.padded_vocab_size > 0, "GPTConfig not finalized");
  params_.push_back(&word_embeddings);
  if (cfg.position_embedding_type == PositionEmbedding::LearnedAbsolute) {
    position_embeddings =
        make_param("embedding.position_embeddings.weight",
                   {cfg.max_position_embeddings, cfg.hidden_size}, cfg.init_method_std, seed,
                   Placement::of(cfg));
    params_.push_back(&position_embeddings);
  }
  for (int64_t i = 0; i < cfg.num_layers; ++i) {
    layers_.push_back(std::make_unique<TransformerLayer>(cfg_, i, seed, mp_));
    layers_.back()->collect_params(params_);
  }
  final_layernorm.collect_params(params_);
  if (cfg.untie_embeddings_and_output_weights) {
    output_layer = make_param("output_layer.weight", {cfg.padded_vocab_size, cfg.hidden_size},
                              cfg.init_method_std, seed, Placement::of(cfg));
    params_.push_back(&output_layer);
  }
  // Dense and expert params in two buffers: they are reduced over different groups.
  std::vector<Param*> dense, expert;
  for (Param* p : params_) (p->is_expert ? expert : dense).push_back(p);
  buffers_.reserve(2);
  buffers_.emplace_back(dense, dense_shards, false);
  if (!expert.empty()) buffers_.emplace_back(expert, expert_shards, true);
}

int64_t GPTModel::num_parameters() const {
  int64_t n = 0;
  for (const Param* p : params_) n += p->weight.numel();
  return n;
}

Tensor GPTModel::forward_hidden(const Tensor& tokens, const ForwardContext& ctx) {
  batch_ = tokens.dim(0);
  seq_ = tokens.dim(1);
  MEGATON_CHECK(cfg_.position_embedding_type != PositionEmbedding::LearnedAbsolute ||
                    seq_ <= cfg_.max_position_embeddings,
                "sequence of {} tokens exceeds max_position_embeddings {}", seq_,
                cfg_.max_position_embeddings);
  int64_t T = batch_ * seq_, H = cfg_.hidden_size;
  tokens_ = tokens.view({T}).to(cfg_.device);
  Tensor emb = empty_like(word_embeddings.weight, {T, H});
  ops::embedding_forward(tokens_, word_embeddings.weight, emb);
  if (position_embeddings.weight.defined()) {
    for (int64_t b = 0; b < batch_; ++b) {
      Tensor rows = emb.rows(b * seq_, seq_);
      ops::add_(rows, position_embeddings.weight.rows(0, seq_));
    }
  }
  emb_dropout_p_ = ctx.training ? cfg_.hidden_dropout : 0.0f;
  emb_seed_ = ctx.seed;
  emb_stream_ = ctx.stream(-1, 0);
  Tensor x = emb;
  if (emb_dropout_p_ > 0) {
    x = empty_like(emb, {T, H});
    ops::dropout_forward(emb, x, emb_dropout_p_, emb_seed_, emb_stream_);
  }
  for (auto& layer : layers_) x = layer->forward(x, batch_, seq_, ctx);
  return final_layernorm.forward(x);
}

MicroBatchLoss GPTModel::forward(const Tensor& tokens, const Tensor& labels,
                                 const ForwardContext& ctx) {
  final_hidden_ = forward_hidden(tokens, ctx);
  int64_t T = batch_ * seq_;
  const Param& out_w = output_layer.weight.defined() ? output_layer : word_embeddings;
  logits_ = empty_like(final_hidden_, {T, cfg_.padded_vocab_size});
  ops::gemm(final_hidden_, false, out_w.weight, true, logits_);
  labels_ = labels.view({T}).to(cfg_.device);
  MicroBatchLoss result;
  result.losses = Tensor::empty({T}, DType::F32, cfg_.device);
  lse_ = Tensor::empty({T}, DType::F32, cfg_.device);
  ops::cross_entropy_forward(logits_, labels_, result.losses, lse_);
  for (auto& layer : layers_)
    if (layer->moe) result.aux_loss += layer->moe->last_aux_loss;
  return result;
}

Tensor GPTModel::logits(const Tensor& tokens) {
  ForwardContext ctx;
  ctx.training = false;
  Tensor hidden = forward_hidden(tokens, ctx);
  const Param& out_w = output_layer.weight.defined() ? output_layer : word_embeddings;
  Tensor out = empty_like(hidden, {hidden.dim(0), cfg_.padded_vocab_size});
  ops::gemm(hidden, false, out_w.weight, true, out);
  return out.dtype() == DType::F32 ? out.to(Device::CPU) : out.to(Device::CPU).to(DType::F32);
}

void GPTModel::backward(const Tensor& dlosses, float aux_grad_scale) {
  int64_t T = batch_ * seq_, H = cfg_.hidden_size;
  Param& out_w = output_layer.weight.defined() ? output_layer : word_embeddings;
  // In place: the logits buffer ([T, V], the largest activation) becomes dlogits.
  Tensor dlogits = logits_;
  ops::cross_entropy_backward(dlosses.to(cfg_.device), logits_, labels_, lse_, dlogits);
  logits_ = Tensor();
  Tensor dhidden = empty_like(dlogits, {T, H});
  ops::gemm(dlogits, false, out_w.weight, false, dhidden);
  ops::gemm(dlogits, true, final_hidden_, false, out_w.main_grad, 1.0f, 1.0f);
  dlogits = final_hidden_ = Tensor();

  Tensor dx = final_layernorm.backward(dhidden);
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) {
    if ((*it)->moe) (*it)->moe->aux_grad_scale = aux_grad_scale;
    dx = (*it)->backward(dx);
  }
  Tensor demb = dx;
  if (emb_dropout_p_ > 0) {
    demb = empty_like(dx, {T, H});
    ops::dropout_backward(dx, demb, emb_dropout_p_, emb_seed_, emb_stream_);
  }
  if (position_embeddings.weight.defined()) {
    for (int64_t b = 0; b < batch_; ++b) {
      Tensor g = position_embeddings.main_grad.rows(0, seq_);
      Tensor rows = demb.rows(b * seq_, seq_);
      if (rows.dtype() != DType::F32) {
        Tensor rows_f32 = Tensor::empty(rows.shape(), DType::F32, rows.device());
        ops::cast(rows, rows_f32);
        rows = rows_f32;
      }
      ops::add_(g, rows);
    }
  }
  ops::embedding_backward(demb, tokens_, word_embeddings.main_grad);
  tokens_ = labels_ = lse_ = Tensor();
}

}  // namespace megaton
