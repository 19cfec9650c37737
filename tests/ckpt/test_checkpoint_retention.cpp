// Checkpoint directories: --save-retain-interval keeps exactly the latest checkpoint and
// the multiples of the interval; the partial save of a killed run is removed and its
// iteration rewritten cleanly.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "ckpt/checkpoint.h"

namespace megaton::ckpt {
namespace {

namespace fs = std::filesystem;

class CheckpointDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("megaton_retain_" + std::to_string(getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  std::string save(int64_t iteration, int64_t retain) {
    Tensor t = Tensor::zeros({2}, DType::F32, Device::CPU);
    t.f32()[1] = float(iteration);
    SaveOptions options;
    options.save_retain_interval = retain;
    return save_checkpoint(dir_.string(), iteration, {{"w", t}},
                           "{\"iteration\": " + std::to_string(iteration) + "}", options);
  }
  fs::path dir_;
};

TEST_F(CheckpointDir, RetainIntervalKeepsLatestAndMultiples) {
  const std::string tracker = "latest_checkpointed_iteration.txt";
  EXPECT_EQ(save(10, 30), "");
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000010", tracker}));
  EXPECT_EQ(save(20, 30), (dir_ / "iter_0000010").string());
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000020", tracker}));
  save(30, 30);
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000030", tracker}));
  EXPECT_EQ(save(40, 30), "") << "30 is a multiple of the interval";
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000030", "iter_0000040", tracker}));
  save(50, 30);
  save(60, 30);
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000030", "iter_0000060", tracker}));
  EXPECT_EQ(tracked_iteration(dir_.string()), 60);
  save(60, 30);  // the same iteration again: replaced, nothing else removed
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000030", "iter_0000060", tracker}));
  // Without retention every checkpoint stays.
  save(70, 0);
  save(80, 0);
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000030", "iter_0000060", "iter_0000070",
                                                 "iter_0000080", tracker}));
}

TEST_F(CheckpointDir, RetainSkipsSymbolicLinks) {
  save(10, 100);
  fs::rename(dir_ / "iter_0000010", dir_ / "real");
  fs::create_directory_symlink(dir_ / "real", dir_ / "iter_0000010");
  EXPECT_EQ(save(20, 100), "");
  EXPECT_TRUE(fs::is_symlink(dir_ / "iter_0000010"));
  EXPECT_TRUE(fs::exists(dir_ / "real" / "model_optim_rng.safetensors"));
}

TEST_F(CheckpointDir, KilledSaveIsOverwrittenCleanly) {
  save(10, 0);
  // A process that is gone: its partial iteration directory and tracker are stale.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  const fs::path partial = dir_ / ("iter_0000020.tmp" + std::to_string(child));
  fs::create_directories(partial);
  std::ofstream(partial / "model_optim_rng.safetensors") << "truncated";
  std::ofstream(dir_ / ("latest_checkpointed_iteration.txt.tmp" + std::to_string(child))) << "2";
  EXPECT_EQ(tracked_iteration(dir_.string()), 10) << "the killed save never moved the tracker";
  save(20, 0);
  EXPECT_EQ(entries(), (std::vector<std::string>{"iter_0000010", "iter_0000020",
                                                 "latest_checkpointed_iteration.txt"}));
  LoadedCheckpoint ck = load_checkpoint(dir_.string());
  EXPECT_EQ(ck.iteration, 20);
  EXPECT_EQ(ck.tensors.at("w").f32()[1], 20.0f);
}

TEST(TrackedIteration, MissingOrJunkIsMinusOne) {
  const fs::path dir = fs::temp_directory_path() / ("megaton_tracker_" + std::to_string(getpid()));
  fs::create_directories(dir);
  EXPECT_EQ(tracked_iteration(dir.string()), -1);
  std::ofstream(dir / "latest_checkpointed_iteration.txt") << "release\n";
  EXPECT_EQ(tracked_iteration(dir.string()), -1);
  std::ofstream(dir / "latest_checkpointed_iteration.txt") << "1234\n";
  EXPECT_EQ(tracked_iteration(dir.string()), 1234);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace megaton::ckpt
