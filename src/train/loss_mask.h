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

// sum_t losses[t] * mask[t], accumulated in fp64 on the host. losses [T] F32 (host or
// device: read to the host, a synchronization on the GPU), mask [T] F32 host.
// InternalError on other sizes or dtypes.
double masked_loss_sum(const Tensor& losses, const Tensor& mask);

}  // namespace megaton
