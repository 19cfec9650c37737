// --eod-mask-loss (issue 19): the loss leaves out the predictions made at end-of-document
// input tokens. The trainer's logged loss, evaluation loss and gradients against a hand
// computation from the model's per-token losses (Megatron's loss_func and forward_step:
// per micro-batch sum(losses * mask) / sum(mask), averaged over micro-batches for the
// gradient; the global masked sum over the global count for the logged loss), and a
// micro-batch with no unmasked token (zero gradient, not Megatron's 0 / 0).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include "common/testing.h"
#include "data/blended_dataset.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"
#include "ops/ops.h"
#include "train/loss_mask.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

constexpr int32_t kEod = 256;  // ByteTokenizer's end-of-document id

TEST(EodLossMask, MaskWeightsAndCount) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Tensor tokens = testing::randint({2, 8}, 256, seed);
  for (int64_t t : {0, 3, 9, 15}) tokens.i32()[t] = kEod;
  LossMask m = eod_loss_mask(tokens, kEod);
  ASSERT_EQ(m.num_tokens, 12);
  for (int64_t t = 0; t < 16; ++t) {
    const bool eod = t == 0 || t == 3 || t == 9 || t == 15;
    EXPECT_EQ(m.mask.f32()[t], eod ? 0.0f : 1.0f) << t;
    EXPECT_EQ(m.weights.f32()[t], eod ? 0.0f : 1.0f / 12.0f) << t;
  }
  Tensor losses = testing::randn({16}, seed + 1);
  double expected = 0;
  for (int64_t t = 0; t < 16; ++t)
    if (tokens.i32()[t] != kEod) expected += losses.f32()[t];
  EXPECT_NEAR(masked_loss_sum(losses, m.mask), expected, 1e-12);
  // No token left: zero weights (no gradient), never 1 / 0.
  for (int64_t t = 0; t < 16; ++t) tokens.i32()[t] = kEod;
  m = eod_loss_mask(tokens, kEod);
  EXPECT_EQ(m.num_tokens, 0);
  for (int64_t t = 0; t < 16; ++t) EXPECT_EQ(m.weights.f32()[t], 0.0f) << t;
}

class EodMaskLossTrain : public ::testing::Test {
 protected:
  static constexpr int64_t kSeq = 16, kGlobalBatch = 4;  // micro-batch 1: 4 micro-batches

  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_eod_mask_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  // Byte-token documents, each ending in eod; every `eod_run_every`-th is a run of 40 eods
  // (0: none), so that some samples hold no token but eod. only_eod: every token is eod.
  std::string write_data(uint64_t seed, bool only_eod = false) {
    const std::string prefix = (dir / "docs").string();
    data::IndexedDatasetBuilder builder(prefix, data::TokenDType::U16);
    std::mt19937_64 gen(seed);
    for (int d = 0; d < 120; ++d) {
      std::vector<int32_t> doc;
      if (only_eod || d % 3 == 0) {
        doc.assign(40, kEod);
      } else {
        const int n = 5 + int(gen() % 20);
        for (int i = 0; i < n; ++i) doc.push_back(int32_t(gen() % 256));
        doc.push_back(kEod);
      }
      builder.add_document(doc);
    }
    builder.finalize();
    return prefix;
  }

  RawOptions options(const std::string& prefix, bool mask) const {
    RawOptions raw = {{"num-layers", {"2"}},
                      {"hidden-size", {"32"}},
                      {"num-attention-heads", {"4"}},
                      {"seq-length", {std::to_string(kSeq)}},
                      {"position-embedding-type", {"rope"}},
                      {"normalization", {"RMSNorm"}},
                      {"swiglu", {"true"}},
                      {"disable-bias-linear", {"true"}},
                      {"hidden-dropout", {"0"}},
                      {"attention-dropout", {"0"}},
                      {"micro-batch-size", {"1"}},
                      {"global-batch-size", {std::to_string(kGlobalBatch)}},
                      {"train-iters", {"1"}},
                      {"lr", {"1e-3"}},
                      {"eval-iters", {"1"}},
                      {"eval-interval", {"100"}},
                      {"log-interval", {"1"}},
                      {"split", {"70,30,0"}},
                      {"tokenizer-type", {"ByteTokenizer"}},
                      {"data-path", {prefix}},
                      {"device", {"cpu"}}};
    if (mask) raw["eod-mask-loss"] = {"true"};
    return raw;
  }

  // The hand computation for one global batch of `split`: the model built alone from the
  // same config and seed (the trainer's initial weights), each micro-batch's per-token
  // losses and, with `backward`, the gradient of Megatron's loss with the mask (or without:
  // every token counts) accumulated into the model's main_grads.
  struct Reference {
    double loss_sum = 0, num_tokens = 0;  // over the global batch
    std::vector<int64_t> tokens_per_micro_batch;
  };
  Reference reference(GPTModel& model, const data::SampleSource& source, bool mask, bool backward) {
    Reference ref;
    model.zero_grad();
    std::vector<int32_t> sample(kSeq + 1);
    for (int64_t mb = 0; mb < kGlobalBatch; ++mb) {
      source.get(mb % source.size(), sample.data());
      Tensor tokens = Tensor::empty({1, kSeq}, DType::I32);
      Tensor labels = Tensor::empty({1, kSeq}, DType::I32);
      int64_t count = 0;
      for (int64_t t = 0; t < kSeq; ++t) {
        tokens.i32()[t] = sample[t];
        labels.i32()[t] = sample[t + 1];
        count += !mask || sample[t] != kEod;
      }
      ForwardContext ctx{backward, 1234, 0, 0};  // no dropout: the trainer's losses
      ctx.forward_only = !backward;
      MicroBatchLoss out = model.forward(tokens, labels, ctx);
      Tensor dlosses = Tensor::zeros({kSeq});
      for (int64_t t = 0; t < kSeq; ++t) {
        if (mask && sample[t] == kEod) continue;
        ref.loss_sum += out.losses.f32()[t];
        dlosses.f32()[t] = float(1.0 / (double(count) * double(kGlobalBatch)));
      }
      ref.num_tokens += double(count);
      ref.tokens_per_micro_batch.push_back(count);
      if (backward)
        model.backward(dlosses, 1.0f / float(kGlobalBatch));
      else
        model.take_activations();
    }
    return ref;
  }

  // The objective whose gradient the step takes: the mean over micro-batches of each one's
  // masked token mean (0 for a micro-batch with no unmasked token), in fp64.
  double objective(GPTModel& model, const data::SampleSource& source) {
    std::vector<int32_t> sample(kSeq + 1);
    double total = 0;
    for (int64_t mb = 0; mb < kGlobalBatch; ++mb) {
      source.get(mb % source.size(), sample.data());
      Tensor tokens = Tensor::empty({1, kSeq}, DType::I32);
      Tensor labels = Tensor::empty({1, kSeq}, DType::I32);
      for (int64_t t = 0; t < kSeq; ++t) {
        tokens.i32()[t] = sample[t];
        labels.i32()[t] = sample[t + 1];
      }
      ForwardContext ctx{false, 1234, 0, 0};
      ctx.forward_only = true;
      MicroBatchLoss out = model.forward(tokens, labels, ctx);
      model.take_activations();
      double sum = 0, count = 0;
      for (int64_t t = 0; t < kSeq; ++t)
        if (sample[t] != kEod) {
          sum += out.losses.f32()[t];
          count += 1;
        }
      if (count > 0) total += sum / count;
    }
    return total / double(kGlobalBatch);
  }

  // The datasets the trainer builds for these options (same config, same sample counts:
  // one global batch per split, 1 iteration and 1 evaluation iteration).
  std::array<std::unique_ptr<data::SampleSource>, 3> datasets(const TrainArgs& args) {
    data::GPTDatasetConfig cfg;
    cfg.blend = data::parse_data_path(args.data_path);
    cfg.split = args.split;
    cfg.seq_length = args.model.seq_length;
    cfg.seed = args.seed;
    return data::build_gpt_datasets(cfg, {kGlobalBatch, kGlobalBatch, kGlobalBatch});
  }

  fs::path dir;
};

// The first iteration's logged loss and the evaluation loss are the global masked token
// means of the model's per-token losses; the gradient is the mean over micro-batches of
// each one's masked token mean, and a micro-batch with only eod inputs adds nothing to it.
TEST_F(EodMaskLossTrain, LossAndGradientsAreTheMaskedMeans) {
  const std::string prefix = write_data(11);
  const RawOptions raw = options(prefix, true);
  TrainArgs args = parse_train_args(raw);
  ASSERT_TRUE(args.eod_mask_loss);
  Trainer trainer(args, raw);
  const TrainResult result = trainer.train();
  ASSERT_EQ(result.losses.size(), 1u);

  dist::ValidatedLayout layout;
  auto tokenizer = finish_train_args(args, 1, layout);
  ASSERT_EQ(tokenizer->eod(), kEod);
  auto ds = datasets(args);
  GPTModel model(args.model, args.seed);
  // Evaluation at iteration 0 (before the step): the validation batch, masked.
  const Reference valid = reference(model, *ds[1], true, false);
  ASSERT_GT(valid.num_tokens, 0);
  ASSERT_LT(valid.num_tokens, double(kGlobalBatch * kSeq)) << "the validation batch has no eod";
  EXPECT_NEAR(result.first_valid_loss, valid.loss_sum / valid.num_tokens,
              1e-6 + 5e-6 * valid.loss_sum / valid.num_tokens);

  const Reference ref = reference(model, *ds[0], true, true);
  std::string counts;
  for (int64_t c : ref.tokens_per_micro_batch) counts += std::to_string(c) + " ";
  SCOPED_TRACE("unmasked tokens per micro-batch: " + counts);
  // The data exercise what is tested: micro-batches with different counts, one of them 0.
  ASSERT_NE(std::find(ref.tokens_per_micro_batch.begin(), ref.tokens_per_micro_batch.end(), 0),
            ref.tokens_per_micro_batch.end());
  ASSERT_GT(ref.num_tokens, 0);
  const double expected = ref.loss_sum / ref.num_tokens;
  EXPECT_NEAR(result.losses[0], expected, 1e-6 + 5e-6 * expected);
  EXPECT_TRUE(std::isfinite(result.grad_norms[0]));

  // The trainer's gradients (main_grads after the step: the optimizer leaves them) equal
  // the hand-built backward's.
  const std::vector<Param*>& got = trainer.model().params();
  const std::vector<Param*>& want = model.params();
  ASSERT_EQ(got.size(), want.size());
  double sum_sq = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i]->name, want[i]->name);
    EXPECT_LE(testing::rel_error(got[i]->main_grad, want[i]->main_grad), 1e-5) << want[i]->name;
    sum_sq += ops::sum_of_squares(want[i]->main_grad);
  }
  EXPECT_NEAR(result.grad_norms[0], std::sqrt(sum_sq), 1e-5 * std::sqrt(sum_sq));

  // And that backward is the gradient of the masked objective: central differences on the
  // elements with the largest gradients (fp32 forward, eps 3e-3 as tests/model).
  std::vector<std::pair<float, std::pair<Param*, int64_t>>> largest;
  for (Param* p : want)
    for (int64_t i = 0; i < p->main_grad.numel(); ++i)
      largest.push_back({std::fabs(p->main_grad.f32()[i]), {p, i}});
  std::partial_sort(largest.begin(), largest.begin() + 8, largest.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int k = 0; k < 8; ++k) {
    auto [p, i] = largest[k].second;
    const float orig = p->weight.f32()[i], eps = 3e-3f;
    p->weight.f32()[i] = orig + eps;
    const double up = objective(model, *ds[0]);
    p->weight.f32()[i] = orig - eps;
    const double down = objective(model, *ds[0]);
    p->weight.f32()[i] = orig;
    const double fd = (up - down) / (2 * eps);
    EXPECT_NEAR(p->main_grad.f32()[i], fd, 2e-3 + 2e-2 * std::fabs(fd))
        << p->name << "[" << i << "]";
  }

  // Without the flag: every token counts, and the numbers differ.
  const RawOptions plain_raw = options(prefix, false);
  Trainer plain(parse_train_args(plain_raw), plain_raw);
  const TrainResult plain_result = plain.train();
  const Reference all = reference(model, *ds[0], false, true);
  EXPECT_EQ(all.num_tokens, double(kGlobalBatch * kSeq));
  EXPECT_NEAR(plain_result.losses[0], all.loss_sum / all.num_tokens,
              1e-6 + 5e-6 * all.loss_sum / all.num_tokens);
  EXPECT_GT(std::fabs(plain_result.losses[0] - result.losses[0]), 1e-3);
  double diff_sq = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LE(testing::rel_error(plain.model().params()[i]->main_grad, want[i]->main_grad), 1e-5)
        << want[i]->name;
    diff_sq += std::pow(testing::rel_error(got[i]->main_grad, want[i]->main_grad), 2);
  }
  EXPECT_GT(std::sqrt(diff_sq), 1e-2) << "masked and unmasked gradients are alike";
}

// Data of eod tokens only: no token is in any loss. The logged and evaluation losses are 0
// and the gradients zero (Megatron would divide 0 by 0), and the run goes on.
TEST_F(EodMaskLossTrain, NoTokenLeftGivesZeroNotNaN) {
  const std::string prefix = write_data(12, /*only_eod=*/true);
  RawOptions raw = options(prefix, true);
  raw["train-iters"] = {"2"};
  Trainer trainer(parse_train_args(raw), raw);
  const TrainResult result = trainer.train();
  ASSERT_EQ(result.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(result.losses[i], 0.0) << "iteration " << i + 1;
    EXPECT_EQ(result.grad_norms[i], 0.0) << "iteration " << i + 1;
  }
  EXPECT_EQ(result.first_valid_loss, 0.0);
  EXPECT_EQ(result.last_valid_loss, 0.0);
}

}  // namespace
}  // namespace megaton
