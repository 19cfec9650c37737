// CPU reference of squared ReLU and of the MoE experts' row-weighted ops: weighted SwiGLU /
// GeLU / squared ReLU (routing probabilities applied after the activation, Megatron's
// weighted_swiglu and weighted_squared_relu), the probability-weighted expert bias, and
// moe_permute_rows. Forwards against fp64 references computed here; backwards (dx and the
// weights' gradient) against central finite differences of a random linear functional of
// the output.
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

enum class Act { Swiglu, Gelu, SquaredRelu };

double silu(double g) { return g / (1.0 + std::exp(-g)); }
double gelu(double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); }
double squared_relu(double v) { return v > 0 ? v * v : 0.0; }

// relu(x)^2 has a kink in its derivative at 0: a central difference over [x - eps, x + eps]
// that straddles it is off by up to eps / 2. Inputs are moved at least 5 eps away from 0.
void away_from_kink(Tensor& x) {
  for (int64_t i = 0; i < x.numel(); ++i) {
    float& v = x.f32()[i];
    if (std::fabs(v) < 5 * kFdEps) v += v < 0 ? -5 * kFdEps : 5 * kFdEps;
  }
}

// act(x) row by row in fp64: [R, 2F] -> [R, F] (SwiGLU) or [R, F] -> [R, F].
std::vector<double> act_ref(const Tensor& x, Act act) {
  const bool gated = act == Act::Swiglu;
  const int64_t in = x.dim(1), rows = x.dim(0), ffn = gated ? in / 2 : in;
  std::vector<double> out(rows * ffn);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < ffn; ++j) {
      const double v = x.f32()[t * in + j];
      out[t * ffn + j] = act == Act::Swiglu ? silu(v) * x.f32()[t * in + ffn + j]
                         : act == Act::Gelu ? gelu(v)
                                            : squared_relu(v);
    }
  return out;
}

void weighted_forward(Act act, const Tensor& x, const Tensor& w, Tensor& y) {
  switch (act) {
    case Act::Swiglu:
      ops::weighted_swiglu_forward(x, w, y);
      break;
    case Act::Gelu:
      ops::weighted_gelu_forward(x, w, y);
      break;
    case Act::SquaredRelu:
      ops::weighted_squared_relu_forward(x, w, y);
      break;
  }
}

void weighted_backward(Act act, const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dx,
                       Tensor& dw, Tensor* y = nullptr) {
  switch (act) {
    case Act::Swiglu:
      ops::weighted_swiglu_backward(dy, x, w, dx, dw, y);
      break;
    case Act::Gelu:
      ops::weighted_gelu_backward(dy, x, w, dx, dw, y);
      break;
    case Act::SquaredRelu:
      ops::weighted_squared_relu_backward(dy, x, w, dx, dw, y);
      break;
  }
}

void unweighted_forward(Act act, const Tensor& x, Tensor& y) {
  switch (act) {
    case Act::Swiglu:
      ops::swiglu_forward(x, y);
      break;
    case Act::Gelu:
      ops::gelu_forward(x, y);
      break;
    case Act::SquaredRelu:
      ops::squared_relu_forward(x, y);
      break;
  }
}

// ------------------------------------------------------------------------ squared ReLU

TEST(SquaredRelu, ForwardIsReluSquared) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (int64_t n : {int64_t(35), int64_t(1) << 15}) {  // serial and threaded paths
    Tensor x = randn({n}, seed, 3.0f);
    x.f32()[0] = 0.0f;  // relu(0)^2 = 0
    Tensor y = Tensor::empty({n});
    poison(y);
    ops::squared_relu_forward(x, y);
    std::vector<float> ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = float(squared_relu(x.f32()[i]));
    EXPECT_TRUE(allclose(y, Tensor::from({n}, ref), kAtol, kRtol));
  }
  // Not gated: the output has the input's shape; any other is refused.
  Tensor x = randn({4, 6}, seed), y_half = Tensor::empty({4, 3});
  EXPECT_THROW(ops::squared_relu_forward(x, y_half), InternalError);
}

TEST(SquaredRelu, BackwardIsTwiceReluAndMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 5, cols = 7;
  Tensor x = randn({rows, cols}, seed, 2.0f), probe = randn({rows, cols}, seed + 1);
  away_from_kink(x);
  auto loss = [&] {
    Tensor y = Tensor::empty({rows, cols});
    ops::squared_relu_forward(x, y);
    return dot(probe, y);
  };
  Tensor fd = finite_difference(x, loss, kFdEps);
  Tensor dx = Tensor::empty({rows, cols});
  poison(dx);
  ops::squared_relu_backward(probe, x, dx);
  EXPECT_TRUE(allclose(dx, fd, kFdAtol, kFdRtol));
  // Megatron's _squared_relu_back: dy * 2 relu(x), 0 for x <= 0 (x = 0 included).
  x.f32()[0] = 0.0f;
  ops::squared_relu_backward(probe, x, dx);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double v = x.f32()[i];
    EXPECT_NEAR(dx.f32()[i], double(probe.f32()[i]) * 2.0 * (v > 0 ? v : 0.0), 1e-6) << i;
  }
  // The backward that also writes the forward output: the same dx, squared_relu_forward's y.
  Tensor dx2 = Tensor::empty({rows, cols}), y2 = Tensor::empty({rows, cols}),
         y_fwd = Tensor::empty({rows, cols});
  poison(dx2);
  poison(y2);
  ops::squared_relu_backward(probe, x, dx2, &y2);
  ops::squared_relu_forward(x, y_fwd);
  EXPECT_EQ(dx2.to_vector(), dx.to_vector());
  EXPECT_EQ(y2.to_vector(), y_fwd.to_vector());
  Tensor dx_bad = Tensor::empty({rows, cols + 1});
  EXPECT_THROW(ops::squared_relu_backward(probe, x, dx_bad), InternalError);
}

// ------------------------------------------------------------------------ row-weighted

class WeightedActivation : public ::testing::TestWithParam<Act> {};

TEST_P(WeightedActivation, ForwardIsActivationTimesRowWeight) {
  const Act act = GetParam();
  const bool gated = act == Act::Swiglu;
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (auto [rows, ffn] : {std::pair<int64_t, int64_t>{3, 5}, {128, 160}}) {
    Tensor x = randn({rows, gated ? 2 * ffn : ffn}, seed, 3.0f);
    Tensor w = randn({rows}, seed + 1);
    w.f32()[0] = 0.0f;  // a padding row: all zeros out
    Tensor y = Tensor::empty({rows, ffn});
    poison(y);
    weighted_forward(act, x, w, y);
    std::vector<double> ref = act_ref(x, act);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < ffn; ++j) ref[t * ffn + j] *= w.f32()[t];
    std::vector<float> ref_f(ref.begin(), ref.end());
    EXPECT_TRUE(allclose(y, Tensor::from({rows, ffn}, ref_f), kAtol, kRtol));
  }
}

TEST_P(WeightedActivation, BackwardMatchesFiniteDifferences) {
  const Act act = GetParam();
  const bool gated = act == Act::Swiglu;
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 5, ffn = 6, in = gated ? 2 * ffn : ffn;
  Tensor x = randn({rows, in}, seed, 2.0f), w = randn({rows}, seed + 1);
  if (act == Act::SquaredRelu) away_from_kink(x);
  Tensor probe = randn({rows, ffn}, seed + 2);  // d loss / d y
  auto loss = [&] {
    Tensor y = Tensor::empty({rows, ffn});
    weighted_forward(act, x, w, y);
    return dot(probe, y);
  };
  Tensor fd_x = finite_difference(x, loss, kFdEps);
  Tensor fd_w = finite_difference(w, loss, kFdEps);
  Tensor dx = Tensor::empty({rows, in}), dw = Tensor::empty({rows});
  poison(dx);
  poison(dw);
  weighted_backward(act, probe, x, w, dx, dw);
  EXPECT_TRUE(allclose(dx, fd_x, kFdAtol, kFdRtol));
  EXPECT_TRUE(allclose(dw, fd_w, kFdAtol, kFdRtol));
  // The backward that also writes the forward output: the forward's bits, the same grads.
  Tensor dx2 = Tensor::empty({rows, in}), dw2 = Tensor::empty({rows}),
         y2 = Tensor::empty({rows, ffn});
  poison(dx2);
  poison(dw2);
  poison(y2);
  weighted_backward(act, probe, x, w, dx2, dw2, &y2);
  Tensor y_fwd = Tensor::empty({rows, ffn});
  weighted_forward(act, x, w, y_fwd);
  EXPECT_EQ(y2.to_vector(), y_fwd.to_vector());
  EXPECT_EQ(dx2.to_vector(), dx.to_vector());
  EXPECT_EQ(dw2.to_vector(), dw.to_vector());
  // With every weight 1 the ops are the unweighted activation.
  Tensor ones = Tensor::from({rows}, std::vector<float>(rows, 1.0f)),
         y1 = Tensor::empty({rows, ffn}), y0 = Tensor::empty({rows, ffn});
  weighted_forward(act, x, ones, y1);
  unweighted_forward(act, x, y0);
  EXPECT_EQ(y1.to_vector(), y0.to_vector());
}

TEST_P(WeightedActivation, DoorChecks) {
  const Act act = GetParam();
  const int64_t rows = 4, ffn = 6, in = act == Act::Swiglu ? 2 * ffn : ffn;
  Tensor x = Tensor::zeros({rows, in}), y = Tensor::empty({rows, ffn});
  Tensor w_short = Tensor::zeros({rows - 1}), w = Tensor::zeros({rows});
  EXPECT_THROW(weighted_forward(act, x, w_short, y), InternalError);
  Tensor y_bad = Tensor::empty({rows, ffn + 1});
  EXPECT_THROW(weighted_forward(act, x, w, y_bad), InternalError);
  Tensor dx = Tensor::empty({rows, in}), dw_short = Tensor::empty({rows - 1});
  EXPECT_THROW(weighted_backward(act, y, x, w, dx, dw_short), InternalError);
  Tensor w_bf16 = Tensor::zeros({rows}).to(DType::BF16);
  EXPECT_THROW(weighted_forward(act, x, w_bf16, y), InternalError);
}

INSTANTIATE_TEST_SUITE_P(Activations, WeightedActivation,
                         ::testing::Values(Act::Swiglu, Act::Gelu, Act::SquaredRelu),
                         [](const auto& info) {
                           return info.param == Act::Swiglu ? "SwiGLU"
                                  : info.param == Act::Gelu ? "GeLU"
                                                            : "SquaredReLU";
                         });

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
