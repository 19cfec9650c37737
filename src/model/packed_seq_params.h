// PackedSeqParams: the documents packed into a micro-batch's samples (and the context-
// parallel split of its sequences), as the layers see them (Megatron-LM's PackedSeqParams with
// qkv_format "thd"; --reset-attention-mask and
// --reset-position-ids, docs/data.md "Packed sequences").
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/context_parallel.h"

namespace megaton {

// The micro-batch's B samples of S tokens are T = B * S token rows (row t = b * S + s, the
// order of the layers' activations); every sample boundary is a document boundary too.
struct PackedSeqParams {
  // --reset-attention-mask: the documents' boundaries over the T rows, I32 [N + 1] on the
  // model's device: 0 = c0 < c1 < ... < cN = T, document n = rows [c_n, c_n+1), each
  // ending at its eod token (or at its sample's end). A token attends to the tokens of its
  // own document at or before it only (ops::attention_varlen_forward). Undefined: causal
  // attention within each sample (the dense op).
  Tensor cu_seqlens;
  // The same boundaries on the host (N + 1 values), for the host-side work that follows the
  // documents (the MTP depths' per-document shift, model/mtp.h). Empty when cu_seqlens is.
  std::vector<int32_t> cu_seqlens_host;
  // The longest document (rows), >= 1 when cu_seqlens is defined; at most S.
  int64_t max_seqlen = 0;
  // --reset-position-ids: each row's position (RoPE's, or the learned position embedding's
  // row), I32 [T] on the model's device,
  // restarting at 0 after each eod. Undefined: row t's position is s = t % S.
  Tensor position_ids;
  // With cu_seqlens and document_positions requested (a hybrid model's Mamba layers, whose
  // convolution and scan restart at each document): each row's position within its
  // document, I32 [T] on the model's device; position_ids itself when those restart too
  // (--reset-position-ids: the same values). Undefined otherwise.
  Tensor document_positions;
  // Context parallelism (--context-parallel-size > 1): the group and comm type the core
  // attention reaches across (model/context_parallel.h); the micro-batch's rows are this
  // rank's two chunks of each sample and position_ids their global positions (Megatron's
  // PackedSeqParams likewise carries the CP group for hybrid CP). comm null: no CP.
  CpAttention context_parallel;

  bool reset_attention_mask() const { return cu_seqlens.defined(); }
  bool has_context_parallel() const { return context_parallel.comm != nullptr; }
};

}  // namespace megaton
