// GPTModel forward/backward (TransformerLayer: transformer_layer.cpp).
#include "model/gpt.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <unordered_map>
#include <utility>

#include "model/kv_cache.h"
#include "model/main_grad.h"
#include "model/mtp.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace megaton {

// ParamAndGradBuffer's own_bucket argument for buffers without one.
static std::vector<const Param*> no_own_bucket() { return {}; }

// The dtype of the gradients the layers accumulate into for a buffer of `shards` shards:
// the run's main grads, or under FSDP's sharded gradients (more than one shard) the grad
// comm dtype (the own shards keep the main grads dtype).
static DType bucket_grad_dtype(const GPTConfig& cfg, const ChunkSharding& sharding,
                               int64_t shards) {
  const bool sharded = sharding.strategy >= ShardingStrategy::OptimGrads && shards > 1;
  return sharded ? sharding.grad_comm_dtype : cfg.main_grads_dtype;
}

std::vector<std::span<Param* const>> GPTModel::param_units() const {
  std::vector<std::span<Param* const>> out;
  if (!head_params_.empty()) out.emplace_back(head_params_);
  for (const auto& ps : layer_params_) out.emplace_back(ps);
  if (!tail_forward_.empty()) out.emplace_back(tail_forward_);
  return out;
}

// Whether a chunk needs the word embeddings: for the lookup (pre_process), or as the
// tied output layer (post_process without untie_embeddings_and_output_weights).
// Multi-token prediction on the last stage looks up embeddings too.
static bool holds_word_embeddings(const GPTConfig& cfg, const PipelineChunk& chunk) {
  return chunk.pre_process || (chunk.post_process && (!cfg.untie_embeddings_and_output_weights ||
                                                      cfg.mtp_num_layers > 0));
}

GPTModel::GPTModel(const GPTConfig& cfg, uint64_t seed, const ModelParallel& mp,
                   int64_t dense_shards, int64_t expert_shards, const PipelineChunk& chunk,
                   int64_t bucket_size, const ChunkSharding& sharding)
    : cfg_(cfg),
      mp_(mp),
      chunk_(chunk),
      // Vocab-parallel: rank r holds vocabulary rows [r V/tp, (r+1) V/tp).
      word_embeddings(holds_word_embeddings(cfg, chunk)
                          ? make_param_sharded("embedding.word_embeddings.weight",
                                               {cfg.padded_vocab_size, cfg.hidden_size},
                                               cfg.init_method_std, seed, Placement::of(cfg), 0,
                                               mp.tp_rank(), mp.tp_size())
                          : Param()),
      final_layernorm(final_norm_name(cfg), cfg.hidden_size, cfg.normalization, cfg.norm_epsilon,
                      Placement::of(cfg), mp.sequence_parallel && mp.tp_size() > 1) {
  MEGATON_CHECK(cfg.padded_vocab_size > 0, "GPTConfig not finalized");
  MEGATON_CHECK(
      cfg.padded_vocab_size % mp_.tp_size() == 0 && cfg.tensor_model_parallel_size == mp_.tp_size(),
      "GPTConfig padded for tensor-parallel size {}, the model runs {}",
      cfg.tensor_model_parallel_size, mp_.tp_size());
  vocab_start_ = int64_t(mp_.tp_rank()) * (cfg.padded_vocab_size / mp_.tp_size());
  if (word_embeddings.weight.defined()) word_embeddings.padded_vocab_rows = true;
  if (chunk_.num_layers < 0) chunk_.num_layers = cfg.num_layers - chunk_.first_layer;
  MEGATON_CHECK(chunk_.first_layer >= 0 && chunk_.first_layer + chunk_.num_layers <= cfg.num_layers,
                "model chunk of layers [{}, {}) outside the model's {} layers", chunk_.first_layer,
                chunk_.first_layer + chunk_.num_layers, cfg.num_layers);
  if (chunk_.pre_process) params_.push_back(&word_embeddings);
  if (chunk_.pre_process && cfg.position_embedding_type == PositionEmbedding::LearnedAbsolute) {
    position_embeddings = make_param("embedding.position_embeddings.weight",
                                     {cfg.max_position_embeddings, cfg.hidden_size},
                                     cfg.init_method_std, seed, Placement::of(cfg));
    position_embeddings.sequence_parallel = mp_.sequence_parallel && mp_.tp_size() > 1;
    params_.push_back(&position_embeddings);
  }
  head_params_ = params_;
  for (int64_t i = chunk_.first_layer; i < chunk_.first_layer + chunk_.num_layers; ++i) {
    layers_.push_back(std::make_unique<TransformerLayer>(cfg_, i, seed, mp_));
    layer_params_.emplace_back();
    layers_.back()->collect_params(layer_params_.back());
    params_.insert(params_.end(), layer_params_.back().begin(), layer_params_.back().end());
  }
  if (chunk_.post_process) {
    final_layernorm.collect_params(tail_grads_);
    // Multi-token prediction depths, on the last stage (Megatron's default placement).
    for (int64_t k = 0; k < cfg.mtp_num_layers; ++k) {
      mtp_.push_back(std::make_unique<MultiTokenPredictionLayer>(cfg_, k, seed, mp_));
      mtp_.back()->collect_params(tail_grads_);
    }
    params_.insert(params_.end(), tail_grads_.begin(), tail_grads_.end());
  }
  if (chunk_.post_process && !chunk_.pre_process && word_embeddings.weight.defined()) {
    // The last stage's copy of the tied embeddings (or of the embeddings MTP looks up),
    // equal to the first stage's from the start (drawn by name) and kept equal by summing
    // the two gradients.
    word_embeddings.shared = true;
    params_.push_back(&word_embeddings);
    tail_grads_.push_back(&word_embeddings);
  }
  if (chunk_.post_process && cfg.untie_embeddings_and_output_weights) {
    output_layer = make_param_sharded("output_layer.weight",
                                      {cfg.padded_vocab_size, cfg.hidden_size}, cfg.init_method_std,
                                      seed, Placement::of(cfg), 0, mp_.tp_rank(), mp_.tp_size());
    output_layer.padded_vocab_rows = true;
    params_.push_back(&output_layer);
    tail_grads_.push_back(&output_layer);
  }
  tail_forward_ = tail_grads_;
  // The tail reads the word embeddings as the tied output layer and in MTP's lookups.
  if (chunk_.post_process && chunk_.pre_process &&
      (!cfg.untie_embeddings_and_output_weights || cfg.mtp_num_layers > 0))
    tail_forward_.push_back(&word_embeddings);
  // Dense and expert params in two buffers: they are reduced over different groups; the
  // FP8 weights of --fp8-param-gather in two more (their weight buffers are FP8). The layer-
  // wise distributed optimizer's Muon params in two more, laid out whole (Megatron keys its
  // buffers by is_managed_by_layer_wise_optimizer too).
  const bool layer_wise = sharding.layer_wise && (dense_shards > 1 || expert_shards > 1);
  std::vector<Param*> dense, expert, dense_fp8, expert_fp8, dense_muon, expert_muon;
  for (Param* p : params_)
    if (layer_wise && muon_param(*p))
      (p->is_expert ? expert_muon : dense_muon).push_back(p);
    else
      (p->is_expert ? (p->fp8_param ? expert_fp8 : expert) : (p->fp8_param ? dense_fp8 : dense))
          .push_back(p);
  // Embeddings tied across pipeline stages: sharded alike on both stages, so their
  // gradients can be summed over the stages after the data-parallel reduce-scatter
  // (Megatron's _does_param_require_new_bucket).
  std::vector<const Param*> own_bucket;
  if (word_embeddings.weight.defined() && chunk_.pre_process != chunk_.post_process &&
      dense_shards > 1)
    own_bucket.push_back(&word_embeddings);
  buffers_.reserve(6);
  // FSDP: a bucket per unit (the hooks' units: 0 the embedding, 1 + i layer i, then the tail),
  // each buffer storing its shards as the strategy says.
  const bool fsdp = sharding.use_megatron_fsdp;
  MEGATON_CHECK(!layer_wise || !fsdp,
                "the layer-wise distributed optimizer (Muon) under Megatron-FSDP");
  std::unordered_map<const Param*, int> unit_of;
  if (fsdp) {
    for (const Param* p : head_params_) unit_of[p] = 0;
    for (size_t i = 0; i < layer_params_.size(); ++i)
      for (const Param* p : layer_params_[i]) unit_of[p] = int(i) + 1;
    for (const Param* p : tail_grads_) unit_of.try_emplace(p, int(layer_params_.size()) + 1);
  }
  auto units_of = [&](const std::vector<Param*>& ps) {
    std::vector<int> units;
    for (const Param* p : ps) units.push_back(fsdp ? unit_of.at(p) : 0);
    return fsdp ? units : std::vector<int>();
  };
  auto buffer_sharding = [&](bool is_expert) {
    BufferSharding bs;
    bs.strategy = sharding.strategy;
    bs.shard_index = is_expert ? sharding.expert_index : sharding.dense_index;
    bs.main_grad_dtype = sharding.main_grad_dtype;
    bs.double_buffer = sharding.double_buffer;
    return bs;
  };
  const int64_t bucket = fsdp ? 0 : bucket_size;
  const DType dense_grads = bucket_grad_dtype(cfg_, sharding, dense_shards);
  const DType expert_grads = bucket_grad_dtype(cfg_, sharding, expert_shards);
  buffers_.emplace_back(dense, dense_shards, false, bucket, own_bucket, dense_grads,
                        units_of(dense), buffer_sharding(false));
  if (!dense_fp8.empty())
    buffers_.emplace_back(dense_fp8, dense_shards, false, bucket, no_own_bucket(), dense_grads,
                          units_of(dense_fp8), buffer_sharding(false));
  if (!expert.empty())
    buffers_.emplace_back(expert, expert_shards, true, bucket, no_own_bucket(), expert_grads,
                          units_of(expert), buffer_sharding(true));
  if (!expert_fp8.empty())
    buffers_.emplace_back(expert_fp8, expert_shards, true, bucket, no_own_bucket(), expert_grads,
                          units_of(expert_fp8), buffer_sharding(true));
  if (!dense_muon.empty())
    buffers_.emplace_back(dense_muon, dense_shards, false, bucket, no_own_bucket(), dense_grads,
                          std::vector<int>(), buffer_sharding(false), BufferLayout::WholeParams);
  if (!expert_muon.empty())
    buffers_.emplace_back(expert_muon, expert_shards, true, bucket, no_own_bucket(), expert_grads,
                          std::vector<int>(), buffer_sharding(true), BufferLayout::WholeParams);
  if (cfg_.cpu_offloading.enabled && cfg_.cpu_offloading.num_layers > 0) {
    std::vector<TransformerLayer*> layers;
    for (auto& layer : layers_) layers.push_back(layer.get());
    const int64_t offloaded = std::min<int64_t>(cfg_.cpu_offloading.num_layers, chunk_.num_layers);
    offload_ = std::make_unique<ActivationOffload>(std::move(layers), offloaded, cfg_.device);
  }
}

GPTModel::~GPTModel() = default;

std::vector<TransformerLayer*> GPTModel::all_layers() {
  std::vector<TransformerLayer*> out;
  for (auto& layer : layers_) out.push_back(layer.get());
  for (auto& depth : mtp_) out.push_back(depth->transformer_layer.get());
  return out;
}

int64_t GPTModel::num_parameters() const {
  int64_t n = 0;
  for (const Param* p : params_) n += p->weight.numel();
  return n;
}

int64_t GPTModel::hidden_rows(int64_t batch, int64_t seq) const {
  return mp_.sequence_parallel ? batch * seq / mp_.tp_size() : batch * seq;
}

Tensor GPTModel::embed(const Tensor& tokens, const ForwardContext& ctx) {
  Saved& s = saved_;
  s.batch = tokens.dim(0);
  s.seq = tokens.dim(1);
  MEGATON_CHECK(cfg_.position_embedding_type != PositionEmbedding::LearnedAbsolute ||
                    s.seq <= cfg_.max_position_embeddings,
                "sequence of {} tokens exceeds max_position_embeddings {}", s.seq,
                cfg_.max_position_embeddings);
  int64_t T = s.batch * s.seq;
  s.tokens = tokens.view({T}).to(cfg_.device);
  Tensor emb = embedding_lookup(s.tokens);
  const PackedSeqParams* packed = ctx.packed_seq_params.get();
  if (position_embeddings.weight.defined() && packed && packed->position_ids.defined()) {
    // --reset-position-ids: each row's position restarts after each eod (Megatron's
    // LanguageModelEmbedding looks position_ids up). Under SP this rank's rows.
    const int64_t first_row = mp_.sequence_parallel ? mp_.tp_rank() * emb.dim(0) : 0;
    s.position_ids = packed->position_ids.rows(first_row, emb.dim(0));
    Tensor positions = empty_like(emb, emb.shape());
    ops::embedding_forward(s.position_ids, position_embeddings.weight, positions);
    ops::add_(emb, positions);
  } else if (position_embeddings.weight.defined()) {
    for_each_position_block(emb.dim(0), [&](int64_t local_row, int64_t pos, int64_t n) {
      Tensor rows = emb.rows(local_row, n);
      ops::add_(rows, position_embeddings.weight.rows(pos, n));
    });
  }
  s.emb_dropout_p = ctx.training ? cfg_.hidden_dropout : 0.0f;
  s.emb_seed = ctx.seed;
  s.emb_stream = ctx.stream(-1, 0);
  Tensor x = emb;
  if (s.emb_dropout_p > 0) {
    x = empty_like(emb, emb.shape());
    ops::dropout_forward(emb, x, s.emb_dropout_p, s.emb_seed, s.emb_stream);
  }
  return x;
}

Tensor GPTModel::embedding_lookup(const Tensor& tokens) {
  Tensor emb = empty_like(word_embeddings.weight, {tokens.numel(), cfg_.hidden_size});
  if (mp_.tp_size() == 1) {
    ops::embedding_forward(tokens, word_embeddings.weight, emb);
  } else {
    // Each rank looks up the ids in its vocabulary rows (zeros elsewhere); the sum over
    // TP is the lookup, whole on every rank or this rank's token rows under SP.
    ops::embedding_forward_vocab_range(tokens, word_embeddings.weight, vocab_start_, emb);
    if (mp_.sequence_parallel)
      emb = reduce_scatter_sequence(emb, mp_);
    else
      all_reduce_tensor_parallel(emb, mp_);
  }
  return emb;
}

void GPTModel::embedding_lookup_backward(const Tensor& dx, const Tensor& tokens) {
  // Every token row's gradient (gathered under SP) into this rank's vocabulary rows.
  Tensor demb = dx;
  if (mp_.tp_size() > 1 && mp_.sequence_parallel) demb = gather_sequence(demb, mp_);
  accumulate_main_grad(word_embeddings.main_grad, [&](Tensor& main_grad) {
    if (mp_.tp_size() == 1)
      ops::embedding_backward(demb, tokens, main_grad);
    else
      ops::embedding_backward_vocab_range(demb, tokens, vocab_start_, main_grad);
  });
}

void GPTModel::for_each_position_block(
    int64_t local_rows, const std::function<void(int64_t, int64_t, int64_t)>& fn) const {
  // Row i of the micro-batch is position i % seq; under SP this rank's rows start at
  // tp_rank x local_rows.
  const int64_t first_row = mp_.sequence_parallel ? mp_.tp_rank() * local_rows : 0;
  const int64_t seq = saved_.seq;
  for (int64_t row = first_row; row < first_row + local_rows;) {
    const int64_t pos = row % seq, n = std::min(seq - pos, first_row + local_rows - row);
    fn(row - first_row, pos, n);
    row += n;
  }
}

Tensor GPTModel::forward_hidden(const Tensor& tokens, const ForwardContext& ctx) {
  saved_ = {};
  if (offload_) offload_->discard();  // the layers' state is replaced
  Tensor x = embed(tokens, ctx);
  for (auto& layer : layers_) x = layer->forward(x, saved_.batch, saved_.seq, ctx);
  return final_layernorm.forward(x);
}

MicroBatchLoss GPTModel::forward(const Tensor& tokens, const Tensor& labels,
                                 const ForwardContext& ctx) {
  MEGATON_CHECK(chunk_.pre_process && chunk_.post_process,
                "GPTModel::forward needs the whole model, not a pipeline chunk");
  return forward_chunk({tokens.dim(0), tokens.dim(1), tokens, labels, Tensor(), Tensor()}, ctx)
      .loss;
}

ChunkOutput GPTModel::forward_chunk(const ChunkInput& in, const ForwardContext& ctx) {
  saved_ = {};  // this micro-batch replaces any the chunk held
  Tensor x;
  if (chunk_.pre_process) {
    MEGATON_CHECK(in.tokens.defined() && in.tokens.ndim() == 2 && in.tokens.dim(0) == in.batch &&
                      in.tokens.dim(1) == in.seq,
                  "forward_chunk: tokens must be [{}, {}]", in.batch, in.seq);
    before_forward(head_params_);
    x = embed(in.tokens, ctx);
    after_forward(head_params_);
  } else {
    saved_.batch = in.batch;
    saved_.seq = in.seq;
    const Shape want{hidden_rows(in.batch, in.seq), cfg_.hidden_size};
    MEGATON_CHECK(in.hidden.defined() && in.hidden.shape() == want &&
                      in.hidden.dtype() == cfg_.compute_dtype() &&
                      in.hidden.device() == cfg_.device,
                  "forward_chunk: the input hidden state must be {} {}", shape_str(want),
                  dtype_name(cfg_.compute_dtype()));
    x = in.hidden;
  }
  // Full recompute: each recompute group keeps its first layer's input; its layers keep
  // nothing else (but MoE routing), and backward_chunk runs the group's forward again.
  const RecomputeConfig& rc = cfg_.recompute;
  const int64_t n = int64_t(layers_.size());
  saved_.ctx = ctx;
  if (ctx.training && rc.granularity == RecomputeGranularity::Full)
    saved_.recompute_inputs.assign(layers_.size(), Tensor());
  // --cpu-offloading: a training forward's first layers go to the host (not evaluation).
  if (offload_) offload_->discard();
  const bool offloading = offload_ && ctx.training && !ctx.forward_only && !ctx.recompute;
  for (int64_t i = 0; i < n; ++i) {
    before_forward(layer_params_[i]);
    const int64_t group_start = saved_.recompute_inputs.empty() ? -1 : rc.full_group_start(i, n);
    if (group_start == i) saved_.recompute_inputs[i] = x;
    x = layers_[i]->forward(x, saved_.batch, saved_.seq, ctx);
    after_forward(layer_params_[i]);
    if (group_start >= 0 || ctx.forward_only)
      layers_[i]->discard_saved();
    else if (offloading)
      offload_->after_forward(i);
  }
  if (offloading) offload_->finish_forward();
  ChunkOutput out;
  for (auto& layer : layers_) {
    if (!layer->moe()) continue;
    if (!out.loss.aux_losses.defined())
      out.loss.aux_losses = Tensor::zeros({1}, DType::F32, cfg_.device);
    ops::add_(out.loss.aux_losses, layer->moe()->last_aux_loss_tensor());
  }
  if (!chunk_.post_process) {
    out.hidden = x;
    return out;
  }
  MEGATON_CHECK(in.labels.defined() && in.labels.numel() == in.batch * in.seq,
                "forward_chunk: labels must be [{}, {}]", in.batch, in.seq);
  before_forward(tail_forward_);
  const Tensor h0 = final_layernorm.forward(x);
  out.loss.losses = output_loss(h0, in.labels, saved_.output);
  if (!mtp_.empty() && !ctx.forward_only) mtp_forward(h0, in, ctx, out.loss);
  return out;
}

double MicroBatchLoss::aux_loss() const {
  return aux_losses.defined() ? double(aux_losses.to(Device::CPU).f32()[0]) : 0.0;
}

Tensor GPTModel::output_loss(const Tensor& hidden, const Tensor& labels, OutputLossSaved& s) {
  // The output layer is column-parallel over the vocabulary: every token row is needed.
  s.final_hidden = hidden;
  if (mp_.sequence_parallel) s.final_hidden = gather_sequence(s.final_hidden, mp_);
  const int64_t T = s.final_hidden.dim(0);
  const Param& out_w = output_layer.weight.defined() ? output_layer : word_embeddings;
  s.logits = empty_like(s.final_hidden, {T, out_w.weight.dim(0)});
  ops::gemm(s.final_hidden, false, out_w.weight, true, s.logits);
  s.labels = labels.view({T}).to(cfg_.device);
  Tensor losses = Tensor::empty({T}, DType::F32, cfg_.device);
  s.lse = Tensor::empty({T}, DType::F32, cfg_.device);
  if (mp_.tp_size() == 1) {
    ops::cross_entropy_forward(s.logits, s.labels, losses, s.lse);
  } else {
    // Megatron's vocab_parallel_cross_entropy: max, sum of exponentials and the target
    // logit reduced over the vocabulary shards.
    Tensor row_max = Tensor::empty({T}, DType::F32, cfg_.device);
    Tensor sum_exp = Tensor::empty({T}, DType::F32, cfg_.device);
    Tensor target = Tensor::empty({T}, DType::F32, cfg_.device);
    ops::cross_entropy_partial_stats(s.logits, s.labels, vocab_start_, row_max, sum_exp, target);
    Tensor global_max = row_max.clone();
    mp_.comm->all_reduce(global_max, mp_.tp(), dist::ReduceOp::Max);
    ops::cross_entropy_rescale_sum_exp(row_max, global_max, sum_exp);
    mp_.comm->all_reduce(sum_exp, mp_.tp());
    mp_.comm->all_reduce(target, mp_.tp());
    ops::cross_entropy_finish(global_max, sum_exp, target, losses, s.lse);
  }
  return losses;
}

Tensor GPTModel::logits(const Tensor& tokens) {
  MEGATON_CHECK(chunk_.pre_process && chunk_.post_process,
                "GPTModel::logits needs the whole model, not a pipeline chunk");
  MEGATON_CHECK(mp_.tp_size() == 1, "GPTModel::logits runs on one tensor-parallel rank");
  ForwardContext ctx;
  ctx.training = false;
  Tensor hidden = forward_hidden(tokens, ctx);
  const Param& out_w = output_layer.weight.defined() ? output_layer : word_embeddings;
  Tensor out = empty_like(hidden, {hidden.dim(0), cfg_.padded_vocab_size});
  ops::gemm(hidden, false, out_w.weight, true, out);
  return out.dtype() == DType::F32 ? out.to(Device::CPU) : out.to(Device::CPU).to(DType::F32);
}

Tensor GPTModel::prefill(std::span<const int32_t> tokens, InferenceContext& context) {
  context.sequence_len_offset = 0;
  return forward_inference(tokens, context);
}

Tensor GPTModel::decode_step(int32_t token, InferenceContext& context) {
  return forward_inference(std::span<const int32_t>(&token, 1), context);
}

Tensor GPTModel::forward_inference(std::span<const int32_t> tokens, InferenceContext& context) {
  MEGATON_CHECK(chunk_.pre_process && chunk_.post_process && mp_.tp_size() == 1,
                "GPTModel inference needs the whole model on one tensor-parallel rank");
  const int64_t n = int64_t(tokens.size()), first = context.sequence_len_offset,
                H = cfg_.hidden_size;
  MEGATON_CHECK(n >= 1, "GPTModel inference: no tokens");
  MEGATON_CHECK(context.key_value_memory_dict.size() == layers_.size(),
                "GPTModel inference: the context has {} layers, the model {}",
                context.key_value_memory_dict.size(), layers_.size());
  MEGATON_CHECK(context.fits(n),
                "GPTModel inference: {} tokens at position {} exceed the cache's {}", n, first,
                context.max_sequence_length);
  MEGATON_CHECK(!position_embeddings.weight.defined() || first + n <= cfg_.max_position_embeddings,
                "GPTModel inference: position {} exceeds max_position_embeddings {}", first + n - 1,
                cfg_.max_position_embeddings);
  const Tensor ids =
      Tensor::from_i32({n}, std::vector<int32_t>(tokens.begin(), tokens.end())).to(cfg_.device);
  Tensor x = empty_like(word_embeddings.weight, {n, H});
  ops::embedding_forward(ids, word_embeddings.weight, x);
  if (position_embeddings.weight.defined()) ops::add_(x, position_embeddings.weight.rows(first, n));
  for (size_t i = 0; i < layers_.size(); ++i) {
    InferenceContext::LayerCache& cache = context.key_value_memory_dict[i];
    x = layers_[i]->forward_inference(x, first, cache.key, cache.value);
  }
  context.sequence_len_offset = first + n;
  // Only the last token's logits are wanted: the final norm is per row.
  const Tensor hidden = final_layernorm.forward_inference(x.rows(n - 1, 1));
  const Param& out_w = output_layer.weight.defined() ? output_layer : word_embeddings;
  Tensor out = empty_like(hidden, {1, cfg_.padded_vocab_size});
  ops::gemm(hidden, false, out_w.weight, true, out);
  const Tensor host = out.to(Device::CPU);
  return (host.dtype() == DType::F32 ? host : host.to(DType::F32)).view({cfg_.padded_vocab_size});
}

void GPTModel::backward(const Tensor& dlosses, float aux_grad_scale) {
  MEGATON_CHECK(chunk_.pre_process && chunk_.post_process,
                "GPTModel::backward needs the whole model, not a pipeline chunk");
  backward_chunk(dlosses, aux_grad_scale);
}

Tensor GPTModel::backward_chunk(const Tensor& dout, float aux_grad_scale) {
  MEGATON_CHECK(holds_activations(),
                "backward_chunk of layers [{}, {}): the chunk holds no forward (taken, or "
                "backward already run)",
                chunk_.first_layer, chunk_.first_layer + chunk_.num_layers);
  Tensor dx = dout;
  if (chunk_.post_process) {
    before_backward(tail_forward_);
    Tensor dh = output_loss_backward(dout, saved_.output);
    // The MTP depths read the final-normed output too (their hnorm).
    if (!saved_.mtp.empty()) ops::add_(dh, mtp_backward(aux_grad_scale));
    dx = final_layernorm.backward(dh);
    after_backward(tail_grads_);
  }
  const RecomputeConfig& rc = cfg_.recompute;
  const int64_t n = int64_t(layers_.size());
  for (int64_t i = n; i-- > 0;) {
    const int64_t group_start = saved_.recompute_inputs.empty() ? -1 : rc.full_group_start(i, n);
    if (group_start >= 0 && i + 1 == rc.full_group_end(i, n)) {
      // The group's forward again from its kept input, re-saving what backward needs.
      ForwardContext ctx = saved_.ctx;
      ctx.recompute = true;
      Tensor h = std::exchange(saved_.recompute_inputs[group_start], Tensor());
      for (int64_t j = group_start; j <= i; ++j) {
        before_backward(layer_params_[j]);  // gathered until its backward is done
        h = layers_[j]->forward(h, saved_.batch, saved_.seq, ctx);
      }
    }
    before_backward(layer_params_[i]);
    if (offload_) offload_->before_backward(i);  // layer i back, layer i - 1 on its way
    if (layers_[i]->moe()) layers_[i]->moe()->aux_grad_scale = aux_grad_scale;
    dx = layers_[i]->backward(dx);
    after_backward(layer_params_[i]);
  }
  if (chunk_.pre_process) {
    before_backward(head_params_);
    embed_backward(dx);
    after_backward(head_params_);
    dx = Tensor();
  }
  saved_ = {};
  return dx;
}

ChunkActivations GPTModel::take_activations() {
  MEGATON_CHECK(holds_activations(),
                "take_activations of layers [{}, {}): the chunk holds no forward",
                chunk_.first_layer, chunk_.first_layer + chunk_.num_layers);
  if (offload_) offload_->reload_all();  // a stash holds its tensors
  ChunkActivations out;
  out.owner_ = this;
  out.model_ = std::exchange(saved_, {});
  out.final_layernorm_ = final_layernorm.take_saved();
  out.layers_.reserve(layers_.size());
  for (auto& layer : layers_) out.layers_.push_back(layer->take_saved());
  for (auto& d : mtp_)
    out.mtp_.push_back({d->enorm.take_saved(), d->hnorm.take_saved(),
                        d->final_layernorm.take_saved(), d->eh_proj.take_saved(),
                        d->transformer_layer->take_saved()});
  return out;
}

void GPTModel::restore_activations(ChunkActivations&& activations) {
  MEGATON_CHECK(activations.owner_ == this, "restore_activations of layers [{}, {}): {}",
                chunk_.first_layer, chunk_.first_layer + chunk_.num_layers,
                activations.empty() ? "no activations (empty, or restored already)"
                                    : "activations taken from another chunk");
  MEGATON_CHECK(!holds_activations(),
                "restore_activations of layers [{}, {}): the chunk holds another forward",
                chunk_.first_layer, chunk_.first_layer + chunk_.num_layers);
  ChunkActivations in = std::move(activations);
  saved_ = std::move(in.model_);
  final_layernorm.restore_saved(std::move(in.final_layernorm_));
  for (size_t i = 0; i < layers_.size(); ++i) layers_[i]->restore_saved(std::move(in.layers_[i]));
  for (size_t k = 0; k < mtp_.size(); ++k) {
    ChunkActivations::MtpActivations& a = in.mtp_[k];
    mtp_[k]->enorm.restore_saved(std::move(a.enorm));
    mtp_[k]->hnorm.restore_saved(std::move(a.hnorm));
    mtp_[k]->final_layernorm.restore_saved(std::move(a.final_layernorm));
    mtp_[k]->eh_proj.restore_saved(std::move(a.eh_proj));
    mtp_[k]->transformer_layer->restore_saved(std::move(a.layer));
  }
}

Tensor GPTModel::output_loss_backward(const Tensor& dlosses, OutputLossSaved& s) {
  const int64_t T = s.final_hidden.dim(0), H = cfg_.hidden_size;
  Param& out_w = output_layer.weight.defined() ? output_layer : word_embeddings;
  // In place: the logits buffer ([T, V/tp], the largest activation) becomes dlogits.
  Tensor dlogits = s.logits;
  if (mp_.tp_size() == 1)
    ops::cross_entropy_backward(dlosses.to(cfg_.device), s.logits, s.labels, s.lse, dlogits);
  else
    ops::cross_entropy_backward_vocab_range(dlosses.to(cfg_.device), s.logits, s.labels, s.lse,
                                            vocab_start_, dlogits);
  s.logits = Tensor();
  Tensor dhidden = empty_like(dlogits, {T, H});
  ops::gemm(dlogits, false, out_w.weight, false, dhidden);
  gemm_main_grad(dlogits, true, s.final_hidden, false, out_w.main_grad);
  dlogits = s.final_hidden = Tensor();
  // Partial over the vocabulary shards: summed (and split into token rows under SP).
  if (mp_.sequence_parallel)
    dhidden = reduce_scatter_sequence(dhidden, mp_);
  else
    all_reduce_tensor_parallel(dhidden, mp_);
  s.labels = s.lse = Tensor();
  return dhidden;
}

void GPTModel::embed_backward(const Tensor& dx) {
  Saved& s = saved_;
  Tensor demb = dx;
  if (s.emb_dropout_p > 0) {
    demb = empty_like(dx, dx.shape());
    ops::dropout_backward(dx, demb, s.emb_dropout_p, s.emb_seed, s.emb_stream);
  }
  if (position_embeddings.weight.defined() && s.position_ids.defined())
    accumulate_main_grad(position_embeddings.main_grad, [&](Tensor& main_grad) {
      ops::embedding_backward(demb, s.position_ids, main_grad);
    });
  else if (position_embeddings.weight.defined())
    // Every sequence's rows summed in fp32, then rounded once into a BF16 main grad.
    accumulate_main_grad(position_embeddings.main_grad, [&](Tensor& main_grad) {
      for_each_position_block(demb.dim(0), [&](int64_t local_row, int64_t pos, int64_t n) {
        Tensor g = main_grad.rows(pos, n);
        Tensor rows = demb.rows(local_row, n);
        if (rows.dtype() != DType::F32) {
          Tensor rows_f32 = Tensor::empty(rows.shape(), DType::F32, rows.device());
          ops::cast(rows, rows_f32);
          rows = rows_f32;
        }
        ops::add_(g, rows);
      });
    });
  embedding_lookup_backward(demb, s.tokens);
  s.tokens = s.position_ids = Tensor();
}

}  // namespace megaton
