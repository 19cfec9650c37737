// Multi-token prediction (model/mtp.h): the depths' modules and GPTModel's forward and
// backward through them on the last pipeline stage.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "model/gpt.h"
#include "model/layer_spec.h"
#include "model/mtp.h"
#include "ops/mla.h"
#include "ops/ops.h"

namespace megaton {

namespace {
std::string depth_prefix(int64_t depth) { return "mtp.layers." + std::to_string(depth); }
bool partial_over_tp(const ModelParallel& mp) { return mp.sequence_parallel && mp.tp_size() > 1; }
}  // namespace

MultiTokenPredictionLayer::MultiTokenPredictionLayer(const GPTConfig& cfg, int64_t depth,
                                                     uint64_t seed, const ModelParallel& mp)
    : enorm(depth_prefix(depth) + ".enorm", cfg.hidden_size, cfg.normalization, cfg.norm_epsilon,
            Placement::of(cfg), partial_over_tp(mp)),
      hnorm(depth_prefix(depth) + ".hnorm", cfg.hidden_size, cfg.normalization, cfg.norm_epsilon,
            Placement::of(cfg), partial_over_tp(mp)),
      eh_proj(depth_prefix(depth) + ".eh_proj", 2 * cfg.hidden_size, cfg.hidden_size, false,
              cfg.init_method_std, seed, Placement::of(cfg), TensorParallelMode::None, mp),
      // The decoder's last layer's spec (Megatron: decoder_layer_specs[-1]); its layer
      // number follows the decoder's for dropout streams and MoE bookkeeping.
      transformer_layer(std::make_unique<TransformerLayer>(
          cfg, decoder_layer_spec(cfg, cfg.num_layers - 1),
          depth_prefix(depth) + ".transformer_layer", cfg.num_layers + depth, seed, mp)),
      final_layernorm(depth_prefix(depth) + ".final_layernorm", cfg.hidden_size, cfg.normalization,
                      cfg.norm_epsilon, Placement::of(cfg), partial_over_tp(mp)) {
  eh_proj.weight.sequence_parallel = partial_over_tp(mp);
}

void MultiTokenPredictionLayer::collect_params(std::vector<Param*>& out) {
  enorm.collect_params(out);
  hnorm.collect_params(out);
  eh_proj.collect_params(out);
  transformer_layer->collect_params(out);
  final_layernorm.collect_params(out);
}

MtpShifted mtp_shift(const Tensor& labels, const Tensor& loss_mask, int64_t batch, int64_t seq,
                     int64_t k, const std::vector<int32_t>* cu_seqlens) {
  MEGATON_CHECK(labels.numel() == batch * seq && labels.dtype() == DType::I32 &&
                    labels.device() == Device::CPU,
                "mtp_shift: labels must be host int32 [{} x {}]", batch, seq);
  MEGATON_CHECK(!loss_mask.defined() ||
                    (loss_mask.numel() == batch * seq && loss_mask.dtype() == DType::F32 &&
                     loss_mask.device() == Device::CPU),
                "mtp_shift: the loss mask must be host fp32 [{} x {}]", batch, seq);
  MEGATON_CHECK(k >= 1, "mtp_shift: depth {} must be >= 1", k);
  const int64_t T = batch * seq;
  // Every row's segment end: its sample's, or its document's.
  std::vector<int64_t> segment_end(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) segment_end[size_t(t)] = (t / seq + 1) * seq;
  if (cu_seqlens && !cu_seqlens->empty()) {
    const std::vector<int32_t>& cu = *cu_seqlens;
    MEGATON_CHECK(cu.front() == 0 && cu.back() == T,
                  "mtp_shift: document boundaries must run "
                  "from 0 to {}, got {} .. {}",
                  T, cu.front(), cu.back());
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      MEGATON_CHECK(cu[n] < cu[n + 1], "mtp_shift: document boundaries {} and {} not increasing",
                    cu[n], cu[n + 1]);
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t)
        segment_end[size_t(t)] = std::min<int64_t>(segment_end[size_t(t)], cu[n + 1]);
    }
  }
  MtpShifted out;
  out.tokens = Tensor::zeros({T}, DType::I32);
  out.labels = Tensor::zeros({T}, DType::I32);
  out.mask = Tensor::zeros({T});
  const int32_t* l = labels.i32();
  for (int64_t row = 0; row < T; ++row) {
    const int64_t src = row + k;
    if (src >= segment_end[size_t(row)]) continue;
    out.tokens.i32()[row] = l[src - 1];
    out.labels.i32()[row] = l[src];
    out.mask.f32()[row] = loss_mask.defined() ? loss_mask.f32()[src] : 1.0f;
    out.num_tokens += out.mask.f32()[row];
  }
  return out;
}

MtpShifted mtp_shift_rows(const Tensor& labels, const Tensor& loss_mask, int64_t batch, int64_t seq,
                          int64_t k, const std::vector<int64_t>& positions,
                          const std::vector<int32_t>* document_starts) {
  MEGATON_CHECK(!document_starts || int64_t(document_starts->size()) == batch * seq,
                "mtp_shift_rows: {} document starts for {} x {} tokens",
                document_starts ? document_starts->size() : 0, batch, seq);
  // The documents' boundaries over the whole rows (every sample end among them).
  std::vector<int32_t> cu{0};
  for (int64_t t = 1; t <= batch * seq; ++t)
    if (t % seq == 0 || (document_starts && (*document_starts)[size_t(t)] == int32_t(t % seq)))
      cu.push_back(int32_t(t));
  const MtpShifted whole = mtp_shift(labels, loss_mask, batch, seq, k, &cu);
  const int64_t L = int64_t(positions.size());
  MtpShifted out;
  out.tokens = Tensor::empty({batch * L}, DType::I32);
  out.labels = Tensor::empty({batch * L}, DType::I32);
  out.mask = Tensor::empty({batch * L});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < L; ++i) {
      MEGATON_CHECK(positions[size_t(i)] >= 0 && positions[size_t(i)] < seq,
                    "mtp_shift_rows: position {} outside a sequence of {}", positions[size_t(i)],
                    seq);
      const int64_t src = b * seq + positions[size_t(i)], dst = b * L + i;
      out.tokens.i32()[dst] = whole.tokens.i32()[src];
      out.labels.i32()[dst] = whole.labels.i32()[src];
      out.mask.f32()[dst] = whole.mask.f32()[src];
      out.num_tokens += whole.mask.f32()[src];
    }
  return out;
}

namespace {

// Context parallelism: the whole samples [B, S] (S = cp x the local rows) of a local
// [B, L] tensor in the CP split's order (cp_split_sequence), gathered over the CP group (on
// `device`, the model's) to the host.
Tensor whole_samples(const Tensor& local, int64_t B, int64_t L, const CpAttention& cp,
                     Device device) {
  const int N = cp.group->size();
  // (The pipeline's loader hands the last stage host labels and masks; the Comm is the
  // model's device's.)
  Tensor rows = (local.device() == device ? local : local.to(device)).view({B, L});
  Tensor gathered = Tensor::empty({int64_t(N), B, L}, local.dtype(), local.device());
  cp.comm->all_gather(rows, gathered, *cp.group);
  const Tensor host = gathered.to(Device::CPU);
  const int64_t S = L * N;
  Tensor out = Tensor::empty({B, S}, local.dtype());
  const size_t es = dtype_size(local.dtype());
  for (int m = 0; m < N; ++m) {
    const std::vector<int64_t> positions = cp_local_positions(S, N, m);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < L; ++i)
        std::memcpy(static_cast<char*>(out.raw()) + size_t(b * S + positions[size_t(i)]) * es,
                    static_cast<const char*>(host.raw()) + size_t((m * B + b) * L + i) * es, es);
  }
  return out;
}

}  // namespace

void GPTModel::mtp_forward(const Tensor& h0, const ChunkInput& in, const ForwardContext& ctx,
                           MicroBatchLoss& out) {
  const int64_t B = in.batch, S = in.seq, T = B * S, D = int64_t(mtp_.size());
  const Tensor labels = in.labels.to(Device::CPU).view({T});
  const Tensor mask = in.loss_mask.defined() ? in.loss_mask.to(Device::CPU).view({T}) : Tensor();
  // Context parallelism: the shift reaches into other ranks' chunks, so each depth shifts
  // the whole samples (gathered) and keeps this rank's rows. N_k is the whole micro-batch's
  // (the one-rank run's; Megatron's local count differs between CP ranks): the gradient
  // weight divides by it (the trainer's aux_grad_scale carries cp against the average over
  // CP), the logged loss by N_k / cp (the logged values are averaged over CP).
  const CpAttention* cp = ctx.packed_seq_params && ctx.packed_seq_params->has_context_parallel()
                              ? &ctx.packed_seq_params->context_parallel
                              : nullptr;
  Tensor whole_labels, whole_mask;
  std::vector<int64_t> positions;
  if (cp) {
    const int N = cp->group->size();
    whole_labels = whole_samples(in.labels, B, S, *cp, cfg_.device);
    if (in.loss_mask.defined()) whole_mask = whole_samples(in.loss_mask, B, S, *cp, cfg_.device);
    positions = cp_local_positions(S * N, N, cp->group->rank);
  }
  // Megatron's per-token mode weighs depth k by N_0 / N_k (N_0: the main loss's tokens).
  double n0 = double(T);
  if (mask.defined()) {
    n0 = 0;
    for (int64_t t = 0; t < T; ++t) n0 += mask.f32()[t];
  }
  // Packed documents: each depth shifts within its document (Megatron's packed roll).
  const std::vector<int32_t>* documents =
      ctx.packed_seq_params ? &ctx.packed_seq_params->cu_seqlens_host : nullptr;
  out.mtp_losses = Tensor::zeros({D}, DType::F32, cfg_.device);
  saved_.mtp.assign(size_t(D), {});
  Tensor h = h0;
  for (int64_t k = 1; k <= D; ++k) {
    MultiTokenPredictionLayer& d = *mtp_[size_t(k - 1)];
    Saved::MtpDepth& sd = saved_.mtp[size_t(k - 1)];
    MtpShifted shifted;
    double log_tokens = 0;  // the logged loss's divisor
    if (cp) {
      const int64_t N = cp->group->size();
      const std::vector<int32_t>* starts = cp->document_starts.get();
      shifted = mtp_shift_rows(whole_labels.view({B * S * N}),
                               whole_mask.defined() ? whole_mask.view({B * S * N}) : Tensor(), B,
                               S * N, k, positions, starts);
      std::vector<int64_t> all(size_t(S * N));
      for (int64_t p = 0; p < S * N; ++p) all[size_t(p)] = p;
      const double whole_tokens =
          mtp_shift_rows(whole_labels.view({B * S * N}),
                         whole_mask.defined() ? whole_mask.view({B * S * N}) : Tensor(), B, S * N,
                         k, all, starts)
              .num_tokens;
      sd.num_tokens = whole_tokens;
      log_tokens = whole_tokens / double(N);
    } else {
      shifted = mtp_shift(labels, mask, B, S, k, documents);
      sd.num_tokens = log_tokens = shifted.num_tokens;
    }
    sd.tokens = shifted.tokens.to(cfg_.device);
    sd.mask = shifted.mask.to(cfg_.device);  // read by the loss below and by backward
    // The shifted tokens' embeddings, with the embedding's dropout (its own stream).
    Tensor e = embedding_lookup(sd.tokens);
    sd.emb_dropout_p = ctx.training ? cfg_.hidden_dropout : 0.0f;
    sd.emb_stream = ctx.stream(cfg_.num_layers + k - 1, 7);
    if (sd.emb_dropout_p > 0) {
      Tensor dropped = empty_like(e, e.shape());
      ops::dropout_forward(e, dropped, sd.emb_dropout_p, ctx.seed, sd.emb_stream);
      e = dropped;
    }
    const Tensor en = d.enorm.forward(e), hn = d.hnorm.forward(h);
    Tensor cat = empty_like(en, {en.dim(0), 2 * cfg_.hidden_size});
    ops::concat_columns({en, hn}, cat);
    const Tensor x = d.eh_proj.forward(cat);
    const Tensor y = d.transformer_layer->forward(x, B, S, ctx);
    if (MoELayer* moe = d.transformer_layer->moe()) {
      if (!out.aux_losses.defined()) out.aux_losses = Tensor::zeros({1}, DType::F32, cfg_.device);
      ops::add_(out.aux_losses, moe->last_aux_loss_tensor());
    }
    h = d.final_layernorm.forward(y);
    const Tensor losses = output_loss(h, shifted.labels, sd.output);
    // "mtp_k loss": the masked mean, on the device.
    Tensor slot = out.mtp_losses.rows(k - 1, 1);
    ops::dot(losses, sd.mask, slot);
    ops::scale_(slot, float(1.0 / std::max(log_tokens, 1.0)));
    // The objective's weight of this depth's per-token losses (Megatron's process_mtp_loss:
    // scale / N_k, times N_0 / (B S) under per-token loss, where the gradient scale the
    // trainer passes carries B S).
    sd.weight =
        float(double(cfg_.mtp_loss_scaling_factor) / double(D) / std::max(sd.num_tokens, 1.0) *
              (cfg_.calculate_per_token_loss ? n0 / double(T) : 1.0));
  }
}

Tensor GPTModel::mtp_backward(float aux_grad_scale) {
  Tensor dh_next;  // d h_k from depth k + 1's hnorm
  for (int64_t k = int64_t(mtp_.size()); k >= 1; --k) {
    MultiTokenPredictionLayer& d = *mtp_[size_t(k - 1)];
    Saved::MtpDepth& sd = saved_.mtp[size_t(k - 1)];
    Tensor dlosses = sd.mask.clone();
    ops::scale_(dlosses, float(double(aux_grad_scale) * double(sd.weight)));
    Tensor dh = output_loss_backward(dlosses, sd.output);
    if (dh_next.defined()) ops::add_(dh, dh_next);
    const Tensor dy = d.final_layernorm.backward(dh);
    if (MoELayer* moe = d.transformer_layer->moe()) moe->aux_grad_scale = aux_grad_scale;
    const Tensor dx = d.transformer_layer->backward(dy);
    const Tensor dcat = d.eh_proj.backward(dx);
    std::vector<Tensor> parts{empty_like(dcat, {dcat.dim(0), cfg_.hidden_size}),
                              empty_like(dcat, {dcat.dim(0), cfg_.hidden_size})};
    ops::split_columns(dcat, parts);
    Tensor de = d.enorm.backward(parts[0]);
    if (sd.emb_dropout_p > 0) {
      Tensor g = empty_like(de, de.shape());
      ops::dropout_backward(de, g, sd.emb_dropout_p, saved_.ctx.seed, sd.emb_stream);
      de = g;
    }
    embedding_lookup_backward(de, sd.tokens);
    dh_next = d.hnorm.backward(parts[1]);
    sd = {};
  }
  saved_.mtp.clear();
  return dh_next;
}

}  // namespace megaton
