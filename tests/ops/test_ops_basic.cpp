// CPU reference ops: gemm, reductions, embedding, norms, activations, dropout, AdamW.
// Forwards are checked against references computed here in fp64; backwards against
// central finite differences of a random linear functional of the output.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "core/rng.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::dot;
using testing::finite_difference;
using testing::poison;
using testing::randint;
using testing::randn;
using testing::rel_error;

// fp32 CPU op against an fp64 reference (CONVENTIONS.md, "fp32 CPU vs CPU").
constexpr double kAtol = 1e-6, kRtol = 5e-6;

// Finite differences in fp32. With eps = 1e-2 the central difference has truncation
// error ~ eps^2 / 6 * |f'''| ~ 2e-5 for these O(1) inputs, and the loss (a sum of ~100
// fp32 outputs weighted by N(0, 1)) carries rounding noise ~ 1e-6, i.e. ~ 5e-5 after
// dividing by 2 eps (eps = 1e-3 makes that noise 10x larger). Measured on the norm
// backwards over 49 seeds: max |fd - analytic| ~ 4e-5, at most 4% of atol 1e-3 +
// rtol 1e-2 * |g|. These tolerances still fail a backward with a 10% error in one term
// or 1/(H+1) for 1/H (tried), so they hide no real bug.
constexpr float kFdEps = 1e-2f;
constexpr double kFdAtol = 1e-3, kFdRtol = 1e-2;

Tensor from_double(const Shape& shape, const std::vector<double>& values) {
  std::vector<float> f(values.begin(), values.end());
  return Tensor::from(shape, f);
}

// Tensor a + b (same shape), for "accumulates onto its starting value" checks.
Tensor plus(const Tensor& a, const Tensor& b) {
  Tensor out = a.clone();
  for (int64_t i = 0; i < out.numel(); ++i) out.f32()[i] += b.f32()[i];
  return out;
}

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

// ---------------------------------------------------------------------------- gemm

struct GemmCase {
  int m, n, k;
  float alpha, beta;
};

TEST(Gemm, AllTransposeCombosOddSizesAlphaBeta) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const GemmCase cases[] = {{7, 5, 3, 1.0f, 0.0f},
                            {33, 17, 65, 1.0f, 0.0f},
                            {33, 17, 65, 0.5f, -1.25f},
                            {1, 9, 4, -2.0f, 1.0f},
                            {64, 1, 130, 1.0f, 0.75f}};
  for (const GemmCase& gc : cases) {
    for (int combo = 0; combo < 4; ++combo) {
      bool ta = combo & 1, tb = combo & 2;
      SCOPED_TRACE(fmt::format("m={} n={} k={} alpha={} beta={} trans_a={} trans_b={}", gc.m, gc.n,
                               gc.k, gc.alpha, gc.beta, ta, tb));
      Tensor a = randn(ta ? Shape{gc.k, gc.m} : Shape{gc.m, gc.k}, seed + 1);
      Tensor b = randn(tb ? Shape{gc.n, gc.k} : Shape{gc.k, gc.n}, seed + 2);
      Tensor c = randn({gc.m, gc.n}, seed + 3);
      // beta == 0 must not read c: poison it to prove that.
      if (gc.beta == 0.0f) poison(c);
      Tensor c0 = c.clone();

      std::vector<double> ref(size_t(gc.m) * gc.n), bound(ref.size());
      for (int i = 0; i < gc.m; ++i) {
        for (int j = 0; j < gc.n; ++j) {
          double s = 0, abs_sum = 0;
          for (int p = 0; p < gc.k; ++p) {
            double av = ta ? a.f32()[p * gc.m + i] : a.f32()[i * gc.k + p];
            double bv = tb ? b.f32()[j * gc.k + p] : b.f32()[p * gc.n + j];
            s += av * bv;
            abs_sum += std::fabs(av * bv);
          }
          double cv = gc.beta == 0.0f ? 0.0 : double(c0.f32()[i * gc.n + j]);
          ref[i * gc.n + j] = gc.alpha * s + gc.beta * cv;
          // Forward error bound of a length-k fp32 dot product (Higham, Accuracy and
          // Stability, eq. 3.5): gamma_{k+2} * (|alpha| sum |a b| + |beta c|).
          bound[i * gc.n + j] =
              (gc.k + 2) * 0x1p-24 * (std::fabs(gc.alpha) * abs_sum + std::fabs(gc.beta * cv));
        }
      }
      ops::gemm(a, ta, b, tb, c, gc.alpha, gc.beta);
      for (size_t i = 0; i < ref.size(); ++i)
        ASSERT_LE(std::fabs(c.f32()[i] - ref[i]), bound[i] + 1e-30) << "element " << i;
      EXPECT_LE(rel_error(c, from_double({gc.m, gc.n}, ref)), 1e-6);
    }
  }
}

TEST(Gemm, MergesLeadingDimensions) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // x [B, S, H] @ W^T, W [N, H]: the linear-layer forward on a 3-d activation.
  Tensor x = randn({2, 3, 8}, seed), w = randn({5, 8}, seed + 1);
  Tensor y = Tensor::empty({2, 3, 5});
  poison(y);
  ops::gemm(x, false, w, true, y);
  std::vector<double> ref(30);
  for (int t = 0; t < 6; ++t)
    for (int j = 0; j < 5; ++j)
      for (int p = 0; p < 8; ++p) ref[t * 5 + j] += double(x.f32()[t * 8 + p]) * w.f32()[j * 8 + p];
  EXPECT_TRUE(allclose(y, from_double({2, 3, 5}, ref), 1e-5, 1e-5));
}

TEST(Gemm, EmptyInnerDimensionScalesC) {
  Tensor a = Tensor::empty({3, 0}), b = Tensor::empty({0, 4});
  Tensor c = Tensor::empty({3, 4});
  poison(c);
  ops::gemm(a, false, b, false, c);
  for (int64_t i = 0; i < c.numel(); ++i) EXPECT_EQ(c.f32()[i], 0.0f);
  c.fill(2.0f);
  ops::gemm(a, false, b, false, c, 1.0f, 0.5f);
  for (int64_t i = 0; i < c.numel(); ++i) EXPECT_EQ(c.f32()[i], 1.0f);
}

TEST(Gemm, DoorChecks) {
  Tensor a = Tensor::zeros({4, 3}), b = Tensor::zeros({5, 2}), c = Tensor::zeros({4, 2});
  EXPECT_THROW(ops::gemm(a, false, b, false, c), InternalError);  // k 3 vs 5
  Tensor b_ok = Tensor::zeros({3, 2});
  EXPECT_NO_THROW(ops::gemm(a, false, b_ok, false, c));
  Tensor c_bad = Tensor::zeros({4, 3});
  EXPECT_THROW(ops::gemm(a, false, b_ok, false, c_bad), InternalError);  // n 2 vs 3
  Tensor a_i32 = Tensor::zeros({4, 3}, DType::I32);
  EXPECT_THROW(ops::gemm(a_i32, false, b_ok, false, c), InternalError);
  Tensor vec = Tensor::zeros({3});
  EXPECT_THROW(ops::gemm(a, false, vec, false, c), InternalError);  // rank 1
  // c may not alias an input (BLAS would read what it has already overwritten).
  Tensor sq = Tensor::zeros({4, 4});
  EXPECT_THROW(ops::gemm(sq, false, sq, false, sq), InternalError);
}

// ------------------------------------------------------------------ elementwise/reduce

TEST(Reduce, AddAndScale) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // 1 << 16 elements takes the threaded path.
  for (int64_t n : {int64_t(37), int64_t(1) << 16}) {
    Tensor y = randn({n}, seed), x = randn({n}, seed + 1);
    Tensor y0 = y.clone();
    ops::add_(y, x, -0.75f);
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = double(y0.f32()[i]) - 0.75 * x.f32()[i];
    EXPECT_TRUE(allclose(y, from_double({n}, ref), kAtol, kRtol));

    Tensor z = x.clone();
    ops::scale_(z, 3.5f);
    for (int64_t i = 0; i < n; ++i) ref[i] = 3.5 * x.f32()[i];
    EXPECT_TRUE(allclose(z, from_double({n}, ref), kAtol, kRtol));
  }
  Tensor y = Tensor::zeros({4}), x = Tensor::zeros({5});
  EXPECT_THROW(ops::add_(y, x), InternalError);
}

TEST(Reduce, BiasAddForward) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor y = randn({2, 3, 7}, seed), bias = randn({7}, seed + 1);
  Tensor y0 = y.clone();
  ops::bias_add_(y, bias);
  std::vector<double> ref(42);
  for (int i = 0; i < 42; ++i) ref[i] = double(y0.f32()[i]) + bias.f32()[i % 7];
  EXPECT_TRUE(allclose(y, from_double({2, 3, 7}, ref), kAtol, kRtol));
  Tensor wrong = Tensor::zeros({6});
  EXPECT_THROW(ops::bias_add_(y, wrong), InternalError);
}

TEST(Reduce, BiasBackwardAccumulatesFiniteDifferenceGradient) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (int64_t rows : {int64_t(9), int64_t(600)}) {  // 600 x 70: the threaded path
    const int64_t cols = 70;
    Tensor y_in = randn({rows, cols}, seed), bias = randn({cols}, seed + 1);
    Tensor w = randn({rows, cols}, seed + 2);
    auto loss = [&] {
      Tensor y = y_in.clone();
      ops::bias_add_(y, bias);
      return dot(w, y);
    };
    Tensor dbias = randn({cols}, seed + 3);  // nonzero start: the op must accumulate
    Tensor dbias0 = dbias.clone();
    ops::bias_backward(w, dbias);
    // fd only on the small case: its rounding noise grows with the rows * cols outputs
    // summed into the loss, and the fp64 check below covers the threaded path.
    if (rows == 9) {
      Tensor fd = finite_difference(bias, loss, kFdEps);
      EXPECT_TRUE(allclose(dbias, plus(dbias0, fd), kFdAtol, kFdRtol));
    }
    // Tightly against the fp64 column sums.
    std::vector<double> ref(cols);
    for (int64_t j = 0; j < cols; ++j) {
      ref[j] = dbias0.f32()[j];
      for (int64_t t = 0; t < rows; ++t) ref[j] += w.f32()[t * cols + j];
    }
    EXPECT_TRUE(allclose(dbias, from_double({cols}, ref), kAtol, kRtol));
  }
}

TEST(Reduce, SumsAccumulateInFp64) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // 1e8 followed by 1000 ones: an fp32 accumulator stays at 1e8 (its ulp there is 8).
  Tensor x = Tensor::empty({1001});
  x.fill(1.0f);
  x.f32()[0] = 1e8f;
  EXPECT_EQ(ops::sum(x), 1e8 + 1000.0);
  x.f32()[0] = 1e4f;  // squares: 1e8 again
  EXPECT_EQ(ops::sum_of_squares(x), 1e8 + 1000.0);

  for (int64_t n : {int64_t(1000), int64_t(1) << 18}) {
    Tensor r = randn({n}, seed, 3.0f);
    double s = 0, ss = 0;
    for (int64_t i = 0; i < n; ++i) {
      s += r.f32()[i];
      ss += double(r.f32()[i]) * r.f32()[i];
    }
    // Only the fp64 summation order differs from the reference.
    EXPECT_NEAR(ops::sum(r), s, 1e-12 * ss);
    EXPECT_NEAR(ops::sum_of_squares(r), ss, 1e-12 * ss);
  }
}

// ------------------------------------------------------------------------ embedding

TEST(Embedding, ForwardCopiesRows) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int vocab = 11, hidden = 6;
  Tensor table = randn({vocab, hidden}, seed);
  Tensor ids = randint({2, 5}, vocab, seed + 1);  // [B, S]
  Tensor out = Tensor::empty({2, 5, hidden});
  poison(out);
  ops::embedding_forward(ids, table, out);
  for (int t = 0; t < 10; ++t)
    for (int j = 0; j < hidden; ++j)
      ASSERT_EQ(out.f32()[t * hidden + j], table.f32()[ids.i32()[t] * hidden + j]);
}

TEST(Embedding, BackwardAccumulatesFiniteDifferenceGradient) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int vocab = 11, hidden = 6, tokens = 13;
  Tensor table = randn({vocab, hidden}, seed);
  Tensor ids = randint({tokens}, vocab, seed + 1);
  ids.i32()[4] = ids.i32()[1];  // a repeated id must sum both tokens' gradients
  ids.i32()[9] = ids.i32()[1];
  Tensor w = randn({tokens, hidden}, seed + 2);
  auto loss = [&] {
    Tensor out = Tensor::empty({tokens, hidden});
    ops::embedding_forward(ids, table, out);
    return dot(w, out);
  };
  Tensor fd = finite_difference(table, loss, kFdEps);
  Tensor dtable = randn({vocab, hidden}, seed + 3);
  Tensor dtable0 = dtable.clone();
  ops::embedding_backward(w, ids, dtable);
  EXPECT_TRUE(allclose(dtable, plus(dtable0, fd), kFdAtol, kFdRtol));
}

TEST(Embedding, OutOfRangeIdIsInternalErrorNamingTheId) {
  Tensor table = Tensor::zeros({11, 4});
  Tensor out = Tensor::zeros({3, 4});
  for (int32_t bad : {11, -1, 1000}) {
    Tensor ids = Tensor::from_i32({3}, {0, bad, 2});
    try {
      ops::embedding_forward(ids, table, out);
      ADD_FAILURE() << "id " << bad << " accepted";
    } catch (const InternalError& e) {
      EXPECT_NE(std::string(e.what()).find("token id " + std::to_string(bad)), std::string::npos)
          << e.what();
    }
    Tensor dtable = Tensor::zeros({11, 4});
    EXPECT_THROW(ops::embedding_backward(out, ids, dtable), InternalError);
  }
}

TEST(Embedding, DoorChecks) {
  Tensor table = Tensor::zeros({11, 4});
  Tensor ids = Tensor::from_i32({3}, {0, 1, 2});
  Tensor out_bad = Tensor::zeros({3, 5});
  EXPECT_THROW(ops::embedding_forward(ids, table, out_bad), InternalError);
  Tensor ids_f32 = Tensor::zeros({3});
  Tensor out = Tensor::zeros({3, 4});
  EXPECT_THROW(ops::embedding_forward(ids_f32, table, out), InternalError);
}

// ------------------------------------------------------------------------ norms

struct NormRef {
  std::vector<double> y, mean, rstd;
};

NormRef ref_norm(const Tensor& x, const Tensor& weight, const Tensor* bias, float eps,
                 bool layernorm) {
  int64_t h = x.dim(-1), rows = x.numel() / h;
  NormRef r{std::vector<double>(x.numel()), std::vector<double>(rows), std::vector<double>(rows)};
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x.f32() + t * h;
    double mu = 0;
    if (layernorm) {
      for (int64_t j = 0; j < h; ++j) mu += xr[j];
      mu /= h;
    }
    double ms = 0;
    for (int64_t j = 0; j < h; ++j) ms += (xr[j] - mu) * (xr[j] - mu);
    double rstd = 1.0 / std::sqrt(ms / h + eps);
    for (int64_t j = 0; j < h; ++j)
      r.y[t * h + j] = (xr[j] - mu) * rstd * weight.f32()[j] + (bias ? bias->f32()[j] : 0.0);
    r.mean[t] = mu;
    r.rstd[t] = rstd;
  }
  return r;
}

TEST(RMSNorm, Forward) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // Small rows and 256 x 96 (threaded path). x has a mean offset and scale.
  for (auto [rows, h] : {std::pair<int64_t, int64_t>{5, 16}, {256, 96}}) {
    Tensor x = randn({rows, h}, seed, 2.0f), weight = randn({h}, seed + 1);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] += 0.5f;
    Tensor y = Tensor::empty({rows, h}), rstd = Tensor::empty({rows});
    poison(y);
    poison(rstd);
    ops::rmsnorm_forward(x, weight, 1e-5f, y, rstd);
    NormRef r = ref_norm(x, weight, nullptr, 1e-5f, false);
    EXPECT_TRUE(allclose(y, from_double({rows, h}, r.y), kAtol, kRtol));
    EXPECT_TRUE(allclose(rstd, from_double({rows}, r.rstd), kAtol, kRtol));
  }
}

TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 5, h = 12;
  const float eps = 1e-5f;
  Tensor x = randn({rows, h}, seed), weight = randn({h}, seed + 1);
  Tensor w = randn({rows, h}, seed + 2);  // dL/dy
  auto loss = [&] {
    Tensor y = Tensor::empty({rows, h}), rstd = Tensor::empty({rows});
    ops::rmsnorm_forward(x, weight, eps, y, rstd);
    return dot(w, y);
  };
  Tensor fd_x = finite_difference(x, loss, kFdEps);
  Tensor fd_w = finite_difference(weight, loss, kFdEps);

  Tensor y = Tensor::empty({rows, h}), rstd = Tensor::empty({rows});
  ops::rmsnorm_forward(x, weight, eps, y, rstd);
  Tensor dx = Tensor::empty({rows, h});
  poison(dx);
  Tensor dweight = randn({h}, seed + 3);
  Tensor dweight0 = dweight.clone();
  ops::rmsnorm_backward(w, x, weight, rstd, dx, dweight);
  EXPECT_TRUE(allclose(dx, fd_x, kFdAtol, kFdRtol));
  EXPECT_TRUE(allclose(dweight, plus(dweight0, fd_w), kFdAtol, kFdRtol));
}

TEST(RMSNorm, ThreadedBackwardAgreesWithRowByRow) {
  // 300 x 64 takes the threaded path; each row's slice, run alone, must give the same dx
  // and the dweight contributions must add up.
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 300, h = 64;
  Tensor x = randn({rows, h}, seed), weight = randn({h}, seed + 1), dy = randn({rows, h}, seed + 2);
  Tensor y = Tensor::empty({rows, h}), rstd = Tensor::empty({rows});
  ops::rmsnorm_forward(x, weight, 1e-6f, y, rstd);
  Tensor dx = Tensor::empty({rows, h}), dweight = Tensor::zeros({h});
  ops::rmsnorm_backward(dy, x, weight, rstd, dx, dweight);
  std::vector<double> dw(h);
  for (int64_t t = 0; t < rows; ++t) {
    Tensor dx_row = Tensor::empty({1, h}), dw_row = Tensor::zeros({h});
    ops::rmsnorm_backward(dy.rows(t, 1), x.rows(t, 1), weight, rstd.rows(t, 1), dx_row, dw_row);
    ASSERT_TRUE(allclose(dx_row, dx.rows(t, 1), 0, 0)) << "row " << t;
    for (int64_t j = 0; j < h; ++j) dw[j] += dw_row.f32()[j];
  }
  EXPECT_TRUE(allclose(dweight, from_double({h}, dw), 1e-5, 1e-5));
}

TEST(LayerNorm, ForwardWithAndWithoutBias) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (bool with_bias : {true, false}) {
    for (auto [rows, h] : {std::pair<int64_t, int64_t>{5, 16}, {256, 96}}) {
      SCOPED_TRACE(fmt::format("bias={} rows={} h={}", with_bias, rows, h));
      Tensor x = randn({rows, h}, seed, 2.0f), weight = randn({h}, seed + 1);
      for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] += 3.0f;  // mean far from 0
      Tensor bias = with_bias ? randn({h}, seed + 2) : Tensor();
      Tensor y = Tensor::empty({rows, h}), mean = Tensor::empty({rows}),
             rstd = Tensor::empty({rows});
      poison(y);
      poison(mean);
      poison(rstd);
      ops::layernorm_forward(x, weight, bias, 1e-5f, y, mean, rstd);
      NormRef r = ref_norm(x, weight, with_bias ? &bias : nullptr, 1e-5f, true);
      EXPECT_TRUE(allclose(y, from_double({rows, h}, r.y), kAtol, kRtol));
      EXPECT_TRUE(allclose(mean, from_double({rows}, r.mean), kAtol, kRtol));
      EXPECT_TRUE(allclose(rstd, from_double({rows}, r.rstd), kAtol, kRtol));
    }
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 5, h = 12;
  const float eps = 1e-5f;
  for (bool with_bias : {true, false}) {
    SCOPED_TRACE(fmt::format("bias={}", with_bias));
    Tensor x = randn({rows, h}, seed), weight = randn({h}, seed + 1);
    Tensor bias = with_bias ? randn({h}, seed + 2) : Tensor();
    Tensor w = randn({rows, h}, seed + 3);
    auto loss = [&] {
      Tensor y = Tensor::empty({rows, h}), mean = Tensor::empty({rows}),
             rstd = Tensor::empty({rows});
      ops::layernorm_forward(x, weight, bias, eps, y, mean, rstd);
      return dot(w, y);
    };
    Tensor fd_x = finite_difference(x, loss, kFdEps);
    Tensor fd_w = finite_difference(weight, loss, kFdEps);

    Tensor y = Tensor::empty({rows, h}), mean = Tensor::empty({rows}), rstd = Tensor::empty({rows});
    ops::layernorm_forward(x, weight, bias, eps, y, mean, rstd);
    Tensor dx = Tensor::empty({rows, h});
    poison(dx);
    Tensor dweight = randn({h}, seed + 4), dweight0 = dweight.clone();
    Tensor dbias = with_bias ? randn({h}, seed + 5) : Tensor();
    Tensor dbias0 = with_bias ? dbias.clone() : Tensor();
    ops::layernorm_backward(w, x, weight, mean, rstd, dx, dweight, dbias);
    EXPECT_TRUE(allclose(dx, fd_x, kFdAtol, kFdRtol));
    EXPECT_TRUE(allclose(dweight, plus(dweight0, fd_w), kFdAtol, kFdRtol));
    if (with_bias) {
      Tensor fd_b = finite_difference(bias, loss, kFdEps);
      EXPECT_TRUE(allclose(dbias, plus(dbias0, fd_b), kFdAtol, kFdRtol));
    }
  }
}

TEST(Norm, DoorChecks) {
  Tensor x = Tensor::zeros({4, 8}), weight = Tensor::zeros({8}), y = Tensor::zeros({4, 8});
  Tensor rstd = Tensor::zeros({4}), mean = Tensor::zeros({4});
  Tensor weight_bad = Tensor::zeros({7}), rstd_bad = Tensor::zeros({5});
  EXPECT_THROW(ops::rmsnorm_forward(x, weight_bad, 1e-5f, y, rstd), InternalError);
  EXPECT_THROW(ops::rmsnorm_forward(x, weight, 1e-5f, y, rstd_bad), InternalError);
  EXPECT_THROW(ops::layernorm_forward(x, weight, weight_bad, 1e-5f, y, mean, rstd), InternalError);
  Tensor dw = Tensor::zeros({8});
  Tensor no_bias;
  EXPECT_THROW(ops::layernorm_backward(y, x, weight, mean, rstd, y, dw, no_bias),
               InternalError);  // dx aliases dy
}

// The fused residual add + norm is, on the CPU, the add followed by the norm: same bits.
// sum may be x's buffer (the model writes it in place), and dx may be dresidual's.
TEST(Norm, FusedResidualAddEqualsAddThenNorm) {
  const uint64_t seed = testing::test_seed();
  for (bool layernorm : {false, true}) {
    SCOPED_TRACE(layernorm ? "LayerNorm" : "RMSNorm");
    const int64_t rows = 6, cols = 40;
    Tensor x = randn({rows, cols}, seed + 1), res = randn({rows, cols}, seed + 2, 3.0f);
    Tensor w = randn({cols}, seed + 3), b = randn({cols}, seed + 4);
    Tensor dy = randn({rows, cols}, seed + 5), dres = randn({rows, cols}, seed + 6);

    // Unfused: sum = x + res, norm(sum); dx = norm backward, then += dres.
    Tensor sum_ref = x.clone();
    ops::add_(sum_ref, res);
    Tensor y_ref = Tensor::empty({rows, cols}), mean_ref = Tensor::empty({rows});
    Tensor rstd_ref = Tensor::empty({rows});
    Tensor dx_ref = Tensor::empty({rows, cols}), dw_ref = Tensor::zeros({cols});
    Tensor db_ref = Tensor::zeros({cols});
    if (layernorm) {
      ops::layernorm_forward(sum_ref, w, b, 1e-5f, y_ref, mean_ref, rstd_ref);
      ops::layernorm_backward(dy, sum_ref, w, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref);
    } else {
      ops::rmsnorm_forward(sum_ref, w, 1e-5f, y_ref, rstd_ref);
      ops::rmsnorm_backward(dy, sum_ref, w, rstd_ref, dx_ref, dw_ref);
    }
    ops::add_(dx_ref, dres);

    // Fused, in place: sum into x's buffer, dx into dres's.
    Tensor sum = x.clone(), y = Tensor::empty({rows, cols}), mean = Tensor::empty({rows});
    Tensor rstd = Tensor::empty({rows});
    poison(y);
    poison(mean);
    poison(rstd);
    Tensor dx = dres.clone(), dw = Tensor::zeros({cols}), db = Tensor::zeros({cols});
    if (layernorm) {
      ops::add_layernorm_forward(sum, res, w, b, 1e-5f, sum, y, mean, rstd);
      ops::layernorm_backward(dy, sum, w, mean, rstd, dx, dw, db, dx);
      EXPECT_EQ(mean.to_vector(), mean_ref.to_vector());
      EXPECT_EQ(db.to_vector(), db_ref.to_vector());
    } else {
      ops::add_rmsnorm_forward(sum, res, w, 1e-5f, sum, y, rstd);
      ops::rmsnorm_backward(dy, sum, w, rstd, dx, dw, dx);
    }
    EXPECT_EQ(sum.to_vector(), sum_ref.to_vector());
    EXPECT_EQ(y.to_vector(), y_ref.to_vector());
    EXPECT_EQ(rstd.to_vector(), rstd_ref.to_vector());
    EXPECT_EQ(dx.to_vector(), dx_ref.to_vector());
    EXPECT_EQ(dw.to_vector(), dw_ref.to_vector());

    // sum may also be residual's buffer.
    Tensor sum2 = res.clone();
    Tensor y2 = Tensor::empty({rows, cols}), mean2 = Tensor::empty({rows}), rstd2 = Tensor::empty({rows});
    if (layernorm) ops::add_layernorm_forward(x, sum2, w, b, 1e-5f, sum2, y2, mean2, rstd2);
    else ops::add_rmsnorm_forward(x, sum2, w, 1e-5f, sum2, y2, rstd2);
    EXPECT_EQ(sum2.to_vector(), sum_ref.to_vector());
    EXPECT_EQ(y2.to_vector(), y_ref.to_vector());
    // Partial overlaps are refused before anything is written: sum one row into x, y over x.
    Tensor big = Tensor::zeros({rows + 1, cols});
    Tensor xs = big.rows(0, rows), shifted = big.rows(1, rows);
    EXPECT_THROW(ops::add_rmsnorm_forward(xs, res, w, 1e-5f, shifted, y2, rstd2), InternalError);
    EXPECT_THROW(ops::add_rmsnorm_forward(x, res, w, 1e-5f, sum2, sum2, rstd2), InternalError);
    EXPECT_EQ(big.to_vector(), Tensor::zeros({rows + 1, cols}).to_vector());
    EXPECT_THROW(ops::rmsnorm_backward(dy, sum, w, rstd, shifted, dw, xs), InternalError);

    Tensor short_res = Tensor::zeros({rows - 1, cols});
    EXPECT_THROW(ops::add_rmsnorm_forward(x, short_res, w, 1e-5f, sum, y, rstd), InternalError);
    EXPECT_THROW(ops::rmsnorm_backward(dy, sum, w, rstd, dx_ref, dw, short_res), InternalError);
  }
}

// ------------------------------------------------------------------------ activations

double silu(double g) { return g / (1.0 + std::exp(-g)); }
double gelu(double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); }

TEST(SwiGLU, Forward) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (auto [rows, ffn] : {std::pair<int64_t, int64_t>{3, 5}, {128, 160}}) {
    Tensor x = randn({rows, 2 * ffn}, seed, 3.0f);
    Tensor y = Tensor::empty({rows, ffn});
    poison(y);
    ops::swiglu_forward(x, y);
    std::vector<double> ref(rows * ffn);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < ffn; ++j)
        ref[t * ffn + j] = silu(x.f32()[t * 2 * ffn + j]) * x.f32()[t * 2 * ffn + ffn + j];
    EXPECT_TRUE(allclose(y, from_double({rows, ffn}, ref), kAtol, kRtol));
  }
}

TEST(SwiGLU, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 4, ffn = 6;
  Tensor x = randn({rows, 2 * ffn}, seed, 2.0f), w = randn({rows, ffn}, seed + 1);
  auto loss = [&] {
    Tensor y = Tensor::empty({rows, ffn});
    ops::swiglu_forward(x, y);
    return dot(w, y);
  };
  Tensor fd = finite_difference(x, loss, kFdEps);
  Tensor dx = Tensor::empty({rows, 2 * ffn});
  poison(dx);
  ops::swiglu_backward(w, x, dx);
  // The backward that also writes the forward output: the same dx and swiglu_forward's y.
  Tensor dx2 = Tensor::empty({rows, 2 * ffn}), y2 = Tensor::empty({rows, ffn});
  poison(dx2);
  poison(y2);
  Tensor y_fwd = Tensor::empty({rows, ffn});
  ops::swiglu_forward(x, y_fwd);
  ops::swiglu_backward(w, x, dx2, &y2);
  EXPECT_EQ(dx2.to_vector(), dx.to_vector());
  EXPECT_EQ(y2.to_vector(), y_fwd.to_vector());
  EXPECT_TRUE(allclose(dx, fd, kFdAtol, kFdRtol));
  Tensor y_bad = Tensor::zeros({rows, 2 * ffn});
  EXPECT_THROW(ops::swiglu_forward(x, y_bad), InternalError);
  Tensor x_odd = Tensor::zeros({rows, 5}), y_odd = Tensor::zeros({rows, 2});
  EXPECT_THROW(ops::swiglu_forward(x_odd, y_odd), InternalError);
}

TEST(GeLU, ForwardIsExactErfForm) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor x = randn({1 << 15}, seed, 3.0f);  // threaded path; tails out to ~ +-12
  Tensor y = Tensor::empty({1 << 15});
  poison(y);
  ops::gelu_forward(x, y);
  std::vector<double> ref(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) ref[i] = gelu(x.f32()[i]);
  EXPECT_TRUE(allclose(y, from_double({1 << 15}, ref), kAtol, kRtol));
  // The tanh approximation differs from the erf form by ~1e-4 near |x| = 2; the exact
  // form is what torch.nn.functional.gelu computes by default.
  Tensor two = Tensor::from({1}, {2.0f}), y2 = Tensor::empty({1});
  ops::gelu_forward(two, y2);
  EXPECT_NEAR(y2.item(), 1.9544997361036416, 1e-6);
}

TEST(GeLU, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor x = randn({5, 7}, seed, 2.0f), w = randn({5, 7}, seed + 1);
  auto loss = [&] {
    Tensor y = Tensor::empty({5, 7});
    ops::gelu_forward(x, y);
    return dot(w, y);
  };
  Tensor fd = finite_difference(x, loss, kFdEps);
  Tensor dx = Tensor::empty({5, 7});
  poison(dx);
  ops::gelu_backward(w, x, dx);
  EXPECT_TRUE(allclose(dx, fd, kFdAtol, kFdRtol));
}

TEST(SigmoidGate, ForwardScalesEachRow) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 37, hidden = 300;  // threaded path
  Tensor x = randn({rows, hidden}, seed, 2.0f), logits = randn({rows, 1}, seed + 1, 3.0f);
  Tensor y = Tensor::empty({rows, hidden});
  poison(y);
  ops::sigmoid_gate_forward(x, logits, y);
  std::vector<double> ref(rows * hidden);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < hidden; ++h)
      ref[t * hidden + h] = double(x.f32()[t * hidden + h]) / (1.0 + std::exp(-double(logits.f32()[t])));
  EXPECT_TRUE(allclose(y, from_double({rows, hidden}, ref), kAtol, kRtol));
}

TEST(SigmoidGate, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 5, hidden = 7;
  Tensor x = randn({rows, hidden}, seed, 2.0f), logits = randn({rows}, seed + 1, 2.0f);
  Tensor w = randn({rows, hidden}, seed + 2);
  auto loss = [&] {
    Tensor y = Tensor::empty({rows, hidden});
    ops::sigmoid_gate_forward(x, logits, y);
    return dot(w, y);
  };
  Tensor fd_x = finite_difference(x, loss, kFdEps);
  Tensor fd_logits = finite_difference(logits, loss, kFdEps);
  Tensor dx = Tensor::empty({rows, hidden}), dlogits = Tensor::empty({rows});
  poison(dx);
  poison(dlogits);
  ops::sigmoid_gate_backward(w, x, logits, dx, dlogits);
  EXPECT_TRUE(allclose(dx, fd_x, kFdAtol, kFdRtol));
  EXPECT_TRUE(allclose(dlogits, fd_logits, kFdAtol, kFdRtol));
  // dx may overwrite dy.
  Tensor dy = w.clone(), dlogits2 = Tensor::empty({rows});
  ops::sigmoid_gate_backward(dy, x, logits, dy, dlogits2);
  EXPECT_TRUE(allclose(dy, dx, 0.0, 0.0));
  EXPECT_TRUE(allclose(dlogits2, dlogits, 0.0, 0.0));
  Tensor short_logits = Tensor::zeros({rows - 1}), y = Tensor::empty({rows, hidden});
  EXPECT_THROW(ops::sigmoid_gate_forward(x, short_logits, y), InternalError);
  Tensor y_bad = Tensor::empty({rows, hidden + 1});
  EXPECT_THROW(ops::sigmoid_gate_forward(x, logits, y_bad), InternalError);
}

// ------------------------------------------------------------------------ dropout

TEST(Dropout, MaskIsPhiloxOfSeedAndStream) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const float p = 0.3f;
  const int64_t n = 1 << 16;  // threaded path
  Tensor x = randn({n}, seed);
  Tensor y = Tensor::empty({n});
  poison(y);
  const uint64_t drop_seed = 0x1234abcd5678ull, stream = 7;
  ops::dropout_forward(x, y, p, drop_seed, stream);
  // The contract (ops.h): keep[i] = Philox(seed).uniform(stream, i) >= p, so any backend
  // and any rank can regenerate the mask.
  const Philox rng(drop_seed);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    bool keep = rng.uniform(stream, i) >= p;
    kept += keep;
    double want = keep ? x.f32()[i] / (1.0 - p) : 0.0;
    ASSERT_NEAR(y.f32()[i], want, kAtol + kRtol * std::fabs(want)) << "element " << i;
  }
  // Fraction kept ~ 1 - p: sd = sqrt(p (1 - p) / n) = 1.8e-3, so 0.01 is > 5 sd.
  EXPECT_NEAR(double(kept) / n, 1.0 - p, 0.01);

  // Reproducible from (seed, stream); another stream or seed gives another mask.
  Tensor y_again = Tensor::empty({n});
  ops::dropout_forward(x, y_again, p, drop_seed, stream);
  EXPECT_TRUE(allclose(y_again, y, 0, 0));
  for (auto [s, st] :
       {std::pair<uint64_t, uint64_t>{drop_seed, stream + 1}, {drop_seed + 1, stream}}) {
    Tensor y_other = Tensor::empty({n});
    ops::dropout_forward(x, y_other, p, s, st);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += (y_other.f32()[i] == 0) != (y.f32()[i] == 0);
    // Independent masks disagree on 2 p (1 - p) = 42% of elements.
    EXPECT_GT(differ, n / 3) << "seed " << s << " stream " << st;
  }
}

TEST(Dropout, BackwardUsesTheForwardMask) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const float p = 0.25f;
  const int64_t n = 1000;
  Tensor x = randn({n}, seed), dy = randn({n}, seed + 1);
  Tensor y = Tensor::empty({n}), dx = Tensor::empty({n});
  poison(dx);
  ops::dropout_forward(x, y, p, 99, 3);
  ops::dropout_backward(dy, dx, p, 99, 3);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(y.f32()[i] == 0, dx.f32()[i] == 0) << "element " << i;
    if (dx.f32()[i] != 0) {
      ASSERT_NEAR(dx.f32()[i], dy.f32()[i] / (1.0 - p), 1e-6 * (1 + std::fabs(dy.f32()[i])));
    }
  }
  // And dx is the gradient of sum(dy * dropout(x)).
  Tensor xs = randn({4, 6}, seed + 2), w = randn({4, 6}, seed + 3);
  auto loss = [&] {
    Tensor ys = Tensor::empty({4, 6});
    ops::dropout_forward(xs, ys, p, 5, 11);
    return dot(w, ys);
  };
  Tensor fd = finite_difference(xs, loss, kFdEps);
  Tensor dxs = Tensor::empty({4, 6});
  ops::dropout_backward(w, dxs, p, 5, 11);
  EXPECT_TRUE(allclose(dxs, fd, kFdAtol, kFdRtol));
}

TEST(Dropout, ZeroProbabilityIsIdentity) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor x = randn({3, 50}, seed);
  Tensor y = Tensor::empty({3, 50});
  poison(y);
  ops::dropout_forward(x, y, 0.0f, 1, 2);
  EXPECT_TRUE(allclose(y, x, 0, 0));
  Tensor dx = Tensor::empty({3, 50});
  poison(dx);
  ops::dropout_backward(x, dx, 0.0f, 1, 2);
  EXPECT_TRUE(allclose(dx, x, 0, 0));
}

TEST(Dropout, DoorChecks) {
  Tensor x = Tensor::zeros({4}), y = Tensor::zeros({4}), y_bad = Tensor::zeros({5});
  EXPECT_THROW(ops::dropout_forward(x, y_bad, 0.1f, 1, 0), InternalError);
  EXPECT_THROW(ops::dropout_forward(x, y, 1.0f, 1, 0), InternalError);
  EXPECT_THROW(ops::dropout_forward(x, y, -0.1f, 1, 0), InternalError);
}

// ------------------------------------------------------------------------ AdamW

TEST(AdamW, ThreeStepsMatchTorchFormula) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t n = 1 << 16;  // threaded path
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  Tensor param = randn({n}, seed);
  Tensor exp_avg = Tensor::zeros({n}), exp_avg_sq = Tensor::zeros({n});
  // torch.optim.AdamW (_single_tensor_adamw) in fp64, written in torch's own form:
  //   param.mul_(1 - lr * wd); exp_avg.lerp_(grad, 1 - beta1);
  //   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  //   denom = exp_avg_sq.sqrt() / sqrt(1 - beta2^step) + eps;
  //   param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1^step)).
  // Hyperparameters are the fp32 values the op receives.
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0);
  for (int64_t i = 0; i < n; ++i) p[i] = param.f32()[i];
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor grad = randn({n}, seed + 10 * step, 0.1f);
    double bc1 = 1.0 - std::pow(double(beta1), double(step));
    double bc2_sqrt = std::sqrt(1.0 - std::pow(double(beta2), double(step)));
    for (int64_t i = 0; i < n; ++i) {
      double g = grad.f32()[i];
      p[i] *= 1.0 - double(lr) * weight_decay;
      m[i] += (g - m[i]) * (1.0 - beta1);
      v[i] = v[i] * beta2 + (1.0 - beta2) * g * g;
      double denom = std::sqrt(v[i]) / bc2_sqrt + eps;
      p[i] -= double(lr) / bc1 * m[i] / denom;
    }
    ops::adamw_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step);
  }
  EXPECT_TRUE(allclose(param, from_double({n}, p), kAtol, kRtol));
  EXPECT_TRUE(allclose(exp_avg, from_double({n}, m), kAtol, kRtol));
  EXPECT_TRUE(allclose(exp_avg_sq, from_double({n}, v), kAtol, kRtol));
  // The step moved every parameter by ~ lr per step, far above the tolerance.
  EXPECT_GT(rel_error(param, randn({n}, seed)), 1e-3);
}

TEST(AdamW, DoorChecks) {
  Tensor p = Tensor::zeros({4}), g = Tensor::zeros({4}), m = Tensor::zeros({4});
  Tensor v = Tensor::zeros({4}), v_bad = Tensor::zeros({3});
  EXPECT_THROW(ops::adamw_step(p, g, m, v_bad, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1), InternalError);
  EXPECT_THROW(ops::adamw_step(p, g, m, v, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0),
               InternalError);  // step is 1-based
}

}  // namespace
}  // namespace megaton
