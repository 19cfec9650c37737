// ops::attention_varlen_forward/backward (packed sequences, CPU): each sequence gives what
// the dense ops::attention_forward/backward give on it alone; finite differences; the
// documented dropout rule against a naive double reference; the argument checks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/rng.h"
#include "ops/attention_varlen.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::dot;
using testing::finite_difference;
using testing::poison;
using testing::randn;

// fp32 CPU against fp32 CPU (CONVENTIONS.md).
constexpr double kAtol = 1e-6, kRtol = 5e-6;
// Finite differences of an fp32 forward with eps = 1e-2 (as test_ops_attention.cpp).
constexpr double kFdAtol = 1e-3, kFdRtol = 1e-2;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

Tensor cu_seqlens_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  std::partial_sum(lengths.begin(), lengths.end(), cu.begin() + 1);
  return Tensor::from_i32({int64_t(cu.size())}, cu);
}

int64_t longest(const std::vector<int32_t>& lengths) {
  int64_t m = 0;
  for (int32_t l : lengths) m = std::max<int64_t>(m, l);
  return m;
}

// Rows [start, start + count) of a [T, ...] tensor, as a [1, count, ...] copy.
Tensor sequence_rows(const Tensor& x, int64_t start, int64_t count) {
  Shape shape = x.shape();
  Tensor rows = x.rows(start, count).clone();
  shape[0] = count;
  shape.insert(shape.begin(), 1);
  return rows.view(shape);
}

struct VarlenCase {
  std::vector<int32_t> lengths;
  int64_t Hq, Hkv, D, Dv;
  float scale = 0.0f;  // <= 0: 1 / sqrt(D)
};

std::string case_name(const ::testing::TestParamInfo<VarlenCase>& info) {
  const VarlenCase& c = info.param;
  std::string lengths;
  for (int32_t l : c.lengths) lengths += fmt::format("_{}", l);
  return fmt::format("L{}_Hq{}_Hkv{}_D{}_Dv{}{}", lengths, c.Hq, c.Hkv, c.D, c.Dv,
                     c.scale > 0 ? "_scaled" : "");
}

class AttentionVarlenTest : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(AttentionVarlenTest, EachSequenceMatchesTheDenseOpAlone) {
  const VarlenCase c = GetParam();
  const uint64_t seed = testing::test_seed() + 900;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = std::accumulate(c.lengths.begin(), c.lengths.end(), int64_t(0));
  Tensor q = randn({T, c.Hq, c.D}, seed), k = randn({T, c.Hkv, c.D}, seed + 1),
         v = randn({T, c.Hkv, c.Dv}, seed + 2), dout = randn({T, c.Hq, c.Dv}, seed + 3);
  const Tensor cu = cu_seqlens_of(c.lengths);
  const int64_t max_seqlen = longest(c.lengths);

  Tensor out = Tensor::empty({T, c.Hq, c.Dv}), lse = Tensor::empty({T, c.Hq});
  poison(out);
  poison(lse);
  ops::attention_varlen_forward(q, k, v, out, lse, cu, max_seqlen, 0.0f, 0, 0, c.scale);
  Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
         dv = Tensor::empty(v.shape());
  poison(dq);
  poison(dk);
  poison(dv);
  ops::attention_varlen_backward(dout, q, k, v, out, lse, cu, max_seqlen, dq, dk, dv, 0.0f, 0, 0,
                                 c.scale);

  int64_t start = 0;
  for (size_t n = 0; n < c.lengths.size(); ++n) {
    const int64_t L = c.lengths[n];
    SCOPED_TRACE(fmt::format("sequence {}: rows [{}, {})", n, start, start + L));
    if (L == 0) continue;
    const Tensor qs = sequence_rows(q, start, L), ks = sequence_rows(k, start, L),
                 vs = sequence_rows(v, start, L), dos = sequence_rows(dout, start, L);
    Tensor want_out = Tensor::empty({1, L, c.Hq, c.Dv}), want_lse = Tensor::empty({1, c.Hq, L});
    ops::attention_forward(qs, ks, vs, want_out, want_lse, 0.0f, 0, 0, c.scale);
    Tensor want_dq = Tensor::empty(qs.shape()), want_dk = Tensor::empty(ks.shape()),
           want_dv = Tensor::empty(vs.shape());
    ops::attention_backward(dos, qs, ks, vs, want_out, want_lse, want_dq, want_dk, want_dv, 0.0f, 0,
                            0, c.scale);

    EXPECT_TRUE(allclose(sequence_rows(out, start, L), want_out, kAtol, kRtol)) << "out";
    // lse is [T, Hq] (token-major); the dense op's is [B, Hq, S].
    Tensor lse_rows = Tensor::empty({1, c.Hq, L});
    for (int64_t i = 0; i < L; ++i)
      for (int64_t h = 0; h < c.Hq; ++h)
        lse_rows.f32()[h * L + i] = lse.f32()[(start + i) * c.Hq + h];
    EXPECT_TRUE(allclose(lse_rows, want_lse, kAtol, kRtol)) << "lse";
    EXPECT_TRUE(allclose(sequence_rows(dq, start, L), want_dq, kAtol, kRtol)) << "dq";
    EXPECT_TRUE(allclose(sequence_rows(dk, start, L), want_dk, kAtol, kRtol)) << "dk";
    EXPECT_TRUE(allclose(sequence_rows(dv, start, L), want_dv, kAtol, kRtol)) << "dv";
    start += L;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AttentionVarlenTest,
    ::testing::Values(
        // Unequal lengths with a length-1 sequence; GQA 2:1; Dqk != Dv (24 vs 16).
        VarlenCase{{5, 1, 9, 3}, 4, 2, 24, 16}, VarlenCase{{1}, 2, 2, 8, 8},  // one token alone
        VarlenCase{{1, 1, 1}, 2, 1, 8, 8},            // only single tokens, MQA
        VarlenCase{{7, 0, 12, 0}, 2, 2, 8, 8, 0.4f},  // empty sequences (cu_seqlens padding)
        // Sequences over several 64-row blocks, MQA, a given scale; large enough for the
        // multi-threaded path.
        VarlenCase{{70, 3, 130}, 4, 1, 16, 8, 0.3f}),
    case_name);

// Naive reference in double with the documented rule: query t sees the keys of its own
// sequence at or before it; dropout keeps (h, t, u) when
// Philox(seed).uniform(stream, (h * T + t) * T + u) >= p.
struct Reference {
  Tensor out, lse;
};

Reference reference(const Tensor& q, const Tensor& k, const Tensor& v,
                    const std::vector<int32_t>& lengths, float p, uint64_t seed, uint64_t stream,
                    double scale) {
  const int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hkv = k.dim(1), Dv = v.dim(2);
  const int64_t group = Hq / Hkv;
  Reference ref{Tensor::empty({T, Hq, Dv}), Tensor::empty({T, Hq})};
  std::vector<int64_t> sequence_start(static_cast<size_t>(T));
  for (int64_t start = 0, n = 0; n < int64_t(lengths.size()); start += lengths[n++])
    for (int64_t i = 0; i < lengths[n]; ++i) sequence_start[start + i] = start;
  const Philox philox(seed);
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t hk = h / group;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t first = sequence_start[t];
      std::vector<double> scores;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t u = first; u <= t; ++u) {
        double s = 0;
        for (int64_t c = 0; c < D; ++c)
          s += double(q.f32()[(t * Hq + h) * D + c]) * k.f32()[(u * Hkv + hk) * D + c];
        scores.push_back(s * scale);
        mx = std::max(mx, s * scale);
      }
      double sum = 0;
      for (double s : scores) sum += std::exp(s - mx);
      ref.lse.f32()[t * Hq + h] = float(mx + std::log(sum));
      for (int64_t c = 0; c < Dv; ++c) {
        double o = 0;
        for (int64_t u = first; u <= t; ++u) {
          double prob = std::exp(scores[u - first] - mx) / sum;
          const uint64_t index = (uint64_t(h) * T + t) * T + u;
          if (p > 0) prob = philox.uniform(stream, index) >= p ? prob / (1.0 - p) : 0.0;
          o += prob * v.f32()[(u * Hkv + hk) * Dv + c];
        }
        ref.out.f32()[(t * Hq + h) * Dv + c] = float(o);
      }
    }
  }
  return ref;
}

TEST(AttentionVarlen, ForwardMatchesNaiveReferenceWithDropout) {
  const std::vector<int32_t> lengths{6, 1, 11, 4};
  const int64_t T = 22, Hq = 4, Hkv = 2, D = 12, Dv = 8;
  const uint64_t seed = testing::test_seed() + 910;
  SCOPED_TRACE(seed_trace(seed));
  Tensor q = randn({T, Hq, D}, seed), k = randn({T, Hkv, D}, seed + 1),
         v = randn({T, Hkv, Dv}, seed + 2);
  for (float p : {0.0f, 0.25f}) {
    SCOPED_TRACE("dropout_p " + std::to_string(p));
    Tensor out = Tensor::empty({T, Hq, Dv}), lse = Tensor::empty({T, Hq});
    poison(out);
    poison(lse);
    ops::attention_varlen_forward(q, k, v, out, lse, cu_seqlens_of(lengths), 11, p, 77, 5);
    const Reference ref = reference(q, k, v, lengths, p, 77, 5, 1.0 / std::sqrt(double(D)));
    // fp32 GEMM dot products against a double reference (as test_ops_attention.cpp).
    EXPECT_TRUE(allclose(out, ref.out, 1e-5, 1e-4));
    EXPECT_TRUE(allclose(lse, ref.lse, 1e-5, 1e-5));
    EXPECT_LE(testing::rel_error(out, ref.out), 1e-5);
  }
}

// One sequence over all T tokens is the dense op with B = 1, S = T, dropout included.
TEST(AttentionVarlen, OneSequenceIsTheDenseOpWithItsDropoutMask) {
  const int64_t T = 40, Hq = 4, Hkv = 2, D = 8, Dv = 8;
  const float p = 0.2f;
  const uint64_t seed = testing::test_seed() + 920;
  SCOPED_TRACE(seed_trace(seed));
  Tensor q = randn({T, Hq, D}, seed), k = randn({T, Hkv, D}, seed + 1),
         v = randn({T, Hkv, Dv}, seed + 2), dout = randn({T, Hq, Dv}, seed + 3);
  const Tensor cu = cu_seqlens_of({int32_t(T)});
  Tensor out = Tensor::empty({T, Hq, Dv}), lse = Tensor::empty({T, Hq});
  ops::attention_varlen_forward(q, k, v, out, lse, cu, T, p, 5, 3);
  Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
         dv = Tensor::empty(v.shape());
  ops::attention_varlen_backward(dout, q, k, v, out, lse, cu, T, dq, dk, dv, p, 5, 3);

  const Tensor q4 = q.view({1, T, Hq, D}), k4 = k.view({1, T, Hkv, D}),
               v4 = v.view({1, T, Hkv, Dv}), dout4 = dout.view({1, T, Hq, Dv});
  Tensor want_out = Tensor::empty(dout4.shape()), want_lse = Tensor::empty({1, Hq, T});
  ops::attention_forward(q4, k4, v4, want_out, want_lse, p, 5, 3);
  Tensor want_dq = Tensor::empty(q4.shape()), want_dk = Tensor::empty(k4.shape()),
         want_dv = Tensor::empty(v4.shape());
  ops::attention_backward(dout4, q4, k4, v4, want_out, want_lse, want_dq, want_dk, want_dv, p, 5,
                          3);
  EXPECT_TRUE(allclose(out, want_out, kAtol, kRtol));
  EXPECT_TRUE(allclose(dq, want_dq, kAtol, kRtol));
  EXPECT_TRUE(allclose(dk, want_dk, kAtol, kRtol));
  EXPECT_TRUE(allclose(dv, want_dv, kAtol, kRtol));
  // Dropout did act: the p = 0 output differs.
  Tensor plain = Tensor::empty(out.shape());
  ops::attention_varlen_forward(q, k, v, plain, lse, cu, T);
  EXPECT_GT(testing::rel_error(plain, out), 0.05);
}

TEST(AttentionVarlen, BackwardMatchesFiniteDifferences) {
  const std::vector<int32_t> lengths{3, 1, 4};
  const int64_t T = 8, Hq = 4, Hkv = 2, D = 6, Dv = 4;
  const float scale = 0.7f;
  const uint64_t seed = testing::test_seed() + 930;
  SCOPED_TRACE(seed_trace(seed));
  Tensor q = randn({T, Hq, D}, seed), k = randn({T, Hkv, D}, seed + 1),
         v = randn({T, Hkv, Dv}, seed + 2), w = randn({T, Hq, Dv}, seed + 3);
  const Tensor cu = cu_seqlens_of(lengths);
  // With dropout the mask is a pure function of (seed, stream, index), so the loss is a
  // smooth function of q, k, v and central differences remain valid.
  for (float p : {0.0f, 0.3f}) {
    SCOPED_TRACE("dropout_p " + std::to_string(p));
    Tensor out = Tensor::empty({T, Hq, Dv}), lse = Tensor::empty({T, Hq});
    auto loss = [&] {
      ops::attention_varlen_forward(q, k, v, out, lse, cu, 4, p, 3, 9, scale);
      return dot(w, out);
    };
    const Tensor fd_q = finite_difference(q, loss), fd_k = finite_difference(k, loss),
                 fd_v = finite_difference(v, loss);
    ops::attention_varlen_forward(q, k, v, out, lse, cu, 4, p, 3, 9, scale);
    Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
           dv = Tensor::empty(v.shape());
    poison(dq);
    poison(dk);
    poison(dv);
    ops::attention_varlen_backward(w, q, k, v, out, lse, cu, 4, dq, dk, dv, p, 3, 9, scale);
    EXPECT_TRUE(allclose(dq, fd_q, kFdAtol, kFdRtol)) << "dq";
    EXPECT_TRUE(allclose(dk, fd_k, kFdAtol, kFdRtol)) << "dk";
    EXPECT_TRUE(allclose(dv, fd_v, kFdAtol, kFdRtol)) << "dv";
  }
}

TEST(AttentionVarlen, RejectsBadArguments) {
  const int64_t T = 6, H = 2, D = 8;
  const Tensor q = randn({T, H, D}, 1), k = randn({T, H, D}, 2), v = randn({T, H, D}, 3);
  Tensor out = Tensor::empty({T, H, D}), lse = Tensor::empty({T, H});
  auto forward = [&](const std::vector<int32_t>& cu, int64_t max_seqlen) {
    ops::attention_varlen_forward(q, k, v, out, lse, Tensor::from_i32({int64_t(cu.size())}, cu),
                                  max_seqlen);
  };
  EXPECT_NO_THROW(forward({0, 2, 6}, 4));
  EXPECT_NO_THROW(forward({0, 2, 2, 6, 6}, 4));           // empty sequences
  EXPECT_THROW(forward({1, 2, 6}, 4), InternalError);     // does not start at 0
  EXPECT_THROW(forward({0, 4, 2, 6}, 4), InternalError);  // decreasing
  EXPECT_THROW(forward({0, 2, 5}, 4), InternalError);     // does not end at T
  EXPECT_THROW(forward({0, 1, 6}, 4), InternalError);     // longer than max_seqlen
  EXPECT_THROW(forward({0, 2, 6}, 0), InternalError);     // max_seqlen < 1
  EXPECT_THROW(forward({6}, 6), InternalError);           // N = 0
  const Tensor float_cu = Tensor::from({3}, {0, 2, 6});
  EXPECT_THROW(ops::attention_varlen_forward(q, k, v, out, lse, float_cu, 4), InternalError);
  Tensor dense_lse = Tensor::empty({1, H, T});  // the dense op's layout, not [T, Hq]
  EXPECT_THROW(ops::attention_varlen_forward(q, k, v, out, dense_lse, cu_seqlens_of({2, 4}), 4),
               InternalError);
  const Tensor odd_kv = randn({T, 3, D}, 4);  // 2 query heads over 3 kv heads
  EXPECT_THROW(ops::attention_varlen_forward(q, odd_kv, odd_kv, out, lse, cu_seqlens_of({2, 4}), 4),
               InternalError);
  EXPECT_THROW(ops::attention_varlen_forward(q, k, v, out, lse, cu_seqlens_of({2, 4}), 4, 1.0f),
               InternalError);  // dropout_p outside [0, 1)
  // No tokens at all: nothing to do, nothing thrown.
  Tensor none = Tensor::empty({0, H, D}), none_lse = Tensor::empty({0, H});
  EXPECT_NO_THROW(
      ops::attention_varlen_forward(none, none, none, none, none_lse, cu_seqlens_of({0}), 1));
}

}  // namespace
}  // namespace megaton
