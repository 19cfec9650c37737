// --async-save (issue 21): each rank's checkpoint file is written by a background thread from
// a host snapshot taken at the save's iteration, and the index is committed at a later step.
// The files equal a blocking save's byte for byte, the metadata records the save's
// iteration (not the commit's), and a resume from them continues the uninterrupted run
// exactly.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "ckpt/checkpoint.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

class AsyncSave : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("megaton_async_save_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  // A small MoE model (expert bias through the checkpoint too) on one CPU rank.
  RawOptions tiny(int64_t iters, const fs::path& save) const {
    return {{"device", {"cpu"}},
            {"mock-data", {"true"}},
            {"tokenizer-type", {"NullTokenizer"}},
            {"vocab-size", {"64"}},
            {"num-layers", {"2"}},
            {"hidden-size", {"32"}},
            {"num-attention-heads", {"4"}},
            {"position-embedding-type", {"rope"}},
            {"num-experts", {"4"}},
            {"moe-router-topk", {"2"}},
            {"moe-router-enable-expert-bias", {"true"}},
            {"moe-router-score-function", {"sigmoid"}},
            {"seq-length", {"16"}},
            {"micro-batch-size", {"2"}},
            {"global-batch-size", {"4"}},
            {"train-iters", {std::to_string(iters)}},
            {"lr", {"1e-3"}},
            {"eval-iters", {"0"}},
            {"log-interval", {"1"}},
            {"save", {save.string()}},
            {"save-interval", {"2"}}};
  }
  static TrainResult run(RawOptions raw) {
    TrainArgs args = parse_train_args(raw);
    return Trainer(args, raw).train();
  }
  static std::string bytes(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  fs::path dir;
};

TEST_F(AsyncSave, SameFilesAsBlockingAndResumesExactly) {
  const TrainResult blocking = run(tiny(6, dir / "blocking"));
  RawOptions async_raw = tiny(6, dir / "async");
  async_raw["async-save"] = {"true"};
  const TrainResult async = run(async_raw);
  EXPECT_EQ(async.losses, blocking.losses);
  for (const char* it : {"iter_0000002", "iter_0000004", "iter_0000006"}) {
    SCOPED_TRACE(it);
    const fs::path a = dir / "async" / it, b = dir / "blocking" / it;
    ASSERT_TRUE(fs::exists(a / "metadata.json"));
    EXPECT_EQ(bytes(a / "rank_00000.safetensors"), bytes(b / "rank_00000.safetensors"));
    // The metadata differs in the saved flags only (--save, --async-save).
    auto ma = nlohmann::json::parse(bytes(a / "metadata.json")),
         mb = nlohmann::json::parse(bytes(b / "metadata.json"));
    ma.erase("args");
    mb.erase("args");
    EXPECT_EQ(ma, mb);
  }
  EXPECT_EQ(ckpt::tracked_iteration((dir / "async").string()), 6);
  // No temporary directory is left.
  for (const auto& entry : fs::directory_iterator(dir / "async"))
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  // Resuming from the background-written iteration 2 repeats iterations 3..6.
  RawOptions resume = tiny(6, dir / "resumed");
  resume["load"] = {(dir / "async").string()};
  resume["ckpt-step"] = {"2"};
  const TrainResult resumed = run(resume);
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], blocking.losses[i + 2]) << i + 3;
}

}  // namespace
}  // namespace megaton
