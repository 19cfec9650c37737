// Trainings with the precision-aware optimizer (--use-precision-aware-optimizer, bf16 Adam
// moments, stochastically rounded) on the CPU: the dense demo model's 100-iteration loss
// curve ends within 1% of the fp32-state run, resume from a checkpoint of bf16 states is
// bit-identical, and a checkpoint of fp32 states loads into a bf16-state run (converted,
// with a notice).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

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

}  // namespace
}  // namespace megaton
