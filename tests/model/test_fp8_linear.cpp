// FP8 Linear (model/fp8.h, Linear::enable_fp8) on the CPU against an fp64 reference that
// quantizes with core/dtype.h's scalar conversions: forward, input and weight gradients in
// each recipe, the delayed recipe's one-step lag, and hybrid's e5m2 gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "model/fp8.h"
#include "model/layers.h"

namespace megaton {
namespace {

using testing::randn;

float fp8_round(float v, DType fp8) {
  return fp8 == DType::F8E4M3 ? fp8e4m3_to_float(float_to_fp8e4m3(v))
                              : fp8e5m2_to_float(float_to_fp8e5m2(v));
}
double fp8_max_of(DType fp8) { return fp8 == DType::F8E4M3 ? 448.0 : 57344.0; }

// The largest power of two <= v (v > 0, normal).
float pow2_floor(float v) { return std::ldexp(1.0f, std::ilogb(v)); }

// x [R, C] fake-quantized: each block of block_rows x block_cols gets scale
// fp8_max / amax (a power of two when pow2), or `fixed_scale` when > 0 (one scale for all).
std::vector<double> fake_quantize(const Tensor& x, DType fp8, int64_t block_rows,
                                  int64_t block_cols, bool pow2, float fixed_scale = 0) {
  const int64_t R = x.dim(0), C = x.dim(1);
  std::vector<double> out(size_t(R * C));
  for (int64_t r0 = 0; r0 < R; r0 += block_rows)
    for (int64_t c0 = 0; c0 < C; c0 += block_cols) {
      const int64_t r1 = std::min(R, r0 + block_rows), c1 = std::min(C, c0 + block_cols);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x.f32()[r * C + c]));
      float scale = fixed_scale > 0 ? fixed_scale : 1.0f;
      if (fixed_scale <= 0 && amax > 0) {
        scale = float(fp8_max_of(fp8)) / amax;
        if (pow2) scale = pow2_floor(scale);
      }
      const float scale_inv = 1.0f / scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          out[size_t(r * C + c)] =
              double(fp8_round(x.f32()[r * C + c] * scale, fp8)) * double(scale_inv);
    }
  return out;
}

// c [M, N] = a [M, K] @ b [N, K]^T in fp64.
std::vector<double> matmul_nt(const std::vector<double>& a, const std::vector<double>& b,
                              int64_t M, int64_t N, int64_t K) {
  std::vector<double> c(size_t(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += a[size_t(m * K + k)] * b[size_t(n * K + k)];
      c[size_t(m * N + n)] = s;
    }
  return c;
}

std::vector<double> transpose(const std::vector<double>& x, int64_t R, int64_t C) {
  std::vector<double> t(x.size());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) t[size_t(c * R + r)] = x[size_t(r * C + c)];
  return t;
}

// ||got - want|| / ||want|| over fp32 got.
double rel_err(const Tensor& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double d = double(got.f32()[i]) - want[size_t(i)];
    num += d * d;
    den += want[size_t(i)] * want[size_t(i)];
  }
  return std::sqrt(num / den);
}

struct Case {
  Fp8Recipe recipe;
  bool hybrid;
};

class Fp8LinearTest : public ::testing::TestWithParam<Case> {};

// Tokens T, in, out: multiples of 128 so that every recipe takes them; a partial
// weight block column is not needed here (blockwise partial blocks are the op tests').
constexpr int64_t T = 128, kIn = 256, kOut = 128;

TEST_P(Fp8LinearTest, ForwardAndGradientsMatchTheFakeQuantizedReference) {
  const Case c = GetParam();
  SCOPED_TRACE(::testing::Message() << fp8_recipe_name(c.recipe) << (c.hybrid ? " hybrid" : " e4m3")
                                    << " seed " << testing::test_seed());
  Fp8Config config;
  config.enabled = true;
  config.recipe = c.recipe;
  config.hybrid = c.hybrid;
  Linear linear("l", kIn, kOut, /*bias=*/false, 0.05f, testing::test_seed(), Placement{});
  linear.enable_fp8(config);
  ASSERT_TRUE(linear.fp8());
  const Tensor x = randn({T, kIn}, testing::test_seed() + 1);
  const Tensor dy = randn({T, kOut}, testing::test_seed() + 2, 0.01f);
  const Tensor& w = linear.weight.weight;
  linear.weight.main_grad = Tensor::zeros(w.shape());  // the model would give a buffer slice

  const bool blockwise = c.recipe == Fp8Recipe::Blockwise;
  const DType grad_fp8 = c.hybrid ? DType::F8E5M2 : DType::F8E4M3;
  // The delayed recipe's first quantization of each operand uses scale 1 (no history yet).
  const float first = c.recipe == Fp8Recipe::Delayed ? 1.0f : 0.0f;
  // Per tensor: one block of everything; blockwise: 1x128.
  const int64_t act_rows = blockwise ? 1 : (1 << 30), act_cols = blockwise ? 128 : (1 << 30);
  const auto xq = fake_quantize(x, DType::F8E4M3, act_rows, act_cols, blockwise, first);
  const auto wq = blockwise ? fake_quantize(w, DType::F8E4M3, 128, 128, true)
                            : fake_quantize(w, DType::F8E4M3, 1 << 30, 1 << 30, false, first);
  const auto y_ref = matmul_nt(xq, wq, T, kOut, kIn);

  Tensor y = linear.forward(x);
  EXPECT_LT(rel_err(y, y_ref), 1e-6);

  // dx = dy W: the gradient is quantized row-wise for dgrad; blockwise 1x128 along out.
  const auto dyq = fake_quantize(dy, grad_fp8, act_rows, act_cols, blockwise, first);
  const auto dx_ref = matmul_nt(dyq, transpose(wq, kOut, kIn), T, kIn, kOut);
  // dW = dy^T x: blockwise quantizes dy^T and x^T in 1x128 blocks along the tokens.
  std::vector<double> dyq_t, xq_t;
  if (blockwise) {
    Tensor dy_t = Tensor::empty({kOut, T}), x_t = Tensor::empty({kIn, T});
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t o = 0; o < kOut; ++o) dy_t.f32()[o * T + t] = dy.f32()[t * kOut + o];
      for (int64_t i = 0; i < kIn; ++i) x_t.f32()[i * T + t] = x.f32()[t * kIn + i];
    }
    dyq_t = fake_quantize(dy_t, grad_fp8, 1, 128, true);
    xq_t = fake_quantize(x_t, DType::F8E4M3, 1, 128, true);
  } else {
    dyq_t = transpose(dyq, T, kOut);
    xq_t = transpose(xq, T, kIn);
  }
  const auto dw_ref = matmul_nt(dyq_t, xq_t, kOut, kIn, T);

  Tensor dx = linear.backward(dy);
  EXPECT_LT(rel_err(dx, dx_ref), 1e-6);
  EXPECT_LT(rel_err(linear.weight.main_grad, dw_ref), 1e-6);

  // FP8 stays close to the exact GEMM: e4m3 has 3 mantissa bits (relative rounding error
  // <= 2^-4 per element), which averages down over K products.
  std::vector<double> xd(x.numel()), wd(w.numel());
  for (int64_t i = 0; i < x.numel(); ++i) xd[size_t(i)] = x.f32()[i];
  for (int64_t i = 0; i < w.numel(); ++i) wd[size_t(i)] = w.f32()[i];
  if (first == 0.0f) {
    EXPECT_LT(rel_err(y, matmul_nt(xd, wd, T, kOut, kIn)), 0.05);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8LinearTest,
    ::testing::Values(Case{Fp8Recipe::Tensorwise, false}, Case{Fp8Recipe::Tensorwise, true},
                      Case{Fp8Recipe::Delayed, false}, Case{Fp8Recipe::Delayed, true},
                      Case{Fp8Recipe::Blockwise, false}),
    [](const auto& info) {
      return std::string(fp8_recipe_name(info.param.recipe)) + (info.param.hybrid ? "Hybrid" : "E4M3");
    });

// A caller that recomputes the input (forward with save_input false, backward given x)
// gets the same outputs and gradients as one that lets the Linear keep it.
TEST_P(Fp8LinearTest, RecomputedInputGivesTheSameGradients) {
  const Case c = GetParam();
  Fp8Config config;
  config.enabled = true;
  config.recipe = c.recipe;
  config.hybrid = c.hybrid;
  const Tensor x = randn({T, kIn}, testing::test_seed() + 3);
  const Tensor dy = randn({T, kOut}, testing::test_seed() + 4, 0.01f);
  std::vector<Tensor> results;
  for (bool keep : {true, false}) {
    Linear linear("l", kIn, kOut, false, 0.05f, testing::test_seed(), Placement{});
    linear.enable_fp8(config);
    linear.weight.main_grad = Tensor::zeros(linear.weight.weight.shape());
    for (int step = 0; step < 2; ++step) {  // the second step uses the delayed history
      Tensor y = linear.forward(x, keep);
      Tensor dx = keep ? linear.backward(dy) : linear.backward(dy, x);
      if (step == 1) results.insert(results.end(), {y, dx, linear.weight.main_grad.clone()});
    }
  }
  for (int i = 0; i < 3; ++i)
    for (int64_t j = 0; j < results[size_t(i)].numel(); ++j)
      ASSERT_EQ(results[size_t(i)].f32()[j], results[size_t(i + 3)].f32()[j]) << "output " << i << " element " << j;
}

// Delayed scaling lags one quantization: the second forward scales x by fp8_max / the
// first x's amax (history length 1, most_recent), whatever the second x holds.
TEST(Fp8Linear, DelayedScalingUsesThePreviousAmax) {
  Fp8Config config;
  config.enabled = true;
  config.recipe = Fp8Recipe::Delayed;
  Linear linear("l", kIn, kOut, false, 0.05f, 7, Placement{});
  linear.enable_fp8(config);
  const Tensor x1 = randn({T, kIn}, 11, 1.0f);
  const Tensor x2 = randn({T, kIn}, 12, 3.0f);  // a larger amax than x1's
  linear.forward(x1);
  linear.take_saved();
  float amax1 = 0;
  for (int64_t i = 0; i < x1.numel(); ++i) amax1 = std::max(amax1, std::fabs(x1.f32()[i]));
  float amax_w = 0;
  for (int64_t i = 0; i < linear.weight.weight.numel(); ++i)
    amax_w = std::max(amax_w, std::fabs(linear.weight.weight.f32()[i]));
  const auto xq = fake_quantize(x2, DType::F8E4M3, 1 << 30, 1 << 30, false, 448.0f / amax1);
  const auto wq = fake_quantize(linear.weight.weight, DType::F8E4M3, 1 << 30, 1 << 30, false,
                                448.0f / amax_w);
  Tensor y = linear.forward(x2);
  EXPECT_LT(rel_err(y, matmul_nt(xq, wq, T, kOut, kIn)), 1e-6);
  // x2's values beyond 448 / scale saturated: the saturation is visible in the error.
  int64_t saturated = 0;
  for (int64_t i = 0; i < x2.numel(); ++i) saturated += std::fabs(x2.f32()[i]) > amax1;
  EXPECT_GT(saturated, 0);
}

// --first-last-layers-bf16 picks the layers by index.
TEST(Fp8Config, FirstLastLayersBf16) {
  Fp8Config config;
  config.enabled = true;
  EXPECT_TRUE(config.layer_in_fp8(0, 4));
  config.first_last_layers_bf16 = true;
  config.num_layers_at_start_in_bf16 = 1;
  config.num_layers_at_end_in_bf16 = 2;
  std::vector<bool> in_fp8;
  for (int64_t l = 0; l < 6; ++l) in_fp8.push_back(config.layer_in_fp8(l, 6));
  EXPECT_EQ(in_fp8, (std::vector<bool>{false, true, true, true, false, false}));
  config.enabled = false;
  EXPECT_FALSE(config.layer_in_fp8(2, 6));
}

}  // namespace
}  // namespace megaton
