// ops::attention_block_* (CPU): one block over the whole sequence is ops::attention_forward /
// backward; a query block against key blocks, merged by their log-sum-exp, is the query
// block's whole attention, and the blocks' backward shares sum to its gradients (what
// context parallelism does across ranks); the unmasked block's gradients against finite
// differences.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/testing.h"
#include "ops/attention_block.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::finite_difference;
using testing::randn;

constexpr double kAtol = 2e-6, kRtol = 2e-5;

// [1, S, H, D] <-> [S, H, D] and the dense op's lse [1, H, S] -> [S, H].
Tensor sample(const Tensor& x) { return x.view({x.dim(1), x.dim(2), x.dim(3)}); }
Tensor token_major_lse(const Tensor& lse) {
  const int64_t H = lse.dim(1), S = lse.dim(2);
  Tensor out = Tensor::empty({S, H});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < S; ++s) out.f32()[s * H + h] = lse.f32()[h * S + s];
  return out;
}

struct Case {
  int64_t S, Hq, Hkv, D, Dv;
};

class AttentionBlock : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionBlock, WholeSequenceIsTheDenseOp) {
  const Case c = GetParam();
  Tensor q = randn({1, c.S, c.Hq, c.D}, 1), k = randn({1, c.S, c.Hkv, c.D}, 2),
         v = randn({1, c.S, c.Hkv, c.Dv}, 3), dout = randn({1, c.S, c.Hq, c.Dv}, 4);
  Tensor out = Tensor::empty({1, c.S, c.Hq, c.Dv}), lse = Tensor::empty({1, c.Hq, c.S});
  ops::attention_forward(q, k, v, out, lse);
  Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
         dv = Tensor::empty(v.shape());
  ops::attention_backward(dout, q, k, v, out, lse, dq, dk, dv);

  Tensor bout = Tensor::empty({c.S, c.Hq, c.Dv}), blse = Tensor::empty({c.S, c.Hq});
  ops::attention_block_forward(sample(q), sample(k), sample(v), 0, 0, true, bout, blse);
  EXPECT_TRUE(allclose(bout, sample(out), kAtol, kRtol));
  EXPECT_TRUE(allclose(blse, token_major_lse(lse), kAtol, kRtol));
  Tensor bdq = Tensor::zeros({c.S, c.Hq, c.D}), bdk = Tensor::zeros({c.S, c.Hkv, c.D}),
         bdv = Tensor::zeros({c.S, c.Hkv, c.Dv});
  ops::attention_block_backward(sample(dout), sample(q), sample(k), sample(v), bout, blse, 0, 0,
                                true, bdq, bdk, bdv);
  EXPECT_TRUE(allclose(bdq, sample(dq), kAtol, kRtol));
  EXPECT_TRUE(allclose(bdk, sample(dk), kAtol, kRtol));
  EXPECT_TRUE(allclose(bdv, sample(dv), kAtol, kRtol));
}

// Queries [a, b) of the sequence against the key blocks [0, c1), [c1, c2), ... [cn, S), each
// with its offsets (causal by position), merged: the rows [a, b) of the whole attention;
// the blocks' backward shares with the merged out and lse sum to the whole's gradients.
TEST_P(AttentionBlock, KeyBlocksMergedAreTheWholeAttention) {
  const Case c = GetParam();
  Tensor q = randn({1, c.S, c.Hq, c.D}, 11), k = randn({1, c.S, c.Hkv, c.D}, 12),
         v = randn({1, c.S, c.Hkv, c.Dv}, 13), dout = randn({1, c.S, c.Hq, c.Dv}, 14);
  Tensor out = Tensor::empty({1, c.S, c.Hq, c.Dv}), lse = Tensor::empty({1, c.Hq, c.S});
  ops::attention_forward(q, k, v, out, lse);
  Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
         dv = Tensor::empty(v.shape());
  ops::attention_backward(dout, q, k, v, out, lse, dq, dk, dv);
  const Tensor whole_lse = token_major_lse(lse);

  // Query blocks of every size, key blocks cut at thirds (some entirely after the queries:
  // their rows see nothing there).
  const std::vector<int64_t> cuts = {0, c.S / 3, 2 * c.S / 3, c.S};
  Tensor dk_sum = Tensor::zeros({c.S, c.Hkv, c.D}), dv_sum = Tensor::zeros({c.S, c.Hkv, c.Dv});
  for (int64_t a = 0; a < c.S; a += 5) {
    const int64_t b = std::min(c.S, a + 5);
    Tensor qb = sample(q).rows(a, b - a).clone(), dob = sample(dout).rows(a, b - a).clone();
    Tensor merged = Tensor::zeros({b - a, c.Hq, c.Dv}), mlse = Tensor::empty({b - a, c.Hq});
    mlse.fill(-std::numeric_limits<float>::infinity());
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      const int64_t k0 = cuts[j], n = cuts[j + 1] - cuts[j];
      Tensor part = Tensor::empty({b - a, c.Hq, c.Dv}), plse = Tensor::empty({b - a, c.Hq});
      ops::attention_block_forward(qb, sample(k).rows(k0, n).clone(), sample(v).rows(k0, n).clone(),
                                   a, k0, true, part, plse);
      ops::attention_lse_merge(merged, mlse, part, plse);
    }
    EXPECT_TRUE(allclose(merged, sample(out).rows(a, b - a).clone(), kAtol, kRtol))
        << "queries [" << a << ", " << b << ")";
    EXPECT_TRUE(allclose(mlse, whole_lse.rows(a, b - a).clone(), kAtol, kRtol));
    Tensor dqb = Tensor::zeros({b - a, c.Hq, c.D});
    for (size_t j = 0; j + 1 < cuts.size(); ++j) {
      const int64_t k0 = cuts[j], n = cuts[j + 1] - cuts[j];
      Tensor dkb = dk_sum.rows(k0, n), dvb = dv_sum.rows(k0, n);
      ops::attention_block_backward(dob, qb, sample(k).rows(k0, n).clone(),
                                    sample(v).rows(k0, n).clone(), merged, mlse, a, k0, true, dqb,
                                    dkb, dvb);
    }
    EXPECT_TRUE(allclose(dqb, sample(dq).rows(a, b - a).clone(), kAtol, kRtol))
        << "queries [" << a << ", " << b << ")";
  }
  EXPECT_TRUE(allclose(dk_sum, sample(dk), kAtol, kRtol));
  EXPECT_TRUE(allclose(dv_sum, sample(dv), kAtol, kRtol));
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBlock,
                         ::testing::Values(Case{12, 2, 2, 8, 8}, Case{16, 4, 2, 8, 6},
                                           Case{13, 4, 1, 4, 4}));

// An unmasked block: its gradients (a block alone is the whole attention) against finite
// differences of sum(out * w).
TEST(AttentionBlockGradients, UnmaskedBlockMatchesFiniteDifferences) {
  Tensor q = randn({3, 2, 4}, 21), k = randn({5, 1, 4}, 22), v = randn({5, 1, 3}, 23),
         w = randn({3, 2, 3}, 24);
  auto loss = [&] {
    Tensor out = Tensor::empty({3, 2, 3}), lse = Tensor::empty({3, 2});
    ops::attention_block_forward(q, k, v, 7, 0, false, out, lse);
    double s = 0;
    for (int64_t i = 0; i < out.numel(); ++i) s += double(out.f32()[i]) * w.f32()[i];
    return s;
  };
  Tensor out = Tensor::empty({3, 2, 3}), lse = Tensor::empty({3, 2});
  ops::attention_block_forward(q, k, v, 7, 0, false, out, lse);
  Tensor dq = Tensor::zeros(q.shape()), dk = Tensor::zeros(k.shape()),
         dv = Tensor::zeros(v.shape());
  ops::attention_block_backward(w, q, k, v, out, lse, 7, 0, false, dq, dk, dv);
  EXPECT_TRUE(allclose(dq, finite_difference(q, loss), 1e-3, 1e-2));
  EXPECT_TRUE(allclose(dk, finite_difference(k, loss), 1e-3, 1e-2));
  EXPECT_TRUE(allclose(dv, finite_difference(v, loss), 1e-3, 1e-2));
}

}  // namespace
}  // namespace megaton
