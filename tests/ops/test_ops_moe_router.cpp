// Tests of the CPU MoE router ops (ops.h, "MoE router, all of Megatron's options")
// beyond Megatron's golden data (test_ops_moe_router_golden.cpp): tie order and group
// limit by hand, sinkhorn's balance, finite differences of every backward, the door
// checks, token dropping by expert capacity, the Philox fills and mul_.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using ops::RouterScoreFunction;
using ops::RouterTopK;
using testing::finite_difference;
using testing::poison;
using testing::randn;

// Finite differences of fp32 forwards with eps = 1e-2: truncation O(eps^2) ~ 1e-4
// relative, fp32 rounding of the loss / (2 eps) ~ 1e-5 absolute; an order of magnitude
// of headroom above both.
constexpr float kFdEps = 1e-2f;
constexpr double kFdAtol = 1e-3, kFdRtol = 1e-2;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

double weighted_sum(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += double(a.f32()[i]) * b.f32()[i];
  return s;
}

// ---------------------------------------------------------------------------------------
// Behaviour beyond the golden cases

TEST(MoeRouterTopk, TiesGoToTheLowerExpertAndEveryOutputIsWritten) {
  // Row 0: all equal; row 1: two equal best; the order of the chosen is best first.
  Tensor logits = Tensor::from({2, 6}, {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f,  //
                                        0.1f, 0.9f, 0.3f, 0.9f, -1.0f, 0.3f});
  for (RouterScoreFunction f : {RouterScoreFunction::Softmax, RouterScoreFunction::Sigmoid,
                                RouterScoreFunction::SqrtSoftplus}) {
    for (bool pre : {false, true}) {
      RouterTopK o;
      o.topk = 3;
      o.score_function = f;
      o.pre_softmax = pre;
      Tensor probs = Tensor::empty({2, 3}), indices = Tensor::empty({2, 3}, DType::I32);
      poison(probs);
      indices.fill(-7);
      ops::moe_router_topk_forward(logits, Tensor(), o, probs, indices);
      EXPECT_EQ(std::vector<int32_t>(indices.i32(), indices.i32() + 6),
                (std::vector<int32_t>{0, 1, 2, 1, 3, 2}))
          << int(f) << " pre " << pre;
      for (int i = 0; i < 6; ++i) EXPECT_TRUE(std::isfinite(probs.f32()[i])) << i;
    }
  }
}

TEST(MoeRouterTopk, GroupLimitExcludesExpertsOutsideTheBestGroups) {
  // 8 experts in 4 groups of 2, k = 2, group_topk = 2: a group's score is its best expert
  // (k / group_topk = 1). Group scores 0.9 (g0), 0.8 (g1), 0.95 (g2), 0.1 (g3): groups 2
  // and 0 stay, so expert 3 (0.8, second best overall) is excluded.
  Tensor logits = Tensor::from({1, 8}, {0.9f, 0.0f, 0.2f, 0.8f, 0.95f, 0.7f, 0.1f, 0.05f});
  RouterTopK o;
  o.topk = 2;
  o.num_groups = 4;
  o.group_topk = 2;
  Tensor probs = Tensor::empty({1, 2}), indices = Tensor::empty({1, 2}, DType::I32);
  ops::moe_router_topk_forward(logits, Tensor(), o, probs, indices);
  EXPECT_EQ(indices.i32()[0], 4);
  EXPECT_EQ(indices.i32()[1], 0);
  // With k / group_topk = 2 a group's score sums its best two: g2 = 1.65, g1 = 1.0,
  // g0 = 0.9; k = 4, group_topk = 2 keeps groups 2 and 1.
  o.topk = 4;
  Tensor probs4 = Tensor::empty({1, 4}), indices4 = Tensor::empty({1, 4}, DType::I32);
  ops::moe_router_topk_forward(logits, Tensor(), o, probs4, indices4);
  EXPECT_EQ(std::vector<int32_t>(indices4.i32(), indices4.i32() + 4),
            (std::vector<int32_t>{4, 3, 5, 2}));
}

TEST(MoeRouterSinkhorn, BalancesRowsAndColumns) {
  const uint64_t seed = testing::test_seed() + 700;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 3000, E = 12;  // many column-sum chunks, above the threading threshold
  Tensor logits = randn({T, E}, seed, 1.5f), out = Tensor::empty({T, E});
  poison(out);
  ops::moe_sinkhorn(logits, out);
  // Converged: each column sums to 1/E (d1 is the last update, so exactly up to eps and
  // rounding), each row to 1/T within the stopping tolerance's effect.
  for (int64_t e = 0; e < E; ++e) {
    double col = 0;
    for (int64_t t = 0; t < T; ++t) col += out.f32()[t * E + e];
    EXPECT_NEAR(col, 1.0 / double(E), 1e-5) << "column " << e;
  }
  double worst_row = 0;
  for (int64_t t = 0; t < T; ++t) {
    double row = 0;
    for (int64_t e = 0; e < E; ++e) row += out.f32()[t * E + e];
    worst_row = std::max(worst_row, std::abs(row * double(T) - 1.0));
  }
  EXPECT_LT(worst_row, 1e-2);
}

TEST(MoeRouterTopk, ParallelRowsMatchOneRowAtATime) {
  // T * E above the threading threshold: the OpenMP paths must give each row what a
  // one-row call gives (bitwise), and the statistics the sums of the one-row calls.
  const uint64_t seed = testing::test_seed() + 600;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 3000, E = 16;
  RouterTopK o;
  o.topk = 4;
  o.score_function = RouterScoreFunction::Sigmoid;
  o.num_groups = 4;
  o.group_topk = 2;
  o.scaling_factor = 2.0f;
  const Tensor logits = randn({T, E}, seed), bias = randn({E}, seed + 1, 0.05f);
  Tensor probs = Tensor::empty({T, 4}), indices = Tensor::empty({T, 4}, DType::I32);
  ops::moe_router_topk_forward(logits, bias, o, probs, indices);
  const Tensor dprobs = randn({T, 4}, seed + 2);
  Tensor dlogits = Tensor::empty({T, E});
  ops::moe_router_topk_backward(dprobs, logits, probs, indices, o, dlogits);
  Tensor scores = Tensor::empty({T, E}), sums = Tensor::empty({1, E}),
         counts = Tensor::empty({1, E});
  ops::moe_aux_loss_statistics(logits, RouterScoreFunction::Sigmoid, 4, 0, T, scores, sums, counts);
  std::vector<double> want_sums(E, 0.0), want_counts(E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const Tensor row = logits.rows(t, 1);
    Tensor p = Tensor::empty({1, 4}), i = Tensor::empty({1, 4}, DType::I32),
           d = Tensor::empty({1, E});
    ops::moe_router_topk_forward(row, bias, o, p, i);
    ops::moe_router_topk_backward(dprobs.rows(t, 1), row, p, i, o, d);
    for (int j = 0; j < 4; ++j) {
      ASSERT_EQ(i.i32()[j], indices.i32()[t * 4 + j]) << "row " << t;
      ASSERT_EQ(p.f32()[j], probs.f32()[t * 4 + j]) << "row " << t;
    }
    for (int64_t e = 0; e < E; ++e) ASSERT_EQ(d.f32()[e], dlogits.f32()[t * E + e]) << "row " << t;
    Tensor s = Tensor::empty({1, E}), ss = Tensor::empty({1, E}), c = Tensor::empty({1, E});
    ops::moe_aux_loss_statistics(row, RouterScoreFunction::Sigmoid, 4, 0, 1, s, ss, c);
    for (int64_t e = 0; e < E; ++e) {
      ASSERT_EQ(s.f32()[e], scores.f32()[t * E + e]) << "row " << t;
      want_sums[e] += s.f32()[e];
      want_counts[e] += c.f32()[e];
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(sums.f32()[e], float(want_sums[e])) << e;
    EXPECT_EQ(counts.f32()[e], float(want_counts[e])) << e;
  }
}

TEST(MoeRouterCounts, TokensPerExpertAccumulates) {
  Tensor indices = Tensor::from_i32({3, 2}, {0, 2, 2, 1, 3, 2});
  Tensor counts = Tensor::from({4}, {1.0f, 0.0f, 0.5f, 0.0f});
  ops::moe_tokens_per_expert(indices, 4, counts);
  EXPECT_EQ(counts.to_vector(), (std::vector<float>{2.0f, 1.0f, 3.5f, 1.0f}));
}

// Five tokens, top-2 of three experts. Entries by expert (flat index t * 2 + j: prob):
// expert 0: 0: .5, 3: .3, 4: .6, 6: .5, 9: .1; expert 1: 1: .5, 2: .7, 7: .5;
// expert 2: 5: .4, 8: .9.
struct CapacityExample {
  Tensor probs = Tensor::from({5, 2}, {0.5f, 0.5f, 0.7f, 0.3f, 0.6f, 0.4f, 0.5f, 0.5f, 0.9f, 0.1f});
  Tensor indices = Tensor::from_i32({5, 2}, {0, 1, 1, 0, 0, 2, 0, 1, 2, 0});
  static constexpr int64_t kExperts = 3;
  // keep (poisoned first, so every entry must be written) and counts += from {1, .5, 2}.
  std::pair<std::vector<float>, std::vector<float>> drop(int64_t capacity, bool by_position) {
    Tensor keep = Tensor::empty({5, 2});
    poison(keep);
    Tensor counts = Tensor::from({kExperts}, {1.0f, 0.5f, 2.0f});
    ops::moe_capacity_drop(probs, indices, kExperts, capacity, by_position, keep, counts);
    return {keep.to_vector(), counts.to_vector()};
  }
};

TEST(MoeCapacityDrop, ProbsPolicyKeepsTheLargestWithTiesToTheLowerRow) {
  CapacityExample ex;
  using V = std::vector<float>;
  // Capacity 2. Expert 0: .6 (4), then .5 at rows 0 and 3: row 0 (entry 0). Expert 1: .7
  // (2), then .5 at rows 0 and 3: row 0 (entry 1). Expert 2: both.
  auto [keep, counts] = ex.drop(2, false);
  EXPECT_EQ(keep, (V{1, 1, 1, 0, 1, 1, 0, 0, 1, 0}));
  EXPECT_EQ(counts, (V{3, 2.5f, 4}));
  // Capacity 1: the largest of each expert (4, 2, 8).
  std::tie(keep, counts) = ex.drop(1, false);
  EXPECT_EQ(keep, (V{0, 0, 1, 0, 1, 0, 0, 0, 1, 0}));
  EXPECT_EQ(counts, (V{2, 1.5f, 3}));
  // Capacity 3: expert 0 adds the second .5 (6); experts 1 and 2 keep everything.
  std::tie(keep, counts) = ex.drop(3, false);
  EXPECT_EQ(keep, (V{1, 1, 1, 0, 1, 1, 1, 1, 1, 0}));
  EXPECT_EQ(counts, (V{4, 3.5f, 4}));
}

TEST(MoeCapacityDrop, PositionPolicyKeepsTheFirstRows) {
  CapacityExample ex;
  using V = std::vector<float>;
  // Capacity 2: expert 0 keeps rows 0, 1 (entries 0, 3), expert 1 rows 0, 1 (1, 2),
  // expert 2 both (5, 8), whatever the probabilities.
  auto [keep, counts] = ex.drop(2, true);
  EXPECT_EQ(keep, (V{1, 1, 1, 1, 0, 1, 0, 0, 1, 0}));
  EXPECT_EQ(counts, (V{3, 2.5f, 4}));
  std::tie(keep, counts) = ex.drop(1, true);
  EXPECT_EQ(keep, (V{1, 1, 0, 0, 0, 1, 0, 0, 0, 0}));
  EXPECT_EQ(counts, (V{2, 1.5f, 3}));
}

TEST(MoeCapacityDrop, CapacityZeroDropsAllAndEnoughCapacityDropsNone) {
  CapacityExample ex;
  using V = std::vector<float>;
  for (bool by_position : {false, true}) {
    SCOPED_TRACE(by_position ? "position" : "probs");
    auto [keep, counts] = ex.drop(0, by_position);
    EXPECT_EQ(keep, V(10, 0.0f));
    EXPECT_EQ(counts, (V{1, 0.5f, 2}));   // += 0
    for (int64_t capacity : {5, 1000}) {  // expert 0 has 5 entries, the most
      std::tie(keep, counts) = ex.drop(capacity, by_position);
      EXPECT_EQ(keep, V(10, 1.0f)) << capacity;
      EXPECT_EQ(counts, (V{6, 3.5f, 4})) << capacity;  // += tokens per expert 5, 3, 2
    }
  }
}

TEST(MoeCapacityDrop, SignedZerosTieAndSameRowTiesGoToTheLowerSlot) {
  // Expert 0: -0 (row 0), +0 (row 1), then row 2 names expert 1 twice with equal probs.
  Tensor probs = Tensor::from({3, 2}, {-0.0f, 0.2f, 0.0f, 0.1f, 0.3f, 0.3f});
  Tensor indices = Tensor::from_i32({3, 2}, {0, 2, 0, 2, 1, 1});
  Tensor keep = Tensor::empty({3, 2});
  poison(keep);
  Tensor counts = Tensor::zeros({3});
  ops::moe_capacity_drop(probs, indices, 3, 1, false, keep, counts);
  EXPECT_EQ(keep.to_vector(), (std::vector<float>{1, 1, 0, 0, 1, 0}));
  EXPECT_EQ(counts.to_vector(), (std::vector<float>{1, 1, 1}));
}

TEST(MoeCapacityDrop, KeptCountsAreMinOfRoutedAndCapacityOnRandomRoutes) {
  const uint64_t seed = 4711;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 300, k = 3, E = 7;
  const Tensor indices = testing::randint({T, k}, int32_t(E), seed);
  const Tensor probs = testing::randn({T, k}, seed + 1);
  std::vector<int64_t> routed(E, 0);
  for (int64_t i = 0; i < T * k; ++i) ++routed[indices.i32()[i]];
  for (int64_t capacity : {0, 17, 100, 300})
    for (bool by_position : {false, true}) {
      Tensor keep = Tensor::empty({T, k}), counts = Tensor::zeros({E});
      poison(keep);
      ops::moe_capacity_drop(probs, indices, E, capacity, by_position, keep, counts);
      std::vector<int64_t> kept(E, 0);
      std::vector<float> dropped_max(E, -INFINITY), kept_min(E, INFINITY);
      std::vector<int64_t> last_kept_row(E, -1), first_dropped_row(E, T);
      for (int64_t i = 0; i < T * k; ++i) {
        const float v = keep.f32()[i], p = probs.f32()[i];
        const int32_t e = indices.i32()[i];
        ASSERT_TRUE(v == 0.0f || v == 1.0f) << i << ": " << v;
        if (v == 1.0f) {
          ++kept[e];
          kept_min[e] = std::min(kept_min[e], p);
          last_kept_row[e] = std::max(last_kept_row[e], i / k);
        } else {
          dropped_max[e] = std::max(dropped_max[e], p);
          first_dropped_row[e] = std::min(first_dropped_row[e], i / k);
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        EXPECT_EQ(kept[e], std::min(routed[e], capacity)) << e;
        EXPECT_EQ(counts.f32()[e], float(kept[e])) << e;
        // Random normal probs have no ties: the kept ones beat the dropped ones; by
        // position, every kept row comes before every dropped one.
        if (by_position) {
          EXPECT_LE(last_kept_row[e], first_dropped_row[e]) << e;
        } else {
          EXPECT_GT(kept_min[e], dropped_max[e]) << e;
        }
      }
    }
}

TEST(MoeCapacityDrop, BadShapesAndIndicesThrowBeforeWriting) {
  const Tensor probs = Tensor::from({2, 2}, {0.6f, 0.4f, 0.7f, 0.3f});
  const Tensor indices = Tensor::from_i32({2, 2}, {0, 1, 2, 0});
  Tensor keep = Tensor::zeros({2, 2}), counts = Tensor::zeros({3});
  auto drop = [&](const Tensor& p, const Tensor& i, int64_t E, int64_t capacity, Tensor& kp,
                  Tensor& c) { ops::moe_capacity_drop(p, i, E, capacity, false, kp, c); };
  EXPECT_NO_THROW(drop(probs, indices, 3, 1, keep, counts));
  EXPECT_THROW(drop(probs.view({4}), indices, 3, 1, keep, counts), InternalError);
  EXPECT_THROW(drop(probs, Tensor::from_i32({1, 4}, {0, 1, 2, 0}), 3, 1, keep, counts),
               InternalError);
  EXPECT_THROW(drop(probs, indices.to(DType::F32), 3, 1, keep, counts), InternalError);
  EXPECT_THROW(drop(probs.to(DType::BF16), indices, 3, 1, keep, counts), InternalError);
  Tensor wide_keep = Tensor::zeros({2, 3}), int_keep = Tensor::zeros({2, 2}, DType::I32);
  EXPECT_THROW(drop(probs, indices, 3, 1, wide_keep, counts), InternalError);
  EXPECT_THROW(drop(probs, indices, 3, 1, int_keep, counts), InternalError);
  Tensor long_counts = Tensor::zeros({4});
  EXPECT_THROW(drop(probs, indices, 3, 1, keep, long_counts), InternalError);
  Tensor no_counts = Tensor::zeros({0});
  EXPECT_THROW(drop(probs, indices, 0, 1, keep, no_counts), InternalError);
  EXPECT_THROW(drop(probs, indices, 3, -1, keep, counts), InternalError);
  // An index outside [0, E): thrown before keep or counts change.
  for (int32_t bad : {3, -1}) {
    Tensor fresh_keep = Tensor::from({2, 2}, {5, 5, 5, 5}), fresh_counts = Tensor::zeros({3});
    EXPECT_THROW(
        drop(probs, Tensor::from_i32({2, 2}, {0, 1, bad, 0}), 3, 1, fresh_keep, fresh_counts),
        InternalError)
        << bad;
    EXPECT_EQ(fresh_keep.to_vector(), std::vector<float>(4, 5.0f));
    EXPECT_EQ(fresh_counts.to_vector(), std::vector<float>(3, 0.0f));
  }
}

TEST(MoeMarkDropped, DroppedEntriesNameExpertEAndSortLastInThePermutation) {
  // The capacity example at capacity 1 keeps entries 2, 4 and 8 (expert 1, 0, 2).
  CapacityExample ex;
  Tensor keep = Tensor::empty({5, 2}), counts = Tensor::zeros({3});
  ops::moe_capacity_drop(ex.probs, ex.indices, 3, 1, false, keep, counts);
  Tensor routed = Tensor::empty({5, 2}, DType::I32);
  routed.fill(-1);
  ops::moe_mark_dropped(ex.indices, keep, 3, routed);
  const std::vector<int32_t> want = {3, 3, 1, 3, 0, 3, 3, 3, 2, 3};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(routed.i32()[i], want[i]) << "entry " << i;
  // moe_permute over E + 1 groups: the kept copies by expert, then the 7 dropped ones.
  const Tensor x = randn({5, 4}, 17);
  Tensor permuted = Tensor::empty({10, 4}), map = Tensor::empty({10}, DType::I32),
         tokens = Tensor::empty({4}, DType::I64);
  ops::moe_permute(x, routed, 4, permuted, map, tokens);
  EXPECT_EQ(tokens.to_vector(), (std::vector<float>{1, 1, 1, 7}));
  EXPECT_EQ(map.i32()[0], 4);
  EXPECT_EQ(map.i32()[1], 2);
  EXPECT_EQ(map.i32()[2], 8);
  // Everything kept: the indices unchanged.
  keep.fill(1.0f);
  ops::moe_mark_dropped(ex.indices, keep, 3, routed);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(routed.i32()[i], ex.indices.i32()[i]) << "entry " << i;
}

TEST(MoeMarkDropped, BadShapesAndIndicesThrow) {
  const Tensor indices = Tensor::from_i32({2, 2}, {0, 1, 2, 0});
  const Tensor keep = Tensor::from({2, 2}, {1, 0, 1, 1});
  Tensor routed = Tensor::empty({2, 2}, DType::I32);
  EXPECT_NO_THROW(ops::moe_mark_dropped(indices, keep, 3, routed));
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep, 2, routed), InternalError);  // kept 2
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep, 0, routed), InternalError);
  EXPECT_THROW(ops::moe_mark_dropped(indices.to(DType::F32), keep, 3, routed), InternalError);
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep.view({4}), 3, routed), InternalError);
  Tensor wide = Tensor::empty({2, 3}, DType::I32), floats = Tensor::empty({2, 2});
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep, 3, wide), InternalError);
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep, 3, floats), InternalError);
  Tensor aliased = indices.clone();
  EXPECT_THROW(ops::moe_mark_dropped(aliased, keep, 3, aliased), InternalError);
}

// ---------------------------------------------------------------------------------------
// Finite differences

// Logits [T, E] (N(0, std)) whose top-k selection, group choice included, does not change
// when any one logit moves by +-kFdEps (rows, or with sinkhorn the whole matrix, are
// redrawn until so): the selection has no gradient, so the finite differences are of the
// smooth part only.
Tensor stable_logits(int64_t T, int64_t E, const RouterTopK& o, const Tensor& bias, uint64_t seed,
                     float std) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, std);
  Tensor x = Tensor::empty({T, E});
  auto route = [&](const Tensor& logits) {
    Tensor probs = Tensor::empty({logits.dim(0), o.topk}),
           indices = Tensor::empty({logits.dim(0), o.topk}, DType::I32);
    ops::moe_router_topk_forward(logits, bias, o, probs, indices);
    return std::vector<int32_t>(indices.i32(), indices.i32() + indices.numel());
  };
  auto stable = [&](Tensor& logits) {
    const std::vector<int32_t> base = route(logits);
    for (int64_t i = 0; i < logits.numel(); ++i) {
      const float v = logits.f32()[i];
      for (float d : {kFdEps, -kFdEps}) {
        logits.f32()[i] = v + d;
        const bool same = route(logits) == base;
        logits.f32()[i] = v;
        if (!same) return false;
      }
    }
    return true;
  };
  for (int attempt = 0; attempt < 1000; ++attempt) {
    if (o.sinkhorn) {  // the selection depends on every row
      for (int64_t i = 0; i < T * E; ++i) x.f32()[i] = dist(gen);
      if (stable(x)) return x;
      continue;
    }
    bool all = true;
    for (int64_t t = 0; t < T; ++t) {
      Tensor row = x.rows(t, 1);
      for (int tries = 0;; ++tries) {
        for (int64_t e = 0; e < E; ++e) row.f32()[e] = dist(gen);
        if (stable(row)) break;
        if (tries == 1000) {
          all = false;
          break;
        }
      }
    }
    if (all) return x;
  }
  ADD_FAILURE() << "no stable logits";
  return x;
}

struct TopkCase {
  const char* what;
  RouterTopK options;
  bool bias = false;
};

std::vector<TopkCase> topk_cases() {
  auto make = [](int k, RouterScoreFunction f, bool pre, float scale, int groups, int group_topk,
                 bool sinkhorn) {
    RouterTopK o;
    o.topk = k;
    o.score_function = f;
    o.pre_softmax = pre;
    o.scaling_factor = scale;
    o.num_groups = groups;
    o.group_topk = group_topk;
    o.sinkhorn = sinkhorn;
    return o;
  };
  using F = RouterScoreFunction;
  return {
      {"softmax k3", make(3, F::Softmax, false, 0, 0, 0, false)},
      {"softmax k3 scaled", make(3, F::Softmax, false, 2.5f, 0, 0, false)},
      {"pre-softmax k1", make(1, F::Softmax, true, 0, 0, 0, false)},
      {"pre-softmax k3 scaled", make(3, F::Softmax, true, 1.5f, 0, 0, false)},
      {"softmax k4 groups 4/2", make(4, F::Softmax, false, 0, 4, 2, false)},
      {"pre-softmax k4 groups 4/3", make(4, F::Softmax, true, 0, 4, 3, false)},
      {"sigmoid k1", make(1, F::Sigmoid, false, 0, 0, 0, false)},
      {"sigmoid k4", make(4, F::Sigmoid, false, 0, 0, 0, false)},
      {"sigmoid k4 bias scaled groups 8/4", make(4, F::Sigmoid, false, 2.5f, 8, 4, false), true},
      {"sqrtsoftplus k1", make(1, F::SqrtSoftplus, false, 0, 0, 0, false)},
      {"sqrtsoftplus k4 bias", make(4, F::SqrtSoftplus, false, 0, 0, 0, false), true},
      {"sqrtsoftplus k2 groups 4/1 scaled", make(2, F::SqrtSoftplus, false, 1.5f, 4, 1, false)},
      {"sinkhorn k1", make(1, F::Softmax, false, 0, 0, 0, true)},
      {"sinkhorn k3", make(3, F::Softmax, false, 0, 0, 0, true)},
  };
}

TEST(MoeRouterTopk, BackwardMatchesFiniteDifferences) {
  const int64_t T = 5, E = 16;
  uint64_t seed = testing::test_seed() + 800;
  for (const TopkCase& tc : topk_cases()) {
    ++seed;
    SCOPED_TRACE(std::string(tc.what) + ", " + seed_trace(seed));
    const int k = tc.options.topk;
    Tensor bias;
    if (tc.bias) bias = randn({E}, seed + 1000, 0.1f);
    // Logits up to ~25 in magnitude reach softplus's linear branch (x > 20).
    const float std = tc.options.score_function == RouterScoreFunction::SqrtSoftplus ? 8.0f : 1.5f;
    Tensor logits = stable_logits(T, E, tc.options, bias, seed, std);
    Tensor probs = Tensor::empty({T, k}), indices = Tensor::empty({T, k}, DType::I32);
    ops::moe_router_topk_forward(logits, bias, tc.options, probs, indices);
    const Tensor w = randn({T, k}, seed + 2000);
    Tensor dlogits = Tensor::empty({T, E});
    poison(dlogits);
    ops::moe_router_topk_backward(w, logits, probs, indices, tc.options, dlogits);
    Tensor fd = finite_difference(
        logits,
        [&] {
          Tensor p = Tensor::empty({T, k}), i = Tensor::empty({T, k}, DType::I32);
          ops::moe_router_topk_forward(logits, bias, tc.options, p, i);
          return weighted_sum(w, p);
        },
        kFdEps);
    EXPECT_TRUE(testing::allclose(dlogits, fd, kFdAtol, kFdRtol));
  }
}

TEST(MoeRouterAuxStatistics, BackwardMatchesFiniteDifferencesWithGroupsAndOffset) {
  // Rows 5 .. 14 of a token list in sequences of 4 rows: groups 1, 2 and 3 of G = 4.
  const int64_t T = 10, E = 8, first_row = 5, rows_per_group = 4, G = 4;
  uint64_t seed = testing::test_seed() + 900;
  for (RouterScoreFunction f : {RouterScoreFunction::Softmax, RouterScoreFunction::Sigmoid,
                                RouterScoreFunction::SqrtSoftplus}) {
    ++seed;
    SCOPED_TRACE("score function " + std::to_string(int(f)) + ", " + seed_trace(seed));
    Tensor logits = randn({T, E}, seed, f == RouterScoreFunction::SqrtSoftplus ? 8.0f : 1.5f);
    const Tensor coeffs = randn({G, E}, seed + 1);
    Tensor scores = Tensor::empty({T, E}), sums = Tensor::empty({G, E}),
           counts = Tensor::empty({G, E});
    poison(sums);
    poison(counts);
    ops::moe_aux_loss_statistics(logits, f, 3, first_row, rows_per_group, scores, sums, counts);
    // Group 0 has no rows of this call: zero sums and counts; the others count k per row.
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_EQ(sums.f32()[e], 0.0f);
      EXPECT_EQ(counts.f32()[e], 0.0f);
    }
    const int rows_in_group[G] = {0, 3, 4, 3};
    for (int64_t g = 0; g < G; ++g) {
      double total = 0, score_total = 0;
      for (int64_t e = 0; e < E; ++e) {
        total += counts.f32()[g * E + e];
        score_total += sums.f32()[g * E + e];
      }
      EXPECT_EQ(total, 3.0 * rows_in_group[g]) << "group " << g;
      // Every score function's scores sum to 1 over a row (up to the 1e-20).
      EXPECT_NEAR(score_total, rows_in_group[g], 1e-5) << "group " << g;
    }
    // L = sum_t sum_e coeffs[g(t), e] scores[t, e]; backward accumulates into dlogits.
    const Tensor start = randn({T, E}, seed + 2);
    Tensor dlogits = start.clone();
    ops::moe_aux_loss_statistics_backward(coeffs, logits, scores, f, first_row, rows_per_group,
                                          dlogits);
    ops::add_(dlogits, start, -1.0f);
    Tensor fd = finite_difference(
        logits,
        [&] {
          Tensor s = Tensor::empty({T, E}), ss = Tensor::empty({G, E}), c = Tensor::empty({G, E});
          ops::moe_aux_loss_statistics(logits, f, 3, first_row, rows_per_group, s, ss, c);
          double loss = 0;
          for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < E; ++e)
              loss += double(coeffs.f32()[(first_row + t) / rows_per_group * E + e]) *
                      s.f32()[t * E + e];
          return loss;
        },
        kFdEps);
    EXPECT_TRUE(testing::allclose(dlogits, fd, kFdAtol, kFdRtol));
  }
}

TEST(MoeRouterZLoss, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 1000;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 7, E = 12;
  const float scale = 0.37f;
  Tensor logits = randn({T, E}, seed, 3.0f);
  Tensor lse = Tensor::empty({T});
  ops::moe_router_logsumexp(logits, lse);
  const Tensor start = randn({T, E}, seed + 1);
  Tensor dlogits = start.clone();
  ops::moe_z_loss_backward(scale, logits, lse, dlogits);
  ops::add_(dlogits, start, -1.0f);
  Tensor fd = finite_difference(
      logits,
      [&] {
        Tensor l = Tensor::empty({T});
        ops::moe_router_logsumexp(logits, l);
        double loss = 0;
        for (int64_t t = 0; t < T; ++t)
          loss += 0.5 * double(scale) * double(l.f32()[t]) * l.f32()[t];
        return loss;
      },
      kFdEps);
  EXPECT_TRUE(testing::allclose(dlogits, fd, kFdAtol, kFdRtol));
}

// ---------------------------------------------------------------------------------------
// Door checks

TEST(MoeRouterErrors, BadShapesAndOptionsThrow) {
  const int64_t T = 4, E = 8;
  Tensor logits = randn({T, E}, 1), bias = Tensor::zeros({E});
  Tensor probs = Tensor::empty({T, 2}), indices = Tensor::empty({T, 2}, DType::I32);
  auto forward = [&](RouterTopK o, const Tensor& b = Tensor()) {
    Tensor p = Tensor::empty({T, o.topk}), i = Tensor::empty({T, o.topk}, DType::I32);
    ops::moe_router_topk_forward(logits, b, o, p, i);
  };
  RouterTopK o;
  o.topk = 9;
  EXPECT_THROW(forward(o), InternalError);  // k > E
  o.topk = 0;
  EXPECT_THROW(forward(o), InternalError);
  o = RouterTopK();
  EXPECT_THROW(forward(o, bias), InternalError);  // bias with softmax
  o.score_function = RouterScoreFunction::Sigmoid;
  EXPECT_THROW(forward(o, Tensor::zeros({E + 1})), InternalError);  // bias shape
  o.sinkhorn = true;
  EXPECT_THROW(forward(o, bias), InternalError);  // bias with sinkhorn
  o = RouterTopK();
  o.num_groups = 3;  // 8 % 3
  o.group_topk = 1;
  EXPECT_THROW(forward(o), InternalError);
  o.num_groups = 4;
  o.group_topk = 5;  // > num_groups
  EXPECT_THROW(forward(o), InternalError);
  o.group_topk = 0;
  EXPECT_THROW(forward(o), InternalError);
  o.group_topk = 3;  // k / group_topk = 0
  EXPECT_THROW(forward(o), InternalError);
  o.topk = 6;  // 6 > 2 groups x 2 experts
  o.group_topk = 2;
  EXPECT_THROW(forward(o), InternalError);
  o = RouterTopK();
  EXPECT_THROW(ops::moe_router_topk_forward(logits.view({T * E}), Tensor(), o, probs, indices),
               InternalError);
  Tensor wrong_probs = Tensor::empty({T, 3});
  EXPECT_THROW(ops::moe_router_topk_forward(logits, Tensor(), o, wrong_probs, indices),
               InternalError);
  Tensor f32_indices = Tensor::empty({T, 2});
  EXPECT_THROW(ops::moe_router_topk_forward(logits, Tensor(), o, probs, f32_indices),
               InternalError);
  EXPECT_THROW(ops::moe_router_topk_forward(logits.to(DType::BF16), Tensor(), o, probs, indices),
               InternalError);

  ops::moe_router_topk_forward(logits, Tensor(), o, probs, indices);
  Tensor dlogits = Tensor::empty({T, E});
  EXPECT_THROW(
      ops::moe_router_topk_backward(Tensor::empty({T, 3}), logits, probs, indices, o, dlogits),
      InternalError);
  Tensor wide = Tensor::empty({T, E + 1});
  EXPECT_THROW(ops::moe_router_topk_backward(probs, logits, probs, indices, o, wide),
               InternalError);
  Tensor bad_indices = indices.clone();
  bad_indices.i32()[3] = int32_t(E);
  EXPECT_THROW(ops::moe_router_topk_backward(probs, logits, probs, bad_indices, o, dlogits),
               InternalError);

  Tensor out = Tensor::empty({T, E + 1});
  EXPECT_THROW(ops::moe_sinkhorn(logits, out), InternalError);

  Tensor scores = Tensor::empty({T, E}), sums = Tensor::empty({2, E}),
         counts = Tensor::empty({2, E});
  EXPECT_THROW(ops::moe_aux_loss_statistics(logits, RouterScoreFunction::Softmax, 9, 0, T, scores,
                                            sums, counts),
               InternalError);  // k > E
  EXPECT_THROW(ops::moe_aux_loss_statistics(logits, RouterScoreFunction::Softmax, 2, 0, 1, scores,
                                            sums, counts),
               InternalError);  // 4 groups of 1 row need G = 4
  EXPECT_THROW(ops::moe_aux_loss_statistics(logits, RouterScoreFunction::Softmax, 2, -1, T, scores,
                                            sums, counts),
               InternalError);
  EXPECT_THROW(ops::moe_aux_loss_statistics(logits, RouterScoreFunction::Softmax, 2, 0, 0, scores,
                                            sums, counts),
               InternalError);
  Tensor counts_wrong = Tensor::empty({3, E});
  EXPECT_THROW(ops::moe_aux_loss_statistics(logits, RouterScoreFunction::Softmax, 2, 0, T, scores,
                                            sums, counts_wrong),
               InternalError);
  EXPECT_THROW(ops::moe_aux_loss_statistics_backward(Tensor::zeros({1, E}), logits, scores,
                                                     RouterScoreFunction::Softmax, 2, 2, dlogits),
               InternalError);  // rows 2 .. 5 in pairs need 3 groups
  EXPECT_THROW(ops::moe_aux_loss_statistics_backward(Tensor::zeros({1, E - 1}), logits, scores,
                                                     RouterScoreFunction::Softmax, 0, T, dlogits),
               InternalError);

  Tensor lse = Tensor::empty({T + 1});
  EXPECT_THROW(ops::moe_router_logsumexp(logits, lse), InternalError);
  Tensor good_lse = Tensor::empty({T});
  EXPECT_THROW(ops::moe_z_loss_backward(1.0f, logits, lse, dlogits), InternalError);
  EXPECT_THROW(ops::moe_z_loss_backward(1.0f, logits, good_lse, out), InternalError);

  Tensor tokens = Tensor::zeros({E});
  Tensor bad = Tensor::from_i32({1, 2}, {0, int32_t(E)});
  EXPECT_THROW(ops::moe_tokens_per_expert(bad, E, tokens), InternalError);
  Tensor negative = Tensor::from_i32({1, 2}, {-1, 0});
  EXPECT_THROW(ops::moe_tokens_per_expert(negative, E, tokens), InternalError);
  EXPECT_THROW(ops::moe_tokens_per_expert(indices, E + 1, tokens), InternalError);

  Tensor y = Tensor::zeros({T, E});
  EXPECT_THROW(ops::mul_(y, Tensor::zeros({T, E + 1})), InternalError);
  EXPECT_THROW(ops::mul_(y, Tensor::zeros({T, E}, DType::BF16)), InternalError);
  Tensor ints = Tensor::zeros({4}, DType::I32);
  EXPECT_THROW(ops::fill_normal(ints, 1, 0), InternalError);
  EXPECT_THROW(ops::fill_uniform(ints, 0.0f, 1.0f, 1, 0), InternalError);
}

// ---------------------------------------------------------------------------------------
// Random fills and mul_

TEST(MoeRouterFill, NormalAndUniformStatistics) {
  const int64_t n = 100000;
  Tensor t = Tensor::empty({n});
  poison(t);
  ops::fill_normal(t, 1234, 7);
  double mean = 0, var = 0;
  for (int64_t i = 0; i < n; ++i) mean += t.f32()[i];
  mean /= double(n);
  for (int64_t i = 0; i < n; ++i) var += (t.f32()[i] - mean) * (t.f32()[i] - mean);
  var /= double(n - 1);
  // Standard errors: mean 1 / sqrt(n) = 3.2e-3, variance sqrt(2 / n) = 4.5e-3; 5 sigma.
  EXPECT_NEAR(mean, 0.0, 0.016);
  EXPECT_NEAR(var, 1.0, 0.023);

  const float lo = -0.25f, hi = 0.75f;
  ops::fill_uniform(t, lo, hi, 1234, 7);
  mean = 0;
  var = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_GE(t.f32()[i], lo) << i;
    ASSERT_LT(t.f32()[i], hi) << i;
    mean += t.f32()[i];
  }
  mean /= double(n);
  for (int64_t i = 0; i < n; ++i) var += (t.f32()[i] - mean) * (t.f32()[i] - mean);
  var /= double(n - 1);
  // U(lo, hi): mean 0.25 (s.e. 9e-4), variance 1/12 (s.e. 2.9e-4 for 1e5 samples); 5 sigma.
  EXPECT_NEAR(mean, 0.25, 4.6e-3);
  EXPECT_NEAR(var, 1.0 / 12.0, 1.5e-3);
}

TEST(MoeRouterFill, SameSeedAndStreamRepeatOthersDiffer) {
  const int64_t n = 4096;
  Tensor a = Tensor::empty({n}), b = Tensor::empty({n}), c = Tensor::empty({n}),
         d = Tensor::empty({n});
  ops::fill_normal(a, 99, 3);
  ops::fill_normal(b, 99, 3);
  ops::fill_normal(c, 99, 4);
  ops::fill_normal(d, 100, 3);
  EXPECT_EQ(a.to_vector(), b.to_vector());
  int same_stream = 0, same_seed = 0;
  for (int64_t i = 0; i < n; ++i) {
    same_stream += a.f32()[i] == c.f32()[i];
    same_seed += a.f32()[i] == d.f32()[i];
  }
  EXPECT_LT(same_stream, 5);
  EXPECT_LT(same_seed, 5);
  // Element i is Philox(seed).normal(stream, i), so a prefix of a longer fill is the same.
  Tensor prefix = Tensor::empty({100});
  ops::fill_normal(prefix, 99, 3);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(prefix.f32()[i], a.f32()[i]);

  ops::fill_uniform(a, 0.0f, 1.0f, 99, 3);
  ops::fill_uniform(b, 0.0f, 1.0f, 99, 3);
  ops::fill_uniform(c, 0.0f, 1.0f, 99, 4);
  EXPECT_EQ(a.to_vector(), b.to_vector());
  same_stream = 0;
  for (int64_t i = 0; i < n; ++i) same_stream += a.f32()[i] == c.f32()[i];
  EXPECT_LT(same_stream, 5);
}

TEST(MoeRouterMul, MultipliesElementwiseInEveryFloatDtype) {
  const uint64_t seed = testing::test_seed() + 1100;
  SCOPED_TRACE(seed_trace(seed));
  const Tensor y0 = randn({5, 7}, seed), x = randn({5, 7}, seed + 1);
  Tensor y = y0.clone();
  ops::mul_(y, x);
  for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y.f32()[i], y0.f32()[i] * x.f32()[i]) << i;
  // bf16 y with an fp32 or a bf16 x: product in fp32, rounded once to bf16.
  for (bool x_bf16 : {false, true}) {
    Tensor yb = y0.to(DType::BF16);
    const Tensor xs = x_bf16 ? x.to(DType::BF16) : x;
    ops::mul_(yb, xs);
    for (int64_t i = 0; i < y.numel(); ++i) {
      const uint16_t expect = float_to_bf16(bf16_to_float(float_to_bf16(y0.f32()[i])) * xs.item(i));
      EXPECT_EQ(reinterpret_cast<const uint16_t*>(yb.raw())[i], expect) << i;
    }
  }
}

}  // namespace
}  // namespace megaton
