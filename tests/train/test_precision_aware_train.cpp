// Trainings with the precision-aware optimizer (--use-precision-aware-optimizer, bf16, fp16
// and fp8 Adam moments, stochastically rounded; fp16 and fp8 with per-tensor scales) on the
// CPU: the dense demo model's 100-iteration loss curve ends within 1% of the fp32-state run
// (bf16, fp16; fp8 first moments beside fp16 second ones within 3%), resume from a checkpoint of
// bf16, fp16 or fp8 states is bit-identical, and a checkpoint of other states loads converted, with
// a notice.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>

#include "data/preprocess.h"
#include "train/train_testing.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

// The demo's corpus (configs/demo-dense.yaml).
const char* kFortunes = "/usr/share/games/fortunes";

class PrecisionAwareTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_pa_train_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    testing::write_grammar_corpus(dir / "corpus.jsonl", 300, 11);
    data::PreprocessOptions opt;
    opt.inputs = {(dir / "corpus.jsonl").string()};
    opt.output_prefix = (dir / "corpus").string();
    opt.tokenizer_type = "ByteTokenizer";
    data::preprocess(opt);
  }
  void TearDown() override { fs::remove_all(dir); }

  // configs/demo-dense.yaml (4 layers, hidden 256, SwiGLU, RoPE, GQA, clip 1, weight decay
  // 0.1, cosine) on two files of its fortunes corpus, with bytes for tokens (no SentencePiece training)
  // and shorter sequences and batches to fit a test. The grammar corpus above would be
  // learnt to a loss near 0.3 in 100 iterations, where 1% is below the run-to-run noise.
  RawOptions demo_dense() const {
    data::PreprocessOptions opt;
    opt.inputs = {std::string(kFortunes) + "/computers", std::string(kFortunes) + "/science"};
    opt.input_format = data::InputFormat::Fortune;
    opt.output_prefix = (dir / "fortunes").string();
    opt.tokenizer_type = "ByteTokenizer";
    opt.workers = 2;
    data::preprocess(opt);
    RawOptions raw = read_yaml_options(std::string(MEGATON_SOURCE_DIR) + "/configs/demo-dense.yaml");
    raw["tokenizer-type"] = {"ByteTokenizer"};
    raw.erase("tokenizer-model");
    raw["data-path"] = {(dir / "fortunes_text_document").string()};
    raw["seq-length"] = {"64"};
    raw["max-position-embeddings"] = {"64"};
    raw["micro-batch-size"] = {"4"};
    raw["global-batch-size"] = {"4"};
    raw["train-iters"] = {"100"};
    raw["lr-warmup-iters"] = {"10"};
    raw["eval-interval"] = {"1000"};
    raw["eval-iters"] = {"16"};
    raw["log-interval"] = {"50"};
    raw["split"] = {"90,10,0"};
    raw.erase("save-interval");
    return raw;
  }

  // A tiny MoE model with dropout (as test_train.cpp's resume test).
  RawOptions tiny_moe() const {
    return {{"num-layers", {"2"}},          {"hidden-size", {"32"}},
            {"num-attention-heads", {"4"}}, {"group-query-attention", {"true"}},
            {"num-query-groups", {"2"}},    {"seq-length", {"32"}},
            {"position-embedding-type", {"rope"}}, {"normalization", {"RMSNorm"}},
            {"swiglu", {"true"}},           {"disable-bias-linear", {"true"}},
            {"num-experts", {"4"}},         {"moe-ffn-hidden-size", {"48"}},
            {"moe-router-topk", {"2"}},     {"moe-aux-loss-coeff", {"0.01"}},
            {"hidden-dropout", {"0.1"}},    {"attention-dropout", {"0.1"}},
            {"micro-batch-size", {"2"}},    {"global-batch-size", {"4"}},
            {"train-iters", {"6"}},         {"lr", {"3e-3"}},
            {"lr-warmup-iters", {"2"}},     {"lr-decay-style", {"cosine"}},
            {"clip-grad", {"1.0"}},         {"weight-decay", {"0.1"}},
            {"eval-iters", {"1"}},          {"eval-interval", {"100"}},
            {"log-interval", {"1"}},        {"split", {"90,10,0"}},
            {"tokenizer-type", {"ByteTokenizer"}},
            {"data-path", {(dir / "corpus_text_document").string()}}};
  }

  static RawOptions with_bf16_states(RawOptions raw) {
    raw["use-precision-aware-optimizer"] = {"true"};
    raw["exp-avg-dtype"] = {"bf16"};
    raw["exp-avg-sq-dtype"] = {"bf16"};
    return raw;
  }

  static RawOptions with_states(RawOptions raw, const char* exp_avg, const char* exp_avg_sq) {
    raw["use-precision-aware-optimizer"] = {"true"};
    raw["exp-avg-dtype"] = {exp_avg};
    raw["exp-avg-sq-dtype"] = {exp_avg_sq};
    return raw;
  }

  static TrainResult run(const RawOptions& raw) {
    TrainArgs args = parse_train_args(raw);
    return Trainer(args, raw).train();
  }

  fs::path dir;
};

TEST_F(PrecisionAwareTrainTest, Bf16StatesEndWithinOnePercentOfFp32States) {
  if (!fs::is_directory(kFortunes))
    GTEST_SKIP() << kFortunes << " missing (Debian package fortunes)";
  const TrainResult fp32 = run(demo_dense());
  const TrainResult bf16 = run(with_bf16_states(demo_dense()));
  ASSERT_EQ(fp32.losses.size(), 100u);
  ASSERT_EQ(bf16.losses.size(), 100u);
  // The end of the curve: the validation loss after the last iteration, over 16 held-out
  // batches (a training batch of 4 x 64 tokens is too noisy a measure: the two runs'
  // trajectories part, and single-batch losses differ by a few percent either way).
  EXPECT_LT(fp32.last_valid_loss, fp32.first_valid_loss - 1.0) << "the fp32-state run did not learn";
  // Measured: 2.594 (bf16, stochastically rounded) vs 2.589 (fp32), 0.2% apart; a 1e-5
  // change of the learning rate moves either by about 0.4% (the trajectories part). With
  // round-to-nearest bf16 moments (Transformer Engine's) it ended at 2.627, 1.5% above: with
  // beta2 = 0.999, bf16(0.999 v) == v, so a stored exp_avg_sq never decays
  // (docs/memory.md "Stochastic rounding of the bf16 moments"). A broken update (moments
  // truncated, or not fp32 math) is far outside 1%.
  EXPECT_NEAR(bf16.last_valid_loss, fp32.last_valid_loss, 0.01 * fp32.last_valid_loss);
  // The moments' dtype did change the run (the flags reached the optimizer).
  EXPECT_NE(bf16.losses[99], fp32.losses[99]);
}

// Six iterations in one run, and three, saved, then three more resumed from the save.
TEST_F(PrecisionAwareTrainTest, ResumeWithBf16StatesIsBitIdentical) {
  const RawOptions options = with_bf16_states(tiny_moe());
  const TrainResult full = run(options);
  ASSERT_EQ(full.losses.size(), 6u);
  RawOptions first = options;
  first["save"] = {(dir / "ckpt").string()};
  first["exit-interval"] = {"3"};
  const TrainResult a = run(first);
  ASSERT_EQ(a.losses.size(), 3u);
  RawOptions second = options;
  second["load"] = {(dir / "ckpt").string()};
  const TrainResult b = run(second);
  ASSERT_EQ(b.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a.losses[i], full.losses[i]) << "iteration " << i + 1;
    EXPECT_EQ(b.losses[i], full.losses[i + 3]) << "iteration " << i + 4;
    EXPECT_EQ(b.grad_norms[i], full.grad_norms[i + 3]) << "iteration " << i + 4;
  }
}

// A checkpoint of fp32 moments resumed with bf16 moments: converted with one notice, and
// the first resumed iteration (computed before any update) has the fp32 run's loss.
TEST_F(PrecisionAwareTrainTest, Fp32StateCheckpointLoadsIntoBf16StatesWithANotice) {
  RawOptions first = tiny_moe();
  first["save"] = {(dir / "ckpt").string()};
  first["exit-interval"] = {"3"};
  const TrainResult full = run(tiny_moe());
  run(first);
  RawOptions second = with_bf16_states(tiny_moe());
  second["load"] = {(dir / "ckpt").string()};
  ::testing::internal::CaptureStdout();
  const TrainResult b = run(second);
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(b.losses.size(), 3u);
  EXPECT_EQ(b.losses[0], full.losses[3]);
  size_t notices = 0;
  for (size_t at = out.find("holds the Adam moments in F32"); at != std::string::npos;
       at = out.find("holds the Adam moments in F32", at + 1))
    ++notices;
  EXPECT_EQ(notices, 1u) << out;
}

// fp16 moments (scaled, TE's range 32752) end as close to the fp32-state run as bf16 ones:
// 10 mantissa bits against bf16's 7. fp8 (E4M3) first moments beside fp16 second moments
// are looser. (fp8 second moments are not checked here: E4M3 spans 2^18 between its
// smallest subnormal and 448, and squared gradients of one tensor span more, so most of a
// tensor's exp_avg_sq rounds to 0 and those elements step by m / eps; measured 3.00 against
// 2.59, as TE's round-to-nearest would flush them too. docs/memory.md.)
TEST_F(PrecisionAwareTrainTest, ScaledStatesEndCloseToFp32States) {
  if (!fs::is_directory(kFortunes))
    GTEST_SKIP() << kFortunes << " missing (Debian package fortunes)";
  const TrainResult fp32 = run(demo_dense());
  const TrainResult fp16 = run(with_states(demo_dense(), "fp16", "fp16"));
  const TrainResult fp8 = run(with_states(demo_dense(), "fp8", "fp16"));
  ASSERT_EQ(fp16.losses.size(), 100u);
  ASSERT_EQ(fp8.losses.size(), 100u);
  EXPECT_LT(fp32.last_valid_loss, fp32.first_valid_loss - 1.0)
      << "the fp32-state run did not learn";
  std::printf("validation loss after 100 iterations: fp32 states %.4f, fp16 %.4f, fp8/fp16 %.4f\n",
              fp32.last_valid_loss, fp16.last_valid_loss, fp8.last_valid_loss);
  // Measured: fp16 2.5844 against fp32 2.5886 (0.2%).
  EXPECT_NEAR(fp16.last_valid_loss, fp32.last_valid_loss, 0.01 * fp32.last_valid_loss);
  EXPECT_NEAR(fp8.last_valid_loss, fp32.last_valid_loss, 0.03 * fp32.last_valid_loss);
  EXPECT_NE(fp16.losses[99], fp32.losses[99]);
  EXPECT_NE(fp8.losses[99], fp16.losses[99]);
}

// Resume with fp16 first moments and fp8 second moments (their scales in the checkpoint).
TEST_F(PrecisionAwareTrainTest, ResumeWithScaledStatesIsBitIdentical) {
  for (auto [m, v] : {std::pair{"fp16", "fp8"}, std::pair{"fp8", "fp16"}}) {
    SCOPED_TRACE(std::string(m) + "/" + v);
    const RawOptions options = with_states(tiny_moe(), m, v);
    const TrainResult full = run(options);
    ASSERT_EQ(full.losses.size(), 6u);
    RawOptions first = options;
    fs::remove_all(dir / "ckpt");
    first["save"] = {(dir / "ckpt").string()};
    first["exit-interval"] = {"3"};
    const TrainResult a = run(first);
    ASSERT_EQ(a.losses.size(), 3u);
    RawOptions second = options;
    second["load"] = {(dir / "ckpt").string()};
    const TrainResult b = run(second);
    ASSERT_EQ(b.losses.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(a.losses[i], full.losses[i]) << "iteration " << i + 1;
      EXPECT_EQ(b.losses[i], full.losses[i + 3]) << "iteration " << i + 4;
      EXPECT_EQ(b.grad_norms[i], full.grad_norms[i + 3]) << "iteration " << i + 4;
    }
  }
}

// A checkpoint of bf16 moments resumed with fp8 ones, and one of fp16 moments resumed with
// fp32 ones: converted with one notice each; the first resumed iteration (before any
// update) has the uninterrupted run's loss, and the later ones stay close to it.
TEST_F(PrecisionAwareTrainTest, ScaledStateCheckpointsConvertWithANotice) {
  const std::pair<const char*, const char*> cases[][2] = {{{"bf16", "bf16"}, {"fp8", "fp8"}},
                                                          {{"fp16", "fp16"}, {"fp32", "fp32"}}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c[0].first) + " -> " + c[1].first);
    fs::remove_all(dir / "ckpt");
    RawOptions first = with_states(tiny_moe(), c[0].first, c[0].second);
    const TrainResult full = run(first);
    first["save"] = {(dir / "ckpt").string()};
    first["exit-interval"] = {"3"};
    run(first);
    RawOptions second = with_states(tiny_moe(), c[1].first, c[1].second);
    second["load"] = {(dir / "ckpt").string()};
    ::testing::internal::CaptureStdout();
    const TrainResult b = run(second);
    const std::string out = ::testing::internal::GetCapturedStdout();
    ASSERT_EQ(b.losses.size(), 3u);
    EXPECT_EQ(b.losses[0], full.losses[3]);
    EXPECT_NEAR(b.losses[2], full.losses[5], 0.02 * full.losses[5]);
    const std::string needle = std::string("holds the Adam moments in ") +
                               (c[0].first == std::string("bf16") ? "BF16" : "F16");
    size_t notices = 0;
    for (size_t at = out.find(needle); at != std::string::npos; at = out.find(needle, at + 1))
      ++notices;
    EXPECT_EQ(notices, 1u) << out;
  }
}

}  // namespace
}  // namespace megaton
