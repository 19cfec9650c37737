// The Trainer's data: the datasets of the three splits, the micro-batches read from them
// (each step's staged inputs, the pipeline's loader) and their packed documents.
#include <algorithm>

#include "core/error.h"
#include "data/blended_dataset.h"
#include "data/gpt_dataset.h"
#include "dist/host_reduce.h"
#include "model/context_parallel.h"
#include "train/loss_mask.h"
#include "train/packed_batch.h"
#include "train/trainer.h"

namespace megaton {

void Trainer::build_datasets(const std::array<int64_t, 3>& num_samples) {
  data::GPTDatasetConfig data_cfg;
  if (!args_.data_path.empty()) data_cfg.blend = data::parse_data_path(args_.data_path);
  for (int s = 0; s < 3; ++s)
    if (!args_.per_split_data_path[s].empty())
      data_cfg.blend_per_split[s] = data::parse_data_path(args_.per_split_data_path[s]);
  data_cfg.split = args_.split;
  data_cfg.path_to_cache = args_.data_cache_path;
  data_cfg.seq_length = args_.model.seq_length;
  data_cfg.seed = args_.seed;
  datasets_ = data::build_gpt_datasets(data_cfg, num_samples);
  if (!datasets_[0]) fail("data-path: the train split of '{}' is empty", args_.split);
  for (const auto& ds : datasets_)
    if (ds && ds->size() > 0) {
      // Every token id must fit the model's vocabulary.
      std::vector<int32_t> sample(args_.model.seq_length + 1);
      ds->get(0, sample.data());
      for (int32_t t : sample)
        if (t < 0 || t >= args_.model.vocab_size)
          fail(
              "data-path: token id {} is outside the tokenizer's vocabulary of {} (was the "
              "data preprocessed with another tokenizer?)",
              t, args_.model.vocab_size);
    }
}

void Trainer::load_batch(const data::SampleSource& source, int64_t first_sample, int64_t count,
                         Tensor& tokens, Tensor& labels, Tensor* whole_tokens) const {
  int64_t seq = args_.model.seq_length;
  tokens = Tensor::empty({count, seq}, DType::I32);
  labels = Tensor::empty({count, seq}, DType::I32);
  std::vector<int32_t> sample(seq + 1);
  for (int64_t i = 0; i < count; ++i) {
    source.get((first_sample + i) % source.size(), sample.data());
    std::copy(sample.begin(), sample.end() - 1, tokens.i32() + i * seq);
    std::copy(sample.begin() + 1, sample.end(), labels.i32() + i * seq);
  }
  if (whole_tokens) *whole_tokens = tokens;
  // Context parallelism: this rank's two chunks of each sample (labels shifted before the
  // split, as Megatron's get_batch_on_this_cp_rank).
  if (const dist::Group& cp = grid_->cp(); cp.size() > 1) {
    tokens = cp_split_sequence(tokens, cp.size(), cp.rank);
    labels = cp_split_sequence(labels, cp.size(), cp.rank);
  }
}

std::shared_ptr<const PackedSeqParams> Trainer::packing(const Tensor& tokens,
                                                        Tensor position_ids_buffer) const {
  if (cp_params_) {
    if (!args_.reset_position_ids && !args_.reset_attention_mask) return cp_params_;
    return context_parallel_packed_seq_params(tokens, tokenizer_->eod(), args_.reset_position_ids,
                                              args_.reset_attention_mask,
                                              cp_params_->context_parallel, args_.model.device);
  }
  return packed_seq_params(tokens, tokenizer_->eod(), args_.reset_position_ids,
                           args_.reset_attention_mask, args_.model.device,
                           std::move(position_ids_buffer),
                           args_.model.is_hybrid() && args_.model.has_hybrid_symbol(kHybridMamba));
}

std::shared_ptr<const PackedSeqParams> Trainer::packing(const data::SampleSource& source,
                                                        int64_t first_sample) const {
  if (!args_.reset_position_ids && !args_.reset_attention_mask) return cp_params_;
  Tensor tokens, labels, whole;
  load_batch(source, first_sample, args_.micro_batch_size, tokens, labels, &whole);
  return packing(whole);
}

LossMask Trainer::loss_mask_of(const Tensor& whole_tokens) const {
  const dist::Group& cp = grid_->cp();
  return eod_loss_mask(whole_tokens, tokenizer_->eod(), cp.size(), cp.rank);
}

PipelineMicroBatches Trainer::pipeline_micro_batches(
    const data::SampleSource& source, int64_t batch_start, int64_t count,
    std::function<ForwardContext(int64_t)> context) const {
  PipelineMicroBatches out;
  out.count = count;
  out.batch = args_.micro_batch_size;
  out.seq = local_seq_length();
  out.load = [this, &source, batch_start](int64_t mb, Tensor& tokens, Tensor& labels) {
    load_batch(source, micro_batch_start(batch_start, mb), args_.micro_batch_size, tokens, labels);
  };
  if (args_.eod_mask_loss)
    out.loss_mask = [this, &source, batch_start](int64_t mb, const Tensor& tokens) {
      if (grid_->cp().size() == 1) return eod_loss_mask(tokens, tokenizer_->eod());
      Tensor local, labels, whole;  // under CP the weights count the whole micro-batch
      load_batch(source, micro_batch_start(batch_start, mb), args_.micro_batch_size, local, labels,
                 &whole);
      return loss_mask_of(whole);
    };
  out.context = std::move(context);
  // Packed documents: every stage's layers need the micro-batch's packing, also the
  // stages that load no tokens (it is remade from the samples); so do the CP chunks.
  if (args_.reset_position_ids || args_.reset_attention_mask || cp_params_)
    out.context = [this, &source, batch_start, context = std::move(out.context)](int64_t mb) {
      ForwardContext ctx = context(mb);
      ctx.packed_seq_params = packing(source, micro_batch_start(batch_start, mb));
      return ctx;
    };
  return out;
}

void Trainer::stage_step_inputs(double lr) {
  lr_.copy_from(Tensor::from({1}, {float(lr)}));
  const size_t n_mb = schedule_ ? 0 : size_t(local_micro_batches());  // none with a pipeline
  double loss_tokens = 0;
  for (size_t mb = 0; mb < n_mb; ++mb) {
    Tensor tokens, labels, whole;
    load_batch(*datasets_[0], micro_batch_start(consumed_samples_, int64_t(mb)),
               args_.micro_batch_size, tokens, labels, &whole);
    batch_tokens_[mb].copy_from(tokens);
    batch_labels_[mb].copy_from(labels);
    // (Under context parallelism the rows' ids are made anew: the buffer holds a whole
    // sample's, and CUDA graphs are refused with CP and packed documents.)
    batch_packing_[mb] = packing(
        whole, args_.reset_position_ids && !cp_params_ ? batch_position_ids_[mb] : Tensor());
    if (args_.eod_mask_loss) {
      const LossMask mask = loss_mask_of(whole);
      batch_loss_masks_[mb].copy_from(mask.mask);
      batch_loss_weights_[mb].copy_from(mask.weights);
      loss_tokens += double(mask.num_tokens);
    }
  }
  // Each data-parallel rank counts its own micro-batches' tokens.
  if (args_.eod_mask_loss && !schedule_)
    staged_loss_tokens_ = dist::sum_over(*comm_, grid_->dp_cp(), {loss_tokens})[0];
}

int64_t Trainer::current_global_batch_size() const {
  return batch_schedule_->global_batch_size(consumed_samples_);
}

int64_t Trainer::local_micro_batches() const {
  return current_global_batch_size() / (args_.micro_batch_size * grid_->dp().size());
}

int64_t Trainer::micro_batch_start(int64_t batch_start, int64_t mb) const {
  const int64_t dp = grid_->dp().size();
  return batch_start + (mb * dp + grid_->dp().rank) * args_.micro_batch_size;
}

}  // namespace megaton
