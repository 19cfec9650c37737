// BatchSchedule: constant, ramped and step-scheduled global batch sizes.
#include "train/batch_schedule.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>

#include "core/error.h"
#include "core/printable.h"

namespace megaton {

namespace {

constexpr const char* kStepFlag = "--step-batch-size-schedule";

// Megatron's _parse_numeric_value: an optional K/M/B/T suffix (any case), then
// int(float(value) * multiplier).
int64_t parse_suffixed(const std::string& text, const std::string& entry) {
  std::string s = text;
  double multiplier = 1;
  if (!s.empty()) {
    switch (std::toupper(static_cast<unsigned char>(s.back()))) {
      case 'T': multiplier = 1e12; s.pop_back(); break;
      case 'B': multiplier = 1e9; s.pop_back(); break;
      case 'M': multiplier = 1e6; s.pop_back(); break;
      case 'K': multiplier = 1e3; s.pop_back(); break;
      default: break;
    }
  }
  char* end = nullptr;
  const double v = s.empty() ? NAN : std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || !std::isfinite(v) || v < 0 || v * multiplier > 9e18)
    fail("{}: '{}' in entry '{}' is not a number (with an optional K, M, B or T)", kStepFlag,
         printable(text), printable(entry));
  return int64_t(v * multiplier);
}

// Python's floor division for a possibly negative numerator.
int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

}  // namespace

BatchSchedule::BatchSchedule(const BatchScheduleConfig& c) : global_(c.global_batch_size) {
  const int64_t unit = c.micro_batch_times_data_parallel_size;
  MEGATON_CHECK(unit > 0, "micro-batch-size x data-parallel size {}", unit);
  const auto check_multiple = [&](int64_t bs, const char* flag) {
    if (bs % unit != 0)
      fail("{}: batch size {} is not a multiple of micro-batch-size x data-parallel size ({})",
           flag, bs, unit);
  };
  if (!c.rampup_batch_size.empty() && !c.step_batch_size_schedule.empty())
    fail("--rampup-batch-size and --step-batch-size-schedule exclude each other (the step "
         "schedule is Megatron's replacement for the ramp)");
  if (!c.step_batch_size_schedule.empty()) {
    kind_ = Kind::Step;
    std::string text = c.step_batch_size_schedule;
    std::replace(text.begin(), text.end(), ',', ' ');
    std::istringstream in(text);
    for (std::string entry; in >> entry;) {
      const size_t colon = entry.find(':');
      if (colon == std::string::npos)
        fail("{}: entry '{}' is not THRESHOLD:BATCH_SIZE", kStepFlag, printable(entry));
      int64_t threshold = parse_suffixed(entry.substr(0, colon), entry);
      const int64_t bs = parse_suffixed(entry.substr(colon + 1), entry);
      if (c.seq_length > 0) threshold /= c.seq_length;  // tokens -> samples
      if (bs <= 0) fail("{}: batch size in '{}' must be positive", kStepFlag, printable(entry));
      steps_.emplace_back(threshold, bs);
    }
    if (steps_.empty()) fail("{}: no entry", kStepFlag);
    std::stable_sort(steps_.begin(), steps_.end());
    if (steps_[0].first != 0)
      fail("{}: the first threshold must be 0 (got {} samples)", kStepFlag, steps_[0].first);
    for (size_t i = 1; i < steps_.size(); ++i)
      if (steps_[i].first <= steps_[i - 1].first)
        fail("{}: thresholds must increase (two map to {} samples)", kStepFlag, steps_[i].first);
    for (auto [threshold, bs] : steps_) check_multiple(bs, kStepFlag);
    global_ = steps_.back().second;
    return;
  }
  if (global_ <= 0) fail("global-batch-size must be positive (got {})", global_);
  if (!c.rampup_batch_size.empty()) {
    if (c.rampup_batch_size.size() != 3)
      fail("--rampup-batch-size takes 3 values: start increment samples (got {})",
           c.rampup_batch_size.size());
    kind_ = Kind::Rampup;
    start_ = c.rampup_batch_size[0];
    increment_ = c.rampup_batch_size[1];
    ramp_samples_ = c.rampup_batch_size[2];
    if (start_ <= 0 || increment_ <= 0 || ramp_samples_ < 0)
      fail("--rampup-batch-size: start and increment must be positive and samples >= 0 (got "
           "{} {} {})", start_, increment_, ramp_samples_);
    if (start_ >= global_ || (global_ - start_) % increment_ != 0)
      fail("--rampup-batch-size: global-batch-size ({}) minus the start ({}) must be a positive "
           "multiple of the increment ({})", global_, start_, increment_);
    const int64_t increments = (global_ - start_) / increment_;
    samples_per_increment_ = double(ramp_samples_) / double(increments);
    for (int64_t bs = start_; bs <= global_; bs += increment_) check_multiple(bs, "--rampup-batch-size");
    for (int64_t k = 0; k <= increments; ++k)
      steps_.emplace_back(int64_t(std::ceil(double(k) * samples_per_increment_)), start_ + k * increment_);
    return;
  }
  check_multiple(global_, "global-batch-size");
  steps_.emplace_back(0, global_);
}

int64_t BatchSchedule::global_batch_size(int64_t consumed) const {
  MEGATON_CHECK(consumed >= 0, "consumed samples {}", consumed);
  switch (kind_) {
    case Kind::Constant: return global_;
    case Kind::Rampup: {
      if (consumed > ramp_samples_) return global_;
      const int64_t steps = int64_t(double(consumed) / samples_per_increment_);
      return std::min(global_, start_ + steps * increment_);
    }
    case Kind::Step: {
      int64_t bs = steps_[0].second;
      for (auto [threshold, size] : steps_) {
        if (consumed < threshold) break;
        bs = size;
      }
      return bs;
    }
  }
  return global_;
}

int64_t BatchSchedule::max_global_batch_size() const {
  int64_t most = global_;
  for (auto [threshold, bs] : steps_) most = std::max(most, bs);
  return most;
}

int64_t BatchSchedule::train_iters_for_samples(int64_t train_samples) const {
  MEGATON_CHECK(train_samples > 0, "train samples {}", train_samples);
  int64_t iterations = 0, consumed = 0;
  switch (kind_) {
    case Kind::Constant: return train_samples / global_;
    case Kind::Step:
      while (consumed < train_samples) {
        consumed += global_batch_size(consumed);
        ++iterations;
      }
      return iterations;
    case Kind::Rampup:
      while (consumed <= ramp_samples_ && consumed <= train_samples) {
        consumed += global_batch_size(consumed);
        ++iterations;
      }
      return iterations + floor_div(train_samples - consumed, global_);
  }
  return 0;
}

int64_t BatchSchedule::consumed_samples_after(int64_t iterations) const {
  int64_t consumed = 0;
  if (kind_ == Kind::Constant) return iterations * global_;
  for (int64_t i = 0; i < iterations; ++i) consumed += global_batch_size(consumed);
  return consumed;
}

}  // namespace megaton
