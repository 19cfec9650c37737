// fp16 loss scaling (issue 18): Megatron's dynamic and constant grad scalers, and the
// trainer's use of them (the scaled backward, the unscaled update, skipped steps, the
// learning-rate schedule, the log and the checkpoint). The CPU computes fp32 under --fp16,
// so these runs scale the loss as a GPU fp16 run does without fp16's rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "common/testing.h"
#include "core/error.h"
#include "optim/grad_scaler.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

using optim::GradScaler;
using optim::GradScalerConfig;

GradScalerConfig scaler_config(double initial, int64_t window, int64_t hysteresis,
                               double min_scale = 1.0) {
  GradScalerConfig c;
  c.initial_loss_scale = initial;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.min_loss_scale = min_scale;
  return c;
}

// DynamicGradScaler.update, step by step: hysteresis 2 keeps the scale at the first
// overflow and halves it at the second; later overflows halve it at once (the tracker is
// refilled only by a growth); a window of clean steps doubles it and refills the tracker.
TEST(GradScaler, HysteresisBackoffAndGrowthFollowMegatron) {
  GradScaler s(scaler_config(1024, 3, 2), /*dynamic=*/true);
  EXPECT_EQ(s.scale(), 1024.0f);
  s.update(true);
  EXPECT_EQ(s.scale(), 1024.0f);  // hysteresis: 2 -> 1
  s.update(true);
  EXPECT_EQ(s.scale(), 512.0f);  // 1 -> 0: backoff
  s.update(false);
  s.update(true);  // a clean step between does not refill the tracker
  EXPECT_EQ(s.scale(), 256.0f);
  EXPECT_EQ(s.state().growth_tracker, 0);
  for (int i = 0; i < 2; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 256.0f);
  s.update(false);  // the third clean step in a row: growth
  EXPECT_EQ(s.scale(), 512.0f);
  EXPECT_EQ(s.state().hysteresis_tracker, 2);
  EXPECT_EQ(s.state().growth_tracker, 0);
  s.update(true);
  EXPECT_EQ(s.scale(), 512.0f);  // the refilled tracker absorbs one overflow again
  EXPECT_FLOAT_EQ(s.inv_scale(), 1.0f / 512.0f);
}

TEST(GradScaler, BackoffStopsAtTheMinimumAndGrowthBelowInf) {
  GradScaler s(scaler_config(8, 1000, 1, /*min_scale=*/2), true);
  for (int i = 0; i < 5; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 2.0f);
  GradScaler big(scaler_config(0x1p126, 1, 1), true);
  big.update(false);
  EXPECT_EQ(big.scale(), 0x1p127f);
  big.update(false);  // 2^128 is inf in fp32: kept
  EXPECT_EQ(big.scale(), 0x1p127f);
}

TEST(GradScaler, ConstantAndNoneNeverChange) {
  GradScalerConfig c;
  c.loss_scale = 128;
  GradScaler constant(c, /*dynamic=*/true);  // a static scale wins over dynamic
  EXPECT_FALSE(constant.dynamic());
  EXPECT_TRUE(constant.active());
  constant.update(true);
  EXPECT_EQ(constant.scale(), 128.0f);
  GradScaler none(GradScalerConfig{}, false);
  EXPECT_FALSE(none.active());
  none.update(true);
  EXPECT_EQ(none.scale(), 1.0f);
}

TEST(GradScaler, StateRoundTripsAndBadSettingsAreUserErrors) {
  GradScaler s(scaler_config(1024, 4, 3), true);
  s.update(true);
  s.update(false);
  GradScaler t(scaler_config(65536, 4, 3), true);
  t.load_state(s.state(), "ck");
  EXPECT_EQ(t.state().scale, s.state().scale);
  EXPECT_EQ(t.state().growth_tracker, 1);
  EXPECT_EQ(t.state().hysteresis_tracker, 2);
  EXPECT_THROW(t.load_state({-1.0f, 0, 0}, "ck"), Error);
  EXPECT_THROW(GradScaler(scaler_config(0, 4, 3), true), Error);
  EXPECT_THROW(GradScaler(scaler_config(4, 4, 3, /*min_scale=*/8), true), Error);
  EXPECT_THROW(GradScaler(scaler_config(4, 0, 3), true), Error);
  EXPECT_THROW(GradScaler(scaler_config(4, 4, 0), true), Error);
}

class LossScalingTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_loss_scaling_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  // A tiny MoE model on mock data, the learning rate warming up over the whole run (so
  // each schedule step has its own rate).
  RawOptions tiny(int64_t iters) const {
    return {{"device", {"cpu"}},           {"mock-data", {"true"}},
            {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"100"}},
            {"num-layers", {"2"}},         {"hidden-size", {"16"}},
            {"num-attention-heads", {"2"}}, {"seq-length", {"8"}},
            {"num-experts", {"4"}},        {"moe-router-topk", {"2"}},
            {"moe-aux-loss-coeff", {"0.01"}}, {"micro-batch-size", {"2"}},
            {"global-batch-size", {"4"}},  {"train-iters", {std::to_string(iters)}},
            {"lr", {"1e-3"}},              {"lr-warmup-iters", {"100"}},     {"lr-decay-iters", {"200"}},
            {"eval-iters", {"0"}},         {"log-interval", {"1"}},
            {"log-metrics-file", {(dir / ("metrics" + std::to_string(runs) + ".jsonl")).string()}}};
  }

  struct Run {
    TrainResult result;
    std::vector<nlohmann::json> metrics;
  };
  Run run(RawOptions raw) {
    const std::string metrics = raw.at("log-metrics-file")[0];
    ++runs;
    Run out;
    {
      TrainArgs args = parse_train_args(raw);
      Trainer trainer(args, raw);
      out.result = trainer.train();
    }
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) out.metrics.push_back(nlohmann::json::parse(line));
    return out;
  }

  int runs = 0;
  fs::path dir;
};

// Scaling by powers of two and unscaling is exact in fp32: --fp16 on the CPU (fp32
// compute) gives the unscaled run's losses and gradient norms bit for bit, while the scale
// doubles every loss-scale-window clean steps.
TEST_F(LossScalingTrain, ScaledRunEqualsUnscaledAndScaleGrows) {
  const Run plain = run(tiny(5));
  RawOptions opts = tiny(5);
  opts["fp16"] = {"true"};
  opts["initial-loss-scale"] = {"1024"};
  opts["loss-scale-window"] = {"2"};
  const Run scaled = run(opts);
  ASSERT_EQ(scaled.result.losses.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(scaled.result.losses[i], plain.result.losses[i]) << "iteration " << i + 1;
    EXPECT_EQ(scaled.result.grad_norms[i], plain.result.grad_norms[i]) << "iteration " << i + 1;
  }
  const double want[] = {1024, 2048, 2048, 4096, 4096};
  ASSERT_EQ(scaled.metrics.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(scaled.metrics[i].at("loss_scale").get<double>(), want[i]) << "iteration " << i + 1;
    EXPECT_FALSE(scaled.metrics[i].contains("skipped"));
  }
  EXPECT_FALSE(plain.metrics[0].contains("loss_scale"));
}

// A step whose scaled gradients overflow (a huge aux-loss coefficient: the lm loss stays
// finite) is skipped: the parameters, the optimizer's step count and the learning-rate
// schedule stay where they were, and the scale halves (hysteresis 1). The runs before and
// after the overflow agree with the run that stops before it.
TEST_F(LossScalingTrain, OverflowSkipsTheStepAndHalvesTheScale) {
  RawOptions opts = tiny(6);
  opts["fp16"] = {"true"};
  opts["initial-loss-scale"] = {"1024"};
  opts["hysteresis"] = {"1"};
  opts["loss-scale-window"] = {"2"};  // grows back into the overflow: skips after step 1
  opts["moe-aux-loss-coeff"] = {"1e36"};
  opts["save"] = {(dir / "ck").string()};
  const Run r = run(opts);
  ASSERT_EQ(r.metrics.size(), 6u);
  int skipped_at = -1;  // the first skipped step after the first
  for (int i = 1; i < 6 && skipped_at < 0; ++i)
    if (r.metrics[size_t(i)].contains("skipped")) skipped_at = i;
  ASSERT_GE(skipped_at, 1) << "no step after the first overflowed: the test's premise is gone";
  const nlohmann::json& s = r.metrics[size_t(skipped_at)];
  EXPECT_TRUE(std::isfinite(s.at("lm_loss").get<double>()));  // an overflow, not a NaN loss
  const double before = r.metrics[size_t(skipped_at - 1)].at("loss_scale").get<double>();
  EXPECT_EQ(s.at("loss_scale").get<double>(), before / 2);
  // The next step runs at the skipped step's learning rate: the schedule did not advance.
  ASSERT_LT(skipped_at + 1, 6) << "the overflow was the last step";
  EXPECT_EQ(r.metrics[size_t(skipped_at + 1)].at("lr"), s.at("lr"));
  int64_t skipped = 0;
  for (const auto& m : r.metrics) skipped += m.contains("skipped") ? 1 : 0;
  ckpt::LoadedCheckpoint ck = ckpt::load_checkpoint((dir / "ck").string());
  const auto meta = nlohmann::json::parse(ck.metadata_json);
  EXPECT_EQ(meta.at("optimizer_step").get<int64_t>(), 6 - skipped);
  // The schedule counts the samples of the applied updates (global batch 4).
  EXPECT_EQ(meta.at("scheduler_samples").get<int64_t>(), 4 * (6 - skipped));
  EXPECT_EQ(meta.at("skipped_iterations").get<int64_t>(), skipped);
  EXPECT_EQ(meta.at("nan_iterations").get<int64_t>(), 0);
  EXPECT_EQ(meta.at("grad_scaler").at("scale").get<double>(), r.metrics.back().at("loss_scale").get<double>());

  // The skipped step changed no parameter: a run stopped just before it and a run stopped
  // just after it save the same weights.
  RawOptions upto = opts;
  upto["train-iters"] = {std::to_string(skipped_at)};
  upto["save"] = {(dir / "before").string()};
  RawOptions through = opts;
  through["train-iters"] = {std::to_string(skipped_at + 1)};
  through["save"] = {(dir / "after").string()};
  run(upto);
  run(through);
  ckpt::LoadedCheckpoint a = ckpt::load_checkpoint((dir / "before").string());
  ckpt::LoadedCheckpoint b = ckpt::load_checkpoint((dir / "after").string());
  int compared = 0;
  for (const auto& [name, t] : a.tensors) {
    if (!name.starts_with("model.") && !name.starts_with("optimizer.")) continue;
    const Tensor& u = b.tensors.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw(), u.raw(), t.nbytes()), 0) << name;
    ++compared;
  }
  EXPECT_GT(compared, 10);
}

// A NaN loss under dynamic scaling is skipped and counted as a nan iteration (the check
// that would stop the run is off under dynamic scaling, as in Megatron); the scale falls
// at each such step once the hysteresis is spent, and the run ends normally.
TEST_F(LossScalingTrain, NanLossIsSkippedNotStopped) {
  RawOptions opts = tiny(4);
  opts["fp16"] = {"true"};
  opts["initial-loss-scale"] = {"1024"};
  opts["lr"] = {"1e30"};  // the first update makes every later forward NaN
  opts["lr-warmup-iters"] = {"0"};
  const Run r = run(opts);
  ASSERT_EQ(r.metrics.size(), 4u);
  EXPECT_FALSE(r.metrics[0].contains("skipped"));
  const double want[] = {1024, 1024, 512, 256};  // hysteresis 2
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(r.metrics[i].at("loss_scale").get<double>(), want[i]) << "iteration " << i + 1;
    if (i > 0) EXPECT_TRUE(r.metrics[i].contains("skipped")) << "iteration " << i + 1;
  }
}

// The dynamic scaler's scale and trackers, and the schedule's steps, go through the
// checkpoint: 3 + 3 iterations resumed equal 6 in one run (scale and losses).
TEST_F(LossScalingTrain, ResumeRestoresTheScaler) {
  RawOptions opts = tiny(6);
  opts["fp16"] = {"true"};
  opts["initial-loss-scale"] = {"1024"};
  opts["loss-scale-window"] = {"2"};
  opts["hysteresis"] = {"1"};
  opts["moe-aux-loss-coeff"] = {"1e36"};  // overflows now and then: the trackers move
  const Run full = run(opts);
  RawOptions first = opts;
  first["save"] = {(dir / "ck").string()};
  first["exit-interval"] = {"3"};
  first["log-metrics-file"] = {(dir / "first.jsonl").string()};
  run(first);
  RawOptions second = opts;
  second["load"] = {(dir / "ck").string()};
  second["log-metrics-file"] = {(dir / "second.jsonl").string()};
  const Run resumed = run(second);
  ASSERT_EQ(resumed.metrics.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const nlohmann::json& a = full.metrics[i + 3];
    const nlohmann::json& b = resumed.metrics[i];
    EXPECT_EQ(b.at("iteration"), a.at("iteration"));
    EXPECT_EQ(b.at("loss_scale"), a.at("loss_scale")) << "iteration " << i + 4;
    EXPECT_EQ(b.at("lr"), a.at("lr")) << "iteration " << i + 4;
    EXPECT_EQ(b.contains("skipped"), a.contains("skipped")) << "iteration " << i + 4;
    EXPECT_EQ(b.at("lm_loss"), a.at("lm_loss")) << "iteration " << i + 4;
  }
}

}  // namespace
}  // namespace megaton
