// --use-checkpoint-args (and its -mp- and tokenizer switches) and --ckpt-step (issue 19):
// Megatron's load_args_from_checkpoint rules on hand-written checkpoint metadata, and a
// resume whose command line lacks the model's shape against an uninterrupted run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "train/args/flag_table.h"
#include "train/checkpoint_args.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

class CheckpointArgsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_ckpt_args_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  // A checkpoint directory holding only what the arguments are read from: the tracker
  // (when `track`) and iter_<iteration>/metadata.json with `args`.
  void write_checkpoint(int64_t iteration, const nlohmann::json& args, bool track = true) {
    const fs::path it = dir / "ck" / ckpt::iteration_dir_name(iteration);
    fs::create_directories(it);
    nlohmann::json meta;
    meta["iteration"] = iteration;
    meta["args"] = args;
    meta["tokenizer_model"] = "/abs/tokenizer.model";
    std::ofstream(it / "metadata.json") << meta.dump();
    if (track) std::ofstream(dir / "ck" / "latest_checkpointed_iteration.txt") << iteration;
  }
  RawOptions with_load(RawOptions raw) const {
    raw["use-checkpoint-args"] = {"true"};
    raw["load"] = {(dir / "ck").string()};
    return raw;
  }
  static nlohmann::json saved_args() {
    return {{"num-layers", "4"},
            {"hidden-size", "64"},
            {"num-attention-heads", "4"},
            {"group-query-attention", "true"},
            {"num-query-groups", "2"},
            {"swiglu", "true"},
            {"tokenizer-type", "SentencePieceTokenizer"},
            {"tokenizer-model", "relative/tokenizer.model"},
            {"tensor-model-parallel-size", "2"},
            {"lr", "0.1"}};
  }
  fs::path dir;
};

std::vector<std::string> value(const RawOptions& raw, const std::string& key) {
  auto it = raw.find(key);
  return it == raw.end() ? std::vector<std::string>{"(absent)"} : it->second;
}

using V = std::vector<std::string>;

TEST_F(CheckpointArgsTest, NotAskedLeavesOptionsAlone) {
  write_checkpoint(5, saved_args());
  const RawOptions raw{{"load", {(dir / "ck").string()}}, {"num-layers", {"8"}}};
  const CheckpointArgs out = apply_checkpoint_args(raw);
  EXPECT_EQ(out.raw, raw);
  EXPECT_TRUE(out.messages.empty());
}

TEST_F(CheckpointArgsTest, MegatronRules) {
  write_checkpoint(5, saved_args());
  RawOptions raw = with_load({{"num-layers", {"8"}},              // given: kept (not forced)
                              {"disable-bias-linear", {"true"}},  // forced: not in the ckpt
                              {"num-query-groups", {"4"}},        // forced: the ckpt's
                              {"lr", {"0.5"}},                    // not a model argument
                              {"tokenizer-type", {"GPT2BPETokenizer"}}});
  const CheckpointArgs out = apply_checkpoint_args(raw);
  EXPECT_EQ(value(out.raw, "num-layers"), V{"8"});
  EXPECT_EQ(value(out.raw, "hidden-size"), V{"64"});
  EXPECT_EQ(value(out.raw, "num-attention-heads"), V{"4"});
  EXPECT_EQ(value(out.raw, "num-query-groups"), V{"2"});
  EXPECT_EQ(value(out.raw, "group-query-attention"), V{"true"});
  EXPECT_EQ(value(out.raw, "swiglu"), V{"true"});
  EXPECT_EQ(value(out.raw, "disable-bias-linear"), V{"(absent)"});
  EXPECT_EQ(value(out.raw, "lr"), V{"0.5"});
  // The tokenizer (forced), its model file as the saving run resolved it.
  EXPECT_EQ(value(out.raw, "tokenizer-type"), V{"SentencePieceTokenizer"});
  EXPECT_EQ(value(out.raw, "tokenizer-model"), V{"/abs/tokenizer.model"});
  // Parallel sizes only with --use-mp-args-from-checkpoint-args.
  EXPECT_EQ(value(out.raw, "tensor-model-parallel-size"), V{"(absent)"});
  ASSERT_FALSE(out.messages.empty());
  EXPECT_NE(out.messages[0].find("iter_0000005"), std::string::npos);
  const auto said = [&](const std::string& line) {
    return std::find(out.messages.begin(), out.messages.end(), line) != out.messages.end();
  };
  EXPECT_TRUE(said("Setting --hidden-size to 64 from checkpoint"));
  EXPECT_TRUE(
      said("Setting --disable-bias-linear to its default: the checkpoint's run did not "
           "give it"));
  EXPECT_FALSE(said("Setting --num-layers to 4 from checkpoint"));

  raw["use-mp-args-from-checkpoint-args"] = {"true"};
  raw["no-use-tokenizer-model-from-checkpoint-args"] = {"true"};
  const CheckpointArgs mp = apply_checkpoint_args(raw);
  EXPECT_EQ(value(mp.raw, "tensor-model-parallel-size"), V{"2"});
  EXPECT_EQ(value(mp.raw, "tokenizer-type"), V{"GPT2BPETokenizer"});
  EXPECT_EQ(value(mp.raw, "tokenizer-model"), V{"(absent)"});
  raw.erase("no-use-tokenizer-model-from-checkpoint-args");
  raw["disable-use-tokenizer-model-from-checkpoint-args"] = {"true"};
  EXPECT_EQ(value(apply_checkpoint_args(raw).raw, "tokenizer-type"), V{"GPT2BPETokenizer"});
}

TEST_F(CheckpointArgsTest, CkptStepChoosesTheIteration) {
  write_checkpoint(2, {{"hidden-size", "32"}}, /*track=*/false);
  write_checkpoint(4, {{"hidden-size", "64"}});
  RawOptions raw = with_load({});
  EXPECT_EQ(value(apply_checkpoint_args(raw).raw, "hidden-size"), V{"64"});
  raw["ckpt-step"] = {"2"};
  EXPECT_EQ(value(apply_checkpoint_args(raw).raw, "hidden-size"), V{"32"});
  raw["ckpt-step"] = {"3"};  // no such iteration: Megatron's message, the given arguments
  const CheckpointArgs none = apply_checkpoint_args(raw);
  EXPECT_EQ(value(none.raw, "hidden-size"), V{"(absent)"});
  EXPECT_EQ(none.messages,
            V{"Checkpoint not found to provide arguments, using provided arguments."});
  // The metadata reader: the iteration asked for, or an error naming the directory.
  EXPECT_EQ(ckpt::read_checkpoint_metadata((dir / "ck").string(), 2).iteration, 2);
  EXPECT_EQ(ckpt::read_checkpoint_metadata((dir / "ck").string()).iteration, 4);
  try {
    ckpt::read_checkpoint_metadata((dir / "ck").string(), 3);
    FAIL() << "no error for a missing iteration";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("iter_0000003"), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointArgsTest, MissingLoadOrArguments) {
  EXPECT_THROW(apply_checkpoint_args({{"use-checkpoint-args", {"true"}}}), Error);
  // A checkpoint saved without arguments: the given ones, with Megatron's message.
  fs::create_directories(dir / "ck" / "iter_0000001");
  std::ofstream(dir / "ck" / "iter_0000001" / "metadata.json") << R"({"iteration": 1})";
  std::ofstream(dir / "ck" / "latest_checkpointed_iteration.txt") << 1;
  const CheckpointArgs out = apply_checkpoint_args(with_load({{"num-layers", {"3"}}}));
  EXPECT_EQ(value(out.raw, "num-layers"), V{"3"});
  EXPECT_EQ(out.messages,
            V{"Checkpoint provided does not have arguments saved, using provided arguments."});
  // The parsed flags: --ckpt-step and --use-checkpoint-args need --load.
  const RawOptions base{{"device", {"cpu"}},
                        {"mock-data", {"true"}},
                        {"tokenizer-type", {"NullTokenizer"}},
                        {"vocab-size", {"64"}},
                        {"num-layers", {"2"}},
                        {"hidden-size", {"16"}},
                        {"num-attention-heads", {"2"}},
                        {"seq-length", {"8"}},
                        {"train-iters", {"1"}}};
  RawOptions step = base;
  step["ckpt-step"] = {"2"};
  EXPECT_THROW(parse_train_args(step), Error);
  step["ckpt-step"] = {"-1"};
  step["load"] = {"x"};
  EXPECT_THROW(parse_train_args(step), Error);
  RawOptions use = base;
  use["use-checkpoint-args"] = {"true"};
  EXPECT_THROW(parse_train_args(use), Error);
}

// A hybrid model's checkpoint (Megatron's "Mamba args" and hybrid_layer_pattern): the Mamba
// sizes forced, the pattern only filled in (a run may re-split it into pipeline stages), an
// older checkpoint's hybrid-override-pattern as well; the result parses to the saved model.
TEST_F(CheckpointArgsTest, HybridPatternAndMambaSizes) {
  write_checkpoint(1, {{"hybrid-layer-pattern", "M*M-"},
                       {"hidden-size", "32"},
                       {"num-attention-heads", "4"},
                       {"mamba-num-heads", "4"},
                       {"mamba-head-dim", "16"},
                       {"mamba-num-groups", "2"},
                       {"mamba-state-dim", "8"},
                       {"tokenizer-type", "NullTokenizer"},
                       {"vocab-size", "64"}});
  const RawOptions run = with_load({{"mamba-state-dim", {"16"}}, {"seq-length", {"8"}}});
  const CheckpointArgs out = apply_checkpoint_args(run);
  EXPECT_EQ(value(out.raw, "hybrid-layer-pattern"), V{"M*M-"});
  EXPECT_EQ(value(out.raw, "mamba-num-heads"), V{"4"});
  EXPECT_EQ(value(out.raw, "mamba-state-dim"), V{"8"});  // forced
  const GPTConfig cfg = parse_model_args(out.raw).model;
  EXPECT_EQ(cfg.num_layers, 4);
  EXPECT_EQ(cfg.mamba_num_groups, 2);

  RawOptions resplit = run;
  resplit["hybrid-layer-pattern"] = {"M*|M-"};
  EXPECT_EQ(value(apply_checkpoint_args(resplit).raw, "hybrid-layer-pattern"), V{"M*|M-"});

  fs::remove_all(dir / "ck");
  write_checkpoint(1, {{"hybrid-override-pattern", "M-"}, {"num-layers", "2"}});
  const CheckpointArgs old = apply_checkpoint_args(with_load({}));
  EXPECT_EQ(value(old.raw, "hybrid-override-pattern"), V{"M-"});
  EXPECT_EQ(value(old.raw, "hybrid-layer-pattern"), V{"(absent)"});
}

TEST(CheckpointArgKeys, EveryKeyIsATrainFlag) {
  for (const std::string& key : checkpoint_arg_keys())
    EXPECT_NE(find_option_spec(key), nullptr) << key;
}

// A resume that names only the data and schedule: the model comes from the checkpoint and
// the run continues as the uninterrupted one, bit for bit. --ckpt-step then resumes from
// an earlier checkpoint than the tracker's.
TEST_F(CheckpointArgsTest, ResumeWithoutTheModelFlags) {
  const auto tiny = [&](const std::string& name) -> RawOptions {
    return {{"device", {"cpu"}},
            {"mock-data", {"true"}},
            {"tokenizer-type", {"NullTokenizer"}},
            {"vocab-size", {"64"}},
            {"num-layers", {"2"}},
            {"hidden-size", {"16"}},
            {"num-attention-heads", {"4"}},
            {"group-query-attention", {"true"}},
            {"num-query-groups", {"2"}},
            {"swiglu", {"true"}},
            {"seq-length", {"8"}},
            {"micro-batch-size", {"2"}},
            {"global-batch-size", {"4"}},
            {"train-iters", {"4"}},
            {"lr", {"1e-2"}},
            {"eval-iters", {"0"}},
            {"log-interval", {"1"}},
            {"save", {(dir / name).string()}},
            {"save-interval", {"1"}},
            {"log-metrics-file", {(dir / (name + ".jsonl")).string()}}};
  };
  const auto run = [&](RawOptions raw) {
    const CheckpointArgs from = apply_checkpoint_args(raw);
    {
      TrainArgs args = parse_train_args(from.raw);
      Trainer(args, from.raw).train();
    }
    std::vector<double> losses;
    std::ifstream in(raw.at("log-metrics-file")[0]);
    for (std::string line; std::getline(in, line);)
      losses.push_back(nlohmann::json::parse(line).at("lm_loss").get<double>());
    return losses;
  };
  const std::vector<double> full = run(tiny("full"));
  ASSERT_EQ(full.size(), 4u);
  RawOptions first = tiny("first");
  first["exit-interval"] = {"3"};
  run(first);
  RawOptions resume = tiny("resume");
  for (const char* key :
       {"num-layers", "hidden-size", "num-attention-heads", "group-query-attention",
        "num-query-groups", "swiglu", "tokenizer-type", "vocab-size"})
    resume.erase(key);
  resume["tokenizer-type"] = {"GPT2BPETokenizer"};  // replaced by the checkpoint's
  resume["use-checkpoint-args"] = {"true"};
  resume["load"] = {(dir / "first").string()};
  const std::vector<double> r = run(resume);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0], full[3]);
  // The new checkpoint records the model arguments it ran with.
  const nlohmann::json meta = nlohmann::json::parse(
      ckpt::read_checkpoint_metadata((dir / "resume").string()).metadata_json);
  EXPECT_EQ(meta.at("args").at("swiglu"), "true");
  EXPECT_EQ(meta.at("args").at("num-query-groups"), "2");

  // --ckpt-step 2 of "first" (its tracker says 3): iterations 3 and 4 again.
  RawOptions step = resume;
  step["save"] = {(dir / "step").string()};
  step["log-metrics-file"] = {(dir / "step.jsonl").string()};
  step["ckpt-step"] = {"2"};
  const std::vector<double> s = run(step);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0], full[2]);
  EXPECT_EQ(s[1], full[3]);
  // A missing iteration: one error naming it.
  RawOptions missing = tiny("missing");
  missing["load"] = {(dir / "first").string()};
  missing["ckpt-step"] = {"7"};
  try {
    run(missing);
    FAIL() << "no error for --ckpt-step 7";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("iter_0000007"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megaton
