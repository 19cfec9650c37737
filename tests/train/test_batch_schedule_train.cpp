// Batch-size schedules, sample-based lengths and the weight-decay schedule in training
// (issue 19): the global batch size, consumed samples, learning rate and weight decay of
// every iteration against values worked out by hand, an exact resume in the middle of a
// ramp, and the refusals.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

class BatchScheduleTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_batch_schedule_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  // A tiny dense model on mock data, micro-batches of 2 samples.
  RawOptions tiny() {
    return {{"device", {"cpu"}},         {"mock-data", {"true"}},
            {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"64"}},
            {"num-layers", {"2"}},       {"hidden-size", {"16"}},
            {"num-attention-heads", {"2"}}, {"seq-length", {"8"}},
            {"micro-batch-size", {"2"}}, {"lr", {"1e-3"}},
            {"eval-iters", {"0"}},       {"log-interval", {"1"}},
            {"log-metrics-file", {(dir / ("metrics" + std::to_string(runs) + ".jsonl")).string()}}};
  }
  std::vector<nlohmann::json> run(const RawOptions& raw) {
    const std::string metrics = raw.at("log-metrics-file")[0];
    ++runs;
    {
      TrainArgs args = parse_train_args(raw);
      Trainer trainer(args, raw);
      trainer.train();
    }
    std::vector<nlohmann::json> out;
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  template <class T>
  static std::vector<T> column(const std::vector<nlohmann::json>& m, const char* key) {
    std::vector<T> out;
    for (const auto& line : m) out.push_back(line.at(key).get<T>());
    return out;
  }
  int runs = 0;
  fs::path dir;
};

TEST_F(BatchScheduleTrain, RampupWithSampleBasedWarmup) {
  // Ramp 4 -> 12 by 4 over 16 samples: 2 increments of 8 samples. Batches 4 (at 0), 4 (4),
  // 8 (8), 12 (16 <= 16: floor(16 / 8) = 2 increments), then floor((60 - 28) / 12) = 2 more.
  RawOptions raw = tiny();
  raw["global-batch-size"] = {"12"};
  raw["rampup-batch-size"] = {"4", "4", "16"};
  raw["train-samples"] = {"60"};
  raw["lr-warmup-samples"] = {"24"};
  const auto m = run(raw);
  ASSERT_EQ(m.size(), 6u);
  EXPECT_EQ(column<int64_t>(m, "global_batch_size"), (std::vector<int64_t>{4, 4, 8, 12, 12, 12}));
  EXPECT_EQ(column<int64_t>(m, "consumed_samples"), (std::vector<int64_t>{4, 8, 16, 28, 40, 52}));
  // Warmup over 24 samples, counted in the samples of the updates before: 0, 4, 8, 16.
  const auto lr = column<double>(m, "lr");
  EXPECT_DOUBLE_EQ(lr[0], 0.0);
  EXPECT_NEAR(lr[1], 1e-3 * 4 / 24, 1e-15);
  EXPECT_NEAR(lr[2], 1e-3 * 8 / 24, 1e-15);
  EXPECT_NEAR(lr[3], 1e-3 * 16 / 24, 1e-15);
  // Then the linear decay to 0 over train-samples 60: at 28, (60 - 28) / (60 - 24).
  EXPECT_NEAR(lr[4], 1e-3 * 32 / 36, 1e-15);
}

TEST_F(BatchScheduleTrain, StepScheduleInTokens) {
  // seq-length 8: 128 tokens are 16 samples. Four batches of 4 reach 16, then 8s to 40.
  RawOptions raw = tiny();
  raw["step-batch-size-schedule"] = {"0:4 128:8"};
  raw["train-samples"] = {"40"};
  const auto m = run(raw);
  EXPECT_EQ(column<int64_t>(m, "global_batch_size"), (std::vector<int64_t>{4, 4, 4, 4, 8, 8, 8}));
  EXPECT_EQ(m.back().at("consumed_samples").get<int64_t>(), 40);
}

TEST_F(BatchScheduleTrain, IterationBasedStepScheduleUsesTheLastBatchForTheLrLengths) {
  // 6 iterations of batches 4, 4, 4, 4 (thresholds: 128 tokens = 16 samples), 8, 8; the
  // warmup of 2 iterations is 2 x 8 samples of the last batch size.
  RawOptions raw = tiny();
  raw["step-batch-size-schedule"] = {"0:4 128:8"};
  raw["train-iters"] = {"6"};
  raw["lr-warmup-iters"] = {"2"};
  const auto m = run(raw);
  EXPECT_EQ(column<int64_t>(m, "global_batch_size"), (std::vector<int64_t>{4, 4, 4, 4, 8, 8}));
  const auto lr = column<double>(m, "lr");
  EXPECT_NEAR(lr[1], 1e-3 * 4 / 16, 1e-15);
  EXPECT_NEAR(lr[3], 1e-3 * 12 / 16, 1e-15);
}

TEST_F(BatchScheduleTrain, ResumeInTheMiddleOfARampIsExact) {
  RawOptions raw = tiny();
  raw["global-batch-size"] = {"12"};
  raw["rampup-batch-size"] = {"4", "4", "16"};
  raw["train-samples"] = {"60"};
  raw["save"] = {(dir / "save").string()};
  raw["save-interval"] = {"2"};  // iteration 2: consumed 8, the ramp's next batch is 8
  const auto full = run(raw);
  RawOptions first = tiny();
  first.insert({"global-batch-size", {"12"}});
  first["rampup-batch-size"] = {"4", "4", "16"};
  first["train-samples"] = {"60"};
  first["save"] = {(dir / "resume").string()};
  first["save-interval"] = {"2"};
  first["exit-interval"] = {"2"};
  run(first);
  RawOptions second = first;
  second.erase("exit-interval");
  second["load"] = {(dir / "resume").string()};
  second["log-metrics-file"] = {(dir / "second.jsonl").string()};
  const auto resumed = run(second);
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < resumed.size(); ++i) {
    const auto& a = full[i + 2];
    const auto& b = resumed[i];
    EXPECT_EQ(a.at("iteration"), b.at("iteration"));
    EXPECT_EQ(a.at("global_batch_size"), b.at("global_batch_size"));
    EXPECT_EQ(a.at("consumed_samples"), b.at("consumed_samples"));
    EXPECT_EQ(a.at("lr").get<double>(), b.at("lr").get<double>());
    EXPECT_EQ(a.at("lm_loss").get<double>(), b.at("lm_loss").get<double>()) << "bit-identical";
    EXPECT_EQ(a.at("grad_norm").get<double>(), b.at("grad_norm").get<double>());
  }
}

TEST_F(BatchScheduleTrain, WeightDecayIncrements) {
  // Iteration-based: the run is 5 x 4 = 20 samples; linear from 0 to 0.1 at the samples of
  // the updates before: 0, 4, 8, 12, 16.
  RawOptions raw = tiny();
  raw["global-batch-size"] = {"4"};
  raw["train-iters"] = {"5"};
  raw["weight-decay-incr-style"] = {"linear"};
  raw["start-weight-decay"] = {"0"};
  raw["end-weight-decay"] = {"0.1"};
  const auto m = run(raw);
  const auto wd = column<double>(m, "weight_decay");
  ASSERT_EQ(wd.size(), 5u);
  for (size_t i = 0; i < wd.size(); ++i) EXPECT_NEAR(wd[i], 0.1 * double(4 * i) / 20, 1e-15);
  // The decay changes the update: the same run at constant 0.1 ends elsewhere.
  RawOptions constant = tiny();
  constant["global-batch-size"] = {"4"};
  constant["train-iters"] = {"5"};
  constant["weight-decay"] = {"0.1"};
  const auto c = run(constant);
  EXPECT_NE(c.back().at("lm_loss").get<double>(), m.back().at("lm_loss").get<double>());
}

TEST_F(BatchScheduleTrain, Refusals) {
  const auto refused = [&](RawOptions raw, const std::string& part) {
    try {
      parse_train_args(raw);
    } catch (const Error& e) {
      return std::string(e.what()).find(part) != std::string::npos
                 ? ::testing::AssertionSuccess()
                 : ::testing::AssertionFailure() << e.what();
    }
    return ::testing::AssertionFailure() << "accepted";
  };
  RawOptions raw = tiny();
  raw["global-batch-size"] = {"12"};
  raw["rampup-batch-size"] = {"4", "4", "16"};
  raw["train-iters"] = {"5"};
  raw["cuda-graph-impl"] = {"full_iteration"};
  EXPECT_TRUE(refused(raw, "batch-size schedule with cuda-graph-impl full_iteration"));
  raw.erase("cuda-graph-impl");
  raw["train-samples"] = {"60"};
  EXPECT_TRUE(refused(raw, "give one of train-iters and train-samples"));
  raw.erase("train-iters");
  raw["lr-warmup-iters"] = {"2"};
  EXPECT_TRUE(refused(raw, "lr-warmup-iters does not go with train-samples"));
  RawOptions step = tiny();
  step["step-batch-size-schedule"] = {"0:4"};
  step["global-batch-size"] = {"4"};
  step["train-samples"] = {"8"};
  EXPECT_TRUE(refused(step, "Cannot specify both --step-batch-size-schedule"));
  RawOptions wd = tiny();
  wd["train-iters"] = {"2"};
  wd["start-weight-decay"] = {"0"};
  EXPECT_TRUE(refused(wd, "need weight-decay-incr-style linear or cosine"));
  wd["weight-decay-incr-style"] = {"cosine"};
  EXPECT_TRUE(refused(wd, "needs start-weight-decay and end-weight-decay"));
}

}  // namespace
}  // namespace megaton
