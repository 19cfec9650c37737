// BF16 main gradients through a whole model (GPTConfig::main_grads_dtype, docs/memory.md
// "BF16 main gradients") on the CPU, every tiny GPT variant: the grad buffers are BF16,
// and every parameter's main grad is the fp32-main-grad run's gradient rounded once per
// micro-batch: round(g) after one micro-batch, round(round(g1) + g2) after two (g1, g2 the
// fp32 gradients of each micro-batch alone). The tied word embeddings take two
// accumulations per micro-batch (the output layer's GEMM, then the embedding's
// scatter-add; Megatron rounds them alike), so they are checked against the whole-tensor
// bf16 bound (||a - b|| / ||b|| <= 1e-2). With FP8 GEMMs as well (the wgrad GEMM writing
// the BF16 main grad directly).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "model/gpt.h"
#include "model/tiny_gpt_testing.h"

namespace megaton {
namespace {

// fp8: the layers' linear GEMMs (and the experts') in FP8 with per-tensor current
// scaling on the CPU twins, whose wgrad GEMM writes the BF16 main grad itself (fp32 sum,
// one rounding); every FP8 GEMM dimension a multiple of 16 (as test_recompute.cpp).
GPTConfig config(const testing::TinyGptVariant& v, DType main_grads, bool fp8 = false) {
  GPTConfig cfg = testing::tiny_gpt_config(v);
  cfg.main_grads_dtype = main_grads;
  if (fp8) {
    cfg.fp8.enabled = true;
    cfg.fp8.recipe = Fp8Recipe::Tensorwise;
    cfg.seq_length = 8;
    cfg.moe_ffn_hidden_size = 32;
  }
  cfg.finalize();
  return cfg;
}

struct MicroBatch {
  ChunkInput in;
  Tensor dout;
};

MicroBatch micro_batch(const GPTConfig& cfg, uint64_t seed) {
  const int64_t B = 2, S = cfg.seq_length;
  return {ChunkInput{B, S, testing::randint({B, S}, int32_t(cfg.vocab_size), seed + 1),
                     testing::randint({B, S}, int32_t(cfg.vocab_size), seed + 2), Tensor()},
          testing::randn({B * S}, seed + 4, 0.5f)};
}

// Every main grad after forward and backward of the given micro-batches (in order; with
// zero_between, the grads are zeroed before each, so each holds one micro-batch's alone).
std::vector<std::vector<Tensor>> grads_after(const GPTConfig& cfg,
                                             const std::vector<MicroBatch>& mbs,
                                             bool zero_between) {
  const uint64_t seed = 1234;
  GPTModel model(cfg, seed);
  testing::randomize_params(model, seed + 7);
  std::vector<std::vector<Tensor>> out;
  for (size_t m = 0; m < mbs.size(); ++m) {
    if (zero_between) model.zero_grad();
    model.forward_chunk(mbs[m].in, ForwardContext{true, seed, 3, int64_t(m)});
    model.backward_chunk(mbs[m].dout, 1.0f / float(mbs.size()));
    std::vector<Tensor> grads;
    for (Param* p : model.params()) grads.push_back(p->main_grad.clone());
    out.push_back(grads);
  }
  for (ParamAndGradBuffer& b : model.buffers())
    EXPECT_EQ(b.grads().dtype(), cfg.main_grads_dtype) << "grad buffer dtype";
  return out;
}

std::vector<std::string> param_names(const GPTConfig& cfg) {
  GPTModel model(cfg, 1234);
  std::vector<std::string> names;
  for (const Param* p : model.params()) names.push_back(p->name);
  return names;
}

class Bf16MainGrads : public ::testing::TestWithParam<testing::TinyGptVariant> {};

void check_rounded_once_per_micro_batch(const testing::TinyGptVariant& v, bool fp8) {
  const GPTConfig f32 = config(v, DType::F32, fp8), bf16 = config(v, DType::BF16, fp8);
  const std::vector<MicroBatch> mbs = {micro_batch(f32, 100), micro_batch(f32, 200)};
  // fp32: each micro-batch's gradient alone, and the two accumulated.
  const auto alone = grads_after(f32, mbs, true);
  const auto summed = grads_after(f32, mbs, false)[1];
  const auto got = grads_after(bf16, mbs, false);
  const std::vector<std::string> names = param_names(f32);
  ASSERT_EQ(got[0].size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(names[i]);
    const Tensor& g1 = alone[0][i];
    const Tensor& g2 = alone[1][i];
    ASSERT_EQ(got[0][i].dtype(), DType::BF16);
    EXPECT_GT(ops::sum_of_squares(g1), 0.0) << "a zero gradient proves nothing";
    const bool tied = names[i] == "embedding.word_embeddings.weight" && !v.untie;
    // After micro-batch 1: round(g1); after 2: round(round(g1) + g2).
    Tensor once = g1.to(DType::BF16);
    Tensor twice = Tensor::empty(g1.shape(), DType::BF16);
    const Tensor once32 = once.to(DType::F32);
    for (int64_t k = 0; k < g1.numel(); ++k)
      twice.data<uint16_t>()[k] = float_to_bf16(once32.f32()[k] + g2.f32()[k]);
    if (!tied) {
      EXPECT_EQ(std::memcmp(got[0][i].raw(), once.raw(), size_t(once.nbytes())), 0)
          << "one micro-batch: not round(fp32 grad)";
      EXPECT_EQ(std::memcmp(got[1][i].raw(), twice.raw(), size_t(twice.nbytes())), 0)
          << "two micro-batches: not round(round(g1) + g2)";
    } else {
      // Two roundings of partial sums that may cancel: a whole-tensor bound.
      EXPECT_LE(testing::rel_error(got[0][i].to(DType::F32), g1), 1e-2);
    }
    // Against the fp32 accumulation: within bf16's resolution.
    EXPECT_LE(testing::rel_error(got[1][i].to(DType::F32), summed[i]), 1e-2);
  }
}

TEST_P(Bf16MainGrads, EqualFp32GradsRoundedOncePerMicroBatch) {
  check_rounded_once_per_micro_batch(GetParam(), false);
}

TEST_P(Bf16MainGrads, Fp8TensorwiseEqualFp32GradsRoundedOncePerMicroBatch) {
  check_rounded_once_per_micro_batch(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Variants, Bf16MainGrads, ::testing::ValuesIn(testing::tiny_gpt_variants()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace megaton
