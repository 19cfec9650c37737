// BatchSchedule: the global batch size as training goes on (Megatron's
// num_microbatches_calculator: constant, --rampup-batch-size, --step-batch-size-schedule).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace megaton {

struct BatchScheduleConfig {
  int64_t global_batch_size = 0;  // --global-batch-size: constant, or the ramp's end
  // --rampup-batch-size start increment samples (Megatron's older ramp; empty: none).
  std::vector<int64_t> rampup_batch_size;
  // --step-batch-size-schedule "THRESHOLD:BS ..." (empty: none).
  std::string step_batch_size_schedule;
  // Tokens per sample: the step schedule's thresholds are tokens, converted to samples by
  // floor division, as Megatron's training passes --seq-length to the calculator. 0: the
  // thresholds are samples.
  int64_t seq_length = 0;
  // micro-batch-size x data-parallel size: every batch size must be a multiple.
  int64_t micro_batch_times_data_parallel_size = 1;
};

// Megatron's three calculators (megatron/core/num_microbatches_calculator.py and, for the
// ramp, RampupBatchsizeNumMicroBatchesCalculator of Megatron-LM before it was deprecated):
//  - constant: global_batch_size throughout;
//  - ramp (start, increment, samples): (global - start) / increment increments spread over
//    `samples` samples: start + floor(consumed / (samples / increments)) * increment, and
//    global_batch_size once more than `samples` samples are consumed;
//  - step schedule: thresholds with K/M/B/T suffixes (1e3 ... 1e12; "2.4B" allowed),
//    separated by spaces or commas, sorted, the first 0: the batch size of the last
//    threshold <= consumed samples.
// The constructor throws megaton::Error (one line naming the flag) for: both a ramp and a
// step schedule; a step schedule with --global-batch-size given (caller's check, Megatron's
// message); a malformed entry; a first threshold other than 0; thresholds that do not
// increase; a batch size <= 0; a ramp whose start is not below global_batch_size or whose
// difference is not a multiple of the increment; and any batch size the schedule can
// reach that is not a multiple of micro_batch_times_data_parallel_size.
class BatchSchedule {
 public:
  explicit BatchSchedule(const BatchScheduleConfig& config);

  // The global batch size of the iteration that starts after `consumed_samples`.
  int64_t global_batch_size(int64_t consumed_samples) const;
  // The largest batch size the schedule reaches (the ramp's end, the schedule's largest).
  int64_t max_global_batch_size() const;
  bool is_constant() const { return kind_ == Kind::Constant; }
  // Megatron's update_train_iters for --train-samples: with a step schedule, iterations
  // until the consumed samples reach train_samples (the last one may pass it); with a ramp,
  // the ramp's iterations (while consumed <= ramp samples and <= train_samples) plus
  // floor((train_samples - consumed) / global_batch_size); constant: train_samples /
  // global_batch_size, rounded down.
  int64_t train_iters_for_samples(int64_t train_samples) const;
  // The samples consumed after `iterations` iterations from the start.
  int64_t consumed_samples_after(int64_t iterations) const;
  // The (threshold in samples, batch size) steps, for the start-up log.
  const std::vector<std::pair<int64_t, int64_t>>& steps() const { return steps_; }

 private:
  enum class Kind { Constant, Rampup, Step } kind_ = Kind::Constant;
  int64_t global_ = 0;
  int64_t start_ = 0, increment_ = 0, ramp_samples_ = 0;
  double samples_per_increment_ = 0;
  std::vector<std::pair<int64_t, int64_t>> steps_;
};

}  // namespace megaton
