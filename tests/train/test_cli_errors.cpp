// Bad input to the `megaton` binary: one line naming the culprit, exit status 2, and
// nothing written.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/preprocess.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

class CliErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("megaton_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::ofstream(dir / "corpus.jsonl") << "{\"text\": \"hello world, hello megaton\"}\n"
                                        << "{\"text\": \"another small document here\"}\n";
    data::PreprocessOptions opt;
    opt.inputs = {(dir / "corpus.jsonl").string()};
    opt.output_prefix = (dir / "corpus").string();
    opt.tokenizer_type = "ByteTokenizer";
    data::preprocess(opt);
    prefix = (dir / "corpus_text_document").string();
  }
  void TearDown() override { fs::remove_all(dir); }

  // Writes a config (a valid tiny model plus `extra` lines, which override by coming
  // last... YAML forbids duplicate keys, so callers pass only new keys) and runs train.
  std::string config(const std::string& model_lines) {
    fs::path p = dir / "config.yaml";
    std::ofstream(p) << model_lines << "seq-length: 8\nmicro-batch-size: 1\ntrain-iters: 2\n"
                     << "tokenizer-type: ByteTokenizer\nsplit: 1,0,0\ndata-path: " << prefix
                     << "\n";
    return p.string();
  }

  // Runs the binary; returns the exit status and fills stderr_lines.
  // env: "NAME=value ..." set for the binary only.
  int run(const std::string& args, const std::string& env = "") {
    fs::path err = dir / "stderr.txt";
    std::string cmd = (env.empty() ? "" : "env " + env + " ") + std::string(MEGATON_BINARY) + " " +
                      args + " > /dev/null 2> " + err.string();
    int status = std::system(cmd.c_str());
    std::ifstream in(err);
    stderr_lines.clear();
    for (std::string line; std::getline(in, line);) stderr_lines.push_back(line);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  void expect_user_error(const std::string& args, const std::string& needle,
                         const std::string& env = "") {
    int rc = run(args + " --save " + (dir / "save").string(), env);
    EXPECT_EQ(rc, 2) << args;
    ASSERT_EQ(stderr_lines.size(), 1u) << args;
    EXPECT_NE(stderr_lines[0].find(needle), std::string::npos)
        << "'" << stderr_lines[0] << "' does not mention '" << needle << "'";
    EXPECT_FALSE(fs::exists(dir / "save")) << "a failed run wrote its save directory";
  }

  fs::path dir;
  std::string prefix;
  std::vector<std::string> stderr_lines;
};

const char* kModel = "num-layers: 1\nhidden-size: 16\nnum-attention-heads: 2\n";

TEST_F(CliErrors, UnknownConfigKey) {
  expect_user_error("train --config " + config(std::string(kModel) + "hiden-size: 3\n"),
                    "unknown key 'hiden-size'");
}

TEST_F(CliErrors, HiddenNotDivisibleByHeads) {
  expect_user_error(
      "train --config " + config("num-layers: 1\nhidden-size: 10\nnum-attention-heads: 3\n"),
      "hidden-size (10) is not divisible by num-attention-heads (3)");
}

TEST_F(CliErrors, TopKAboveExperts) {
  expect_user_error("train --config " +
                        config(std::string(kModel) + "num-experts: 2\nmoe-router-topk: 3\n"),
                    "moe-router-topk (3) must be between 1 and num-experts (2)");
}

// Megatron's router configuration checks, one line each.
TEST_F(CliErrors, RouterOptionsThatClash) {
  const std::string moe = std::string(kModel) + "num-experts: 4\n";
  const std::pair<const char*, const char*> cases[] = {
      {"moe-router-topk: 1\n",
       "moe-router-topk 1 with the softmax score function needs moe-router-pre-softmax"},
      {"moe-router-enable-expert-bias: true\n",
       "moe-router-enable-expert-bias needs moe-router-score-function sigmoid or sqrtsoftplus"},
      {"moe-router-num-groups: 3\nmoe-router-group-topk: 1\n",
       "num-experts (4) is not divisible by moe-router-num-groups (3)"},
      {"moe-router-num-groups: 2\nmoe-router-group-topk: 3\n",
       "moe-router-group-topk (3) must be between 1 and moe-router-num-groups (2)"},
      {"moe-router-score-function: relu\n",
       "moe-router-score-function must be softmax, sigmoid or sqrtsoftplus (got 'relu')"},
      {"moe-router-load-balancing-type: [aux_loss, z]\n",
       "moe-router-load-balancing-type 'z' must be aux_loss, seq_aux_loss, global_aux_loss"},
      {"moe-router-load-balancing-type: [aux_loss, seq_aux_loss]\nmoe-aux-loss-coeff: [1, 2, 3]\n",
       "moe-aux-loss-coeff has 3 values for 2 moe-router-load-balancing-type values"},
      {"moe-layer-freq: '[0]*1+[1]*3'\n", "moe-layer-freq pattern has 4 entries for num-layers 1"},
      {"moe-layer-freq: '[0]*'\n", "option 'moe-layer-freq': cannot read pattern '[0]*'"},
      {"moe-shared-expert-gate: true\n", "moe-shared-expert-gate needs a shared expert"},
      {"moe-pad-expert-input-to-capacity: true\n",
       "moe-pad-expert-input-to-capacity needs moe-expert-capacity-factor"},
      {"moe-expert-capacity-factor: 1.0\nmoe-token-drop-policy: random\n",
       "moe-token-drop-policy must be probs or position (got 'random')"},
  };
  for (const auto& [lines, message] : cases) {
    SCOPED_TRACE(lines);
    expect_user_error("train --config " + config(moe + lines), message);
  }
}

TEST_F(CliErrors, MissingCheckpoint) {
  expect_user_error("train --config " + config(kModel) + " --load " + (dir / "nope").string(),
                    (dir / "nope").string());
}

TEST_F(CliErrors, MissingIndexFile) {
  fs::remove(prefix + ".idx");
  expect_user_error("train --config " + config(kModel), prefix + ".idx");
}

TEST_F(CliErrors, CorruptIndexMagic) {
  {
    std::fstream f(prefix + ".idx", std::ios::in | std::ios::out | std::ios::binary);
    f.write("NOTANIDX", 8);
  }
  expect_user_error("train --config " + config(kModel), prefix + ".idx");
}

TEST_F(CliErrors, TruncatedIndex) {
  fs::resize_file(prefix + ".idx", fs::file_size(prefix + ".idx") - 5);
  expect_user_error("train --config " + config(kModel), prefix + ".idx");
}

TEST_F(CliErrors, BadFlagValue) {
  expect_user_error("train --config " + config(kModel) + " --lr fast", "'lr'");
}

TEST_F(CliErrors, BadAlltoAllExchangeSetting) {
  expect_user_error("train --config " + config(std::string(kModel) + "num-experts: 4\n"),
                    "MEGATON_MOE_ALLTOALL_EXCHANGE must be auto, regroup or pull (got 'yes')",
                    "MEGATON_MOE_ALLTOALL_EXCHANGE=yes");
}

TEST_F(CliErrors, MissingConfigFile) {
  expect_user_error("train --config " + (dir / "absent.yaml").string(),
                    (dir / "absent.yaml").string());
}

}  // namespace
}  // namespace megaton
