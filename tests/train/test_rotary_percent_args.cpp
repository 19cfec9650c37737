// --rotary-percent (partial RoPE) at the command line: bad values exit with status 2 and
// one line naming the flag, a run trains with it, and its checkpoint gives the value back
// (--use-checkpoint-args and generation's model loading read the saved flags).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "train/checkpoint_args.h"
#include "train/generate.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

// Mock data and a model with 2 heads of 8 channels (--kv-channels changes that).
const std::string kMock =
    "train --device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 100 "
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
    "--micro-batch-size 2 --eval-iters 0 --log-interval 1 --train-iters 2";

class RotaryPercentCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_rotary_percent_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  // Runs the binary with `args`; returns its exit status and fills stderr_lines.
  int run(const std::string& args) {
    const fs::path err = dir / "stderr.txt";
    const std::string cmd =
        std::string(MEGATON_BINARY) + " " + args + " > /dev/null 2> " + err.string();
    const int status = std::system(cmd.c_str());
    std::ifstream in(err);
    stderr_lines.clear();
    for (std::string line; std::getline(in, line);) stderr_lines.push_back(line);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  fs::path dir;
  std::vector<std::string> stderr_lines;
};

TEST_F(RotaryPercentCli, BadValuesExitWithStatus2AndOneLine) {
  const std::string rope = kMock + " --position-embedding-type rope ";
  const std::pair<std::string, std::string> cases[] = {
      // kv-channels 10 x 0.3 = 3 channels: odd.
      {rope + "--kv-channels 10 --rotary-percent 0.3",
       "rotary-percent 0.3 gives a rotary dim of 3 = int(kv-channels 10 x rotary-percent): it "
       "must be even and positive"},
      // 8 x 0.1 = 0 channels.
      {rope + "--rotary-percent 0.1", "rotary dim of 0"},
      {rope + "--rotary-percent 0", "rotary-percent must be in (0, 1] (got 0)"},
      {rope + "--rotary-percent 1.5", "rotary-percent must be in (0, 1] (got 1.5)"},
      {rope + "--multi-latent-attention --rotary-percent 0.5",
       "rotary-percent 0.5 with multi-latent-attention is not supported"},
  };
  for (const auto& [args, needle] : cases) {
    SCOPED_TRACE(args);
    const fs::path save = dir / "save";
    EXPECT_EQ(run(args + " --save " + save.string()), 2);
    ASSERT_EQ(stderr_lines.size(), 1u);
    EXPECT_NE(stderr_lines[0].find(needle), std::string::npos)
        << "'" << stderr_lines[0] << "' does not mention '" << needle << "'";
    EXPECT_FALSE(fs::exists(save)) << "a failed run wrote its save directory";
  }
}

// Learned absolute positions have no rotary table: Megatron ignores the flag, so does
// Megaton (a value in range; an odd rotary dim is not refused).
TEST_F(RotaryPercentCli, LearnedPositionsIgnoreIt) {
  EXPECT_EQ(run(kMock + " --kv-channels 10 --rotary-percent 0.3"), 0)
      << (stderr_lines.empty() ? "" : stderr_lines.back());
}

// A run with partial RoPE trains and saves; the checkpoint's flags carry rotary-percent 0.5
// back into --use-checkpoint-args (which takes it over the command line's, Megatron's
// force rule) and into the model generation loads.
TEST_F(RotaryPercentCli, TrainsAndTheCheckpointKeepsIt) {
  const fs::path save = dir / "ck";
  ASSERT_EQ(run(kMock + " --position-embedding-type rope --rotary-percent 0.5 --save " +
                save.string() + " --save-interval 2"),
            0)
      << (stderr_lines.empty() ? "" : stderr_lines.back());

  RawOptions raw = {{"device", {"cpu"}},         {"mock-data", {"true"}},
                    {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"100"}},
                    {"train-iters", {"4"}},      {"micro-batch-size", {"2"}},
                    {"rotary-percent", {"0.25"}}, {"use-checkpoint-args", {"true"}},
                    {"load", {save.string()}}};
  const CheckpointArgs from_ckpt = apply_checkpoint_args(raw);
  ASSERT_TRUE(from_ckpt.raw.count("rotary-percent"));
  EXPECT_EQ(from_ckpt.raw.at("rotary-percent"), std::vector<std::string>{"0.5"});
  const TrainArgs args = parse_train_args(from_ckpt.raw);
  EXPECT_EQ(args.model.rotary_percent, 0.5);
  EXPECT_EQ(args.model.position_embedding_type, PositionEmbedding::Rope);

  const LoadedModel loaded = load_model_for_inference(save.string());
  EXPECT_EQ(loaded.model->config().rotary_percent, 0.5);
  EXPECT_EQ(loaded.model->config().rotary_dim(), 4);
}

}  // namespace
}  // namespace megaton
