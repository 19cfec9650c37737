// Megatron's load options (issue 19): --no-load-optim, --no-load-rng and --finetune, each
// against an uninterrupted run.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

class LoadOptions : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_load_options_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  RawOptions tiny(int64_t iters, const std::string& name) const {
    return {{"device", {"cpu"}},         {"mock-data", {"true"}},
            {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"64"}},
            {"num-layers", {"2"}},       {"hidden-size", {"16"}},
            {"num-attention-heads", {"2"}}, {"seq-length", {"8"}},
            {"micro-batch-size", {"2"}}, {"global-batch-size", {"4"}},
            {"train-iters", {std::to_string(iters)}}, {"lr", {"1e-2"}},
            {"hidden-dropout", {"0.1"}}, {"eval-iters", {"0"}},
            {"log-interval", {"1"}},     {"save", {(dir / name).string()}},
            {"save-interval", {"2"}},
            {"log-metrics-file", {(dir / (name + ".jsonl")).string()}}};
  }
  std::vector<nlohmann::json> run(const RawOptions& raw) {
    {
      TrainArgs args = parse_train_args(raw);
      Trainer(args, raw).train();
    }
    std::vector<nlohmann::json> out;
    std::ifstream in(raw.at("log-metrics-file")[0]);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  nlohmann::json meta(const std::string& name) const {
    return nlohmann::json::parse(ckpt::load_checkpoint((dir / name).string()).metadata_json);
  }
  fs::path dir;
};

TEST_F(LoadOptions, NoLoadOptimNoLoadRngAndFinetune) {
  const auto full = run(tiny(4, "full"));
  ASSERT_EQ(full.size(), 4u);
  RawOptions first = tiny(4, "first");
  first["exit-interval"] = {"2"};
  run(first);  // the checkpoint of iteration 2 (the same 4-iteration schedule)

  // --no-load-rng: Megaton's randomness is keyed by the seed, iteration and micro-batch (no
  // RNG state), so the resumed run equals the uninterrupted one bit for bit.
  RawOptions rng = tiny(4, "rng");
  rng["load"] = {(dir / "first").string()};
  rng["no-load-rng"] = {"true"};
  const auto r = run(rng);
  ASSERT_EQ(r.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(r[i].at("iteration").get<int64_t>(), int64_t(3 + i));
    EXPECT_EQ(r[i].at("lm_loss").get<double>(), full[2 + i].at("lm_loss").get<double>());
  }

  // --no-load-optim: the weights and the iteration come back, the Adam state starts empty:
  // iteration 3's loss (before its update) is the uninterrupted run's, iteration 4's is not,
  // and the optimizer has made 2 steps, not 4.
  RawOptions optim = tiny(4, "optim");
  optim["load"] = {(dir / "first").string()};
  optim["no-load-optim"] = {"true"};
  const auto o = run(optim);
  ASSERT_EQ(o.size(), 2u);
  EXPECT_EQ(o[0].at("iteration").get<int64_t>(), 3);
  EXPECT_EQ(o[0].at("lm_loss").get<double>(), full[2].at("lm_loss").get<double>());
  EXPECT_NE(o[1].at("lm_loss").get<double>(), full[3].at("lm_loss").get<double>());
  EXPECT_EQ(meta("optim").at("optimizer_step").get<int64_t>(), 2);
  EXPECT_EQ(meta("full").at("optimizer_step").get<int64_t>(), 4);

  // --finetune: the weights only; iteration 0, consumed samples 0, an empty optimizer.
  RawOptions tune = tiny(2, "tune");  // a run of its own (2 iterations)
  tune["load"] = {(dir / "first").string()};
  tune["finetune"] = {"true"};
  const auto f = run(tune);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0].at("iteration").get<int64_t>(), 1);
  EXPECT_EQ(f[0].at("consumed_samples").get<int64_t>(), 4);
  // The first iteration's data with the trained weights: not the fresh run's loss.
  EXPECT_NE(f[0].at("lm_loss").get<double>(), full[0].at("lm_loss").get<double>());
  EXPECT_EQ(meta("tune").at("iteration").get<int64_t>(), 2);
  EXPECT_EQ(meta("tune").at("optimizer_step").get<int64_t>(), 2);
}

}  // namespace
}  // namespace megaton
