// Megatron's run logs and run control in training (issue 19): TensorBoard scalars read back
// from the event file, the progress log, memory reports, --exit-duration-in-mins, and
// --exit-signal-handler (SIGTERM: the step finishes, a checkpoint is saved, exit 0).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "ckpt/checkpoint.h"
#include "tensorboard_testing.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

class RunLogs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_run_logs_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  RawOptions tiny(int64_t iters) const {
    return {{"device", {"cpu"}},         {"mock-data", {"true"}},
            {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"64"}},
            {"num-layers", {"2"}},       {"hidden-size", {"16"}},
            {"num-attention-heads", {"2"}}, {"seq-length", {"8"}},
            {"micro-batch-size", {"2"}}, {"global-batch-size", {"4"}},
            {"train-iters", {std::to_string(iters)}}, {"lr", {"1e-3"}},
            {"eval-iters", {"1"}},       {"eval-interval", {"2"}},
            {"log-interval", {"2"}},
            {"log-metrics-file", {(dir / "metrics.jsonl").string()}}};
  }
  std::vector<nlohmann::json> metrics() const {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  fs::path dir;
};

TEST_F(RunLogs, TensorBoardScalarsMatchTheMetrics) {
  RawOptions raw = tiny(4);
  raw["tensorboard-dir"] = {(dir / "tb").string()};
  raw["log-timers-to-tensorboard"] = {"true"};
  raw["log-validation-ppl-to-tensorboard"] = {"true"};
  raw["log-world-size-to-tensorboard"] = {"true"};
  {
    TrainArgs args = parse_train_args(raw);
    Trainer(args, raw).train();
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir / "tb")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  std::map<std::string, std::vector<testing::Scalar>> by_tag;
  for (const testing::Scalar& s : testing::read_events(files[0].string()))
    if (!s.tag.empty()) by_tag[s.tag].push_back(s);
  const auto m = metrics();
  ASSERT_EQ(m.size(), 4u);
  ASSERT_EQ(by_tag["lm loss"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(by_tag["lm loss"][i].step, int64_t(i + 1));
    EXPECT_EQ(by_tag["lm loss"][i].value, float(m[i].at("lm_loss").get<double>()));
    EXPECT_EQ(by_tag["learning-rate"][i].value, float(m[i].at("lr").get<double>()));
    EXPECT_EQ(by_tag["grad-norm"][i].value, float(m[i].at("grad_norm").get<double>()));
    EXPECT_EQ(by_tag["batch-size"][i].value, 4.0f);
    EXPECT_EQ(by_tag["world-size"][i].value, 1.0f);
    // " vs samples": the same value against the consumed samples.
    EXPECT_EQ(by_tag["lm loss vs samples"][i].step, int64_t(4 * (i + 1)));
  }
  EXPECT_EQ(by_tag["iteration-time"].size(), 2u);  // at the log interval (2 of 4)
  EXPECT_EQ(by_tag.count("loss-scale"), 0u) << "no loss scaler in an fp32 run";
  // Validation at iterations 2 and 4 (eval-interval 2; the end), with its perplexity.
  ASSERT_GE(by_tag["lm loss validation"].size(), 1u);
  const testing::Scalar& v = by_tag["lm loss validation"][0];
  EXPECT_EQ(v.step, 2);
  EXPECT_NEAR(by_tag["lm loss validation ppl"][0].value, std::exp(v.value), 1e-3 * std::exp(v.value));
}

// Multi-token prediction's "mtp_<k> loss" (issue 20): per depth in the metrics file, as
// TensorBoard scalars of the same values, and on the log line; positive cross entropies
// near the lm loss of an untrained model, not the lm loss itself.
TEST_F(RunLogs, MtpLossesAreLogged) {
  RawOptions raw = tiny(2);
  raw["position-embedding-type"] = {"rope"};
  raw["mtp-num-layers"] = {"2"};
  raw["tensorboard-dir"] = {(dir / "tb").string()};
  raw["log-interval"] = {"1"};
  ::testing::internal::CaptureStdout();
  {
    TrainArgs args = parse_train_args(raw);
    Trainer(args, raw).train();
  }
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("| mtp_1 loss: "), std::string::npos) << out;
  EXPECT_NE(out.find("| mtp_2 loss: "), std::string::npos) << out;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir / "tb")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  std::map<std::string, std::vector<testing::Scalar>> by_tag;
  for (const testing::Scalar& s : testing::read_events(files[0].string()))
    if (!s.tag.empty()) by_tag[s.tag].push_back(s);
  const auto m = metrics();
  ASSERT_EQ(m.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    for (const char* k : {"1", "2"}) {
      const double v = m[i].at(std::string("mtp_") + k + "_loss").get<double>();
      EXPECT_GT(v, 0.5 * m[i].at("lm_loss").get<double>());
      EXPECT_NE(v, m[i].at("lm_loss").get<double>());
      ASSERT_EQ(by_tag[std::string("mtp_") + k + " loss"].size(), 2u);
      EXPECT_EQ(by_tag[std::string("mtp_") + k + " loss"][i].value, float(v));
    }
}

TEST_F(RunLogs, ProgressLogAndMemoryReport) {
  RawOptions raw = tiny(4);
  raw["save"] = {(dir / "save").string()};
  raw["save-interval"] = {"2"};
  raw["log-progress"] = {"true"};
  raw["log-memory-interval"] = {"2"};
  raw["log-device-memory-used"] = {"true"};
  ::testing::internal::CaptureStdout();
  {
    TrainArgs args = parse_train_args(raw);
    Trainer(args, raw).train();
  }
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("[Rank 0] (after 2 iterations) memory (MB) | allocated: "), std::string::npos) << out;
  EXPECT_NE(out.find("(after 4 iterations) memory (MB)"), std::string::npos);
  EXPECT_NE(out.find("total device memory used: "), std::string::npos);
  std::ifstream in(dir / "save" / "progress.txt");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 3u) << "start, then the checkpoints of iterations 2 and 4";
  EXPECT_NE(lines[0].find("\t# GPUs: 1\tStarting job"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("Saved checkpoint\tIteration: 2\tJob throughput: "), std::string::npos)
      << lines[1];
  EXPECT_NE(lines[2].find("Iteration: 4"), std::string::npos);
  // 4 iterations x 4 samples x 8 tokens = 128 tokens.
  EXPECT_NE(lines[2].find("Tokens (in billions): 0.00"), std::string::npos) << lines[2];
}

TEST_F(RunLogs, ExitDurationSavesAndStops) {
  RawOptions raw = tiny(50);
  raw["save"] = {(dir / "save").string()};
  raw["exit-duration-in-mins"] = {"1e-7"};  // 6 microseconds: past after the first step
  TrainResult r;
  {
    TrainArgs args = parse_train_args(raw);
    r = Trainer(args, raw).train();
  }
  EXPECT_EQ(r.final_iteration, 1);
  EXPECT_EQ(ckpt::tracked_iteration((dir / "save").string()), 1);
}

TEST_F(RunLogs, SigtermFinishesTheStepSavesAndExitsZero) {
  const std::string save = (dir / "save").string();
  const std::string metrics_path = (dir / "metrics.jsonl").string();
  const std::string log = (dir / "out.txt").string();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    execl(MEGATON_BINARY, MEGATON_BINARY, "train", "--device", "cpu", "--mock-data",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-layers", "2",
          "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
          "--micro-batch-size", "2", "--train-iters", "100000", "--eval-iters", "0",
          "--log-interval", "1", "--save", save.c_str(), "--exit-signal-handler",
          "--log-metrics-file", metrics_path.c_str(), (char*)nullptr);
    _exit(127);
  }
  // Wait for a few logged iterations, then send SIGTERM (Slurm's preemption signal).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  size_t logged = 0;
  while (logged < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    logged = metrics().size();
  }
  ASSERT_GE(logged, 3u) << "the run did not start";
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  std::ifstream in(log);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(status)) << out.substr(out.size() > 2000 ? out.size() - 2000 : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_NE(out.find("exiting program after receiving SIGTERM."), std::string::npos);
  // The checkpoint is of the last iteration the run finished and logged.
  const auto m = metrics();
  ASSERT_FALSE(m.empty());
  EXPECT_EQ(ckpt::tracked_iteration(save), m.back().at("iteration").get<int64_t>());
  EXPECT_LT(m.back().at("iteration").get<int64_t>(), 100000);
}

}  // namespace
}  // namespace megaton
