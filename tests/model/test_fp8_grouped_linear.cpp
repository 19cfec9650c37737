// Fp8GroupedLinearGemms (model/fp8_linear.h), the MoE experts' FP8 GEMMs, on the CPU:
// its contract is that the batched run (multi-tensor quantization, one grouped GEMM per
// step) gives exactly what G separate Fp8LinearGemms give on the same rows, in each
// recipe, over two steps (the delayed recipe's second uses its history), with a group of
// zero rows, with the input kept and recomputed.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/testing.h"
#include "model/fp8_linear.h"
#include "model/layers.h"

namespace megaton {
namespace {

using testing::randn;

bool same(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  for (int64_t i = 0; i < a.numel(); ++i)
    if (a.f32()[i] != b.f32()[i]) return false;
  return true;
}

struct Case {
  Fp8Recipe recipe;
  bool keep_input;
};

class Fp8GroupedLinearTest : public ::testing::TestWithParam<Case> {};

TEST_P(Fp8GroupedLinearTest, EqualsOneFp8LinearGemmsPerGroup) {
  const Case c = GetParam();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(::testing::Message() << fp8_recipe_name(c.recipe) << " seed " << seed);
  Fp8Config config;
  config.enabled = true;
  config.hybrid = true;
  config.recipe = c.recipe;
  config.amax_history_len = 3;
  config.amax_compute_max = true;
  const int64_t multiple = config.dimension_multiple();
  const std::vector<int64_t> rows = {2 * multiple, 0, multiple, 3 * multiple};
  constexpr int64_t kIn = 128, kOut = 256;
  int64_t total = 0;
  for (int64_t n : rows) total += n;
  const int64_t groups = int64_t(rows.size());

  const Placement cpu{Device::CPU, DType::F32};
  std::vector<Param> grouped_w, single_w;
  for (int64_t g = 0; g < groups; ++g) {
    const std::string name = fmt::format("e{}.weight", g);
    grouped_w.push_back(make_param(name, {kOut, kIn}, 0.05f, seed, cpu));
    single_w.push_back(make_param(name, {kOut, kIn}, 0.05f, seed, cpu));
    grouped_w.back().main_grad = Tensor::zeros({kOut, kIn});
    single_w.back().main_grad = Tensor::zeros({kOut, kIn});
  }
  Fp8GroupedLinearGemms grouped(config, Device::CPU, groups);
  std::vector<Fp8LinearGemms> singles;
  for (int64_t g = 0; g < groups; ++g) singles.emplace_back(config, Device::CPU);
  std::vector<const Param*> grouped_const;
  std::vector<Param*> grouped_mut;
  for (Param& p : grouped_w) {
    grouped_const.push_back(&p);
    grouped_mut.push_back(&p);
  }
  const Fp8LinearGemms::Sharding none;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Groups of different magnitude: one shared scale would differ from per-group ones.
    Tensor x = randn({total, kIn}, seed + 10 * step + 1);
    Tensor dy = randn({total, kOut}, seed + 10 * step + 2, 0.01f);
    for (int64_t r = 0; r < total; ++r)
      for (int64_t k = 0; k < kIn; ++k) x.f32()[r * kIn + k] *= float(1 + r / multiple);
    Tensor y = Tensor::zeros({total, kOut}), dx = Tensor::zeros({total, kIn});
    const Fp8GroupedLinearGemms::Saved saved =
        grouped.forward(x, rows, grouped_const, c.keep_input, none, y);
    grouped.backward(dy, rows, grouped_mut, saved, [&] { return x; }, none, dx);

    int64_t start = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t n = rows[size_t(g)];
      if (n > 0) {
        const Tensor x_g = x.rows(start, n);
        Tensor y_g = Tensor::empty({n, kOut}), dx_g = Tensor::empty({n, kIn});
        const Fp8LinearGemms::Saved s =
            singles[size_t(g)].forward(x_g, single_w[size_t(g)], c.keep_input, none, y_g);
        singles[size_t(g)].backward(dy.rows(start, n), single_w[size_t(g)], s,
                                    [&] { return x_g; }, none, dx_g, single_w[size_t(g)].main_grad);
        EXPECT_TRUE(same(y.rows(start, n), y_g)) << "y of group " << g;
        EXPECT_TRUE(same(dx.rows(start, n), dx_g)) << "dx of group " << g;
      }
      EXPECT_TRUE(same(grouped_w[size_t(g)].main_grad, single_w[size_t(g)].main_grad))
          << "main_grad of group " << g;
      start += n;
    }
  }
  // The empty group's weight got no gradient.
  for (int64_t i = 0; i < kOut * kIn; ++i) ASSERT_EQ(grouped_w[1].main_grad.f32()[i], 0.0f);
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8GroupedLinearTest,
    ::testing::Values(Case{Fp8Recipe::Tensorwise, true}, Case{Fp8Recipe::Tensorwise, false},
                      Case{Fp8Recipe::Delayed, true}, Case{Fp8Recipe::Delayed, false},
                      Case{Fp8Recipe::Blockwise, true}),
    [](const auto& info) {
      return std::string(fp8_recipe_name(info.param.recipe)) +
             (info.param.keep_input ? "Kept" : "Recomputed");
    });

}  // namespace
}  // namespace megaton
