// Tests of the attention-path ops: causal GQA attention, RoPE and softmax cross-entropy.
#include <cmath>
#include <limits>
#include <string>
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
using testing::randn;

// Finite differences of an fp32 forward with eps = 1e-2: the truncation error is
// O(eps^2 * f''') ~ 1e-4 relative, and the fp32 rounding of the summed loss (~1e-7
// relative of a loss of size ~10) divided by 2 eps adds ~1e-5 absolute. These
// tolerances sit an order of magnitude above both.
constexpr double kFdAtol = 1e-3, kFdRtol = 1e-2;

bool all_finite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(t.item(i))) return false;
  return true;
}

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

// ---------------------------------------------------------------------------------------
// Attention

struct AttentionShape {
  int64_t B, S, Hq, Hkv, D;
};

// Naive causal attention in double, with the mask as an explicit -inf matrix and the
// dropout mask drawn from the Philox index ops.h documents.
struct AttentionReference {
  Tensor out, lse;            // fp32 copies of the double results
  std::vector<double> probs;  // [B, Hq, S, S], after dropout
};

// v's head dim Dv may differ from q's and k's D; scale <= 0: 1 / sqrt(D).
AttentionReference reference_attention(const Tensor& q, const Tensor& k, const Tensor& v, float p,
                                       uint64_t seed, uint64_t stream, double scale = 0) {
  const int64_t B = q.dim(0), S = q.dim(1), Hq = q.dim(2), D = q.dim(3), Hkv = k.dim(2);
  const int64_t Dv = v.dim(3);
  const int64_t group = Hq / Hkv;
  if (scale <= 0) scale = 1.0 / std::sqrt(double(D));
  AttentionReference ref{Tensor::empty({B, S, Hq, Dv}), Tensor::empty({B, Hq, S}),
                         std::vector<double>(B * Hq * S * S)};
  const Philox philox(seed);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < S; ++i) {
        std::vector<double> scores(S);
        for (int64_t j = 0; j < S; ++j) {
          double s = 0;
          for (int64_t c = 0; c < D; ++c)
            s += double(q.f32()[((b * S + i) * Hq + h) * D + c]) *
                 k.f32()[((b * S + j) * Hkv + hk) * D + c];
          scores[j] = j <= i ? s * scale : neg_inf;
        }
        double mx = neg_inf, sum = 0;
        for (double s : scores) mx = std::max(mx, s);
        for (double s : scores) sum += std::exp(s - mx);
        ref.lse.f32()[(b * Hq + h) * S + i] = float(mx + std::log(sum));
        for (int64_t j = 0; j < S; ++j) {
          double prob = std::exp(scores[j] - mx) / sum;
          uint64_t index = ((b * Hq + h) * S + i) * S + j;
          if (p > 0) prob = philox.uniform(stream, index) >= p ? prob / (1.0 - p) : 0.0;
          ref.probs[((b * Hq + h) * S + i) * S + j] = prob;
        }
        for (int64_t c = 0; c < Dv; ++c) {
          double o = 0;
          for (int64_t j = 0; j < S; ++j)
            o += ref.probs[((b * Hq + h) * S + i) * S + j] *
                 v.f32()[((b * S + j) * Hkv + hk) * Dv + c];
          ref.out.f32()[((b * S + i) * Hq + h) * Dv + c] = float(o);
        }
      }
    }
  return ref;
}

void PrintTo(const AttentionShape& s, std::ostream* os) {
  *os << "B=" << s.B << " S=" << s.S << " Hq=" << s.Hq << " Hkv=" << s.Hkv << " D=" << s.D;
}

class AttentionTest : public ::testing::TestWithParam<AttentionShape> {};

TEST_P(AttentionTest, ForwardMatchesNaiveReference) {
  const AttentionShape sh = GetParam();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(seed_trace(seed));
  Tensor q = randn({sh.B, sh.S, sh.Hq, sh.D}, seed);
  Tensor k = randn({sh.B, sh.S, sh.Hkv, sh.D}, seed + 1);
  Tensor v = randn({sh.B, sh.S, sh.Hkv, sh.D}, seed + 2);
  for (float p : {0.0f, 0.25f}) {
    SCOPED_TRACE("dropout_p " + std::to_string(p));
    Tensor out = Tensor::empty(q.shape()), lse = Tensor::empty({sh.B, sh.Hq, sh.S});
    poison(out);
    poison(lse);
    ops::attention_forward(q, k, v, out, lse, p, /*seed=*/77, /*stream=*/5);
    AttentionReference ref = reference_attention(q, k, v, p, 77, 5);
    ASSERT_TRUE(all_finite(out) && all_finite(lse));
    // fp32 GEMM dot products of length D against a double reference: the scores carry
    // ~sqrt(D) ulp of error, so elementwise 1e-5/1e-4; the whole tensor must meet the
    // fp32 convention of 1e-5.
    EXPECT_TRUE(allclose(out, ref.out, 1e-5, 1e-4));
    EXPECT_TRUE(allclose(lse, ref.lse, 1e-5, 1e-5));
    EXPECT_LE(testing::rel_error(out, ref.out), 1e-5);
  }
}

TEST_P(AttentionTest, BackwardMatchesFiniteDifferences) {
  AttentionShape sh = GetParam();
  if (sh.S > 16) sh.B = 1;  // keep the finite-difference loop quick
  const uint64_t seed = testing::test_seed() + 10;
  SCOPED_TRACE(seed_trace(seed));
  Tensor q = randn({sh.B, sh.S, sh.Hq, sh.D}, seed);
  Tensor k = randn({sh.B, sh.S, sh.Hkv, sh.D}, seed + 1);
  Tensor v = randn({sh.B, sh.S, sh.Hkv, sh.D}, seed + 2);
  Tensor w = randn(q.shape(), seed + 3);
  // With dropout the mask is a pure function of (seed, stream, index), so the loss is a
  // smooth function of q, k, v and central differences remain valid.
  for (float p : {0.0f, 0.3f}) {
    SCOPED_TRACE("dropout_p " + std::to_string(p));
    Tensor out = Tensor::empty(q.shape()), lse = Tensor::empty({sh.B, sh.Hq, sh.S});
    auto loss = [&] {
      ops::attention_forward(q, k, v, out, lse, p, 3, 9);
      return dot(w, out);
    };
    Tensor fd_q = finite_difference(q, loss);
    Tensor fd_k = finite_difference(k, loss);
    Tensor fd_v = finite_difference(v, loss);

    ops::attention_forward(q, k, v, out, lse, p, 3, 9);
    Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
           dv = Tensor::empty(v.shape());
    poison(dq);
    poison(dk);
    poison(dv);
    ops::attention_backward(w, q, k, v, out, lse, dq, dk, dv, p, 3, 9);
    EXPECT_TRUE(allclose(dq, fd_q, kFdAtol, kFdRtol)) << "dq";
    EXPECT_TRUE(allclose(dk, fd_k, kFdAtol, kFdRtol)) << "dk";
    EXPECT_TRUE(allclose(dv, fd_v, kFdAtol, kFdRtol)) << "dv";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionTest,
    ::testing::Values(AttentionShape{2, 5, 4, 2, 6},    // GQA, 2 query heads per kv head
                      AttentionShape{2, 7, 4, 1, 3},    // multi-query, odd S, odd D
                      AttentionShape{1, 9, 2, 2, 12},   // plain multi-head
                      AttentionShape{1, 70, 2, 1, 5}),  // more than one 64-row block
    [](const auto& info) {
      const AttentionShape& s = info.param;
      return "B" + std::to_string(s.B) + "_S" + std::to_string(s.S) + "_Hq" + std::to_string(s.Hq) +
             "_Hkv" + std::to_string(s.Hkv) + "_D" + std::to_string(s.D);
    });

// MLA's shape: v's head dim differs from q's and k's (DeepSeek-V3: 192 and 128), and the
// softmax scale is given (YaRN's mscale^2 / sqrt(D)). GQA and dropout as above.
TEST(Attention, DistinctValueHeadDimAndSoftmaxScale) {
  const int64_t B = 2, S = 7, Hq = 4, Hkv = 2, D = 6, Dv = 4;
  const float scale = 0.7f;
  const uint64_t seed = testing::test_seed() + 30;
  SCOPED_TRACE(seed_trace(seed));
  Tensor q = randn({B, S, Hq, D}, seed), k = randn({B, S, Hkv, D}, seed + 1),
         v = randn({B, S, Hkv, Dv}, seed + 2), w = randn({B, S, Hq, Dv}, seed + 3);
  for (float p : {0.0f, 0.3f}) {
    SCOPED_TRACE("dropout_p " + std::to_string(p));
    Tensor out = Tensor::empty({B, S, Hq, Dv}), lse = Tensor::empty({B, Hq, S});
    poison(out);
    ops::attention_forward(q, k, v, out, lse, p, 3, 9, scale);
    const AttentionReference ref = reference_attention(q, k, v, p, 3, 9, scale);
    EXPECT_LE(testing::rel_error(out, ref.out), 1e-5);
    EXPECT_TRUE(allclose(lse, ref.lse, 1e-5, 1e-5));
    // The default scale is 1 / sqrt(D), not 1 / sqrt(Dv): a given scale changes the result.
    Tensor out_default = Tensor::empty(out.shape());
    ops::attention_forward(q, k, v, out_default, lse, p, 3, 9);
    EXPECT_LE(testing::rel_error(out_default, reference_attention(q, k, v, p, 3, 9).out), 1e-5);
    EXPECT_GT(testing::rel_error(out_default, out), 1e-3);

    auto loss = [&] {
      ops::attention_forward(q, k, v, out, lse, p, 3, 9, scale);
      return dot(w, out);
    };
    Tensor fd_q = finite_difference(q, loss), fd_k = finite_difference(k, loss),
           fd_v = finite_difference(v, loss);
    ops::attention_forward(q, k, v, out, lse, p, 3, 9, scale);
    Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
           dv = Tensor::empty(v.shape());
    poison(dq);
    poison(dk);
    poison(dv);
    ops::attention_backward(w, q, k, v, out, lse, dq, dk, dv, p, 3, 9, scale);
    EXPECT_TRUE(allclose(dq, fd_q, kFdAtol, kFdRtol)) << "dq";
    EXPECT_TRUE(allclose(dk, fd_k, kFdAtol, kFdRtol)) << "dk";
    EXPECT_TRUE(allclose(dv, fd_v, kFdAtol, kFdRtol)) << "dv";
  }
}

// Gradients at a size where finite differences would be slow, against the analytic
// backward of the naive attention in double: dv = P^T dO, dP = dO v^T, dS = softmax
// backward through the dropout mask, dq = dS k / sqrt(D), dk = dS^T q / sqrt(D).
TEST(Attention, BackwardMatchesDoubleReferenceAcrossBlocks) {
  const int64_t B = 2, S = 131, Hq = 4, Hkv = 2, D = 20, group = Hq / Hkv;
  const float p = 0.1f;
  const uint64_t seed = testing::test_seed() + 20;
  SCOPED_TRACE(seed_trace(seed));
  Tensor q = randn({B, S, Hq, D}, seed), k = randn({B, S, Hkv, D}, seed + 1),
         v = randn({B, S, Hkv, D}, seed + 2), dout = randn({B, S, Hq, D}, seed + 3);
  Tensor out = Tensor::empty(q.shape()), lse = Tensor::empty({B, Hq, S});
  ops::attention_forward(q, k, v, out, lse, p, 11, 2);
  Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
         dv = Tensor::empty(v.shape());
  poison(dq);
  poison(dk);
  poison(dv);
  ops::attention_backward(dout, q, k, v, out, lse, dq, dk, dv, p, 11, 2);

  AttentionReference ref = reference_attention(q, k, v, p, 11, 2);
  // This size runs the multi-threaded path (the small shapes above run on one thread).
  EXPECT_LE(testing::rel_error(out, ref.out), 1e-5);
  EXPECT_TRUE(allclose(lse, ref.lse, 1e-5, 1e-5));
  const Philox philox(11);
  std::vector<double> rdq(q.numel(), 0.0), rdk(k.numel(), 0.0), rdv(v.numel(), 0.0);
  const double scale = 1.0 / std::sqrt(double(D));
  auto qi = [&](int64_t b, int64_t s, int64_t h, int64_t c) {
    return ((b * S + s) * Hq + h) * D + c;
  };
  auto ki = [&](int64_t b, int64_t s, int64_t h, int64_t c) {
    return ((b * S + s) * Hkv + h) * D + c;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < S; ++i) {
        // Undropped probabilities P and the keep scale M for row i.
        std::vector<double> P(S, 0.0), M(S, 0.0), dP(S, 0.0);
        double delta = 0;
        for (int64_t j = 0; j <= i; ++j) {
          uint64_t index = ((b * Hq + h) * S + i) * S + j;
          M[j] = philox.uniform(2, index) >= p ? 1.0 / (1.0 - p) : 0.0;
          const double pd = ref.probs[((b * Hq + h) * S + i) * S + j];
          double s = 0;
          for (int64_t c = 0; c < D; ++c)
            s += double(q.f32()[qi(b, i, h, c)]) * k.f32()[ki(b, j, hk, c)];
          P[j] = std::exp(s * scale - double(ref.lse.f32()[(b * Hq + h) * S + i]));
          double g = 0;  // d loss / d (dropped prob)
          for (int64_t c = 0; c < D; ++c) {
            g += double(dout.f32()[qi(b, i, h, c)]) * v.f32()[ki(b, j, hk, c)];
            rdv[ki(b, j, hk, c)] += pd * dout.f32()[qi(b, i, h, c)];
          }
          dP[j] = g * M[j];
          delta += P[j] * dP[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double dS = P[j] * (dP[j] - delta) * scale;
          for (int64_t c = 0; c < D; ++c) {
            rdq[qi(b, i, h, c)] += dS * k.f32()[ki(b, j, hk, c)];
            rdk[ki(b, j, hk, c)] += dS * q.f32()[qi(b, i, h, c)];
          }
        }
      }
    }
  auto as_tensor = [](const Shape& shape, const std::vector<double>& x) {
    return Tensor::from(shape, std::vector<float>(x.begin(), x.end()));
  };
  // Sums of up to S products in fp32 against fp64: a relative error of a few 1e-6.
  EXPECT_LE(testing::rel_error(dq, as_tensor(q.shape(), rdq)), 1e-5);
  EXPECT_LE(testing::rel_error(dk, as_tensor(k.shape(), rdk)), 1e-5);
  EXPECT_LE(testing::rel_error(dv, as_tensor(v.shape(), rdv)), 1e-5);
  EXPECT_TRUE(allclose(dq, as_tensor(q.shape(), rdq), 1e-4, 1e-3));
  EXPECT_TRUE(allclose(dk, as_tensor(k.shape(), rdk), 1e-4, 1e-3));
  EXPECT_TRUE(allclose(dv, as_tensor(v.shape(), rdv), 1e-4, 1e-3));
}

TEST(Attention, DropoutMaskDependsOnSeedAndStream) {
  const uint64_t seed = testing::test_seed() + 30;
  Tensor q = randn({1, 8, 2, 4}, seed), k = randn({1, 8, 2, 4}, seed + 1),
         v = randn({1, 8, 2, 4}, seed + 2);
  auto run = [&](float p, uint64_t s, uint64_t stream) {
    Tensor out = Tensor::empty(q.shape()), lse = Tensor::empty({1, 2, 8});
    ops::attention_forward(q, k, v, out, lse, p, s, stream);
    return out;
  };
  Tensor a = run(0.5f, 1, 1);
  EXPECT_TRUE(allclose(run(0.5f, 1, 1), a, 0, 0));  // deterministic
  EXPECT_FALSE(allclose(run(0.5f, 1, 2), a, 1e-6, 0));
  EXPECT_FALSE(allclose(run(0.5f, 2, 1), a, 1e-6, 0));
  EXPECT_FALSE(allclose(run(0.0f, 1, 1), a, 1e-6, 0));
}

TEST(Attention, RejectsBadShapes) {
  Tensor q = randn({1, 4, 3, 8}, 1), k = randn({1, 4, 2, 8}, 2), v = randn({1, 4, 2, 8}, 3);
  Tensor out = Tensor::empty(q.shape()), lse = Tensor::empty({1, 3, 4});
  EXPECT_THROW(ops::attention_forward(q, k, v, out, lse), InternalError);  // 3 % 2 != 0
  Tensor q4 = randn({1, 4, 4, 8}, 1), out4 = Tensor::empty(q4.shape());
  Tensor bad_lse = Tensor::empty({1, 4, 5});
  EXPECT_THROW(ops::attention_forward(q4, k, v, out4, bad_lse), InternalError);
  Tensor lse4 = Tensor::empty({1, 4, 4});
  EXPECT_THROW(ops::attention_forward(q4, k, v, out4, lse4, 1.0f), InternalError);
  Tensor q_i32 = Tensor::zeros({1, 4, 4, 8}, DType::I32);
  EXPECT_THROW(ops::attention_forward(q_i32, k, v, out4, lse4), InternalError);
}

// ---------------------------------------------------------------------------------------
// RoPE

// Rotate-half RoPE in double from its definition (Su et al. 2021; HF Llama
// apply_rotary_pos_emb): y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin.
Tensor reference_rope(const Tensor& x, double base, int64_t offset) {
  const int64_t B = x.dim(0), S = x.dim(1), H = x.dim(2), D = x.dim(3), half = D / 2;
  Tensor y = Tensor::empty(x.shape());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const double angle = double(s + offset) * std::pow(base, -2.0 * double(i) / double(D));
          const int64_t o = ((b * S + s) * H + h) * D;
          const double x1 = x.f32()[o + i], x2 = x.f32()[o + i + half];
          y.f32()[o + i] = float(x1 * std::cos(angle) - x2 * std::sin(angle));
          y.f32()[o + i + half] = float(x2 * std::cos(angle) + x1 * std::sin(angle));
        }
  return y;
}

TEST(Rope, ForwardMatchesReference) {
  const uint64_t seed = testing::test_seed() + 40;
  SCOPED_TRACE(seed_trace(seed));
  for (int64_t D : {2, 6, 64}) {
    // D = 64 is large enough (2^15 elements) to take the multi-threaded path.
    Tensor x = randn({2, D == 64 ? 64 : 19, D == 64 ? 4 : 3, D}, seed);
    for (int64_t offset : {0, 5}) {
      Tensor y = Tensor::empty(x.shape());
      poison(y);
      ops::rope_forward(x, y, 10000.0f, offset);
      // The op rounds inv_freq and the angle to fp32 as HF does; at positions < 70 the
      // angle is off by < 70 * 6e-8 from the double one.
      EXPECT_TRUE(allclose(y, reference_rope(x, 10000.0, offset), 1e-5, 1e-5))
          << "D " << D << " offset " << offset;
    }
  }
}

TEST(Rope, PositionOffsetShiftsPositions) {
  const uint64_t seed = testing::test_seed() + 41;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t S = 11, shift = 4, H = 2, D = 8;
  Tensor x_long = randn({1, S + shift, H, D}, seed);
  Tensor y_long = Tensor::empty(x_long.shape());
  ops::rope_forward(x_long, y_long, 500000.0f, 3);
  // The last S positions of x_long, fed alone with the offset increased by `shift`,
  // must see exactly the same angles.
  Tensor x_tail = x_long.view({S + shift, H, D}).rows(shift, S).clone().view({1, S, H, D});
  Tensor y_tail = Tensor::empty(x_tail.shape());
  ops::rope_forward(x_tail, y_tail, 500000.0f, 3 + shift);
  Tensor y_long_tail = y_long.view({S + shift, H, D}).rows(shift, S).clone();
  EXPECT_TRUE(allclose(y_tail, y_long_tail, 0, 0));
  // And an offset does change the result.
  Tensor y_no_offset = Tensor::empty(x_tail.shape());
  ops::rope_forward(x_tail, y_no_offset, 500000.0f, 0);
  EXPECT_FALSE(allclose(y_no_offset, y_tail, 1e-4, 0));
}

TEST(Rope, InPlaceMatchesOutOfPlace) {
  const uint64_t seed = testing::test_seed() + 42;
  Tensor x = randn({2, 7, 3, 10}, seed);
  Tensor y = Tensor::empty(x.shape());
  ops::rope_forward(x, y, 10000.0f, 2);
  Tensor x_alias = x.clone();
  ops::rope_forward(x_alias, x_alias, 10000.0f, 2);
  EXPECT_TRUE(allclose(x_alias, y, 0, 0));
  Tensor dx = Tensor::empty(x.shape());
  ops::rope_backward(y, dx, 10000.0f, 2);
  Tensor dy_alias = y.clone();
  ops::rope_backward(dy_alias, dy_alias, 10000.0f, 2);
  EXPECT_TRUE(allclose(dy_alias, dx, 0, 0));
}

TEST(Rope, BackwardIsInverseRotationAndMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 43;
  SCOPED_TRACE(seed_trace(seed));
  Tensor x = randn({2, 5, 2, 6}, seed), w = randn({2, 5, 2, 6}, seed + 1);
  Tensor y = Tensor::empty(x.shape());
  Tensor fd = finite_difference(x, [&] {
    ops::rope_forward(x, y, 10000.0f, 7);
    return dot(w, y);
  });
  Tensor dx = Tensor::empty(x.shape());
  poison(dx);
  ops::rope_backward(w, dx, 10000.0f, 7);
  // The op is linear in x, so the differences are exact up to fp32 rounding of the loss.
  EXPECT_TRUE(allclose(dx, fd, kFdAtol, kFdRtol));
  // A rotation's transpose is its inverse: backward(forward(x)) = x.
  ops::rope_forward(x, y, 10000.0f, 7);
  Tensor x_back = Tensor::empty(x.shape());
  ops::rope_backward(y, x_back, 10000.0f, 7);
  EXPECT_TRUE(allclose(x_back, x, 1e-6, 5e-6));
}

TEST(Rope, RejectsOddHeadDim) {
  Tensor x = randn({1, 2, 1, 5}, 1), y = Tensor::empty({1, 2, 1, 5});
  EXPECT_THROW(ops::rope_forward(x, y, 10000.0f), InternalError);
  Tensor x6 = randn({1, 2, 1, 6}, 1);
  Tensor y3 = Tensor::empty({1, 2, 6});
  EXPECT_THROW(ops::rope_forward(x6, y3, 10000.0f), InternalError);
}

// ---------------------------------------------------------------------------------------
// Cross-entropy

TEST(CrossEntropy, ForwardMatchesReferenceAndIsStable) {
  const uint64_t seed = testing::test_seed() + 50;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 9, V = 4099;  // T * V >= 2^15: the multi-threaded path
  Tensor logits = randn({T, V}, seed, 3.0f);
  // Large offsets on some rows: a naive exp would overflow.
  for (int64_t v = 0; v < V; ++v) {
    logits.f32()[2 * V + v] += 1000.0f;
    logits.f32()[5 * V + v] -= 1000.0f;
  }
  Tensor labels = testing::randint({T}, int32_t(V), seed + 1);
  Tensor losses = Tensor::empty({T}), lse = Tensor::empty({T});
  poison(losses);
  poison(lse);
  ops::cross_entropy_forward(logits, labels, losses, lse);
  Tensor ref_loss = Tensor::empty({T}), ref_lse = Tensor::empty({T});
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits.f32() + t * V;
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
    ref_lse.f32()[t] = float(mx + std::log(sum));
    ref_loss.f32()[t] = float(mx + std::log(sum) - row[labels.i32()[t]]);
  }
  // lse near 1000 is exact to one fp32 ulp there (6e-5), hence the relative part.
  EXPECT_TRUE(allclose(lse, ref_lse, 1e-5, 1e-6));
  EXPECT_TRUE(allclose(losses, ref_loss, 1e-4, 1e-5));
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 51;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 4, V = 37;
  Tensor logits = randn({T, V}, seed, 2.0f);
  Tensor labels = testing::randint({T}, int32_t(V), seed + 1);
  Tensor dlosses = randn({T}, seed + 2);
  Tensor losses = Tensor::empty({T}), lse = Tensor::empty({T});
  Tensor fd = finite_difference(logits, [&] {
    ops::cross_entropy_forward(logits, labels, losses, lse);
    return dot(dlosses, losses);
  });
  ops::cross_entropy_forward(logits, labels, losses, lse);
  Tensor dlogits = Tensor::empty({T, V});
  poison(dlogits);
  ops::cross_entropy_backward(dlosses, logits, labels, lse, dlogits);
  EXPECT_TRUE(allclose(dlogits, fd, kFdAtol, kFdRtol));
  // Each row's gradient sums to zero (softmax minus a one-hot).
  for (int64_t t = 0; t < T; ++t) {
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += dlogits.f32()[t * V + v];
    EXPECT_NEAR(s, 0.0, 1e-6);
  }
}

TEST(CrossEntropy, RejectsLabelOutOfRange) {
  Tensor logits = randn({3, 5}, 1), losses = Tensor::empty({3}), lse = Tensor::empty({3});
  Tensor labels = Tensor::from_i32({3}, {0, 5, 1});
  EXPECT_THROW(ops::cross_entropy_forward(logits, labels, losses, lse), InternalError);
  Tensor negative = Tensor::from_i32({3}, {0, -1, 1});
  EXPECT_THROW(ops::cross_entropy_forward(logits, negative, losses, lse), InternalError);
}

}  // namespace
}  // namespace megaton
