// Trainer::evaluate: the validation loss (Megatron's evaluate) on the validation split,
// with or without a pipeline, masked as the training loss is.
#include "dist/host_reduce.h"
#include "ops/ops.h"
#include "train/loss_mask.h"
#include "train/pipeline_schedule.h"
#include "train/trainer.h"

namespace megaton {

double Trainer::evaluate() {
  const auto& valid = datasets_[1];
  if (!valid || args_.eval_iters == 0) return -1;
  ddp_->finish_param_sync();
  // Megatron evaluates with the global batch size (its last, under a batch-size schedule).
  const int64_t n_mb = args_.global_batch_size / (args_.micro_batch_size * grid_->dp().size());
  const int64_t mbs = args_.micro_batch_size;
  double loss_sum = 0, tokens_sum = 0;
  for (int64_t it = 0; it < args_.eval_iters; ++it) {
    if (schedule_) {
      const PipelineLosses stage = schedule_->forward_backward(
          pipeline_micro_batches(*valid, it * args_.global_batch_size, n_mb,
                                 [&](int64_t) {
                                   ForwardContext ctx{false, args_.seed, 0, 0};
                                   ctx.forward_only = true;  // evaluation: no backward
                                   return ctx;
                                 }),
          /*forward_only=*/true);
      loss_sum += stage.loss_sum;
      tokens_sum += stage.num_tokens;
    }
    for (int64_t mb = 0; !schedule_ && mb < n_mb; ++mb) {
      Tensor tokens, labels, whole;
      load_batch(*valid, micro_batch_start(it * args_.global_batch_size, mb), mbs, tokens, labels,
                 &whole);
      ForwardContext ctx{false, args_.seed, 0, 0};
      ctx.forward_only = true;
      ctx.packed_seq_params = packing(whole);  // null unless documents are packed or CP
      MicroBatchLoss out = chunks_[0]->forward(tokens, labels, ctx);
      if (args_.eod_mask_loss) {
        const LossMask mask = loss_mask_of(whole);
        loss_sum += masked_loss_sum(out.losses, mask.mask);
        tokens_sum += double(mask.num_tokens);
      } else {
        loss_sum += ops::sum(out.losses);
        tokens_sum += double(out.losses.numel());
      }
      chunks_[0]->take_activations();  // the logits and the rest: no backward follows
    }
  }
  if (schedule_) {  // the losses are on the last stage
    const std::vector<double> pipeline_sums =
        dist::sum_over(*comm_, grid_->pp(), {loss_sum, tokens_sum});
    loss_sum = pipeline_sums[0];
    tokens_sum = pipeline_sums[1];
  }
  const std::vector<double> sums = dist::sum_over(*comm_, grid_->dp_cp(), {loss_sum, tokens_sum});
  // No token in the loss (--eod-mask-loss on all-eod batches): 0, not Megatron's 0 / 0.
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

}  // namespace megaton
