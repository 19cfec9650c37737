// `megaton train ... --dry-run`: prints the plan and its total, exits 0, writes nothing;
// bad flags fail as in a normal run (one line, exit 2).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace megaton {
namespace {

struct Result {
  int status = -1;
  std::string out, err;
};

Result run(const std::string& args, const std::string& env = "") {
  const fs::path dir = fs::temp_directory_path() / ("megaton_dry_run_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string cmd = (env.empty() ? "" : "env " + env + " ") + std::string(MEGATON_BINARY) +
                          " train " + args + " > " + (dir / "out").string() + " 2> " +
                          (dir / "err").string();
  const int status = std::system(cmd.c_str());
  Result r;
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::stringstream out, err;
  out << std::ifstream(dir / "out").rdbuf();
  err << std::ifstream(dir / "err").rdbuf();
  r.out = out.str();
  r.err = err.str();
  fs::remove_all(dir);
  return r;
}

const std::string kFlags =
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 4 "
    "--hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
    "--train-iters 10 --num-experts 8 --moe-router-topk 2 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear";

TEST(DryRun, PrintsThePlanAndExitsZero) {
  const fs::path save = fs::temp_directory_path() / ("megaton_dry_save_" + std::to_string(::getpid()));
  const Result r = run(kFlags + " --dry-run --save " + save.string() + " --save-interval 1");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("= total"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Adam exp_avg"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(" iteration "), std::string::npos) << "a dry run trained:\n" << r.out;
  EXPECT_FALSE(fs::exists(save)) << "a dry run wrote its save directory";
}

// WORLD_SIZE plans a layout of several ranks from one process (as Megatron reads it).
TEST(DryRun, PlansTheWorldSizeOfTheEnvironment) {
  const Result r = run(kFlags + " --dry-run --expert-model-parallel-size 4 "
                                "--pipeline-model-parallel-size 2 --global-batch-size 8",
                       "WORLD_SIZE=8");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("world 8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ep 4"), std::string::npos) << r.out;
}

TEST(DryRun, BadFlagsFailAsInARun) {
  // A layout that does not divide the world.
  Result r = run(kFlags + " --dry-run --tensor-model-parallel-size 3", "WORLD_SIZE=4");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.err.find("tensor-model-parallel-size"), std::string::npos) << r.err;
  // A bad value.
  r = run(kFlags + " --dry-run --hidden-size -5");
  EXPECT_EQ(r.status, 2) << r.out;
  // A bad WORLD_SIZE.
  r = run(kFlags + " --dry-run", "WORLD_SIZE=two");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.err.find("WORLD_SIZE"), std::string::npos) << r.err;
}

// --main-params-dtype fp16 needs bf16/fp16 weights apart from the main params: a dry run
// for --device cuda --bf16 plans it (2-byte main params with their scales); a CPU run
// (fp32 weights) refuses it in one line, exit 2.
TEST(DryRun, Fp16MainParamsPlannedForTheGpuRefusedOnTheCpu) {
  const std::string flags = kFlags + " --dry-run --use-precision-aware-optimizer "
                                     "--main-params-dtype fp16";
  std::string gpu = flags;
  gpu.replace(gpu.find("--device cpu"), 12, "--device cuda --bf16");
  const Result planned = run(gpu);
  EXPECT_EQ(planned.status, 0) << planned.err;
  EXPECT_NE(planned.out.find("main params (fp16 + an fp32 scale per param"), std::string::npos)
      << planned.out;
  const Result refused = run(flags + " --bf16");
  EXPECT_EQ(refused.status, 2);
  EXPECT_NE(refused.err.find("option 'main-params-dtype' fp16 needs bf16 or fp16 weights"),
            std::string::npos)
      << refused.err;
}

}  // namespace
}  // namespace megaton
