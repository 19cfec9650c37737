// The flag walk: every `megaton train` flag, set to hostile values one at a time on a tiny
// dense and a tiny MoE model, is either accepted (and the run trains) or refused with
// megaton::Error (the CLI's one line and exit status 2). Nothing may reach an internal
// check (InternalError: "internal error", exit 1) or throw anything else.
//
// In-process rather than through the binary: about 3,400 cases run in seconds this way; the
// CLI's mapping of megaton::Error to one line and status 2 is tested in test_cli_errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "train/arguments.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

// Values a hostile user tries: signs, zero, the edges of 32- and 64-bit integers, numbers
// no float holds, non-finite floats, fractions where integers go, words, nothing.
const std::vector<std::string> kHostileValues = {
    "-1", "0", "1", "3", "-2147483649", "2147483648", "9223372036854775808",
    "99999999999999999999", "1e300", "-1e300", "1e39", "nan", "inf", "-inf", "0.5",
    "1e-45", "abc", "", "[0]*2", " 1", "0x10"};
const std::vector<std::string> kSwitchValues = {"true", "false", "maybe", ""};

RawOptions dense_base() {
  return {{"device", {"cpu"}},           {"mock-data", {"true"}},
          {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"60"}},
          {"num-layers", {"2"}},         {"hidden-size", {"16"}},
          {"num-attention-heads", {"2"}}, {"seq-length", {"8"}},
          {"micro-batch-size", {"2"}},   {"train-iters", {"2"}},
          {"eval-interval", {"1"}},      {"eval-iters", {"1"}},
          {"log-interval", {"1000"}}};
}

RawOptions moe_base() {
  RawOptions raw = dense_base();
  raw["num-experts"] = {"4"};
  raw["moe-router-topk"] = {"2"};
  raw["position-embedding-type"] = {"rope"};
  raw["normalization"] = {"RMSNorm"};
  raw["swiglu"] = {"true"};
  raw["group-query-attention"] = {"true"};
  raw["num-query-groups"] = {"1"};
  return raw;
}

// A value whose run is cheap to train: not a number, or a number of small magnitude.
// Accepted large values (train-iters, eval-iters...) are built but not trained: they only
// make a run long.
bool cheap_to_train(const std::string& value) {
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  return value.empty() || *end != '\0' || std::fabs(v) <= 16;
}

struct Outcome {
  int accepted = 0, refused = 0;
};

// Runs one case; records a test failure for anything but success or megaton::Error.
void run_case(const RawOptions& raw, const std::string& flag, const std::string& value,
              Outcome& outcome) {
  try {
    TrainArgs args = parse_train_args(raw);
    check_parallel_layout(args, 1);
    Trainer trainer(args, raw);
    if (cheap_to_train(value)) trainer.train();
    ++outcome.accepted;
  } catch (const InternalError& e) {
    ADD_FAILURE() << "--" << flag << " '" << value << "' reached an internal check: " << e.what();
  } catch (const Error&) {
    ++outcome.refused;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "--" << flag << " '" << value << "' threw " << typeid(e).name() << ": "
                  << e.what();
  }
}

class FlagWalk : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    // Flags such as --save and --log-metrics-file write where they point: here.
    dir_ = fs::temp_directory_path() / ("megaton_flag_walk_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    old_cwd_ = fs::current_path();
    fs::current_path(dir_);
  }
  void TearDown() override {
    fs::current_path(old_cwd_);
    fs::remove_all(dir_);
  }
  fs::path dir_, old_cwd_;
};

TEST_P(FlagWalk, EveryFlagIsAcceptedOrRefusedByName) {
  const bool moe = GetParam();
  const RawOptions base = moe ? moe_base() : dense_base();
  Outcome outcome;
  for (const OptionSpec& spec : train_option_specs()) {
    for (const std::string& value : spec.is_switch ? kSwitchValues : kHostileValues) {
      RawOptions raw = base;
      raw[spec.name] = {value};
      SCOPED_TRACE("--" + spec.name + " '" + value + "'");
      run_case(raw, spec.name, value, outcome);
    }
  }
  // The walk exercised both outcomes (a walk that refuses or accepts everything is broken).
  EXPECT_GT(outcome.accepted, 100);
  EXPECT_GT(outcome.refused, 1000);
  std::printf("flag walk (%s): %d cases accepted, %d refused with a named flag\n",
              moe ? "MoE" : "dense", outcome.accepted, outcome.refused);
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoE, FlagWalk, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "MoE" : "Dense"; });

}  // namespace
}  // namespace megaton
