// --calculate-per-token-loss (issue 20): the step's gradient is that of the summed per-token
// losses over the step's loss tokens (Megatron-LM d98e8a6: schedules.py forward_step does
// not divide a micro-batch's sum(losses * mask) by its num_tokens nor by num_microbatches;
// finalize_model_grads divides every gradient by the global token count). Checked against
// a hand computation from the model's per-token losses with --eod-mask-loss on micro-batches
// of different token counts (and finite differences of that objective, and the AdamW update
// that follows), and, without a mask on equal micro-batches, against the default loss
// (the same gradient up to rounding, MoE aux and z losses included).
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
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

constexpr int32_t kEod = 256;  // ByteTokenizer's end-of-document id

class PerTokenLossTrain : public ::testing::Test {
 protected:
  static constexpr int64_t kSeq = 16, kGlobalBatch = 4;  // micro-batch 1: 4 micro-batches
  static constexpr double kLr = 1e-3, kAdamEps = 1e-3;

  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("megaton_per_token_loss_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  // Byte-token documents of 5 to 24 tokens, each ending in eod; every third is a run of 9
  // eods, so that the micro-batches leave out different numbers of tokens.
  std::string write_data(uint64_t seed) {
    const std::string prefix = (dir / "docs").string();
    data::IndexedDatasetBuilder builder(prefix, data::TokenDType::U16);
    std::mt19937_64 gen(seed);
    for (int d = 0; d < 120; ++d) {
      std::vector<int32_t> doc;
      if (d % 3 == 0) {
        doc.assign(9, kEod);
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

  // adam-eps comparable to the gradients and no weight decay: the first AdamW update is
  // lr g / (|g| + eps) (bias-corrected moments of one step), which shows the scale of g.
  RawOptions options(const std::string& prefix, bool mask, bool per_token, bool moe) const {
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
                      {"lr-decay-style", {"constant"}},
                      {"weight-decay", {"0"}},
                      {"adam-eps", {"1e-3"}},
                      {"clip-grad", {"10.0"}},
                      {"eval-iters", {"0"}},
                      {"log-interval", {"1"}},
                      {"split", {"70,30,0"}},
                      {"tokenizer-type", {"ByteTokenizer"}},
                      {"data-path", {prefix}},
                      {"device", {"cpu"}}};
    if (mask) raw["eod-mask-loss"] = {"true"};
    if (per_token) raw["calculate-per-token-loss"] = {"true"};
    if (moe) {
      raw["num-experts"] = {"4"};
      raw["moe-router-topk"] = {"2"};
      raw["moe-ffn-hidden-size"] = {"32"};
      raw["moe-aux-loss-coeff"] = {"1e-2"};
      raw["moe-z-loss-coeff"] = {"1e-3"};
    }
    return raw;
  }

  std::array<std::unique_ptr<data::SampleSource>, 3> datasets(const TrainArgs& args) {
    data::GPTDatasetConfig cfg;
    cfg.blend = data::parse_data_path(args.data_path);
    cfg.split = args.split;
    cfg.seq_length = args.model.seq_length;
    cfg.seed = args.seed;
    return data::build_gpt_datasets(cfg, {kGlobalBatch, kGlobalBatch, kGlobalBatch});
  }

  // Micro-batch mb of the first global batch: tokens, labels [1, kSeq] and the loss mask
  // (input token not eod).
  struct MicroBatch {
    Tensor tokens, labels;
    std::vector<bool> counts;
  };
  static MicroBatch micro_batch(const data::SampleSource& source, int64_t mb) {
    std::vector<int32_t> sample(kSeq + 1);
    source.get(mb % source.size(), sample.data());
    MicroBatch out{Tensor::empty({1, kSeq}, DType::I32), Tensor::empty({1, kSeq}, DType::I32),
                   std::vector<bool>(kSeq)};
    for (int64_t t = 0; t < kSeq; ++t) {
      out.tokens.i32()[t] = sample[t];
      out.labels.i32()[t] = sample[t + 1];
      out.counts[size_t(t)] = sample[t] != kEod;
    }
    return out;
  }

  // The masked tokens of each micro-batch of the first global batch.
  static std::vector<int64_t> token_counts(const data::SampleSource& source) {
    std::vector<int64_t> out;
    for (int64_t mb = 0; mb < kGlobalBatch; ++mb) {
      const MicroBatch b = micro_batch(source, mb);
      out.push_back(std::count(b.counts.begin(), b.counts.end(), true));
    }
    return out;
  }

  // Accumulates into the model's main_grads the gradient of the objective
  // sum_mb sum_t weight(mb) * mask[t] * loss[t] (dense model: no aux losses), with
  // weight(mb) = 1 / num_tokens (per-token loss) or 1 / (count(mb) * micro-batches) (the
  // default), and returns the masked loss sum.
  double backward(GPTModel& model, const data::SampleSource& source, bool per_token) {
    const std::vector<int64_t> counts = token_counts(source);
    double num_tokens = 0;
    for (int64_t c : counts) num_tokens += double(c);
    model.zero_grad();
    double loss_sum = 0;
    for (int64_t mb = 0; mb < kGlobalBatch; ++mb) {
      const MicroBatch b = micro_batch(source, mb);
      const double weight =
          per_token ? 1.0 / num_tokens : 1.0 / (double(counts[size_t(mb)]) * double(kGlobalBatch));
      ForwardContext ctx{true, 1234, 0, 0};
      MicroBatchLoss out = model.forward(b.tokens, b.labels, ctx);
      Tensor dlosses = Tensor::zeros({kSeq});
      for (int64_t t = 0; t < kSeq; ++t) {
        if (!b.counts[size_t(t)]) continue;
        loss_sum += out.losses.f32()[t];
        dlosses.f32()[t] = float(weight);
      }
      model.backward(dlosses, 1.0f / float(kGlobalBatch));
    }
    return loss_sum;
  }

  // The per-token objective in fp64: the masked sum over the global batch over its tokens.
  double objective(GPTModel& model, const data::SampleSource& source) {
    double sum = 0, count = 0;
    for (int64_t mb = 0; mb < kGlobalBatch; ++mb) {
      const MicroBatch b = micro_batch(source, mb);
      ForwardContext ctx{false, 1234, 0, 0};
      ctx.forward_only = true;
      MicroBatchLoss out = model.forward(b.tokens, b.labels, ctx);
      model.take_activations();
      for (int64_t t = 0; t < kSeq; ++t)
        if (b.counts[size_t(t)]) {
          sum += out.losses.f32()[t];
          count += 1;
        }
    }
    return sum / count;
  }

  fs::path dir;
};

TEST_F(PerTokenLossTrain, FlagParsedNotRefused) {
  const std::string prefix = write_data(20);
  EXPECT_TRUE(parse_train_args(options(prefix, false, true, false)).calculate_per_token_loss);
  EXPECT_FALSE(parse_train_args(options(prefix, false, false, false)).calculate_per_token_loss);
}

// With the eod mask on micro-batches of different token counts: the logged loss is the
// global masked mean (unchanged), the gradient that of the masked sum over the global
// count (the main grads hold the undivided sum; the norm, the clipping and the update use
// the divided gradients), and it differs from the default's mean of micro-batch means.
TEST_F(PerTokenLossTrain, MaskedGradientIsTheGlobalTokenMean) {
  const std::string prefix = write_data(21);
  const RawOptions raw = options(prefix, /*mask=*/true, /*per_token=*/true, /*moe=*/false);
  TrainArgs args = parse_train_args(raw);
  Trainer trainer(args, raw);
  const TrainResult result = trainer.train();
  ASSERT_EQ(result.losses.size(), 1u);

  dist::ValidatedLayout layout;
  auto tokenizer = finish_train_args(args, 1, layout);
  ASSERT_EQ(tokenizer->eod(), kEod);
  auto ds = datasets(args);
  const std::vector<int64_t> counts = token_counts(*ds[0]);
  std::string listed;
  for (int64_t c : counts) listed += std::to_string(c) + " ";
  SCOPED_TRACE("unmasked tokens per micro-batch: " + listed);
  // The data exercise what is tested: micro-batches with different nonzero counts.
  ASSERT_GT(*std::min_element(counts.begin(), counts.end()), 0);
  ASSERT_NE(*std::min_element(counts.begin(), counts.end()),
            *std::max_element(counts.begin(), counts.end()));
  double num_tokens = 0;
  for (int64_t c : counts) num_tokens += double(c);

  GPTModel model(args.model, args.seed);  // the trainer's initial weights
  std::vector<Tensor> initial;
  for (const Param* p : model.params()) initial.push_back(p->weight.clone());
  const double loss_sum = backward(model, *ds[0], /*per_token=*/true);
  EXPECT_NEAR(result.losses[0], loss_sum / num_tokens, 1e-6 + 5e-6 * loss_sum / num_tokens);

  const std::vector<Param*>& got = trainer.model().params();
  const std::vector<Param*>& want = model.params();
  ASSERT_EQ(got.size(), want.size());
  double sum_sq = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i]->name, want[i]->name);
    // The main grads are of the summed losses: divided by the step's tokens here.
    Tensor divided = got[i]->main_grad.clone();
    ops::scale_(divided, float(1.0 / num_tokens));
    EXPECT_LE(testing::rel_error(divided, want[i]->main_grad), 1e-5) << want[i]->name;
    sum_sq += ops::sum_of_squares(want[i]->main_grad);
  }
  const double norm = std::sqrt(sum_sq);
  EXPECT_NEAR(result.grad_norms[0], norm, 1e-5 * norm);

  // The update: AdamW's first step, lr g' / (|g'| + eps) with g' the divided gradient,
  // clipped to norm 10 (clip-grad 10: the divided gradient's norm is below it, the sum's
  // is not); a gradient not divided by the tokens moves the weights by about lr instead.
  ASSERT_LT(norm, 10.0);
  ASSERT_GT(norm * num_tokens, 10.0);
  const double clip = norm > 10.0 ? 10.0 / (norm + 1e-6) : 1.0;
  for (size_t i = 0; i < got.size(); ++i) {
    Tensor expected = initial[i].clone();
    const Tensor& g = want[i]->main_grad;
    for (int64_t k = 0; k < g.numel(); ++k) {
      const double gc = double(g.f32()[k]) * clip;
      expected.f32()[k] = float(double(expected.f32()[k]) - kLr * gc / (std::fabs(gc) + kAdamEps));
    }
    Tensor moved = got[i]->weight.clone(), want_moved = expected.clone();
    ops::add_(moved, initial[i], -1.0f);
    ops::add_(want_moved, initial[i], -1.0f);
    EXPECT_LE(testing::rel_error(moved, want_moved), 1e-3) << want[i]->name;
  }

  // The hand backward is the gradient of the per-token objective: central differences on
  // the elements with the largest gradients (fp32 forward, eps 3e-3 as tests/model).
  std::vector<std::pair<float, std::pair<Param*, int64_t>>> largest;
  for (Param* p : want)
    for (int64_t i = 0; i < p->main_grad.numel(); ++i)
      largest.push_back({std::fabs(p->main_grad.f32()[i]), {p, i}});
  std::partial_sort(largest.begin(), largest.begin() + 6, largest.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int k = 0; k < 6; ++k) {
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

  // The default loss (the mean of micro-batch means) has another gradient, and the
  // trainer without the flag takes that one.
  std::vector<Tensor> per_token_grads;
  for (const Param* p : want) per_token_grads.push_back(p->main_grad.clone());
  backward(model, *ds[0], /*per_token=*/false);
  const RawOptions plain_raw = options(prefix, true, false, false);
  Trainer plain(parse_train_args(plain_raw), plain_raw);
  const TrainResult plain_result = plain.train();
  EXPECT_NEAR(plain_result.losses[0], result.losses[0], 1e-6 + 5e-6 * std::fabs(result.losses[0]));
  double diff_sq = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LE(testing::rel_error(plain.model().params()[i]->main_grad, want[i]->main_grad), 1e-5)
        << want[i]->name;
    diff_sq += std::pow(testing::rel_error(per_token_grads[i], want[i]->main_grad), 2);
  }
  EXPECT_GT(std::sqrt(diff_sq), 1e-2) << "per-token and default gradients are alike";
}

// Without a mask every micro-batch has B x S tokens, so the per-token gradient is the
// default one up to rounding; with MoE layers this includes the aux and z losses' gradients
// (Megatron's router multiplies them by the micro-batch's tokens under per-token loss).
TEST_F(PerTokenLossTrain, WithoutMaskEqualsTheDefault) {
  const std::string prefix = write_data(22);
  const RawOptions raw = options(prefix, /*mask=*/false, /*per_token=*/true, /*moe=*/true);
  const RawOptions plain_raw = options(prefix, false, false, true);
  Trainer per_token(parse_train_args(raw), raw);
  Trainer plain(parse_train_args(plain_raw), plain_raw);
  const TrainResult got = per_token.train();
  const TrainResult want = plain.train();
  ASSERT_EQ(got.losses.size(), 1u);
  EXPECT_NEAR(got.losses[0], want.losses[0], 1e-6 * std::fabs(want.losses[0]));
  EXPECT_NEAR(got.grad_norms[0], want.grad_norms[0], 1e-5 * want.grad_norms[0]);
  const double num_tokens = double(kGlobalBatch * kSeq);
  const auto& a = per_token.model().params();
  const auto& b = plain.model().params();
  ASSERT_EQ(a.size(), b.size());
  bool routers = false;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i]->name, b[i]->name);
    routers |= a[i]->name.find("router") != std::string::npos;
    Tensor divided = a[i]->main_grad.clone();
    ops::scale_(divided, float(1.0 / num_tokens));
    EXPECT_LE(testing::rel_error(divided, b[i]->main_grad), 1e-5) << b[i]->name;
    EXPECT_LE(testing::rel_error(a[i]->weight, b[i]->weight), 1e-6) << b[i]->name;
  }
  EXPECT_TRUE(routers) << "no router weights: the aux losses are not exercised";
}

}  // namespace
}  // namespace megaton
