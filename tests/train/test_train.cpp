// Functional tests of `megaton train`: loss falls, resume is bit-identical, sampling.
#include <functional>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "common/testing.h"
#include "train/train_testing.h"
#include "data/preprocess.h"
#include "data/tokenizer.h"
#include "train/generate.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_train_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    testing::write_grammar_corpus(dir / "corpus.jsonl", 200, 7);
    data::PreprocessOptions opt;
    opt.inputs = {(dir / "corpus.jsonl").string()};
    opt.output_prefix = (dir / "corpus").string();
    opt.tokenizer_type = "ByteTokenizer";
    data::preprocess(opt);
  }
  void TearDown() override { fs::remove_all(dir); }

  // A tiny MoE model with dropout on, so resume must also reproduce the dropout masks.
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
            {"eval-iters", {"1"}},          {"eval-interval", {"100"}},
            {"log-interval", {"1"}},        {"split", {"90,10,0"}},
            {"tokenizer-type", {"ByteTokenizer"}},
            {"data-path", {(dir / "corpus_text_document").string()}}};
  }

  TrainResult run(RawOptions raw) {
    TrainArgs args = parse_train_args(raw);
    Trainer trainer(args, raw);
    return trainer.train();
  }

  // Six iterations in one run, and three, saved, then three more resumed from the save.
  void check_resume_is_bit_identical(const RawOptions& options) {
    TrainResult full = run(options);
    ASSERT_EQ(full.losses.size(), 6u);

    RawOptions first = options;
    first["save"] = {(dir / "ckpt").string()};
    first["exit-interval"] = {"3"};
    TrainResult a = run(first);
    ASSERT_EQ(a.losses.size(), 3u);
    ASSERT_TRUE(fs::exists(dir / "ckpt" / "iter_0000003" / "metadata.json"));

    RawOptions second = options;
    second["load"] = {(dir / "ckpt").string()};
    TrainResult b = run(second);
    ASSERT_EQ(b.losses.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(a.losses[i], full.losses[i]) << "iteration " << i + 1;
      EXPECT_EQ(b.losses[i], full.losses[i + 3]) << "iteration " << i + 4;
      EXPECT_EQ(b.grad_norms[i], full.grad_norms[i + 3]) << "iteration " << i + 4;
    }
  }

  fs::path dir;
};

TEST_F(TrainTest, ResumeIsBitIdentical) { check_resume_is_bit_identical(tiny_moe()); }

// --qk-layernorm: the q/k norm weights and their optimizer state go through the checkpoint.
TEST_F(TrainTest, ResumeWithQkLayernormIsBitIdentical) {
  RawOptions options = tiny_moe();
  options["qk-layernorm"] = {"true"};
  check_resume_is_bit_identical(options);
}

// FP8 (issue 16) on the CPU's exact emulation of each recipe: a dense model whose GEMM
// dimensions take blockwise's 128 (hidden 128, 2 x 64 tokens, ffn 256) trains like fp32.
// Tolerance: 2% of the final validation loss. FP8 rounds each GEMM operand to 3 mantissa
// bits (e4m3) or 2 (e5m2 gradients); at lr 1e-3 the six FP8 runs end within 0.6% of fp32
// (measured, docs/fp8.md), so 2% fails on a broken recipe, not on rounding. (At lr 3e-3
// this tiny model is chaotic: two fp32 runs that differ only in the seed end 8% apart, and
// no tolerance would tell FP8 error from that.)
RawOptions tiny_fp8_dense(const fs::path& dir) {
  return {{"num-layers", {"2"}},          {"hidden-size", {"128"}},
          {"num-attention-heads", {"4"}}, {"seq-length", {"64"}},
          {"ffn-hidden-size", {"256"}},   {"swiglu", {"true"}},
          {"position-embedding-type", {"rope"}}, {"normalization", {"RMSNorm"}},
          {"disable-bias-linear", {"true"}},
          {"hidden-dropout", {"0.0"}},    {"attention-dropout", {"0.0"}},
          {"micro-batch-size", {"2"}},    {"global-batch-size", {"2"}},
          {"train-iters", {"40"}},        {"lr", {"1e-3"}},
          {"lr-warmup-iters", {"4"}},     {"lr-decay-style", {"cosine"}},
          {"eval-iters", {"2"}},          {"eval-interval", {"1000"}},
          {"log-interval", {"1000"}},     {"split", {"90,10,0"}},
          {"tokenizer-type", {"ByteTokenizer"}},
          {"data-path", {(dir / "corpus_text_document").string()}}};
}

// The same with MoE layers (4 experts of width 128, top-2): the experts' GEMMs run in FP8
// too, each expert's rows padded to the FP8 multiple.
RawOptions tiny_fp8_moe(const fs::path& dir) {
  RawOptions raw = tiny_fp8_dense(dir);
  raw["num-experts"] = {"4"};
  raw["moe-ffn-hidden-size"] = {"128"};
  raw["moe-router-topk"] = {"2"};
  raw["moe-aux-loss-coeff"] = {"0.01"};
  return raw;
}

void check_fp8_trains_like_fp32(const std::function<RawOptions()>& options,
                                const std::function<TrainResult(RawOptions)>& run) {
  const TrainResult fp32 = run(options());
  ASSERT_LT(fp32.last_valid_loss, 0.8 * fp32.first_valid_loss);
  for (const char* recipe : {"delayed", "tensorwise", "blockwise"}) {
    for (const char* format : {"e4m3", "hybrid"}) {
      SCOPED_TRACE(std::string(recipe) + " " + format);
      RawOptions raw = options();
      raw["fp8-format"] = {format};
      raw["fp8-recipe"] = {recipe};
      const TrainResult fp8 = run(raw);
      EXPECT_NEAR(fp8.last_valid_loss, fp32.last_valid_loss, 0.02 * fp32.last_valid_loss);
      // The same initial weights: the first loss differs only by FP8 rounding.
      EXPECT_NEAR(fp8.losses.front(), fp32.losses.front(), 0.01 * fp32.losses.front());
      EXPECT_NE(fp8.losses.back(), fp32.losses.back());  // FP8 did run
      std::printf("fp8 %s %s: final valid loss %.5f vs fp32 %.5f\n", recipe, format,
                  fp8.last_valid_loss, fp32.last_valid_loss);
    }
  }
}

TEST_F(TrainTest, Fp8RecipesTrainLikeFp32) {
  check_fp8_trains_like_fp32([&] { return tiny_fp8_dense(dir); },
                             [&](RawOptions raw) { return run(std::move(raw)); });
}

TEST_F(TrainTest, Fp8MoERecipesTrainLikeFp32) {
  check_fp8_trains_like_fp32([&] { return tiny_fp8_moe(dir); },
                             [&](RawOptions raw) { return run(std::move(raw)); });
}

// Resume is bit-identical in each recipe: current and block scaling keep no state across
// steps; the delayed recipe's amax histories and scales go through the checkpoint.
void check_fp8_resume(const RawOptions& model, std::initializer_list<const char*> recipes,
                      const fs::path& dir,
                      const std::function<void(const RawOptions&)>& check_resume) {
  for (const char* recipe : recipes) {
    SCOPED_TRACE(recipe);
    RawOptions raw = model;
    raw["train-iters"] = {"6"};
    raw["fp8-format"] = {"hybrid"};
    raw["fp8-recipe"] = {recipe};
    if (recipe == std::string("delayed")) {
      raw["fp8-amax-history-len"] = {"4"};
      raw["fp8-amax-compute-algo"] = {"max"};
    }
    fs::remove_all(dir / "ckpt");
    check_resume(raw);
  }
}

TEST_F(TrainTest, Fp8ResumeIsBitIdentical) {
  check_fp8_resume(tiny_fp8_dense(dir), {"delayed", "tensorwise", "blockwise"}, dir,
                   [&](const RawOptions& raw) { check_resume_is_bit_identical(raw); });
}

// --fp8-param-gather quantizes each FP8 weight from the fp32 main params after the update
// with the per-tensor scale of the whole weight; on the CPU the compute weights are those
// fp32 values, which the tensorwise recipe would quantize with the same scale at each use:
// the runs are bit-identical, dense and MoE (the experts' weights are FP8 too). The FP8
// bytes also go through the distributed optimizer's all-gather (one rank here; the
// layouts test runs DP2 and TP2 x DP2).
TEST_F(TrainTest, Fp8ParamGatherEqualsQuantizingEachUse) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    RawOptions raw = moe ? tiny_fp8_moe(dir) : tiny_fp8_dense(dir);
    raw["train-iters"] = {"6"};
    raw["fp8-format"] = {"hybrid"};
    raw["fp8-recipe"] = {"tensorwise"};
    raw["use-distributed-optimizer"] = {"true"};
    const TrainResult each_use = run(raw);
    raw["fp8-param-gather"] = {"true"};
    const TrainResult gathered = run(raw);
    EXPECT_EQ(gathered.losses, each_use.losses);
    // The FP8 weights' gradients sit in buffers of their own, so the grad norm's fp64 sum
    // adds the same squares in another order.
    ASSERT_EQ(gathered.grad_norms.size(), each_use.grad_norms.size());
    for (size_t i = 0; i < each_use.grad_norms.size(); ++i)
      EXPECT_NEAR(gathered.grad_norms[i], each_use.grad_norms[i], 1e-12 * each_use.grad_norms[i]);
    EXPECT_EQ(gathered.last_valid_loss, each_use.last_valid_loss);
  }
}

// With the delayed recipe the weights take current scaling (the optimizer's cast), the
// activations and gradients keep their histories: it trains like fp32 (as above) and
// resumes bit-identically (the FP8 weights are requantized from the loaded main params).
TEST_F(TrainTest, Fp8ParamGatherDelayedTrainsAndResumes) {
  RawOptions raw = tiny_fp8_moe(dir);
  const TrainResult fp32 = run(raw);
  raw["fp8-format"] = {"hybrid"};
  raw["fp8-recipe"] = {"delayed"};
  raw["use-distributed-optimizer"] = {"true"};
  raw["fp8-param-gather"] = {"true"};
  const TrainResult fp8 = run(raw);
  EXPECT_NEAR(fp8.last_valid_loss, fp32.last_valid_loss, 0.02 * fp32.last_valid_loss);
  raw["train-iters"] = {"6"};
  fs::remove_all(dir / "ckpt");
  check_resume_is_bit_identical(raw);
}

// With MoE layers: each expert's delayed-recipe state goes through the checkpoint.
TEST_F(TrainTest, Fp8MoEResumeIsBitIdentical) {
  check_fp8_resume(tiny_fp8_moe(dir), {"delayed", "blockwise"}, dir,
                   [&](const RawOptions& raw) { check_resume_is_bit_identical(raw); });
}

TEST_F(TrainTest, LossFallsAndModelSamples) {
  RawOptions raw = tiny_moe();
  raw["train-iters"] = {"40"};
  raw["hidden-dropout"] = {"0.0"};
  raw["attention-dropout"] = {"0.0"};
  raw["save"] = {(dir / "ckpt").string()};
  TrainResult r = run(raw);
  ASSERT_GT(r.first_valid_loss, 0);
  // A byte model starts near ln(257) = 5.55; the grammar is learnable well below that.
  EXPECT_NEAR(r.first_valid_loss, std::log(257.0), 0.5);
  EXPECT_LT(r.last_valid_loss, 0.7 * r.first_valid_loss);
  EXPECT_LT(r.losses.back(), r.losses.front());

  LoadedModel lm = load_model_for_inference((dir / "ckpt").string());
  EXPECT_EQ(lm.iteration, 40);
  SamplingParams greedy;
  greedy.greedy = true;
  greedy.tokens_to_generate = 20;
  std::vector<int32_t> prompt = lm.tokenizer->encode("the cat ");
  auto out1 = generate_tokens(*lm.model, prompt, lm.tokenizer->vocab_size(), lm.tokenizer->eod(),
                              greedy);
  auto out2 = generate_tokens(*lm.model, prompt, lm.tokenizer->vocab_size(), lm.tokenizer->eod(),
                              greedy);
  EXPECT_EQ(out1, out2);  // greedy decoding is deterministic
  EXPECT_GT(out1.size(), prompt.size());
  EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), out1.begin()));
}

// --qk-layernorm as a YAML key (underscores allowed, as for every key) and as a flag value.
TEST(Arguments, QkLayernormFromYamlAndFlag) {
  const fs::path yaml =
      fs::temp_directory_path() / ("megaton_qk_layernorm_" + std::to_string(::getpid()) + ".yaml");
  std::ofstream(yaml) << "qk_layernorm: true\n";
  RawOptions raw = read_yaml_options(yaml.string());
  fs::remove(yaml);
  ASSERT_TRUE(raw.count("qk-layernorm"));
  raw["mock-data"] = {"true"};
  raw["tokenizer-type"] = {"NullTokenizer"};
  raw["train-iters"] = {"1"};
  raw["device"] = {"cpu"};
  EXPECT_TRUE(parse_train_args(raw).model.qk_layernorm);
  raw["qk-layernorm"] = {"false"};
  EXPECT_FALSE(parse_train_args(raw).model.qk_layernorm);
  raw.erase("qk-layernorm");
  EXPECT_FALSE(parse_train_args(raw).model.qk_layernorm);  // Megatron's default
  raw["qk-layernorm"] = {"maybe"};
  EXPECT_THROW(parse_train_args(raw), Error);
}

TEST(Sampling, GreedyTopKTopP) {
  std::vector<float> logits = {0.0f, 3.0f, 1.0f, 2.0f, 9.0f};  // id 4 is padding
  SamplingParams p;
  p.greedy = true;
  EXPECT_EQ(sample_token(logits.data(), 4, p, 0.5f), 1);  // padding (id 4) never chosen
  p.greedy = false;
  p.top_k = 1;
  for (float draw : {0.0f, 0.5f, 0.999f}) EXPECT_EQ(sample_token(logits.data(), 4, p, draw), 1);
  p.top_k = 2;  // ids 1 and 3 with probs e^3/(e^3+e^2) = 0.731 and 0.269
  EXPECT_EQ(sample_token(logits.data(), 4, p, 0.70f), 1);
  EXPECT_EQ(sample_token(logits.data(), 4, p, 0.75f), 3);
  p.top_k = 0;
  p.top_p = 0.5f;  // the top token alone has probability 0.644 >= 0.5
  for (float draw : {0.0f, 0.99f}) EXPECT_EQ(sample_token(logits.data(), 4, p, draw), 1);
  p.top_p = 0.0f;
  p.temperature = 1e-3f;  // near-greedy
  EXPECT_EQ(sample_token(logits.data(), 4, p, 0.99f), 1);
  p.temperature = 0.0f;
  EXPECT_THROW(sample_token(logits.data(), 4, p, 0.5f), Error);
}

}  // namespace
}  // namespace megaton
