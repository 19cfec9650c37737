// Packed sequences through the whole model (--reset-attention-mask with
// --reset-position-ids, model/packed_seq_params.h): a micro-batch of packed documents gives
// each token the loss, and every parameter the gradient, that running each document as its
// own sequence (positions from 0) gives. Self attention with GQA (with and without
// --qk-layernorm) and multi-latent attention with MoE; recomputation replays the same ops.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/testing.h"
#include "model/gpt.h"
#include "model/tiny_gpt_testing.h"

namespace megaton {
namespace {

using testing::TinyGptVariant;

constexpr int64_t B = 2, S = 16;
// Document lengths per sample (each sums to S): one-token documents, a document that spans
// most of a sample, and documents whose last token is the sample's (no eod there).
const std::vector<std::vector<int64_t>> kDocuments = {{5, 1, 7, 3}, {9, 6, 1}};

TinyGptVariant variant(const std::string& name) {
  for (const TinyGptVariant& v : testing::tiny_gpt_variants())
    if (v.name == name) return v;
  throw InternalError("no tiny variant " + name);
}

GPTConfig config_of(const std::string& name, const RecomputeConfig& recompute = {}) {
  TinyGptVariant v = variant(name);
  v.seq_length = S;
  if (v.max_position_embeddings) v.max_position_embeddings = std::max<int64_t>(v.max_position_embeddings, S);
  GPTConfig cfg = testing::tiny_gpt_config(v);
  cfg.hidden_dropout = cfg.attention_dropout = 0.0f;
  // The aux loss couples the micro-batch's tokens (its statistics are over all of them):
  // the per-document runs would see other statistics. The LM loss's gradient is per token.
  cfg.moe_aux_loss_coeff = 0.0f;
  cfg.moe_aux_loss_coeffs.assign(cfg.moe_aux_loss_coeffs.size(), 0.0f);
  cfg.recompute = recompute;
  cfg.finalize();
  return cfg;
}

// The packing of kDocuments over the B * S rows: boundaries and per-token positions.
std::shared_ptr<const PackedSeqParams> packing(bool attention_mask, bool position_ids) {
  std::vector<int32_t> cu{0}, positions;
  int64_t longest = 0;
  for (const auto& sample : kDocuments)
    for (int64_t length : sample) {
      cu.push_back(cu.back() + int32_t(length));
      for (int64_t i = 0; i < length; ++i) positions.push_back(int32_t(i));
      longest = std::max(longest, length);
    }
  auto p = std::make_shared<PackedSeqParams>();
  if (attention_mask) {
    p->cu_seqlens = Tensor::from_i32({int64_t(cu.size())}, cu);
    p->cu_seqlens_host = cu;
    p->max_seqlen = longest;
  }
  if (position_ids) p->position_ids = Tensor::from_i32({B * S}, positions);
  return p;
}

struct RunResult {
  Tensor losses;              // [B * S] per token
  std::vector<Tensor> grads;  // every parameter's main_grad
};

std::vector<Tensor> grads_of(GPTModel& model) {
  std::vector<Tensor> out;
  for (Param* p : model.params()) out.push_back(p->main_grad.clone());
  return out;
}

// Tokens and labels in [1, vocab) (eod 0 ends each document, as the data would have it),
// and the per-token loss weights the backward starts from.
struct Batch {
  Tensor tokens, labels, weights;
};
Batch make_batch(const GPTConfig& cfg, uint64_t seed) {
  Batch b{testing::randint({B, S}, int32_t(cfg.vocab_size) - 1, seed),
          testing::randint({B, S}, int32_t(cfg.vocab_size) - 1, seed + 1),
          testing::randn({B * S}, seed + 2, 0.5f)};
  for (int64_t i = 0; i < B * S; ++i) {
    ++b.tokens.i32()[i];
    ++b.labels.i32()[i];
  }
  int64_t row = 0;
  for (const auto& sample : kDocuments)
    for (int64_t length : sample) {
      row += length;
      b.tokens.i32()[row - 1] = 0;
    }
  return b;
}

RunResult run_packed(const GPTConfig& cfg, const Batch& batch,
                     std::shared_ptr<const PackedSeqParams> packed, uint64_t seed) {
  GPTModel model(cfg, seed);
  testing::randomize_params(model, seed + 1);
  ForwardContext ctx{true, seed, 3, 0};
  ctx.packed_seq_params = std::move(packed);
  model.zero_grad();
  RunResult r;
  r.losses = model.forward(batch.tokens, batch.labels, ctx).losses.clone();
  model.backward(batch.weights, 1.0f);
  r.grads = grads_of(model);
  return r;
}

// Each document alone: [1, L] tokens at positions 0 .. L - 1; the gradients add up.
RunResult run_documents(const GPTConfig& cfg, const Batch& batch, uint64_t seed) {
  GPTModel model(cfg, seed);
  testing::randomize_params(model, seed + 1);
  model.zero_grad();
  RunResult r;
  r.losses = Tensor::empty({B * S});
  int64_t row = 0;
  for (const auto& sample : kDocuments)
    for (int64_t length : sample) {
      const Tensor tokens = batch.tokens.view({B * S}).rows(row, length).clone().view({1, length});
      const Tensor labels = batch.labels.view({B * S}).rows(row, length).clone().view({1, length});
      const Tensor losses = model.forward(tokens, labels, ForwardContext{true, seed, 3, 0}).losses;
      r.losses.rows(row, length).copy_from(losses);
      model.backward(batch.weights.rows(row, length).clone(), 1.0f);
      row += length;
    }
  r.grads = grads_of(model);
  return r;
}

// fp32 CPU: the same per-token arithmetic in other GEMM and sum shapes and orders.
void expect_close(const RunResult& got, const RunResult& want, double loss_tol, double grad_tol) {
  EXPECT_TRUE(testing::allclose(got.losses, want.losses, loss_tol, loss_tol));
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i)
    EXPECT_LE(testing::rel_error(got.grads[i], want.grads[i]), grad_tol) << "parameter " << i;
}

double max_abs_difference(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(double(a.item(i)) - b.item(i)));
  return m;
}

class PackedSequences : public ::testing::TestWithParam<std::string> {};

TEST_P(PackedSequences, EqualEachDocumentAsItsOwnSequence) {
  const GPTConfig cfg = config_of(GetParam());
  const uint64_t seed = testing::test_seed() + 70;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Batch batch = make_batch(cfg, seed + 10);
  const RunResult documents = run_documents(cfg, batch, seed);
  const RunResult packed = run_packed(cfg, batch, packing(true, true), seed);
  expect_close(packed, documents, 1e-5, 1e-5);
  // The same tokens without the packing attend across documents: the test would see it.
  const RunResult plain = run_packed(cfg, batch, nullptr, seed);
  EXPECT_GT(max_abs_difference(plain.losses, documents.losses), 1e-3);
}

// --reset-attention-mask alone: RoPE rotates by the position in the sample, and within a
// document the scores depend on position differences only, so the losses are the
// documents' up to the rounding of the rotations (about 1e-6 relative in fp32).
// --reset-position-ids alone: the attention spans the documents, at restarted positions.
TEST_P(PackedSequences, AttentionMaskAndPositionIdsApart) {
  const GPTConfig cfg = config_of(GetParam());
  const uint64_t seed = testing::test_seed() + 80;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Batch batch = make_batch(cfg, seed + 10);
  const RunResult documents = run_documents(cfg, batch, seed);
  const RunResult masked = run_packed(cfg, batch, packing(true, false), seed);
  expect_close(masked, documents, 1e-4, 1e-4);
  // Position ids alone keep the attention across documents, but rotate the keys of the
  // earlier documents by other positions than the plain run does. (Under the attention
  // mask the position ids change only the rounding, as above: this is where the model
  // shows that it applies them.)
  const RunResult positions = run_packed(cfg, batch, packing(false, true), seed);
  const RunResult plain = run_packed(cfg, batch, nullptr, seed);
  EXPECT_GT(max_abs_difference(positions.losses, documents.losses), 1e-3);
  EXPECT_GT(max_abs_difference(positions.losses, plain.losses), 1e-3);
  // The first document of each sample sees no other: the plain run's losses there.
  int64_t first = 0;
  for (const auto& sample : kDocuments) {
    for (int64_t i = 0; i < sample[0]; ++i)
      EXPECT_EQ(positions.losses.item(first + i), plain.losses.item(first + i));
    first += S;
  }
}

// Recomputed activations run the same ops with the same packing: bit for bit.
TEST_P(PackedSequences, RecomputeReplaysThePackedOps) {
  const bool mla = GetParam().rfind("mla", 0) == 0;
  const uint64_t seed = testing::test_seed() + 90;
  const Batch batch = make_batch(config_of(GetParam()), seed + 10);
  const RunResult reference = run_packed(config_of(GetParam()), batch, packing(true, true), seed);
  RecomputeConfig selective;
  selective.granularity = RecomputeGranularity::Selective;
  selective.modules = kRecomputeCoreAttn | kRecomputeLayernorm | (mla ? kRecomputeMlaUpProj : 0u);
  RecomputeConfig full;
  full.granularity = RecomputeGranularity::Full;
  full.method = RecomputeMethod::Uniform;
  full.num_layers = 1;
  for (const RecomputeConfig& rc : {selective, full}) {
    const RunResult r = run_packed(config_of(GetParam(), rc), batch, packing(true, true), seed);
    EXPECT_TRUE(testing::allclose(r.losses, reference.losses, 0, 0));
    for (size_t i = 0; i < r.grads.size(); ++i)
      EXPECT_TRUE(testing::allclose(r.grads[i], reference.grads[i], 0, 0)) << "parameter " << i;
  }
}

// Learned absolute position embeddings read the restarted position ids (Megatron's
// LanguageModelEmbedding looks position_ids up): packed equals each document alone, its
// position embedding rows' gradients included. With the attention mask alone the later
// documents keep their sample positions, so their losses differ.
TEST(PackedSequencesLearnedPositions, EqualEachDocumentAsItsOwnSequence) {
  const GPTConfig cfg = config_of("dense_learned_layernorm_gelu_bias_tied");
  const uint64_t seed = testing::test_seed() + 110;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Batch batch = make_batch(cfg, seed + 10);
  const RunResult documents = run_documents(cfg, batch, seed);
  expect_close(run_packed(cfg, batch, packing(true, true), seed), documents, 1e-5, 1e-5);
  const RunResult masked = run_packed(cfg, batch, packing(true, false), seed);
  EXPECT_GT(max_abs_difference(masked.losses, documents.losses), 1e-3);
}

// Multi-token prediction on packed documents: each depth shifts within its document, so
// depth k's loss summed over its counted tokens is the documents' own sums (a document of L
// tokens counts max(L - k, 0) of them). Without the per-document shift the depths would
// read the next document's tokens: the plain sample shift gives other losses.
TEST(PackedSequencesMtp, DepthLossesAreTheDocumentsOwn) {
  GPTConfig cfg = config_of("dense_rope_rmsnorm_swiglu_gqa_untied");
  cfg.mtp_num_layers = 2;
  cfg.finalize();
  const uint64_t seed = testing::test_seed() + 100;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Batch batch = make_batch(cfg, seed + 10);
  auto mtp_sums = [&](std::shared_ptr<const PackedSeqParams> packed) {
    GPTModel model(cfg, seed);
    testing::randomize_params(model, seed + 1);
    ForwardContext ctx{true, seed, 3, 0};
    ctx.packed_seq_params = std::move(packed);
    const Tensor mtp = model.forward(batch.tokens, batch.labels, ctx).mtp_losses;
    std::vector<double> sums;
    for (int64_t k = 1; k <= 2; ++k) {
      double counted = 0;
      for (const auto& sample : kDocuments)
        for (int64_t length : sample) counted += double(std::max<int64_t>(length - k, 0));
      // Packed: N_k counts every document's tokens; unpacked: S - k per sample.
      if (!ctx.packed_seq_params) counted = double(B * (S - k));
      sums.push_back(double(mtp.item(k - 1)) * counted);
    }
    return sums;
  };
  std::vector<double> documents(2, 0.0);
  {
    GPTModel model(cfg, seed);
    testing::randomize_params(model, seed + 1);
    int64_t row = 0;
    for (const auto& sample : kDocuments)
      for (int64_t length : sample) {
        const Tensor tokens = batch.tokens.view({B * S}).rows(row, length).clone().view({1, length});
        const Tensor labels = batch.labels.view({B * S}).rows(row, length).clone().view({1, length});
        const Tensor mtp =
            model.forward(tokens, labels, ForwardContext{true, seed, 3, 0}).mtp_losses;
        for (int64_t k = 1; k <= 2; ++k)
          documents[size_t(k - 1)] += double(mtp.item(k - 1)) * double(std::max<int64_t>(length - k, 0));
        row += length;
      }
  }
  const std::vector<double> packed = mtp_sums(packing(true, true));
  const std::vector<double> plain = mtp_sums(nullptr);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_NEAR(packed[k], documents[k], 1e-4 * std::fabs(documents[k])) << "depth " << k + 1;
    EXPECT_GT(std::fabs(plain[k] - documents[k]), 1e-2) << "depth " << k + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, PackedSequences,
                         ::testing::Values("dense_rope_qk_layernorm_gqa_bias",
                                           "dense_rope_rmsnorm_swiglu_gqa_untied",
                                           "mla_moe_yarn_rmsnorm_swiglu_shared"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace megaton
