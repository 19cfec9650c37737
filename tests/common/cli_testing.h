// The CLI error tests' fixture (test_cli_errors*.cpp): runs the `megaton` binary on a
// tiny corpus and checks that bad input gives one line naming the culprit, exit status 2,
// and nothing written.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/preprocess.h"

namespace megaton {

namespace fs = std::filesystem;

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
  // shell: commands run before the binary in the same shell ("ulimit -v 4194304;").
  int run(const std::string& args, const std::string& env = "", const std::string& shell = "") {
    fs::path err = dir / "stderr.txt";
    std::string cmd = (env.empty() ? "" : "env " + env + " ") + std::string(MEGATON_BINARY) + " " +
                      args + " > /dev/null 2> " + err.string();
    if (!shell.empty()) cmd = "bash -c '" + shell + " exec " + cmd + "'";
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

// A valid tiny model for config(): the lines callers add to.
inline const char* kModel = "num-layers: 1\nhidden-size: 16\nnum-attention-heads: 2\n";

// A tiny model on random tokens (no data files): the flags of the binary runs.
inline const std::string kMock =
    "train --device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 100 "
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
    "--micro-batch-size 2 --eval-iters 0 --log-interval 1";

}  // namespace megaton
