// --optimizer and the SGD, Lion and Muon flags (issue 24 step 1; docs/research/muon.md
// section 1), from parse_train_args: what they set, dist_muon's warning and distributed
// optimizer, the notices of a rule's flags given without the rule, the one-line refusals,
// and the checkpoint's record of the optimizer that a load of its state checks. The CLI's
// exit status 2 for the refusals is tested in test_cli_errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "common/args_testing.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

using Set = std::vector<std::pair<std::string, std::vector<std::string>>>;

RawOptions with(const Set& set) {
  RawOptions raw = testing::tiny_train_options();
  for (const auto& [k, v] : set) raw[k] = v;
  return raw;
}

std::string error_of(const Set& set) { return testing::layout_error(with(set), 1); }

bool mentions(const std::vector<std::string>& lines, const std::string& what) {
  for (const std::string& l : lines)
    if (l.find(what) != std::string::npos) return true;
  return false;
}

TEST(OptimizerArgs, DefaultsAreMegatronsCommandLine) {
  const TrainArgs a = parse_train_args(testing::tiny_train_options());
  const optim::OptimizerConfig& c = a.optimizer;
  EXPECT_EQ(c.kind, optim::OptimizerKind::Adam);
  EXPECT_FLOAT_EQ(c.muon.momentum, 0.9f);  // the CLI's, not OptimizerConfig's 0.95
  EXPECT_FALSE(c.muon.nesterov);
  EXPECT_TRUE(c.muon.split_qkv);
  EXPECT_EQ(c.muon.coefficients, ops::NsCoefficients::Quintic);
  EXPECT_EQ(c.muon.num_ns_steps, 5);
  EXPECT_EQ(c.muon.scale_mode, ops::MuonScaleMode::Spectral);
  EXPECT_EQ(c.muon.tp_mode, optim::MuonTpMode::Duplicated);
  EXPECT_EQ(c.muon.matmul_precision, optim::MuonMatmulPrecision::Medium);
  EXPECT_EQ(c.muon.scalar_optimizer, optim::OptimizerKind::Adam);
  EXPECT_FLOAT_EQ(c.sgd_momentum, 0.9f);
  EXPECT_FLOAT_EQ(c.lion_beta1, 0.95f);
  EXPECT_FLOAT_EQ(c.lion_beta2, 0.98f);
  EXPECT_TRUE(a.no_effect.empty());
  EXPECT_TRUE(a.adam.store_param_remainders);
}

TEST(OptimizerArgs, NamesRoundTrip) {
  for (const char* name : {"adam", "sgd", "muon", "lion"}) {
    const TrainArgs a = parse_train_args(with({{"optimizer", {name}}}));
    EXPECT_STREQ(optim::optimizer_kind_name(a.optimizer.kind), name);
  }
  for (const char* mode : {"blockwise", "duplicated", "distributed"})
    EXPECT_STREQ(optim::muon_tp_mode_name(optim::parse_muon_tp_mode(mode)), mode);
  for (const char* prec : {"low", "medium", "high"})
    EXPECT_STREQ(optim::muon_matmul_precision_name(optim::parse_muon_matmul_precision(prec)), prec);
}

TEST(OptimizerArgs, MuonFlagsSetTheMuonConfig) {
  const TrainArgs a = parse_train_args(with({{"optimizer", {"muon"}},
                                             {"muon-momentum", {"0.95"}},
                                             {"muon-nesterov", {"true"}},
                                             {"muon-no-split-qkv", {"true"}},
                                             {"muon-coefficient-type", {"polar_express"}},
                                             {"muon-num-ns-steps", {"8"}},
                                             {"muon-scale-mode", {"unit_rms_norm"}},
                                             {"muon-extra-scale-factor", {"0.2"}},
                                             {"muon-tp-mode", {"blockwise"}},
                                             {"muon-fp32-matmul-prec", {"high"}},
                                             {"muon-scalar-optimizer", {"lion"}},
                                             {"lion-beta1", {"0.9"}},
                                             {"lion-beta2", {"0.99"}}}));
  const optim::MuonConfig& m = a.optimizer.muon;
  EXPECT_EQ(a.optimizer.kind, optim::OptimizerKind::Muon);
  EXPECT_FLOAT_EQ(m.momentum, 0.95f);
  EXPECT_TRUE(m.nesterov);
  EXPECT_FALSE(m.split_qkv);
  EXPECT_EQ(m.coefficients, ops::NsCoefficients::PolarExpress);
  EXPECT_EQ(m.num_ns_steps, 8);
  EXPECT_EQ(m.scale_mode, ops::MuonScaleMode::UnitRmsNorm);
  EXPECT_FLOAT_EQ(m.extra_scale_factor, 0.2f);
  EXPECT_EQ(m.tp_mode, optim::MuonTpMode::Blockwise);
  EXPECT_EQ(m.matmul_precision, optim::MuonMatmulPrecision::High);
  EXPECT_EQ(m.scalar_optimizer, optim::OptimizerKind::Lion);
  EXPECT_FLOAT_EQ(a.optimizer.lion_beta1, 0.9f);
  EXPECT_FLOAT_EQ(a.optimizer.lion_beta2, 0.99f);
  // Every flag tunes this run: no notice. The Lion scalar optimizer has no remainders.
  EXPECT_TRUE(a.no_effect.empty()) << a.no_effect.front();
  EXPECT_FALSE(a.adam.store_param_remainders);
  EXPECT_FALSE(a.parallel.use_distributed_optimizer);
  EXPECT_TRUE(a.warnings.empty());
}

TEST(OptimizerArgs, SgdAndLionSettings) {
  const TrainArgs sgd = parse_train_args(with({{"optimizer", {"sgd"}}, {"sgd-momentum", {"0.5"}}}));
  EXPECT_EQ(sgd.optimizer.kind, optim::OptimizerKind::Sgd);
  EXPECT_FLOAT_EQ(sgd.optimizer.sgd_momentum, 0.5f);
  EXPECT_TRUE(sgd.no_effect.empty());
  // Their steps keep whole fp32 main params; Muon's Adam params keep their remainders.
  EXPECT_FALSE(sgd.adam.store_param_remainders);
  EXPECT_FALSE(parse_train_args(with({{"optimizer", {"lion"}}})).adam.store_param_remainders);
  EXPECT_TRUE(parse_train_args(with({{"optimizer", {"muon"}}})).adam.store_param_remainders);
  // SGD is allowed under --fp16 and Megatron-FSDP (Megatron's asserts name sgd and adam).
  EXPECT_EQ(error_of({{"optimizer", {"sgd"}}, {"fp16", {"true"}}}), "");
  EXPECT_EQ(error_of({{"optimizer", {"sgd"}}, {"use-megatron-fsdp", {"true"}}}), "");
}

// Megatron's deprecated alias: muon with the distributed optimizer, a warning; its
// --overlap-param-gather check passes as Megatron's does for dist_muon.
TEST(OptimizerArgs, DistMuonIsMuonWithTheDistributedOptimizer) {
  const TrainArgs a = parse_train_args(with({{"optimizer", {"dist_muon"}}}));
  EXPECT_EQ(a.optimizer.kind, optim::OptimizerKind::Muon);
  EXPECT_TRUE(a.parallel.use_distributed_optimizer);
  ASSERT_EQ(a.warnings.size(), 1u);
  EXPECT_EQ(
      a.warnings[0],
      "--optimizer dist_muon is deprecated: use --optimizer muon --use-distributed-optimizer");
  EXPECT_EQ(error_of({{"optimizer", {"dist_muon"}},
                      {"overlap-grad-reduce", {"true"}},
                      {"overlap-param-gather", {"true"}}}),
            "");
  // Without the alias the same overlap needs the flag.
  EXPECT_NE(error_of({{"optimizer", {"muon"}},
                      {"overlap-grad-reduce", {"true"}},
                      {"overlap-param-gather", {"true"}}})
                .find("overlap-param-gather needs use-distributed-optimizer"),
            std::string::npos);
  EXPECT_TRUE(
      parse_train_args(with({{"optimizer", {"muon"}}, {"use-distributed-optimizer", {"true"}}}))
          .warnings.empty());
  EXPECT_NE(error_of({{"optimizer", {"dist_muon"}}, {"use-distributed-optimizer", {"false"}}})
                .find("optimizer dist_muon is muon with use-distributed-optimizer, which is "
                      "given as false"),
            std::string::npos);
}

// A rule's flags given without the rule: one notice each, naming the flag and the rule.
TEST(OptimizerArgs, FlagsOfAnotherRuleHaveNoEffect) {
  const TrainArgs adam = parse_train_args(with({{"muon-momentum", {"0.8"}},
                                                {"muon-nesterov", {"true"}},
                                                {"muon-no-split-qkv", {"true"}},
                                                {"muon-tp-mode", {"blockwise"}},
                                                {"muon-scalar-optimizer", {"lion"}},
                                                {"sgd-momentum", {"0.5"}},
                                                {"lion-beta1", {"0.9"}}}));
  for (const char* line :
       {"--muon-momentum: only tunes --optimizer muon",
        "--muon-nesterov: only tunes --optimizer muon",
        "--muon-no-split-qkv: only tunes --optimizer muon",
        "--muon-tp-mode: only tunes --optimizer muon",
        "--muon-scalar-optimizer: only tunes --optimizer muon",
        "--sgd-momentum: only tunes --optimizer sgd",
        "--lion-beta1: only tunes --optimizer muon --muon-scalar-optimizer lion"})
    EXPECT_TRUE(mentions(adam.no_effect, line)) << line;
  EXPECT_EQ(adam.no_effect.size(), 7u);
  // Not Adam's own betas: they tune Adam. A switch given as false asks for nothing.
  const TrainArgs quiet =
      parse_train_args(with({{"adam-beta1", {"0.8"}}, {"muon-nesterov", {"false"}}}));
  EXPECT_TRUE(quiet.no_effect.empty());
  // Megatron's top-level Lion takes the Adam betas, not --lion-beta1/2.
  const TrainArgs lion = parse_train_args(
      with({{"optimizer", {"lion"}}, {"lion-beta2", {"0.9"}}, {"adam-beta1", {"0.8"}}}));
  EXPECT_TRUE(mentions(lion.no_effect,
                       "--lion-beta2: --optimizer lion takes --adam-beta1 and --adam-beta2"));
  EXPECT_EQ(lion.no_effect.size(), 1u);
  // Muon with the Adam scalar optimizer: the Lion betas tune nothing; with Lion, Adam's.
  EXPECT_TRUE(
      mentions(parse_train_args(with({{"optimizer", {"muon"}}, {"lion-beta1", {"0.9"}}})).no_effect,
               "--lion-beta1: only tunes --optimizer muon --muon-scalar-optimizer lion"));
  EXPECT_TRUE(
      mentions(parse_train_args(with({{"optimizer", {"muon"}},
                                      {"muon-scalar-optimizer", {"lion"}},
                                      {"adam-eps", {"1e-6"}}}))
                   .no_effect,
               "--adam-eps: no parameter is trained with Adam (--muon-scalar-optimizer lion)"));
  EXPECT_TRUE(
      mentions(parse_train_args(with({{"optimizer", {"sgd"}}, {"adam-beta2", {"0.9"}}})).no_effect,
               "--adam-beta2: no parameter is trained with Adam (--optimizer sgd)"));
}

TEST(OptimizerArgs, BadNamesAndValuesAreRefusedByName) {
  const std::pair<Set, std::string> cases[] = {
      {{{"optimizer", {"adamw"}}},
       "option 'optimizer' must be one of adam, sgd, muon, lion, dist_muon (got 'adamw')"},
      {{{"optimizer", {"soap"}}},
       "--optimizer soap is not supported in Megaton (Megatron registers it but has no flags"},
      {{{"optimizer", {"adaptive_muon"}}}, "--optimizer adaptive_muon is not supported in Megaton"},
      {{{"muon-num-ns-steps", {"0"}}}, "option 'muon-num-ns-steps' must be >= 1 (got 0)"},
      {{{"muon-momentum", {"1"}}}, "option 'muon-momentum' must be in [0, 1) (got 1)"},
      {{{"sgd-momentum", {"-0.1"}}}, "option 'sgd-momentum' must be in [0, 1)"},
      {{{"lion-beta1", {"1.5"}}}, "option 'lion-beta1' must be in [0, 1)"},
      {{{"lion-beta2", {"-1"}}}, "option 'lion-beta2' must be in [0, 1)"},
      {{{"muon-extra-scale-factor", {"-1"}}}, "option 'muon-extra-scale-factor' must be > 0"},
      {{{"muon-tp-mode", {"sharded"}}},
       "option 'muon-tp-mode' must be one of blockwise, duplicated, distributed (got 'sharded')"},
      {{{"muon-fp32-matmul-prec", {"highest"}}},
       "option 'muon-fp32-matmul-prec' must be one of low, medium, high (got 'highest')"},
      {{{"muon-scalar-optimizer", {"sgd"}}},
       "option 'muon-scalar-optimizer' must be one of adam, lion (got 'sgd')"},
      {{{"muon-coefficient-type", {"custom"}}}, "--muon-coefficient-type custom needs"},
      {{{"muon-coefficient-type", {"cubic5"}}},
       "--muon-coefficient-type cubic5 needs Emerging-Optimizers >= 0.4.0"},
      {{{"muon-coefficient-type", {"septic"}}}, "--muon-coefficient-type 'septic' is not one of"},
      {{{"muon-scale-mode", {"rms"}}}, "--muon-scale-mode 'rms' is not one of"},
      {{{"muon-use-syrk", {"true"}}},
       "--muon-use-syrk is not supported in Megaton: Muon's SYRK Newton-Schulz kernels"},
  };
  for (const auto& [set, want] : cases) {
    const std::string e = error_of(set);
    EXPECT_NE(e.find(want), std::string::npos) << "got: '" << e << "', want: " << want;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // A control byte in a refused name is quoted, not echoed.
  const std::string e = error_of({{"muon-tp-mode", {"a\x1b[2Jb"}}});
  EXPECT_NE(e.find("a\\x1b[2Jb"), std::string::npos) << e;
}

// The optimizer against precision, sharding and FP8 (Megatron's validate_args and
// OptimizerConfig asserts; Megaton's own for Muon's FP8 weights).
TEST(OptimizerArgs, RefusalsAcrossGroups) {
  const Set fp8 = {{"fp8-format", {"hybrid"}},
                   {"fp8-param-gather", {"true"}},
                   {"use-distributed-optimizer", {"true"}}};
  Set muon_fp8 = fp8;
  muon_fp8.push_back({"optimizer", {"muon"}});
  const std::pair<Set, std::string> cases[] = {
      {{{"optimizer", {"muon"}}, {"fp16", {"true"}}},
       "fp16 with optimizer muon is not supported (Megatron: emerging optimizer with fp16 is not "
       "supported); use --bf16"},
      {{{"optimizer", {"lion"}}, {"fp16", {"true"}}}, "fp16 with optimizer lion is not supported"},
      {{{"optimizer", {"dist_muon"}}, {"fp16", {"true"}}},
       "fp16 with optimizer muon is not supported"},
      {{{"optimizer", {"sgd"}}, {"use-precision-aware-optimizer", {"true"}}},
       "use-precision-aware-optimizer needs optimizer adam (got sgd), as Megatron's "
       "OptimizerConfig asserts"},
      {{{"optimizer", {"muon"}},
        {"use-precision-aware-optimizer", {"true"}},
        {"optimizer-cpu-offload", {"true"}}},
       "use-precision-aware-optimizer (and with it optimizer-cpu-offload) needs optimizer adam "
       "(got muon)"},
      {{{"optimizer", {"muon"}}, {"use-megatron-fsdp", {"true"}}},
       "use-megatron-fsdp with optimizer muon is not supported (Megatron-FSDP takes adam or sgd)"},
      {{{"optimizer", {"lion"}}, {"use-megatron-fsdp", {"true"}}},
       "use-megatron-fsdp with optimizer lion is not supported"},
      {muon_fp8, "fp8-param-gather with optimizer muon is not supported in Megaton yet"},
      {{{"optimizer", {"muon"}},
        {"use-distributed-optimizer", {"true"}},
        {"overlap-param-gather-with-optimizer-step", {"true"}}},
       "--overlap-param-gather-with-optimizer-step is not supported in Megaton"},
  };
  for (const auto& [set, want] : cases) {
    const std::string e = error_of(set);
    EXPECT_NE(e.find(want), std::string::npos) << "got: '" << e << "', want: " << want;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // The same flags pass with Adam (and FP8 param gather with Lion and SGD).
  EXPECT_EQ(error_of(fp8), "");
  Set lion_fp8 = fp8;
  lion_fp8.push_back({"optimizer", {"lion"}});
  EXPECT_EQ(error_of(lion_fp8), "");
  EXPECT_EQ(error_of({{"optimizer", {"muon"}}, {"bf16", {"true"}}}), "");
  EXPECT_EQ(error_of({{"use-precision-aware-optimizer", {"true"}}}), "");
}

// The checkpoint names its optimizer (Megatron's name); loading its state into another
// optimizer is refused, a checkpoint without the field reads as adam, and --no-load-optim
// takes the weights.
class OptimizerCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("megaton_optimizer_args_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  RawOptions run_options(const std::string& save) const {
    RawOptions raw = testing::tiny_train_options();
    raw["train-iters"] = {"2"};
    raw["eval-iters"] = {"0"};
    raw["save"] = {(dir / save).string()};
    raw["save-interval"] = {"1"};
    return raw;
  }
  static void train(const RawOptions& raw) {
    TrainArgs args = parse_train_args(raw);
    Trainer(args, raw).train();
  }
  fs::path dir;
};

TEST_F(OptimizerCheckpoint, LoadRefusesAnotherOptimizersState) {
  train(run_options("first"));
  const fs::path meta_path = dir / "first" / "iter_0000002" / "metadata.json";
  ASSERT_TRUE(fs::exists(meta_path));
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(meta_path));
  EXPECT_EQ(meta.at("optimizer"), "adam");
  EXPECT_FALSE(meta.contains("muon_scalar_optimizer"));  // only meaningful for muon

  // The same checkpoint as if a Muon run had saved it.
  meta["optimizer"] = "muon";
  meta["muon_scalar_optimizer"] = "adam";
  std::ofstream(meta_path) << meta.dump(1);
  RawOptions resume = run_options("resume");
  resume["train-iters"] = {"3"};
  resume["load"] = {(dir / "first").string()};
  try {
    train(resume);
    ADD_FAILURE() << "an Adam run loaded Muon's optimizer state";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("holds the optimizer state of optimizer muon, this run uses optimizer "
                        "adam: load its weights with --no-load-optim or --finetune"),
              std::string::npos)
        << what;
  }
  // Its weights load.
  RawOptions weights = resume;
  weights["no-load-optim"] = {"true"};
  EXPECT_NO_THROW(train(weights));

  // A checkpoint from before the field: adam's state, which an Adam run loads.
  meta.erase("optimizer");
  meta.erase("muon_scalar_optimizer");
  std::ofstream(meta_path) << meta.dump(1);
  fs::remove_all(dir / "resume");
  EXPECT_NO_THROW(train(resume));
}

}  // namespace
}  // namespace megaton
