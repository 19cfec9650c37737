// Multi-token prediction (DeepSeek-V3; Megatron-LM's MultiTokenPredictionBlock in
// megatron/core/transformer/multi_token_prediction.py; docs/research/deepseek-v3.md
// section 3). Depth k = 1 .. D (--mtp-num-layers D) predicts token t + k + 1 from
//   x_k = eh_proj([enorm(embedding(token t + k)) | hnorm(h_{k-1}(t))])
//   h_k = final_layernorm(transformer_layer(x_k))
// with h_0 the decoder's output after its final norm, the word embeddings and the output
// layer shared with the main model, and the transformer layer of the decoder's last layer's
// spec (MoE when the last decoder layer is). Parameter names are Megatron's checkpoint names:
// mtp.layers.<k-1>.{enorm,hnorm,eh_proj,final_layernorm}.weight and
// mtp.layers.<k-1>.transformer_layer.* (Megatron's mtp_model_layer, saved under that name).
//
// The objective adds, per micro-batch, (mtp_loss_scaling_factor / D) x sum_k
// (sum_t mask_k(t) CE_k(t)) / N_k, where CE_k is the cross entropy of depth k's logits against
// labels shifted by k, mask_k(t) = loss_mask(t + k) (0 for the last k positions of a sample, or
// of a document under --reset-attention-mask)
// and N_k = sum_t mask_k(t); "mtp_k loss" logs (sum_t mask_k CE_k) / N_k unscaled, and "lm
// loss" does not include it (Megatron's process_mtp_loss and MTPLossLoggingHelper).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/gpt.h"

namespace megaton {

// One MTP depth's parameters and modules (Megatron's MultiTokenPredictionLayer).
struct MultiTokenPredictionLayer {
  // depth: 0-based (k - 1); decoder_layers: the model's num_layers (the depth's layer number
  // for dropout streams and MoE bookkeeping is decoder_layers + depth).
  MultiTokenPredictionLayer(const GPTConfig& cfg, int64_t depth, uint64_t seed,
                            const ModelParallel& mp);
  void collect_params(std::vector<Param*>& out);

  Norm enorm, hnorm;
  // [H, 2H], no bias. Replicated over TP (Megatron splits its rows and gathers the output:
  // the same numbers); under SP it runs on this rank's rows and its gradient is a partial
  // sum (Param::sequence_parallel).
  Linear eh_proj;
  std::unique_ptr<TransformerLayer> transformer_layer;
  Norm final_layernorm;
};

// The shifted inputs of MTP depth k (1-based) for a micro-batch of B samples of S tokens,
// from the micro-batch's labels (labels[s] = token s + 1) and loss mask (empty: all ones),
// host tensors [B, S] / [B * S]. Row t = b * S + s lies in a segment [start, end): its
// sample's rows, or, with packed documents (cu_seqlens: the N + 1 document boundaries over
// the B * S rows, PackedSeqParams::cu_seqlens_host; null or empty: none), its document's:
//   tokens_k[t] = labels[t + k - 1]   (the token at t + k)   for t + k < end, else 0
//   labels_k[t] = labels[t + k]                              for t + k < end, else 0
//   mask_k[t]   = loss_mask[t + k]                           for t + k < end, else 0
// (Megatron's roll_tensor with zero fill applied k times; with packed sequences its
// _roll_tensor_packed_seq, which rolls each document on its own.) num_tokens = sum of
// mask_k. InternalError on tensors of other shapes or devices, k < 1, or boundaries that
// do not run from 0 to B * S in increasing order.
struct MtpShifted {
  Tensor tokens, labels;  // [B * S] int32 (host)
  Tensor mask;            // [B * S] fp32 (host)
  double num_tokens = 0;
};
MtpShifted mtp_shift(const Tensor& labels, const Tensor& loss_mask, int64_t batch, int64_t seq,
                     int64_t k, const std::vector<int32_t>* cu_seqlens = nullptr);

// The same for the rows this context-parallel rank holds: labels and loss_mask are the
// WHOLE samples' ([B * S] host, S the whole sequence; the mask may be undefined),
// `positions` the global positions of the rank's rows of each sample (cp_local_positions),
// document_starts null or [B * S] (CpAttention::document_starts: each position's document
// start). Row i of sample b is position positions[i] of that sample; the result has B *
// positions.size() rows, each as mtp_shift gives it at that position; num_tokens counts the
// rank's rows. InternalError on sizes that do not fit.
MtpShifted mtp_shift_rows(const Tensor& labels, const Tensor& loss_mask, int64_t batch, int64_t seq,
                          int64_t k, const std::vector<int64_t>& positions,
                          const std::vector<int32_t>* document_starts);

}  // namespace megaton
