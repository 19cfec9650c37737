// CPU reference of the MoE experts' row-weighted ops: weighted SwiGLU / GeLU (routing
// probabilities applied after the activation, Megatron's weighted_swiglu), the
// probability-weighted expert bias, and moe_permute_rows. Forwards against fp64
// references computed here; backwards (dx and the weights' gradient) against central
// finite differences of a random linear functional of the output.
#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::dot;
using testing::finite_difference;
using testing::poison;
using testing::randn;

constexpr double kAtol = 1e-6, kRtol = 5e-6;  // fp32 CPU vs an fp64 reference
// Finite differences: the tolerances and step of test_ops_basic.cpp (argued there).
constexpr float kFdEps = 1e-2f;
constexpr double kFdAtol = 1e-3, kFdRtol = 1e-2;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

double silu(double g) { return g / (1.0 + std::exp(-g)); }
double gelu(double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); }

// act(x) row by row in fp64: [R, 2F] -> [R, F] (SwiGLU) or [R, F] -> [R, F] (GeLU).
std::vector<double> act_ref(const Tensor& x, bool swiglu) {
  const int64_t in = x.dim(1), rows = x.dim(0), ffn = swiglu ? in / 2 : in;
  std::vector<double> out(rows * ffn);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < ffn; ++j)
      out[t * ffn + j] = swiglu ? silu(x.f32()[t * in + j]) * x.f32()[t * in + ffn + j]
                                : gelu(x.f32()[t * in + j]);
  return out;
}

void weighted_forward(bool swiglu, const Tensor& x, const Tensor& w, Tensor& y) {
  if (swiglu)
    ops::weighted_swiglu_forward(x, w, y);
  else
    ops::weighted_gelu_forward(x, w, y);
}

void weighted_backward(bool swiglu, const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dx,
                       Tensor& dw, Tensor* y = nullptr) {
  if (swiglu)
    ops::weighted_swiglu_backward(dy, x, w, dx, dw, y);
  else
    ops::weighted_gelu_backward(dy, x, w, dx, dw, y);
}

class WeightedActivation : public ::testing::TestWithParam<bool> {};

TEST_P(WeightedActivation, ForwardIsActivationTimesRowWeight) {
  const bool swiglu = GetParam();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (auto [rows, ffn] : {std::pair<int64_t, int64_t>{3, 5}, {128, 160}}) {
    Tensor x = randn({rows, swiglu ? 2 * ffn : ffn}, seed, 3.0f);
    Tensor w = randn({rows}, seed + 1);
    w.f32()[0] = 0.0f;  // a padding row: all zeros out
    Tensor y = Tensor::empty({rows, ffn});
    poison(y);
    weighted_forward(swiglu, x, w, y);
    std::vector<double> ref = act_ref(x, swiglu);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < ffn; ++j) ref[t * ffn + j] *= w.f32()[t];
    std::vector<float> ref_f(ref.begin(), ref.end());
    EXPECT_TRUE(allclose(y, Tensor::from({rows, ffn}, ref_f), kAtol, kRtol));
  }
}

TEST_P(WeightedActivation, BackwardMatchesFiniteDifferences) {
  const bool swiglu = GetParam();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 5, ffn = 6, in = swiglu ? 2 * ffn : ffn;
  Tensor x = randn({rows, in}, seed, 2.0f), w = randn({rows}, seed + 1);
  Tensor probe = randn({rows, ffn}, seed + 2);  // d loss / d y
  auto loss = [&] {
    Tensor y = Tensor::empty({rows, ffn});
    weighted_forward(swiglu, x, w, y);
    return dot(probe, y);
  };
  Tensor fd_x = finite_difference(x, loss, kFdEps);
  Tensor fd_w = finite_difference(w, loss, kFdEps);
  Tensor dx = Tensor::empty({rows, in}), dw = Tensor::empty({rows});
  poison(dx);
  poison(dw);
  weighted_backward(swiglu, probe, x, w, dx, dw);
  EXPECT_TRUE(allclose(dx, fd_x, kFdAtol, kFdRtol));
  EXPECT_TRUE(allclose(dw, fd_w, kFdAtol, kFdRtol));
  // The backward that also writes the forward output: the forward's bits, the same grads.
  Tensor dx2 = Tensor::empty({rows, in}), dw2 = Tensor::empty({rows}),
         y2 = Tensor::empty({rows, ffn});
  poison(dx2);
  poison(dw2);
  poison(y2);
  weighted_backward(swiglu, probe, x, w, dx2, dw2, &y2);
  Tensor y_fwd = Tensor::empty({rows, ffn});
  weighted_forward(swiglu, x, w, y_fwd);
  EXPECT_EQ(y2.to_vector(), y_fwd.to_vector());
  EXPECT_EQ(dx2.to_vector(), dx.to_vector());
  EXPECT_EQ(dw2.to_vector(), dw.to_vector());
  // With every weight 1 the ops are the unweighted activation.
  Tensor ones = Tensor::from({rows}, std::vector<float>(rows, 1.0f)),
         y1 = Tensor::empty({rows, ffn}), y0 = Tensor::empty({rows, ffn});
  weighted_forward(swiglu, x, ones, y1);
  if (swiglu)
    ops::swiglu_forward(x, y0);
  else
    ops::gelu_forward(x, y0);
  EXPECT_EQ(y1.to_vector(), y0.to_vector());
}

TEST_P(WeightedActivation, DoorChecks) {
  const bool swiglu = GetParam();
  const int64_t rows = 4, ffn = 6, in = swiglu ? 2 * ffn : ffn;
  Tensor x = Tensor::zeros({rows, in}), y = Tensor::empty({rows, ffn});
  Tensor w_short = Tensor::zeros({rows - 1}), w = Tensor::zeros({rows});
  EXPECT_THROW(weighted_forward(swiglu, x, w_short, y), InternalError);
  Tensor y_bad = Tensor::empty({rows, ffn + 1});
  EXPECT_THROW(weighted_forward(swiglu, x, w, y_bad), InternalError);
  Tensor dx = Tensor::empty({rows, in}), dw_short = Tensor::empty({rows - 1});
  EXPECT_THROW(weighted_backward(swiglu, y, x, w, dx, dw_short), InternalError);
  Tensor w_bf16 = Tensor::zeros({rows}).to(DType::BF16);
  EXPECT_THROW(weighted_forward(swiglu, x, w_bf16, y), InternalError);
}

INSTANTIATE_TEST_SUITE_P(Activations, WeightedActivation, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "SwiGLU" : "GeLU"; });

TEST(WeightedBias, ForwardAndBackward) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 6, cols = 5;
  Tensor y0 = randn({rows, cols}, seed), b = randn({cols}, seed + 1), w = randn({rows}, seed + 2);
  Tensor y = y0.clone();
  ops::weighted_bias_add_(y, b, w);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < cols; ++j)
      EXPECT_NEAR(y.f32()[t * cols + j],
                  double(y0.f32()[t * cols + j]) + double(w.f32()[t]) * b.f32()[j], 1e-6);
  // Gradients of sum(probe * (y0 + w b)) with respect to b and w, accumulated onto a start.
  Tensor probe = randn({rows, cols}, seed + 3);
  auto loss = [&] {
    Tensor out = y0.clone();
    ops::weighted_bias_add_(out, b, w);
    return dot(probe, out);
  };
  Tensor fd_b = finite_difference(b, loss, kFdEps), fd_w = finite_difference(w, loss, kFdEps);
  Tensor db = randn({cols}, seed + 4), dw = randn({rows}, seed + 5);
  const Tensor db0 = db.clone(), dw0 = dw.clone();
  ops::weighted_bias_backward(probe, b, w, db, &dw);
  for (int64_t j = 0; j < cols; ++j) db.f32()[j] -= db0.f32()[j];
  for (int64_t t = 0; t < rows; ++t) dw.f32()[t] -= dw0.f32()[t];
  EXPECT_TRUE(allclose(db, fd_b, kFdAtol, kFdRtol));
  EXPECT_TRUE(allclose(dw, fd_w, kFdAtol, kFdRtol));
  // Without dweights only the bias gradient is accumulated.
  Tensor db2 = Tensor::zeros({cols});
  ops::weighted_bias_backward(probe, b, w, db2);
  EXPECT_TRUE(allclose(db2, fd_b, kFdAtol, kFdRtol));
  Tensor w_short = Tensor::zeros({rows - 1});
  EXPECT_THROW(ops::weighted_bias_add_(y, b, w_short), InternalError);
}

TEST(MoePermuteRows, GathersByTheMapOfMoePermute) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t T = 7, H = 5, k = 3, E = 4;
  Tensor x = randn({T, H}, seed);
  std::vector<int32_t> idx(T * k);
  for (int64_t i = 0; i < T * k; ++i) idx[i] = int32_t((i * 7 + seed) % E);
  Tensor indices = Tensor::from_i32({T, k}, idx);
  Tensor permuted = Tensor::empty({T * k, H}), map = Tensor::empty({T * k}, DType::I32);
  Tensor counts = Tensor::empty({E}, DType::I64);
  ops::moe_permute(x, indices, int(E), permuted, map, counts);
  Tensor again = Tensor::empty({T * k, H});
  poison(again);
  ops::moe_permute_rows(x, map, int(k), again);
  EXPECT_EQ(again.to_vector(), permuted.to_vector());
  // k = 1 on the probs viewed [T k, 1]: each permuted row's probability, and
  // moe_permute_backward with k = 1 puts them back.
  Tensor probs = randn({T, k}, seed + 1);
  Tensor permuted_probs = Tensor::empty({T * k, 1});
  ops::moe_permute_rows(probs.view({T * k, 1}), map, 1, permuted_probs);
  for (int64_t r = 0; r < T * k; ++r) EXPECT_EQ(permuted_probs.f32()[r], probs.f32()[map.i32()[r]]);
  Tensor back = Tensor::empty({T * k, 1});
  ops::moe_permute_backward(permuted_probs, map, 1, back);
  EXPECT_EQ(back.to_vector(), probs.to_vector());
  Tensor bad_map = Tensor::from_i32({T * k}, std::vector<int32_t>(T * k, int32_t(T * k)));
  EXPECT_THROW(ops::moe_permute_rows(x, bad_map, int(k), again), InternalError);
}

}  // namespace
}  // namespace megaton
