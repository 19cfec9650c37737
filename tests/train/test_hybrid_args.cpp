// Hybrid-model flags (issue 23): what --hybrid-layer-pattern and the Mamba flags set, and
// bad input to the `megaton` binary (an unknown symbol, a pattern whose length is not
// --num-layers, Mamba sizes that do not divide): one line naming it, exit status 2,
// nothing written.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/args_testing.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

RawOptions hybrid(const std::string& pattern) {
  RawOptions raw = testing::tiny_train_options();
  raw.erase("num-layers");
  raw["hybrid-layer-pattern"] = {pattern};
  raw["mamba-head-dim"] = {"8"};
  raw["mamba-num-groups"] = {"2"};
  raw["mamba-state-dim"] = {"8"};
  return raw;
}

TEST(HybridArgs, PatternAndMambaSizesAreRead) {
  const TrainArgs a = parse_train_args(hybrid("M*-|M-"));
  EXPECT_EQ(a.model.hybrid_layer_pattern, "M*-|M-");
  EXPECT_EQ(a.model.num_layers, 5);  // the pattern's, for the later checks
  EXPECT_EQ(a.model.mamba_head_dim, 8);
  EXPECT_EQ(a.model.mamba_num_groups, 2);
  EXPECT_EQ(a.model.mamba_state_dim, 8);
  // Megatron's deprecated name, with a notice.
  RawOptions old = hybrid("M-");
  old.erase("hybrid-layer-pattern");
  old["hybrid-override-pattern"] = {"M-"};
  const TrainArgs b = parse_train_args(old);
  EXPECT_EQ(b.model.hybrid_layer_pattern, "M-");
  EXPECT_FALSE(b.no_effect.empty());
  // Two segments make two pipeline stages of 3 and 2 layers.
  RawOptions pp = hybrid("M*-|M-");
  pp["pipeline-model-parallel-size"] = {"2"};
  EXPECT_EQ(check_parallel_layout(parse_train_args(pp), 2).layers_per_stage,
            (std::vector<int64_t>{3, 2}));
}

TEST(HybridArgs, RefusalsNameTheFlag) {
  RawOptions both = hybrid("M-");
  both["hybrid-override-pattern"] = {"M-"};
  EXPECT_NE(testing::layout_error(both, 1).find("cannot both be given"), std::string::npos);
  RawOptions plain = testing::tiny_train_options();
  plain["mamba-state-dim"] = {"16"};
  EXPECT_NE(testing::layout_error(plain, 1).find("mamba-state-dim applies to hybrid models"),
            std::string::npos);
  RawOptions flag_only = testing::tiny_train_options();
  flag_only["is-hybrid-model"] = {"true"};
  EXPECT_NE(testing::layout_error(flag_only, 1).find("is-hybrid-model needs"), std::string::npos);
  RawOptions pp = hybrid("M*-|M-|-");
  pp["pipeline-model-parallel-size"] = {"2"};
  EXPECT_NE(testing::layout_error(pp, 2).find("3 '|' segments for pipeline-model-parallel-size 2"),
            std::string::npos);
  RawOptions cp = hybrid("M*");
  cp["context-parallel-size"] = {"2"};
  EXPECT_NE(testing::layout_error(cp, 2).find("Mamba layers"), std::string::npos);
}

// The binary: exit status 2 with one line, and no save directory.
class HybridCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("megaton_hybrid_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  void expect_user_error(const std::string& flags, const std::string& needle) {
    const fs::path err = dir / "stderr.txt";
    const std::string cmd = std::string(MEGATON_BINARY) +
                            " train --device cpu --mock-data --tokenizer-type NullTokenizer "
                            "--vocab-size 63 --hidden-size 32 --num-attention-heads 4 "
                            "--seq-length 16 --micro-batch-size 1 --train-iters 1 --save " +
                            (dir / "save").string() + " " + flags + " > /dev/null 2> " +
                            err.string();
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 2) << flags;
    std::ifstream in(err);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    ASSERT_EQ(lines.size(), 1u) << flags;
    EXPECT_NE(lines[0].find(needle), std::string::npos) << lines[0];
    EXPECT_FALSE(fs::exists(dir / "save"));
  }
  fs::path dir;
};

TEST_F(HybridCli, BadPatternsAndSizesExitWithStatusTwo) {
  expect_user_error("--hybrid-layer-pattern 'M-X'", "'X' is not a layer symbol");
  expect_user_error("--hybrid-layer-pattern 'M-G'", "gated delta net");
  expect_user_error("--num-layers 3 --hybrid-layer-pattern 'M-M*'",
                    "has 4 layers but num-layers is 3");
  expect_user_error("--hybrid-layer-pattern 'M-E'", "E (MoE) layers but num-experts");
  // 2 x 32 channels in heads of 6.
  expect_user_error("--hybrid-layer-pattern 'M-' --mamba-head-dim 6",
                    "not divisible by mamba-head-dim (6)");
  expect_user_error("--hybrid-layer-pattern 'M-' --mamba-head-dim 8 --mamba-num-groups 3",
                    "not divisible by mamba-num-groups (3)");
  // FP8 GEMMs need in_proj's width a multiple of 16: 2 x 64 + 2 x 8 x 128 + 8 = 2184.
  expect_user_error("--hybrid-layer-pattern 'M-' --mamba-head-dim 8 --fp8-format hybrid "
                    "--fp8-recipe tensorwise",
                    "in_proj's width");
}

}  // namespace
}  // namespace megaton
