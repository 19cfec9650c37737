// BatchSchedule against hand-computed batch sizes at the thresholds, iteration counts of
// sample-based runs, and the refusals.
#include <gtest/gtest.h>

#include "core/error.h"
#include "train/batch_schedule.h"

namespace megaton {
namespace {

::testing::AssertionResult refused(const BatchScheduleConfig& c, const std::string& part) {
  try {
    BatchSchedule s(c);
  } catch (const Error& e) {
    if (std::string(e.what()).find(part) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message lacks '" << part << "': " << e.what();
  }
  return ::testing::AssertionFailure() << "not refused";
}

TEST(BatchSchedule, RampupAsMegatronsExample) {
  // Megatron's help: rampup 16 8 300000 to 1024: (1024 - 16) / 8 = 126 increments of
  // 300000 / 126 = 2380.95 samples each.
  BatchScheduleConfig c;
  c.global_batch_size = 1024;
  c.rampup_batch_size = {16, 8, 300000};
  c.micro_batch_times_data_parallel_size = 8;
  BatchSchedule s(c);
  EXPECT_FALSE(s.is_constant());
  EXPECT_EQ(s.global_batch_size(0), 16);
  EXPECT_EQ(s.global_batch_size(2380), 16);
  EXPECT_EQ(s.global_batch_size(2381), 24);
  EXPECT_EQ(s.global_batch_size(4761), 24);
  EXPECT_EQ(s.global_batch_size(4762), 32);
  EXPECT_EQ(s.global_batch_size(150000), 16 + 63 * 8);  // 150000 / 2380.95 = 63.0
  EXPECT_EQ(s.global_batch_size(299999), 16 + 125 * 8);
  EXPECT_EQ(s.global_batch_size(300001), 1024);
  EXPECT_EQ(s.max_global_batch_size(), 1024);
}

TEST(BatchSchedule, StepScheduleInTokens) {
  // Megatron's GPT-3 175B example, thresholds in tokens at seq_length 2048:
  // 2.4B / 2048 = 1171875 samples, 4.8B / 2048 = 2343750.
  BatchScheduleConfig c;
  c.step_batch_size_schedule = "0:16 2.4B:320 4.8B:624";
  c.seq_length = 2048;
  c.micro_batch_times_data_parallel_size = 8;
  BatchSchedule s(c);
  EXPECT_EQ(s.global_batch_size(0), 16);
  EXPECT_EQ(s.global_batch_size(1171874), 16);
  EXPECT_EQ(s.global_batch_size(1171875), 320);
  EXPECT_EQ(s.global_batch_size(2343749), 320);
  EXPECT_EQ(s.global_batch_size(2343750), 624);
  EXPECT_EQ(s.max_global_batch_size(), 624);
  // Commas, lower-case suffixes and unsorted entries, thresholds in samples.
  c.step_batch_size_schedule = "1k:32,0:8 2K:64";
  c.seq_length = 0;
  BatchSchedule t(c);
  EXPECT_EQ(t.global_batch_size(999), 8);
  EXPECT_EQ(t.global_batch_size(1000), 32);
  EXPECT_EQ(t.global_batch_size(2000), 64);
}

TEST(BatchSchedule, TrainItersForSamples) {
  BatchScheduleConfig c;
  c.micro_batch_times_data_parallel_size = 8;
  c.step_batch_size_schedule = "0:8 100:16";
  // 13 iterations of 8 reach 104 (the 13th starts at 96 < 100), then 6 of 16 reach 200.
  BatchSchedule step(c);
  EXPECT_EQ(step.train_iters_for_samples(200), 19);
  EXPECT_EQ(step.consumed_samples_after(19), 200);
  EXPECT_EQ(step.train_iters_for_samples(201), 20) << "the last iteration may pass the target";
  // Ramp 8 8 64 to 32: 3 increments of 21.33 samples. Batches 8 (0), 8 (8), 8 (16),
  // 16 (24), 16 (40), 24 (56) reach 80 > 64; then floor((400 - 80) / 32) = 10.
  BatchScheduleConfig r;
  r.micro_batch_times_data_parallel_size = 8;
  r.global_batch_size = 32;
  r.rampup_batch_size = {8, 8, 64};
  BatchSchedule ramp(r);
  EXPECT_EQ(ramp.consumed_samples_after(6), 80);
  EXPECT_EQ(ramp.train_iters_for_samples(400), 16);
  BatchScheduleConfig k;
  k.global_batch_size = 32;
  BatchSchedule constant(k);
  EXPECT_TRUE(constant.is_constant());
  EXPECT_EQ(constant.train_iters_for_samples(400), 12);  // floor(400 / 32)
  EXPECT_EQ(constant.consumed_samples_after(5), 160);
}

TEST(BatchSchedule, Refusals) {
  BatchScheduleConfig c;
  c.micro_batch_times_data_parallel_size = 8;
  c.global_batch_size = 64;
  c.rampup_batch_size = {8, 8, 100};
  c.step_batch_size_schedule = "0:8";
  EXPECT_TRUE(refused(c, "exclude each other"));
  c.rampup_batch_size.clear();
  c.step_batch_size_schedule = "10:8 20:16";
  EXPECT_TRUE(refused(c, "first threshold must be 0"));
  c.step_batch_size_schedule = "0:8 1k:16 1000:32";
  EXPECT_TRUE(refused(c, "must increase"));
  c.step_batch_size_schedule = "0:8 100:12";
  EXPECT_TRUE(refused(c, "not a multiple"));
  c.step_batch_size_schedule = "0:8 lots:16";
  EXPECT_TRUE(refused(c, "'lots'"));
  c.step_batch_size_schedule = "0-8";
  EXPECT_TRUE(refused(c, "THRESHOLD:BATCH_SIZE"));
  c.step_batch_size_schedule = "";
  c.rampup_batch_size = {64, 8, 100};
  EXPECT_TRUE(refused(c, "positive multiple of the increment"));
  c.rampup_batch_size = {8, 24, 100};
  EXPECT_TRUE(refused(c, "positive multiple of the increment"));  // 56 % 24
  c.rampup_batch_size = {8, 8};
  EXPECT_TRUE(refused(c, "3 values"));
  c.rampup_batch_size = {4, 4, 100};
  EXPECT_TRUE(refused(c, "--rampup-batch-size: batch size 4"));
  c.rampup_batch_size.clear();
  c.global_batch_size = 12;
  EXPECT_TRUE(refused(c, "global-batch-size: batch size 12"));
}

}  // namespace
}  // namespace megaton
