// The loss mask of --eod-mask-loss: which tokens' losses count, and the per-token weights
// of a micro-batch's loss (Megatron's loss_mask and loss_func).
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace megaton {

// One micro-batch's loss mask (Megatron's _get_ltor_masks_and_position_ids with
// eod_mask_loss) and the gradient of its loss. Megatron's micro-batch loss is
// sum_t losses[t] mask[t] / num_tokens; the step's gradient is the mean of those over the
// micro-batches.
struct LossMask {
  // [B*S] F32 on the host: 0 where the INPUT token is the end-of-document id (the
  // prediction of the token after a document's end), 1 elsewhere; in the order of the
  // tokens [B, S] and of the per-token losses (MicroBatchLoss::losses).
  Tensor mask;
  // [B*S] F32 on the host: mask / num_tokens, d(micro-batch loss)/d(per-token loss). All
  // zero when num_tokens is 0: such a micro-batch adds nothing to the gradient (Megatron
  // divides 0 by 0 there and its step is not finite; docs/data.md).
  Tensor weights;
  int64_t num_tokens = 0;  // the tokens whose loss counts: the sum of mask
};

// The loss mask of tokens [B, S] int32 (host) whose end-of-document id is `eod`
// (data::Tokenizer::eod). InternalError when tokens is not an I32 host tensor.
LossMask eod_loss_mask(const Tensor& tokens, int32_t eod);

// Context parallelism: the loss mask of this CP rank's rows, from the micro-batch's WHOLE
// tokens [B, S] (before the split): mask and num_tokens those of the rank's rows
// (cp_split_sequence), weights = mask x cp / (the whole micro-batch's unmasked tokens), so
// that after the gradients' average over the CP ranks each token weighs what it does in the
// one-rank run (Megatron divides by the rank's own count instead, which differs between CP
// ranks when the masked tokens fall unevenly). cp == 1: eod_loss_mask. InternalError as
// eod_loss_mask and cp_split_sequence.
LossMask eod_loss_mask(const Tensor& whole_tokens, int32_t eod, int cp, int cp_rank);

// sum_t losses[t] * mask[t], accumulated in fp64 on the host. losses [T] F32 (host or
// device: read to the host, a synchronization on the GPU), mask [T] F32 host.
// InternalError on other sizes or dtypes.
double masked_loss_sum(const Tensor& losses, const Tensor& mask);

}  // namespace megaton
