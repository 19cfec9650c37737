// GPTModel: embedding -> transformer layers -> final norm -> output layer -> cross entropy.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>

#include "model/activation_offload.h"
#include "model/attention.h"
#include "model/layer_spec.h"
#include "model/moe.h"
#include "model/param_buffer.h"

namespace megaton {

// One pre-norm decoder layer (Megatron's TransformerLayer), composed from its LayerSpec
// (model/layer_spec.h: the mixer and MLP kinds):
//   h = x + dropout(mixer(input_layernorm(x)))
//   y = h + dropout(mlp(pre_mlp_layernorm(h)))
// A kind None drops its line (h = x, or y = h): a hybrid model's Mamba layer (Megatron's
// MambaLayer, its norm named "norm"), attention layer, or MLP / MoE layer (MLPLayer).
class TransformerLayer {
 public:
  // The layer of `spec` (default: decoder_layer_spec(cfg, layer)).
  TransformerLayer(const GPTConfig& cfg, int64_t layer, uint64_t seed,
                   const ModelParallel& mp = {});
  TransformerLayer(const GPTConfig& cfg, const LayerSpec& spec, int64_t layer, uint64_t seed,
                   const ModelParallel& mp);
  // With its parameters under `prefix` instead of "decoder.layers.<layer>" (an MTP depth's
  // "mtp.layers.<k>.transformer_layer"); `layer` keys its dropout streams and MoE layer.
  TransformerLayer(const GPTConfig& cfg, const LayerSpec& spec, const std::string& prefix,
                   int64_t layer, uint64_t seed, const ModelParallel& mp);
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, const ForwardContext& ctx);
  // InternalError when nothing was saved.
  Tensor backward(const Tensor& dy);
  // Inference with a KV cache (generation; one rank, no dropout): x [n, H], the tokens at
  // positions first_position .. first_position + n - 1, -> [n, H]; the layer's keys and
  // values go to key_cache / value_cache (Mixer::forward_inference). Dense layers save
  // nothing; an MoE layer runs its evaluation forward (MoELayer::forward, training off),
  // which keeps that forward's routing in its saved state as GPTModel::logits does.
  Tensor forward_inference(const Tensor& x, int64_t first_position, Tensor& key_cache,
                           Tensor& value_cache);
  void collect_params(std::vector<Param*>& out);
  // The FP8 delayed recipe's state of this layer (checkpoints; Fp8LinearGemms::state):
  // experts false: its linear layers' (the mixer's, the dense MLP's or the shared
  // expert's), the same on every data-parallel rank; true: its routed experts' (this
  // expert-parallel rank's experts), the same on every expert-data-parallel rank. Empty
  // for a bf16 layer or another recipe.
  std::vector<std::pair<std::string, Tensor*>> fp8_state(bool experts);

  // The layer's Linear layers: the mixer's, then the dense MLP's or shared expert's.
  std::vector<Linear*> linears();
  const LayerSpec& spec() const { return spec_; }
  // The MoE layer of an MoE spec, else null.
  MoELayer* moe() const { return mlp ? mlp->moe() : nullptr; }

  struct Saved {
    ForwardContext ctx;   // keys the hidden-dropout masks
    float dropout_p = 0;  // hidden dropout of this forward
  };
  // The layer's saved state with its sub-layers' (the mixer's and the MLP's hold their
  // kind's Activations: SelfAttention::Activations, MLP::Activations,
  // MoELayer::Activations).
  struct Activations {
    Saved layer;
    Norm::Saved input_layernorm, pre_mlp_layernorm;
    std::any mixer, mlp;
  };
  Activations take_saved();
  void restore_saved(Activations&& saved);
  // Calls fn on each tensor slot of what the last forward saved for this layer's
  // backward (its norms', mixer's, MLP's; defined or not), in a fixed
  // order for a given forward, so activation offloading (model/activation_offload.h) can
  // take the tensors out (assigning Tensor()) and put them back slot by slot. fn may
  // replace a slot's tensor, not the structure around it. MoE aux losses are not visited
  // (MoELayer::for_each_saved_tensor).
  void for_each_saved_tensor(const std::function<void(Tensor&)>& fn);
  // Drops what the last forward saved, but an MoE layer's routing, aux loss and token
  // counts (MoELayer::keep_routing): after each forward of a full-recompute group (backward
  // then needs forward(x, ..., ctx with recompute) on the same input first) and of a
  // forward-only pass (ForwardContext::forward_only).
  void discard_saved();

  // Null when the spec's kind is None.
  std::unique_ptr<Norm> input_layernorm;  // "decoder.layers.<i>.input_layernorm" (Mamba: ".norm")
  std::unique_ptr<Mixer> mixer;  // params under "decoder.layers.<i>.self_attention." (".mixer.")
  std::unique_ptr<Norm> pre_mlp_layernorm;
  std::unique_ptr<MlpBlock> mlp;  // params under "decoder.layers.<i>.mlp."

 private:
  // branch = residual + dropout(branch + bias) for branch `site` (1: attention, 2: MLP)
  // with its hidden dropout (ops::bias_dropout_add, one pass; a plain add_ without bias or
  // dropout). bias: the branch's output bias (its Linear skips adding it) or undefined.
  void residual_add(Tensor& branch, const Tensor& bias, const Tensor& residual, int site) const;
  // The gradient through branch `site`'s dropout; identity when p == 0.
  Tensor dropout_grad(const Tensor& dy, int site) const;

  const GPTConfig& cfg_;
  LayerSpec spec_;
  ModelParallel mp_;
  int64_t layer_;
  Saved saved_;
};

// Loss of one micro-batch: per-token losses and the router losses of this forward.
struct MicroBatchLoss {
  Tensor losses;  // [B*S] cross entropy per token (fp32)
  // Multi-token prediction (model/mtp.h): [mtp_num_layers] fp32 on the model's device, depth
  // k's masked mean cross entropy (sum_t mask_k CE_k) / max(N_k, 1) of this micro-batch,
  // unscaled; undefined without MTP or off the last pipeline stage.
  Tensor mtp_losses;
  // The sum over MoE layers of the aux loss (with its coefficient): [1] fp32 on the
  // model's device, written by the routers' kernels (no host synchronization); undefined
  // without MoE layers.
  Tensor aux_losses;
  // aux_losses read to the host, 0 when undefined (on the GPU a host synchronization).
  double aux_loss() const;
};

// The part of the model a GPTModel holds: all of it (the default), or one model chunk of
// a pipeline (Megatron's pre_process / post_process and transformer layer offset).
// Layers keep their global numbers, so parameter names and initial values are the
// one-rank model's whatever the split.
struct PipelineChunk {
  int64_t first_layer = 0;   // global index of the chunk's first transformer layer
  int64_t num_layers = -1;   // transformer layers in the chunk; -1: all of GPTConfig's
  bool pre_process = true;   // the first chunk of the pipeline: holds the embedding
  bool post_process = true;  // the last chunk: final norm, output layer and loss
};

// One micro-batch's input to a model chunk (GPTModel::forward_chunk).
struct ChunkInput {
  int64_t batch = 0, seq = 0;  // micro-batch size B and sequence length S
  Tensor tokens;               // [B, S] int32, host or device: read by pre_process chunks only
  Tensor labels;               // [B, S] int32, host or device: read by post_process chunks only
  // The previous chunk's output (chunks without pre_process): [T, H] in the compute dtype
  // on the model's device, T = B*S, or B*S / tp rows under sequence parallelism.
  Tensor hidden;
  // The loss mask [B*S] fp32 (host or device; --eod-mask-loss), read by a post_process
  // chunk's multi-token prediction only (its shifted masks); undefined: every token counts.
  Tensor loss_mask;
};

// One micro-batch's output of a model chunk.
struct ChunkOutput {
  Tensor hidden;        // [T, H] like ChunkInput::hidden, for the next chunk; undefined
                        // for a post_process chunk
  MicroBatchLoss loss;  // losses: post_process chunks only (else undefined); aux_losses:
                        // the sum over this chunk's MoE layers
};

// Callbacks a trainer sets on a model chunk so the data-parallel communication can overlap
// compute (Megatron's DistributedDataParallel forward pre-hooks and gradient hooks).
// Called with the params of one unit (the embedding, one transformer layer, the final
// norm and output layer) in the order the forward or backward reaches them.
struct ParamHooks {
  // Before a forward reads the weights of these params.
  std::function<void(std::span<Param* const>)> before_forward;
  // After a backward has finished these params' gradients for the current micro-batch.
  std::function<void(std::span<Param* const>)> after_backward;
  // FSDP (optional): after a forward no longer reads these weights (not called for the
  // final norm and output layer, whose backward follows), and before a backward (or the
  // forward it recomputes) reads them and accumulates their gradients.
  std::function<void(std::span<Param* const>)> after_forward;
  std::function<void(std::span<Param* const>)> before_backward;
};

// Megatron-FSDP's storage of a chunk's buffers (ParamAndGradBuffer's BufferSharding).
// Under --use-megatron-fsdp (any strategy) a bucket holds one unit's params (the embedding, a
// transformer layer, the final norm with the output layer and MTP depths).
struct ChunkSharding {
  bool use_megatron_fsdp = false;  // a bucket per unit (no_shard too)
  ShardingStrategy strategy = ShardingStrategy::NoShard;
  int64_t dense_index = 0, expert_index = 0;  // this rank in the dp_cp / edp group
  DType main_grad_dtype = DType::F32;  // own gradient shards (--megatron-fsdp-main-grads-dtype)
  DType grad_comm_dtype = DType::F32;  // bucket gradients (--megatron-fsdp-grad-comm-dtype)
  bool double_buffer = false;          // --fsdp-double-buffer (BufferSharding::double_buffer)
  // Muon under --use-distributed-optimizer (Megatron's layer-wise distributed optimizer):
  // when the buffers are sharded, the params Muon takes (muon_param) go to buffers of their
  // own laid out whole (BufferLayout::WholeParams), so each data-parallel rank owns whole
  // matrices.
  bool layer_wise = false;
};

class ChunkActivations;
class InferenceContext;
struct MultiTokenPredictionLayer;

// The GPT model (Megatron's GPTModel), whole or one pipeline model chunk. Parameter
// names match Megatron core's local spec ("embedding.word_embeddings.weight",
// "decoder.layers.0....", "decoder.final_layernorm.weight", "output_layer.weight").
class GPTModel {
 public:
  // cfg must be finalize()d. seed keys every initial weight (Philox, by parameter name).
  // dense_shards / expert_shards: the shard count of the dense and expert
  // ParamAndGradBuffers (the data-parallel and expert-data-parallel sizes under the
  // distributed optimizer, else 1).
  // mp: the parallel layout (default: one rank).
  // chunk: the layers and ends of the model this object holds (default: all). With tied
  // embeddings (no untie_embeddings_and_output_weights), a post_process chunk without
  // pre_process keeps its own copy of "embedding.word_embeddings.weight" (same name, same
  // initial values) for the output layer, marked Param::shared: its gradient must be
  // summed with the first chunk's (Megatron's _allreduce_word_embedding_grads).
  // bucket_size: elements per gradient bucket (ParamAndGradBuffer; <= 0: one bucket per
  // buffer). With dense_shards > 1 the word embeddings tied across pipeline stages get a
  // bucket of their own (see ParamAndGradBuffer).
  // InternalError when the layer range is outside [0, num_layers).
  // sharding (FSDP): how the buffers store their shards, and one bucket per unit (then
  // bucket_size is not used).
  // buffers(): the dense buffer, then (when they have params) the dense FP8, expert and
  // expert FP8 ones; with sharding.layer_wise and dense_shards or expert_shards above 1, the
  // muon_param params are in none of those but in a dense Muon buffer (dense_shards shards,
  // over dp_cp) and an expert one (expert_shards, over edp), WholeParams, after the others
  // (each only when it has params). No param is in two buffers. InternalError when a Muon
  // param is an FP8 weight or FSDP is on (WholeParams refuses both).
  GPTModel(const GPTConfig& cfg, uint64_t seed, const ModelParallel& mp = {},
           int64_t dense_shards = 1, int64_t expert_shards = 1, const PipelineChunk& chunk = {},
           int64_t bucket_size = 0, const ChunkSharding& sharding = {});
  ~GPTModel();
  void set_param_hooks(ParamHooks hooks) { hooks_ = std::move(hooks); }
  const ModelParallel& model_parallel() const { return mp_; }
  const PipelineChunk& chunk() const { return chunk_; }

  // One micro-batch through this chunk, saving what backward_chunk needs in the chunk and
  // its layers (replacing what they held): all of it, or what GPTConfig::recompute keeps
  // (docs/memory.md). With GPTConfig::cpu_offloading a training forward (not
  // forward_only, not a recompute) moves the saved state of the chunk's first
  // cpu_offloading.num_layers layers to host memory (model/activation_offload.h), and
  // backward_chunk brings it back. InternalError when an input the chunk reads is missing or
  // misshapen.
  ChunkOutput forward_chunk(const ChunkInput& in, const ForwardContext& ctx);
  // Backward of the micro-batch the chunk holds (the last forward_chunk, or the one
  // restore_activations put back), which it then no longer holds. dout: for a
  // post_process chunk d(total loss)/d(per-token loss) [B*S] fp32 (host or device);
  // otherwise the gradient of the chunk's output [T, H] (as ChunkOutput::hidden).
  // aux_grad_scale scales the injected MoE aux-loss gradient (1 / number of
  // micro-batches). Under recomputation it first runs again the forwards whose state was
  // not kept (with their collectives: every rank of the layout does the same).
  // Accumulates main_grads. Returns the gradient of ChunkInput::hidden
  // [T, H], undefined for a pre_process chunk. InternalError when the chunk holds no
  // micro-batch.
  Tensor backward_chunk(const Tensor& dout, float aux_grad_scale);
  // Several micro-batches in flight (the pipeline schedules' stashes; Megatron keeps each
  // in-flight micro-batch's autograd graph alive until its backward the same way):
  // take_activations moves everything the held forward saved for its backward, in this
  // chunk and all its layers (activations, dropout keys, MoE routing, token counts and
  // aux loss), out into a ChunkActivations, leaving the chunk holding no micro-batch.
  // Tensors are moved as views: nothing is copied, and the memory stays allocated while
  // the ChunkActivations lives (layers offloaded by --cpu-offloading are brought back
  // first). restore_activations moves it back (leaving `activations`
  // empty), so backward_chunk runs that micro-batch's backward, bit for bit as if no
  // other forward had run in between. take_activations: InternalError when the chunk
  // holds no micro-batch. restore_activations: InternalError when the chunk holds one
  // (its state would be lost) or `activations` is empty or was taken from another chunk.
  ChunkActivations take_activations();
  void restore_activations(ChunkActivations&& activations);
  // Whether the chunk holds a forward's saved state (forward_chunk or restore_activations
  // since the last backward_chunk or take_activations).
  bool holds_activations() const { return saved_.batch > 0; }
  // Rows of the hidden state passed between chunks for a [batch, seq] micro-batch: B*S,
  // divided by the tensor-parallel size under sequence parallelism.
  int64_t hidden_rows(int64_t batch, int64_t seq) const;
  // The word embeddings of this chunk (pre_process, or the tied copy of a post_process
  // chunk), null when it has none.
  Param* word_embeddings_param() {
    return word_embeddings.weight.defined() ? &word_embeddings : nullptr;
  }

  // Whole model only (pre_process and post_process; InternalError otherwise):
  // tokens, labels [B, S] int32 -> per-token losses. Saves activations for backward.
  MicroBatchLoss forward(const Tensor& tokens, const Tensor& labels, const ForwardContext& ctx);
  // Logits [B*S, padded_vocab] (fp32, on the host) for tokens [B, S] (no labels; used by
  // generation and tests). Whole model only.
  Tensor logits(const Tensor& tokens);
  // Generation with a KV cache (model/kv_cache.h; Megatron's inference path with an
  // inference context). Whole model on one rank (tp = pp = ep = 1), no dropout; the
  // training state (saved activations, gradients) is not touched, except that MoE layers
  // keep their last evaluation forward (TransformerLayer::forward_inference).
  // prefill: empties `context`, runs tokens [n] (host ids in [0, padded_vocab)) at
  // positions 0 .. n - 1 in one forward, recording every layer's keys and values, and
  // returns the logits of the last token [padded_vocab] (fp32, host).
  // decode_step: runs one token at position context.sequence_len_offset against the
  // cached keys and values, appends its own, and returns its logits likewise.
  // Both advance context.sequence_len_offset by the tokens run. InternalError when the
  // model is a pipeline chunk or tensor-parallel, `context` was not made for this model's
  // config, tokens is empty, or the tokens do not fit the cache (prefill: n >
  // max_sequence_length; decode_step: the cache is full). The caller keeps positions within
  // max_inference_positions(config()) (model/kv_cache.h).
  Tensor prefill(std::span<const int32_t> tokens, InferenceContext& context);
  Tensor decode_step(int32_t token, InferenceContext& context);
  // dlosses [B*S]: d(total loss)/d(per-token loss). aux_grad_scale scales the injected
  // MoE aux-loss gradient (1 / number of micro-batches). Accumulates main_grads.
  // Whole model only.
  void backward(const Tensor& dlosses, float aux_grad_scale);

  // Zeroes every main_grad (one memset per buffer: they are views into the buffers).
  void zero_grad() {
    for (ParamAndGradBuffer& b : buffers_) b.zero_grads();
  }
  // The units the hooks are called with, in forward order: the embedding (pre_process),
  // each layer, then the final norm with the output weights the forward reads
  // (post_process). FSDP gathers and prefetches by unit.
  std::vector<std::span<Param* const>> param_units() const;
  // The dense parameters' buffer, then the experts' (MoE models only).
  std::vector<ParamAndGradBuffer>& buffers() { return buffers_; }

  // Every parameter of this chunk, in a fixed order (embedding, layers, final norm,
  // output layer).
  const std::vector<Param*>& params() const { return params_; }
  const GPTConfig& config() const { return cfg_; }
  int64_t num_parameters() const;
  std::vector<std::unique_ptr<TransformerLayer>>& layers() { return layers_; }
  // The decoder layers, then the MTP depths' transformer layers (post_process chunks with
  // --mtp-num-layers): every layer with routers, FP8 state or saved activations.
  std::vector<TransformerLayer*> all_layers();
  // The MTP depths (post_process chunks only; empty otherwise).
  std::vector<std::unique_ptr<MultiTokenPredictionLayer>>& mtp_layers() { return mtp_; }
  // The activation offload of --cpu-offloading (null without).
  const ActivationOffload* activation_offload() const { return offload_.get(); }

 private:
  // Embedding lookup (+ positions, dropout) of tokens [B, S] -> [T, H]; sets tokens_.
  Tensor embed(const Tensor& tokens, const ForwardContext& ctx);
  // embed, the layers and the final norm (whole model).
  Tensor forward_hidden(const Tensor& tokens, const ForwardContext& ctx);
  // prefill / decode_step: tokens at positions context.sequence_len_offset onwards ->
  // logits of the last one.
  Tensor forward_inference(std::span<const int32_t> tokens, InferenceContext& context);
  // fn(local_row, position, n) for each run of n rows of this rank's local_rows token
  // rows whose positions are consecutive (learned position embeddings, SP-aware).
  void for_each_position_block(int64_t local_rows,
                               const std::function<void(int64_t, int64_t, int64_t)>& fn) const;
  void before_forward(std::span<Param* const> params) const {
    if (hooks_.before_forward && !params.empty()) hooks_.before_forward(params);
  }
  void after_backward(std::span<Param* const> params) const {
    if (hooks_.after_backward && !params.empty()) hooks_.after_backward(params);
  }
  void after_forward(std::span<Param* const> params) const {
    if (hooks_.after_forward && !params.empty()) hooks_.after_forward(params);
  }
  void before_backward(std::span<Param* const> params) const {
    if (hooks_.before_backward && !params.empty()) hooks_.before_backward(params);
  }
  // What the output layer and its cross entropy keep for backward.
  struct OutputLossSaved {
    Tensor final_hidden;  // the output layer's input [B*S, H] (gathered under SP)
    Tensor logits;        // [B*S, V / tp]; becomes dlogits in backward
    Tensor labels;        // [B*S] int32 on the model's device
    Tensor lse;           // log-sum-exp of the logits [B*S] fp32
  };
  // Output layer and cross entropy of a final-normed hidden state (this rank's rows) against
  // labels [B*S] (host or device) -> per-token losses [B*S] fp32 (post_process).
  Tensor output_loss(const Tensor& hidden, const Tensor& labels, OutputLossSaved& s);
  // Backward of output_loss: dlosses [B*S] -> d hidden (this rank's rows).
  Tensor output_loss_backward(const Tensor& dlosses, OutputLossSaved& s);
  // The word-embedding lookup of tokens [B*S] (device) -> [T, H] (this rank's rows under
  // SP), and its backward into the word embeddings' main_grad (demb: this rank's rows).
  Tensor embedding_lookup(const Tensor& tokens);
  void embedding_lookup_backward(const Tensor& demb, const Tensor& tokens);
  // Multi-token prediction (model/gpt_mtp.cpp): the depths after the main loss, from the
  // final-normed decoder output h0; fills out.mtp_losses and saved_.mtp.
  void mtp_forward(const Tensor& h0, const ChunkInput& in, const ForwardContext& ctx,
                   MicroBatchLoss& out);
  // Their backward: accumulates the depths' main_grads and returns d h0 (this rank's rows).
  Tensor mtp_backward(float aux_grad_scale);
  // Backward of embed: accumulates the embedding main_grads (pre_process).
  void embed_backward(const Tensor& dx);

  GPTConfig cfg_;
  ModelParallel mp_;
  PipelineChunk chunk_;
  Param word_embeddings;
  Param position_embeddings;  // learned_absolute only
  std::vector<std::unique_ptr<TransformerLayer>> layers_;
  Norm final_layernorm;
  Param output_layer;  // untied only
  std::vector<Param*> params_;
  // Weights and main_grads, contiguous (Megatron's param and grad buffers).
  std::vector<ParamAndGradBuffer> buffers_;
  // The params of each unit, for the hooks: the embedding (pre_process), each layer, the
  // final norm with the output weights read by the forward (tail_forward_) and those
  // whose gradient is complete after the output layer's backward (tail_grads_: not the
  // word embeddings of a whole model, which the embedding's backward adds to).
  ParamHooks hooks_;
  std::vector<Param*> head_params_, tail_forward_, tail_grads_;
  std::vector<std::vector<Param*>> layer_params_;
  // Multi-token prediction depths (post_process with --mtp-num-layers) and their params.
  std::vector<std::unique_ptr<MultiTokenPredictionLayer>> mtp_;
  std::vector<Param*> mtp_params_;

  int64_t vocab_start_ = 0;  // first vocabulary row of this tensor-parallel rank

  // What the chunk's forward saved for backward, outside its layers.
  friend class ChunkActivations;
  struct Saved {
    int64_t batch = 0, seq = 0;  // the micro-batch's B and S (0: none held)
    Tensor tokens;               // [B*S] int32 on the model's device (pre_process)
    // This rank's rows' learned-position ids under --reset-position-ids ([rows] int32 on the
    // device); undefined: row i is position i % seq.
    Tensor position_ids;
    OutputLossSaved output;  // the main loss (post_process)
    // Per MTP depth: its output loss, shifted tokens and mask (device) and count,
    // and its embedding dropout key.
    struct MtpDepth {
      OutputLossSaved output;
      Tensor tokens, mask;
      double num_tokens = 0;
      float weight = 0;  // d objective / d per-token loss, before the trainer's scale
      float emb_dropout_p = 0;
      uint64_t emb_stream = 0;
    };
    std::vector<MtpDepth> mtp;
    float emb_dropout_p = 0;  // embedding dropout of this forward
    uint64_t emb_seed = 0;    // its mask's Philox key
    uint64_t emb_stream = 0;  // and stream
    // Full recompute (GPTConfig::recompute): the forward's context, and per layer of the
    // chunk the input of each recompute group's first layer (undefined elsewhere; empty
    // when no layer was recomputed).
    ForwardContext ctx;
    std::vector<Tensor> recompute_inputs;
  };
  Saved saved_;
  // --cpu-offloading: the first layers' saved state on the host between their training
  // forward and backward (null without).
  std::unique_ptr<ActivationOffload> offload_;
};

// One micro-batch's saved state of a model chunk, moved out by
// GPTModel::take_activations and back by restore_activations (see there). Move-only:
// restoring it twice would run a backward twice.
class ChunkActivations {
 public:
  ChunkActivations() = default;
  ChunkActivations(ChunkActivations&& other) noexcept { *this = std::move(other); }
  ChunkActivations& operator=(ChunkActivations&& other) noexcept {
    owner_ = std::exchange(other.owner_, nullptr);
    model_ = std::exchange(other.model_, {});
    final_layernorm_ = std::exchange(other.final_layernorm_, {});
    layers_ = std::exchange(other.layers_, {});
    mtp_ = std::exchange(other.mtp_, {});
    return *this;
  }
  ChunkActivations(const ChunkActivations&) = delete;
  ChunkActivations& operator=(const ChunkActivations&) = delete;
  // True when it holds no micro-batch (default-constructed, restored or moved from).
  bool empty() const { return owner_ == nullptr; }

 private:
  friend class GPTModel;
  const GPTModel* owner_ = nullptr;  // the chunk it was taken from
  GPTModel::Saved model_;
  Norm::Saved final_layernorm_;
  std::vector<TransformerLayer::Activations> layers_;
  // Per MTP depth: enorm, hnorm, final_layernorm, eh_proj and its transformer layer.
  struct MtpActivations {
    Norm::Saved enorm, hnorm, final_layernorm;
    Linear::Saved eh_proj;
    TransformerLayer::Activations layer;
  };
  std::vector<MtpActivations> mtp_;
};

}  // namespace megaton
