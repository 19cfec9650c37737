// Mamba-2's causal depthwise convolution and gated RMSNorm (ops/ssm.h) on the CPU: the
// convolution's taps, packed documents against separate runs, the generation step from
// the forward's final state, the gated RMSNorm against its formula, and both backwards
// against finite differences. The scan: test_ssm.cpp.
#include <cmath>
#include <functional>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/ssm.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randn;

// d loss / d x by central differences with the steps actually taken in fp32, at eps and
// eps / 2 combined by Richardson extrapolation (error O(eps^4) instead of O(eps^2)).
Tensor central_difference(Tensor& x, const std::function<double()>& loss, float eps) {
  Tensor grad = Tensor::empty(x.shape());
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float orig = x.f32()[i];
    auto difference = [&](float step) {
      const float up = orig + step, down = orig - step;
      x.f32()[i] = up;
      const double lp = loss();
      x.f32()[i] = down;
      const double lm = loss();
      x.f32()[i] = orig;
      return (lp - lm) / (double(up) - double(down));
    };
    grad.f32()[i] = float((4.0 * difference(eps / 2) - difference(eps)) / 3.0);
  }
  return grad;
}

// Each sample's rows [from, from + count) of a [batch * seq, C] tensor: [batch * count, C].
Tensor sample_rows(const Tensor& t, int64_t batch, int64_t seq, int64_t from, int64_t count) {
  Tensor out = Tensor::empty({batch * count, t.dim(1)});
  for (int64_t b = 0; b < batch; ++b)
    out.rows(b * count, count).copy_from(t.rows(b * seq + from, count));
  return out;
}

// With one-hot weights the convolution is a shift: weight[c, k] = 1 reads row s - (K-1) + k.
TEST(CausalConv1d, OneHotWeightsShiftTheInput) {
  const int64_t B = 2, S = 6, C = 3, K = 4;
  const Tensor x = randn({B * S, C}, testing::test_seed());
  const Tensor bias = randn({C}, testing::test_seed() + 1);
  for (int64_t tap = 0; tap < K; ++tap) {
    Tensor w = Tensor::zeros({C, K});
    for (int64_t c = 0; c < C; ++c) w.f32()[c * K + tap] = 1.0f;
    Tensor y = Tensor::empty({B * S, C});
    testing::poison(y);
    ops::causal_conv1d_forward(x, w, bias, B, false, y);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t c = 0; c < C; ++c) {
          const int64_t from = s - (K - 1) + tap;
          const float want = bias.f32()[c] + (from >= 0 ? x.f32()[(b * S + from) * C + c] : 0.0f);
          ASSERT_FLOAT_EQ(y.f32()[(b * S + s) * C + c], want)
              << "tap " << tap << ", b " << b << ", s " << s;
        }
  }
}

// Packed documents: each document's rows as if it were alone (with SiLU).
TEST(CausalConv1d, PackedDocumentsEqualSeparateRuns) {
  const uint64_t seed = testing::test_seed() + 10;
  const std::vector<std::vector<int>> lengths{{2, 1, 5, 3}, {6, 1, 4}};
  const int64_t B = 2, S = 11, C = 5, K = 4;
  const Tensor x = randn({B * S, C}, seed), w = randn({C, K}, seed + 1),
               bias = randn({C}, seed + 2);
  std::vector<int32_t> pos;
  for (const auto& sample : lengths)
    for (int len : sample)
      for (int k = 0; k < len; ++k) pos.push_back(k);
  Tensor y = Tensor::empty({B * S, C});
  testing::poison(y);
  ops::causal_conv1d_forward(x, w, bias, B, true, y, Tensor::from_i32({B * S}, pos));
  int64_t start = 0;
  for (const auto& sample : lengths)
    for (int len : sample) {
      Tensor alone = Tensor::empty({len, C});
      ops::causal_conv1d_forward(x.rows(start, len).clone(), w, bias, 1, true, alone);
      EXPECT_TRUE(allclose(y.rows(start, len).clone(), alone, 0, 0)) << "row " << start;
      start += len;
    }
}

// The step continuing from causal_conv1d_final_state over a prefix (shorter than K-1
// included; prefix 0: the zero state) gives the forward's rows over the whole sequence.
TEST(CausalConv1d, StepContinuesFromFinalState) {
  const uint64_t seed = testing::test_seed() + 20;
  const int64_t B = 2, S = 9, C = 5, K = 4;
  const Tensor x = randn({B * S, C}, seed), w = randn({C, K}, seed + 1),
               bias = randn({C}, seed + 2);
  for (bool silu : {false, true}) {
    Tensor full = Tensor::empty({B * S, C});
    ops::causal_conv1d_forward(x, w, bias, B, silu, full);
    for (int64_t prefix : {0, 1, 2, 3, 6}) {
      SCOPED_TRACE("prefix " + std::to_string(prefix) + (silu ? ", silu" : ""));
      Tensor state = Tensor::zeros({B, K - 1, C});
      if (prefix > 0) {
        testing::poison(state);
        ops::causal_conv1d_final_state(sample_rows(x, B, S, 0, prefix), B, state);
      }
      for (int64_t s = prefix; s < S; ++s) {
        Tensor y = Tensor::empty({B, C});
        testing::poison(y);
        ops::causal_conv1d_step(sample_rows(x, B, S, s, 1), w, bias, silu, state, y);
        EXPECT_TRUE(allclose(y, sample_rows(full, B, S, s, 1), 1e-6, 5e-6)) << "step " << s;
      }
      // The state now holds the last K-1 rows.
      Tensor final_state = Tensor::empty({B, K - 1, C});
      ops::causal_conv1d_final_state(x, B, final_state);
      EXPECT_TRUE(allclose(state, final_state, 0, 0));
    }
  }
}

TEST(CausalConv1d, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 30;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t B = 2, S = 7, C = 3, K = 4;
  Tensor x = randn({B * S, C}, seed), w = randn({C, K}, seed + 1, 0.5f),
         bias = randn({C}, seed + 2);
  const Tensor dy = randn({B * S, C}, seed + 3);
  const Tensor pos = Tensor::from_i32({B * S}, {0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 0, 1, 0, 1});
  for (bool silu : {false, true})
    for (const Tensor& ids : {Tensor(), pos}) {
      SCOPED_TRACE(std::string(silu ? "silu" : "identity") +
                   (ids.defined() ? ", position_ids" : ""));
      Tensor dx = Tensor::empty(x.shape()), dw = Tensor::empty(w.shape()),
             db = Tensor::empty(bias.shape());
      testing::poison(dx);
      dw.fill(0.5f);  // accumulators: added to
      db.fill(-0.25f);
      ops::causal_conv1d_backward(dy, x, w, bias, B, silu, dx, dw, db, ids);
      for (int64_t i = 0; i < dw.numel(); ++i) dw.f32()[i] -= 0.5f;
      for (int64_t i = 0; i < db.numel(); ++i) db.f32()[i] += 0.25f;
      Tensor y = Tensor::empty(x.shape());
      auto loss = [&] {
        ops::causal_conv1d_forward(x, w, bias, B, silu, y, ids);
        return testing::dot(dy, y);
      };
      for (auto [input, grad, name] :
           {std::tuple{&x, &dx, "x"}, {&w, &dw, "weight"}, {&bias, &db, "bias"}}) {
        SCOPED_TRACE(name);
        const Tensor fd = central_difference(*input, loss, 1e-2f);
        EXPECT_TRUE(allclose(*grad, fd, 2e-3, 2e-3));
        EXPECT_LT(testing::rel_error(*grad, fd), 1e-3);
      }
    }
}

TEST(CausalConv1d, ArgumentErrors) {
  const Tensor x = randn({12, 4}, 1), w = randn({4, 3}, 2), bias = randn({4}, 3);
  Tensor y = Tensor::empty({12, 4});
  EXPECT_THROW(ops::causal_conv1d_forward(x, w, bias, 5, true, y), InternalError);  // 12 % 5
  EXPECT_THROW(ops::causal_conv1d_forward(x, randn({3, 3}, 4), bias, 2, true, y), InternalError);
  Tensor dx = Tensor::empty({12, 4}), dw = Tensor::zeros({4, 3}), db = Tensor::zeros({5});
  EXPECT_THROW(ops::causal_conv1d_backward(y, x, w, bias, 2, true, dx, dw, db), InternalError);
  Tensor state = Tensor::zeros({2, 3, 4});  // K-1 = 2 rows expected
  Tensor y_step = Tensor::empty({2, 4});
  EXPECT_THROW(ops::causal_conv1d_step(x.rows(0, 2).clone(), w, bias, true, state, y_step),
               InternalError);
}

// out = g / sqrt(mean_group(g^2) + eps) * weight with g = y silu(z), in fp64.
TEST(GatedRmsNorm, ForwardMatchesFormula) {
  const uint64_t seed = testing::test_seed() + 40;
  const int64_t T = 5, D = 12, group = 4;
  const float eps = 1e-5f;
  const Tensor y = randn({T, D}, seed), z = randn({T, D}, seed + 1), weight = randn({D}, seed + 2);
  Tensor out = Tensor::empty({T, D}), rstd = Tensor::empty({T * D / group});
  testing::poison(out);
  testing::poison(rstd);
  ops::gated_rmsnorm_forward(y, z, weight, group, eps, out, rstd);
  Tensor want = Tensor::empty({T, D}), want_rstd = Tensor::empty({T * D / group});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g0 = 0; g0 < D; g0 += group) {
      std::vector<double> gate(static_cast<size_t>(group));
      double squares = 0;
      for (int64_t j = 0; j < group; ++j) {
        const double zv = z.f32()[t * D + g0 + j];
        gate[size_t(j)] = y.f32()[t * D + g0 + j] * zv / (1.0 + std::exp(-zv));
        squares += gate[size_t(j)] * gate[size_t(j)];
      }
      const double r = 1.0 / std::sqrt(squares / double(group) + eps);
      want_rstd.f32()[(t * D + g0) / group] = float(r);
      for (int64_t j = 0; j < group; ++j)
        want.f32()[t * D + g0 + j] = float(gate[size_t(j)] * r * weight.f32()[g0 + j]);
    }
  EXPECT_TRUE(allclose(out, want, 1e-6, 5e-6));
  EXPECT_TRUE(allclose(rstd, want_rstd, 1e-6, 5e-6));
}

TEST(GatedRmsNorm, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 50;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 4, D = 12, group = 4;
  const float eps = 1e-5f;
  Tensor y = randn({T, D}, seed), z = randn({T, D}, seed + 1), weight = randn({D}, seed + 2);
  const Tensor dout = randn({T, D}, seed + 3);
  Tensor out = Tensor::empty({T, D}), rstd = Tensor::empty({T * D / group});
  ops::gated_rmsnorm_forward(y, z, weight, group, eps, out, rstd);
  Tensor dy = Tensor::empty({T, D}), dz = Tensor::empty({T, D}), dw = Tensor::empty({D});
  testing::poison(dy);
  testing::poison(dz);
  dw.fill(1.5f);
  ops::gated_rmsnorm_backward(dout, y, z, weight, rstd, group, dy, dz, dw);
  for (int64_t i = 0; i < D; ++i) dw.f32()[i] -= 1.5f;
  Tensor scratch_rstd = Tensor::empty({T * D / group});
  auto loss = [&] {
    ops::gated_rmsnorm_forward(y, z, weight, group, eps, out, scratch_rstd);
    return testing::dot(dout, out);
  };
  for (auto [input, grad, name] :
       {std::tuple{&y, &dy, "y"}, {&z, &dz, "z"}, {&weight, &dw, "weight"}}) {
    SCOPED_TRACE(name);
    const Tensor fd = central_difference(*input, loss, 1e-2f);
    EXPECT_TRUE(allclose(*grad, fd, 2e-3, 2e-3));
    EXPECT_LT(testing::rel_error(*grad, fd), 1e-3);
  }
}

TEST(GatedRmsNorm, ArgumentErrors) {
  const Tensor y = randn({3, 8}, 1), z = randn({3, 8}, 2), weight = randn({8}, 3);
  Tensor out = Tensor::empty({3, 8}), rstd = Tensor::empty({6});
  EXPECT_THROW(ops::gated_rmsnorm_forward(y, z, weight, 3, 1e-5f, out, rstd), InternalError);
  Tensor small_rstd = Tensor::empty({3});
  EXPECT_THROW(ops::gated_rmsnorm_forward(y, z, weight, 4, 1e-5f, out, small_rstd), InternalError);
  Tensor dy = Tensor::empty({3, 8}), dz = Tensor::empty({3, 8}),
         dw = Tensor::zeros({8}, DType::BF16);
  EXPECT_THROW(ops::gated_rmsnorm_backward(out, y, z, weight, rstd, 4, dy, dz, dw), InternalError);
}

}  // namespace
}  // namespace megaton
