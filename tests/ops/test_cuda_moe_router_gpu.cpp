// CUDA MoE router ops (all of Megatron's router options: moe_router.cu,
// moe_router_sinkhorn.cu, moe_router_stats.cu, moe_router_capacity.cu with
// moe_mark_dropped) against their CPU twins (ops/cpu/moe_router*.cpp): the same random
// seeded inputs on both devices, GPU outputs poisoned before each op runs.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randn;
using testing::rel_error;
using testing::seed_trace;

// CUDA fp32 tolerances of CONVENTIONS.md (fp32 math on identical inputs, another
// summation order and exp implementation).
constexpr double kF32Atol = 1e-5, kF32Rtol = 1e-4;

class CudaMoeRouterTest : public ::testing::Test {
 protected:
  void SetUp() override { MEGATON_SKIP_WITHOUT_GPU(); }
};

Tensor to_gpu(const Tensor& t) { return t.to(Device::CUDA); }
Tensor to_cpu(const Tensor& t) { return t.to(Device::CPU); }

// A GPU output filled with NaN (float) or -1 (integer), so an unwritten element shows.
Tensor poisoned_gpu(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::CUDA);
  t.fill(dtype == DType::I32 || dtype == DType::I64 ? -1.0f : NAN);
  return t;
}

// Every element identical (bit patterns compared; a NaN never matches).
::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  const Tensor x = to_cpu(a), y = to_cpu(b);
  if (x.nbytes() != y.nbytes() || x.dtype() != y.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  const size_t es = dtype_size(x.dtype());
  const char *p = static_cast<const char*>(x.raw()), *q = static_cast<const char*>(y.raw());
  for (int64_t i = 0; i < x.numel(); ++i)
    if (std::memcmp(p + i * es, q + i * es, es) != 0 || std::isnan(x.item(i)))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << x.item(i) << " vs " << y.item(i);
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------
// Inputs

// Router logits [T, E] in [-3, 3] with no near-ties, in selection scores nor in group
// scores: each row ranks its experts by a random order of the num_groups groups (a whole
// group above the next), then a random order within each group; expert of rank r gets
// -3 + 6 (r + jitter) / E, jitter in [0, 0.25). Entries of a row are >= 4.5 / E apart, so
// softmax, sigmoid and sqrt-softplus scores computed on either device rank the same, and
// so do the sums of a group's best scores.
Tensor ranked_logits(int64_t T, int64_t E, int64_t num_groups, uint64_t seed) {
  const int64_t groups = std::max<int64_t>(num_groups, 1), size = E / groups;
  Tensor t = Tensor::empty({T, E});
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> jitter(0.0f, 0.25f);
  std::vector<int64_t> group_rank(groups), within(size);
  for (int64_t r = 0; r < T; ++r) {
    std::iota(group_rank.begin(), group_rank.end(), 0);
    std::shuffle(group_rank.begin(), group_rank.end(), gen);
    for (int64_t g = 0; g < groups; ++g) {
      std::iota(within.begin(), within.end(), 0);
      std::shuffle(within.begin(), within.end(), gen);
      for (int64_t i = 0; i < size; ++i) {
        const int64_t rank = group_rank[g] * size + within[i];
        t.f32()[r * E + g * size + i] = -3.0f + 6.0f * (float(rank) + jitter(gen)) / float(E);
      }
    }
  }
  return t;
}

// Logits drawn from {0, 1, 2}: many exact ties, which both devices must break toward the
// lower expert (and the lower group) index: equal inputs give equal scores on a device.
Tensor tied_logits(int64_t T, int64_t E, uint64_t seed) {
  Tensor t = Tensor::empty({T, E});
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> level(0, 2);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = float(level(gen));
  return t;
}

// Expert bias [E]: an integer tier in {0, 1, 2} per group of experts (per expert without
// groups). Scores lie in (0, 1) (sigmoid) or below 2.1 (sqrt-softplus of x <= 3), so a
// tier reorders the selection without creating near-ties: two experts of one tier differ
// as their scores do, and a group's score gains a multiple of its pick count.
Tensor tiered_bias(int64_t E, int64_t num_groups, uint64_t seed) {
  const int64_t size = num_groups > 0 ? E / num_groups : 1;
  Tensor b = Tensor::empty({E});
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> tier(0, 2);
  for (int64_t e = 0; e < E; e += size) {
    const float v = float(tier(gen));
    for (int64_t i = 0; i < size; ++i) b.f32()[e + i] = v;
  }
  return b;
}

// ---------------------------------------------------------------------------------------
// Top-k routing

struct RouterCase {
  int64_t T, E;
  ops::RouterTopK options;
  bool bias = false;
};

const char* score_name(ops::RouterScoreFunction f) {
  switch (f) {
    case ops::RouterScoreFunction::Softmax:
      return "softmax";
    case ops::RouterScoreFunction::Sigmoid:
      return "sigmoid";
    case ops::RouterScoreFunction::SqrtSoftplus:
      return "sqrtsoftplus";
  }
  return "?";
}

std::string describe(const RouterCase& c) {
  const ops::RouterTopK& o = c.options;
  std::string s = "T " + std::to_string(c.T) + " E " + std::to_string(c.E) + " k " +
                  std::to_string(o.topk) + " " + score_name(o.score_function);
  if (o.pre_softmax) s += " pre_softmax";
  if (c.bias) s += " bias";
  if (o.scaling_factor != 0.0f) s += " scaling " + std::to_string(o.scaling_factor);
  if (o.num_groups > 0)
    s += " groups " + std::to_string(o.num_groups) + " group_topk " + std::to_string(o.group_topk);
  if (o.sinkhorn) s += " sinkhorn";
  return s;
}

ops::RouterTopK router_options(int k, ops::RouterScoreFunction f, bool pre_softmax = false,
                               float scaling = 0.0f, int num_groups = 0, int group_topk = 0,
                               bool sinkhorn = false) {
  ops::RouterTopK o;
  o.topk = k;
  o.score_function = f;
  o.pre_softmax = pre_softmax;
  o.scaling_factor = scaling;
  o.num_groups = num_groups;
  o.group_topk = group_topk;
  o.sinkhorn = sinkhorn;
  return o;
}

// Rows whose GPU indices differ from the CPU's. With `selection` (the CPU's selection
// scores [T, E]) a differing row is accepted when each differing slot's two experts have
// selection scores within 1e-5 relative (a near-tie that fp32 rounding may order either
// way); without it every row must match exactly. Returns the accepted rows' mask.
std::vector<bool> compare_indices(const Tensor& got, const Tensor& want, const Tensor* selection,
                                  ::testing::AssertionResult& result) {
  const int64_t T = want.dim(0), k = want.dim(1);
  std::vector<bool> differs(T, false);
  result = ::testing::AssertionSuccess();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t a = got.i32()[t * k + j], b = want.i32()[t * k + j];
      if (a == b) continue;
      differs[t] = true;
      const int64_t E = selection ? selection->dim(1) : 0;
      const bool near_tie = selection && a >= 0 && a < E &&
                            std::fabs(selection->f32()[t * E + a] - selection->f32()[t * E + b]) <=
                                1e-5 * std::fabs(selection->f32()[t * E + b]);
      if (!near_tie && result) {
        result = ::testing::AssertionFailure()
                 << "token " << t << " slot " << j << ": expert " << a << " vs " << b;
      }
    }
  return differs;
}

// Forward and backward of one case against the CPU. Indices must match exactly, except
// with sinkhorn selection: its scales, summed in another order, may reorder experts whose
// sinkhorn outputs are a few ulp apart, so there indices are compared up to near-ties of
// the CPU's sinkhorn output and probabilities only on the rows routed alike.
void check_router(const RouterCase& c, const Tensor& logits, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const ops::RouterTopK& o = c.options;
  const int64_t T = c.T, E = c.E;
  const int k = o.topk;
  const Tensor bias = c.bias ? tiered_bias(E, o.num_groups, seed + 7) : Tensor();
  const Tensor bias_gpu = c.bias ? to_gpu(bias) : Tensor();

  Tensor ref_probs = Tensor::empty({T, k}), ref_indices = Tensor::empty({T, k}, DType::I32);
  ops::moe_router_topk_forward(logits, bias, o, ref_probs, ref_indices);

  const Tensor logits_gpu = to_gpu(logits);
  Tensor probs = poisoned_gpu({T, k}, DType::F32), indices = poisoned_gpu({T, k}, DType::I32);
  ops::moe_router_topk_forward(logits_gpu, bias_gpu, o, probs, indices);
  const Tensor got_probs = to_cpu(probs), got_indices = to_cpu(indices);
  EXPECT_TRUE(testing::all_finite(got_probs, "probs"));

  if (o.sinkhorn) {
    Tensor selection = Tensor::empty({T, E});
    ops::moe_sinkhorn(logits, selection);
    ::testing::AssertionResult ok = ::testing::AssertionSuccess();
    const std::vector<bool> differs = compare_indices(got_indices, ref_indices, &selection, ok);
    EXPECT_TRUE(ok) << "indices";
    const int64_t rows_differing = std::count(differs.begin(), differs.end(), true);
    EXPECT_LE(rows_differing, std::max<int64_t>(1, T / 100)) << "rows routed differently";
    // Probabilities of the rows routed alike.
    for (int64_t t = 0; t < T; ++t) {
      if (differs[t]) continue;
      for (int j = 0; j < k; ++j) {
        const float got = got_probs.f32()[t * k + j], want = ref_probs.f32()[t * k + j];
        ASSERT_LE(std::fabs(got - want), kF32Atol + kF32Rtol * std::fabs(want))
            << "probs token " << t << " slot " << j;
      }
    }
  } else {
    EXPECT_TRUE(bitwise_equal(got_indices, ref_indices)) << "indices";
    EXPECT_TRUE(allclose(got_probs, ref_probs, kF32Atol, kF32Rtol)) << "probs";
  }

  // Backward from the CPU's forward outputs, so both devices see the same probs/indices.
  const Tensor dprobs = randn({T, k}, seed + 11);
  Tensor ref_dlogits = Tensor::empty({T, E});
  ops::moe_router_topk_backward(dprobs, logits, ref_probs, ref_indices, o, ref_dlogits);
  Tensor dlogits = poisoned_gpu({T, E}, DType::F32);
  ops::moe_router_topk_backward(to_gpu(dprobs), logits_gpu, to_gpu(ref_probs), to_gpu(ref_indices),
                                o, dlogits);
  const Tensor got_dlogits = to_cpu(dlogits);
  EXPECT_TRUE(testing::all_finite(got_dlogits, "dlogits"));
  EXPECT_TRUE(allclose(got_dlogits, ref_dlogits, kF32Atol, kF32Rtol)) << "dlogits";
}

// The score configurations of the sweep: each score function, pre-softmax, bias, scaling.
std::vector<RouterCase> score_configs(int64_t T, int64_t E, int k) {
  using F = ops::RouterScoreFunction;
  return {
      {T, E, router_options(k, F::Softmax)},
      {T, E, router_options(k, F::Softmax, /*pre_softmax=*/true)},
      {T, E, router_options(k, F::Softmax, false, /*scaling=*/2.5f)},
      {T, E, router_options(k, F::Sigmoid)},
      {T, E, router_options(k, F::Sigmoid, false, 2.5f), /*bias=*/true},
      {T, E, router_options(k, F::SqrtSoftplus)},
      {T, E, router_options(k, F::SqrtSoftplus, false, 0.0f), /*bias=*/true},
  };
}

TEST_F(CudaMoeRouterTest, TopkMatchesCpuForEveryScoreFunction) {
  const uint64_t seed = testing::test_seed() + 700;
  SCOPED_TRACE(seed_trace(seed));
  for (int64_t T : {1, 37, 4096})
    for (int64_t E : {8, 16, 64, 128, 256})
      for (int k : {1, 2, 4, 8}) {
        if (k > E) continue;
        const uint64_t case_seed = seed + uint64_t(T) * 1000 + uint64_t(E) * 10 + uint64_t(k);
        const Tensor logits = ranked_logits(T, E, 0, case_seed);
        for (const RouterCase& c : score_configs(T, E, k)) check_router(c, logits, case_seed);
      }
}

// Experts not a multiple of 32 (partly filled lanes), up to 512 and beyond (registers per
// lane 16 and 32), and k up to E.
TEST_F(CudaMoeRouterTest, TopkMatchesCpuForOddAndLargeShapes) {
  const uint64_t seed = testing::test_seed() + 701;
  SCOPED_TRACE(seed_trace(seed));
  struct Shape3 {
    int64_t T, E;
    int k;
  };
  for (const Shape3& s :
       {Shape3{37, 5, 3}, Shape3{37, 100, 6}, Shape3{37, 384, 8}, Shape3{37, 512, 16},
        Shape3{37, 1000, 8}, Shape3{37, 8, 8}, Shape3{37, 64, 64}, Shape3{5, 256, 256}}) {
    const uint64_t case_seed = seed + uint64_t(s.E) * 10 + uint64_t(s.k);
    const Tensor logits = ranked_logits(s.T, s.E, 0, case_seed);
    for (const RouterCase& c : score_configs(s.T, s.E, s.k)) check_router(c, logits, case_seed);
  }
}

TEST_F(CudaMoeRouterTest, TopkBreaksTiesLikeCpu) {
  const uint64_t seed = testing::test_seed() + 702;
  SCOPED_TRACE(seed_trace(seed));
  using F = ops::RouterScoreFunction;
  for (int64_t E : {8, 64}) {
    const Tensor logits = tied_logits(4096, E, seed + uint64_t(E));
    for (int k : {2, 8}) {
      for (const RouterCase& c : score_configs(4096, E, k)) check_router(c, logits, seed);
      // Tied group scores: the lower group wins (4 groups, the best 2 hold E / 2 experts).
      if (k > E / 2) continue;
      check_router({4096, E, router_options(k, F::Sigmoid, false, 0.0f, 4, 2), true}, logits, seed);
      check_router({4096, E, router_options(k, F::Softmax, true, 0.0f, 4, 2)}, logits, seed);
    }
  }
}

TEST_F(CudaMoeRouterTest, GroupLimitedTopkMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 703;
  SCOPED_TRACE(seed_trace(seed));
  using F = ops::RouterScoreFunction;
  struct GroupShape {
    int64_t E;
    int k, groups, group_topk;
  };
  // E=256, 8 groups, best 4, k=8 with sigmoid, bias and scaling 2.5 is DeepSeek-V3's router.
  for (const GroupShape& g :
       {GroupShape{64, 8, 8, 4}, GroupShape{256, 8, 8, 4}, GroupShape{16, 4, 4, 2},
        GroupShape{64, 6, 8, 3}, GroupShape{128, 8, 32, 4}, GroupShape{64, 2, 8, 1}}) {
    for (int64_t T : {1, 37, 4096}) {
      const uint64_t case_seed = seed + uint64_t(T) * 1000 + uint64_t(g.E) * 10 + uint64_t(g.k);
      const Tensor logits = ranked_logits(T, g.E, g.groups, case_seed);
      const std::vector<RouterCase> cases = {
          {T, g.E, router_options(g.k, F::Softmax, false, 0.0f, g.groups, g.group_topk)},
          {T, g.E, router_options(g.k, F::Softmax, true, 0.0f, g.groups, g.group_topk)},
          {T, g.E, router_options(g.k, F::Sigmoid, false, 2.5f, g.groups, g.group_topk), true},
          {T, g.E, router_options(g.k, F::Sigmoid, false, 0.0f, g.groups, g.group_topk)},
          {T, g.E, router_options(g.k, F::SqrtSoftplus, false, 0.0f, g.groups, g.group_topk), true},
      };
      for (const RouterCase& c : cases) check_router(c, logits, case_seed);
    }
  }
}

TEST_F(CudaMoeRouterTest, SinkhornTopkMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 704;
  SCOPED_TRACE(seed_trace(seed));
  using F = ops::RouterScoreFunction;
  for (int64_t T : {1, 37, 4096})
    for (int64_t E : {8, 64})
      for (int k : {1, 2, 4}) {
        const uint64_t case_seed = seed + uint64_t(T) * 1000 + uint64_t(E) * 10 + uint64_t(k);
        const Tensor logits = randn({T, E}, case_seed);
        check_router({T, E, router_options(k, F::Softmax, false, 0.0f, 0, 0, true)}, logits,
                     case_seed);
        check_router({T, E, router_options(k, F::Sigmoid, false, 2.0f, 0, 0, true)}, logits,
                     case_seed);
      }
}

// ---------------------------------------------------------------------------------------
// Sinkhorn

TEST_F(CudaMoeRouterTest, SinkhornMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 710;
  SCOPED_TRACE(seed_trace(seed));
  for (int64_t T : {1, 37, 4096})
    for (int64_t E : {8, 64, 256}) {
      SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(E));
      const Tensor logits = randn({T, E}, seed + uint64_t(T) * 1000 + uint64_t(E), 2.0f);
      Tensor ref = Tensor::empty({T, E});
      ops::moe_sinkhorn(logits, ref);
      Tensor out = poisoned_gpu({T, E}, DType::F32);
      ops::moe_sinkhorn(to_gpu(logits), out);
      const Tensor got = to_cpu(out);
      EXPECT_TRUE(testing::all_finite(got, "out"));
      // The outputs are ~1 / (T E): relative tolerances only. The same iteration count
      // and fp64 sums leave only rounding; one extra or missing iteration would move the
      // scales by up to the 1e-4 stopping tolerance.
      EXPECT_TRUE(allclose(got, ref, 0.0, kF32Rtol)) << "out";
      EXPECT_LE(rel_error(got, ref), 1e-5) << "out";
    }
}

// ---------------------------------------------------------------------------------------
// Aux-loss statistics

struct AuxCase {
  int64_t T, E;
  int k;
  int64_t first_row, rows_per_group, groups;
};

void check_aux_statistics(const AuxCase& c, ops::RouterScoreFunction f, const Tensor& logits,
                          uint64_t seed) {
  SCOPED_TRACE("T " + std::to_string(c.T) + " E " + std::to_string(c.E) + " k " +
               std::to_string(c.k) + " " + score_name(f) + " first_row " +
               std::to_string(c.first_row) + " rows_per_group " + std::to_string(c.rows_per_group) +
               " groups " + std::to_string(c.groups));
  const int64_t T = c.T, E = c.E, G = c.groups;
  Tensor ref_scores = Tensor::empty({T, E}), ref_sums = Tensor::empty({G, E}),
         ref_counts = Tensor::empty({G, E});
  ops::moe_aux_loss_statistics(logits, f, c.k, c.first_row, c.rows_per_group, ref_scores, ref_sums,
                               ref_counts);
  const Tensor logits_gpu = to_gpu(logits);
  Tensor scores = poisoned_gpu({T, E}, DType::F32), sums = poisoned_gpu({G, E}, DType::F32),
         counts = poisoned_gpu({G, E}, DType::F32);
  ops::moe_aux_loss_statistics(logits_gpu, f, c.k, c.first_row, c.rows_per_group, scores, sums,
                               counts);
  EXPECT_TRUE(allclose(to_cpu(scores), ref_scores, kF32Atol, kF32Rtol)) << "scores";
  EXPECT_TRUE(allclose(to_cpu(sums), ref_sums, kF32Atol, kF32Rtol)) << "score_sums";
  EXPECT_TRUE(bitwise_equal(counts, ref_counts)) << "counts";

  // Backward into a random start (it accumulates), from the CPU's scores.
  const Tensor coeffs = randn({G, E}, seed + 1);
  const Tensor start = randn({T, E}, seed + 2, 1e-2f);
  Tensor ref_dlogits = start.clone();
  ops::moe_aux_loss_statistics_backward(coeffs, logits, ref_scores, f, c.first_row,
                                        c.rows_per_group, ref_dlogits);
  Tensor dlogits = to_gpu(start);
  ops::moe_aux_loss_statistics_backward(to_gpu(coeffs), logits_gpu, to_gpu(ref_scores), f,
                                        c.first_row, c.rows_per_group, dlogits);
  EXPECT_TRUE(allclose(to_cpu(dlogits), ref_dlogits, kF32Atol, kF32Rtol)) << "dlogits";
}

TEST_F(CudaMoeRouterTest, AuxLossStatisticsMatchCpu) {
  const uint64_t seed = testing::test_seed() + 720;
  SCOPED_TRACE(seed_trace(seed));
  using F = ops::RouterScoreFunction;
  for (int64_t T : {1, 37, 4096})
    for (int64_t E : {8, 64, 256})
      for (int k : {1, 2, 8}) {
        if (k > E) continue;
        const uint64_t case_seed = seed + uint64_t(T) * 1000 + uint64_t(E) * 10 + uint64_t(k);
        const Tensor logits = ranked_logits(T, E, 0, case_seed);
        // One group (aux_loss / global_aux_loss); sequences of 16 rows from row 5 with
        // one group past the last row (seq_aux_loss; that group stays zero); sequences
        // longer than a 256-row slice.
        const std::vector<AuxCase> cases = {
            {T, E, k, 0, T, 1},
            {T, E, k, 5, 16, (5 + T - 1) / 16 + 2},
            {T, E, k, 300, 1000, (300 + T - 1) / 1000 + 1},
        };
        for (const AuxCase& c : cases)
          for (F f : {F::Softmax, F::Sigmoid, F::SqrtSoftplus})
            check_aux_statistics(c, f, logits, case_seed);
      }
}

TEST_F(CudaMoeRouterTest, AuxLossStatisticsCountTiesLikeCpu) {
  const uint64_t seed = testing::test_seed() + 721;
  SCOPED_TRACE(seed_trace(seed));
  using F = ops::RouterScoreFunction;
  const Tensor logits = tied_logits(4096, 64, seed);
  for (F f : {F::Softmax, F::Sigmoid, F::SqrtSoftplus})
    check_aux_statistics({4096, 64, 8, 0, 4096, 1}, f, logits, seed);
}

TEST_F(CudaMoeRouterTest, AuxLossStatisticsAreDeterministic) {
  const uint64_t seed = testing::test_seed() + 722;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 4096, E = 64, G = 4;
  const Tensor logits = to_gpu(randn({T, E}, seed));
  Tensor first[3], second[3];
  for (Tensor* out : {first, second}) {
    out[0] = poisoned_gpu({T, E}, DType::F32);
    out[1] = poisoned_gpu({G, E}, DType::F32);
    out[2] = poisoned_gpu({G, E}, DType::F32);
    ops::moe_aux_loss_statistics(logits, ops::RouterScoreFunction::Softmax, 8, 0, T / G, out[0],
                                 out[1], out[2]);
  }
  EXPECT_TRUE(bitwise_equal(first[0], second[0])) << "scores";
  EXPECT_TRUE(bitwise_equal(first[1], second[1])) << "score_sums";
  EXPECT_TRUE(bitwise_equal(first[2], second[2])) << "counts";
}

// ---------------------------------------------------------------------------------------
// Z-loss

TEST_F(CudaMoeRouterTest, ZLossMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 730;
  SCOPED_TRACE(seed_trace(seed));
  for (int64_t T : {1, 37, 4096})
    for (int64_t E : {8, 64, 100, 256}) {
      SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(E));
      const Tensor logits = randn({T, E}, seed + uint64_t(T) * 1000 + uint64_t(E), 3.0f);
      const Tensor logits_gpu = to_gpu(logits);
      Tensor ref_lse = Tensor::empty({T});
      ops::moe_router_logsumexp(logits, ref_lse);
      Tensor lse = poisoned_gpu({T}, DType::F32);
      ops::moe_router_logsumexp(logits_gpu, lse);
      EXPECT_TRUE(allclose(to_cpu(lse), ref_lse, kF32Atol, kF32Rtol)) << "lse";

      const float scale = 0.37f;
      const Tensor start = randn({T, E}, seed + 1, 1e-2f);
      Tensor ref_dlogits = start.clone();
      ops::moe_z_loss_backward(scale, logits, ref_lse, ref_dlogits);
      Tensor dlogits = to_gpu(start);
      ops::moe_z_loss_backward(scale, logits_gpu, to_gpu(ref_lse), dlogits);
      EXPECT_TRUE(allclose(to_cpu(dlogits), ref_dlogits, kF32Atol, kF32Rtol)) << "dlogits";
    }
}

// ---------------------------------------------------------------------------------------
// Tokens per expert, fills, mul_

TEST_F(CudaMoeRouterTest, TokensPerExpertMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 740;
  SCOPED_TRACE(seed_trace(seed));
  for (int64_t T : {1, 37, 4096})
    for (int64_t E : {8, 64, 256})
      for (int k : {1, 8}) {
        SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(E) + " k " +
                     std::to_string(k));
        const Tensor indices = testing::randint({T, k}, int32_t(E), seed + uint64_t(T + E + k));
        // Counts accumulate: start from earlier micro-batches' integer counts.
        Tensor start = testing::randint({E}, 1000, seed + 1).to(DType::F32);
        Tensor ref = start.clone();
        ops::moe_tokens_per_expert(indices, E, ref);
        Tensor counts = to_gpu(start);
        ops::moe_tokens_per_expert(to_gpu(indices), E, counts);
        EXPECT_TRUE(bitwise_equal(counts, ref)) << "counts";
      }
}

// Routing indices [T, k]: k distinct experts per row in random order (a router's output).
Tensor distinct_indices(int64_t T, int64_t E, int k, uint64_t seed) {
  Tensor t = Tensor::empty({T, k}, DType::I32);
  std::mt19937_64 gen(seed);
  std::vector<int32_t> experts(E);
  for (int64_t r = 0; r < T; ++r) {
    std::iota(experts.begin(), experts.end(), 0);
    for (int j = 0; j < k; ++j) {  // a partial Fisher-Yates shuffle
      std::uniform_int_distribution<int64_t> pick(j, E - 1);
      std::swap(experts[j], experts[pick(gen)]);
      t.i32()[r * k + j] = experts[j];
    }
  }
  return t;
}

// Probabilities [T, k] in [0, 1): continuous, or on 9 levels (many ties, among them +0
// and -0, which tie with each other).
Tensor capacity_probs(int64_t T, int k, bool tied, uint64_t seed) {
  Tensor t = Tensor::empty({T, k});
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::uniform_int_distribution<int> level(0, 8);
  for (int64_t i = 0; i < T * k; ++i) {
    if (!tied) {
      t.f32()[i] = uniform(gen);
    } else {
      const int l = level(gen);
      t.f32()[i] = l == 0 ? -0.0f : float(l - 1) / 8.0f;
    }
  }
  return t;
}

// The CPU's keep and kept_counts (+= from `start`) against the GPU's, both bitwise, and
// the routing map after dropping (moe_mark_dropped) of each.
void check_capacity_drop(const Tensor& probs, const Tensor& indices, int64_t E, int64_t capacity,
                         bool by_position, const Tensor& start) {
  const Shape shape = probs.shape();
  Tensor keep_ref = Tensor::empty(shape), counts_ref = start.clone();
  ops::moe_capacity_drop(probs, indices, E, capacity, by_position, keep_ref, counts_ref);
  Tensor keep = poisoned_gpu(shape, DType::F32), counts = to_gpu(start);
  const Tensor indices_gpu = to_gpu(indices);
  ops::moe_capacity_drop(to_gpu(probs), indices_gpu, E, capacity, by_position, keep, counts);
  EXPECT_TRUE(bitwise_equal(keep, keep_ref)) << "keep";
  EXPECT_TRUE(bitwise_equal(counts, counts_ref)) << "kept_counts";
  Tensor routed_ref = Tensor::empty(shape, DType::I32);
  ops::moe_mark_dropped(indices, keep_ref, E, routed_ref);
  Tensor routed = poisoned_gpu(shape, DType::I32);
  ops::moe_mark_dropped(indices_gpu, keep, E, routed);
  EXPECT_TRUE(bitwise_equal(routed, routed_ref)) << "moe_mark_dropped";
}

TEST_F(CudaMoeRouterTest, CapacityDropMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 745;
  SCOPED_TRACE(seed_trace(seed));
  struct Shape3 {
    int64_t T, E;
    int k;
  };
  for (const Shape3& s :
       {Shape3{1, 8, 1}, Shape3{37, 8, 2}, Shape3{1000, 64, 6}, Shape3{4096, 256, 8},
        Shape3{8192, 8, 2}, Shape3{8192, 128, 8}, Shape3{8192, 256, 1}}) {
    const uint64_t case_seed = seed + uint64_t(s.T * 1000 + s.E * 10 + s.k);
    const Tensor indices = distinct_indices(s.T, s.E, s.k, case_seed);
    const Tensor start = testing::randint({s.E}, 1000, case_seed + 1).to(DType::F32);
    // get_capacity for capacity factors 0.5 and 1 (drops), 0, and one above every count.
    const double average = double(s.T * s.k) / double(s.E);
    for (int64_t capacity :
         {int64_t(std::ceil(average * 0.5)), int64_t(std::ceil(average)), int64_t(0), s.T})
      for (bool tied : {false, true}) {
        const Tensor probs = capacity_probs(s.T, s.k, tied, case_seed + 2);
        for (bool by_position : {false, true}) {
          SCOPED_TRACE("T " + std::to_string(s.T) + " E " + std::to_string(s.E) + " k " +
                       std::to_string(s.k) + " capacity " + std::to_string(capacity) +
                       (tied ? " tied" : "") + (by_position ? " position" : " probs"));
          check_capacity_drop(probs, indices, s.E, capacity, by_position, start);
        }
      }
  }
}

TEST_F(CudaMoeRouterTest, CapacityDropMatchesCpuWithRepeatedExperts) {
  // The same expert twice in a row (not a router's output): ties then go to the lower slot.
  const uint64_t seed = testing::test_seed() + 746;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 2048, E = 16;
  const Tensor indices = testing::randint({T, 4}, int32_t(E), seed);
  const Tensor probs = capacity_probs(T, 4, true, seed + 1);
  for (int64_t capacity : {1, 100, 600})
    for (bool by_position : {false, true}) {
      SCOPED_TRACE("capacity " + std::to_string(capacity) + (by_position ? " position" : ""));
      check_capacity_drop(probs, indices, E, capacity, by_position, Tensor::zeros({E}));
    }
}

TEST_F(CudaMoeRouterTest, CapacityDropDropsIndicesOutsideTheExperts) {
  // The GPU does not check indices: one outside [0, E) is dropped and counted nowhere. The
  // experts are independent, so the CPU with those entries sent to an extra expert E gives
  // the same result for the others.
  const uint64_t seed = testing::test_seed() + 747;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 500, E = 8;
  const int k = 2;
  const Tensor indices = distinct_indices(T, E, k, seed);
  const Tensor probs = capacity_probs(T, k, true, seed + 1);
  Tensor bad = indices.clone(), as_extra_expert = indices.clone();
  std::vector<int64_t> outside;
  for (int64_t i = 0; i < T * k; i += 7) {
    bad.i32()[i] = i % 2 ? int32_t(E) + 3 : -1;
    as_extra_expert.i32()[i] = int32_t(E);
    outside.push_back(i);
  }
  for (bool by_position : {false, true}) {
    Tensor keep_ref = Tensor::empty({T, k}), counts_ref = Tensor::zeros({E + 1});
    ops::moe_capacity_drop(probs, as_extra_expert, E + 1, 40, by_position, keep_ref, counts_ref);
    for (int64_t i : outside) keep_ref.f32()[i] = 0.0f;
    Tensor keep = poisoned_gpu({T, k}, DType::F32),
           counts = Tensor::zeros({E}, DType::F32, Device::CUDA);
    ops::moe_capacity_drop(to_gpu(probs), to_gpu(bad), E, 40, by_position, keep, counts);
    EXPECT_TRUE(bitwise_equal(keep, keep_ref)) << "keep";
    const std::vector<float> got = to_cpu(counts).to_vector();
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(got[e], counts_ref.f32()[e]) << "expert " << e;
  }
}

TEST_F(CudaMoeRouterTest, CapacityDropRejectsBadShapes) {
  const Tensor probs = to_gpu(Tensor::from({2, 2}, {0.6f, 0.4f, 0.7f, 0.3f}));
  const Tensor host_indices = Tensor::from_i32({2, 2}, {0, 1, 2, 0});
  const Tensor indices = to_gpu(host_indices);
  Tensor keep = poisoned_gpu({2, 2}, DType::F32), counts = poisoned_gpu({3}, DType::F32);
  Tensor wide = poisoned_gpu({2, 3}, DType::F32), host_keep = Tensor::zeros({2, 2});
  EXPECT_THROW(ops::moe_capacity_drop(probs, indices, 3, -1, false, keep, counts), InternalError);
  EXPECT_THROW(ops::moe_capacity_drop(probs, indices, 0, 1, false, keep, counts), InternalError);
  EXPECT_THROW(ops::moe_capacity_drop(probs, indices, 4, 1, false, keep, counts), InternalError);
  EXPECT_THROW(ops::moe_capacity_drop(probs, indices, 3, 1, false, wide, counts), InternalError);
  EXPECT_THROW(ops::moe_capacity_drop(probs, indices, 3, 1, false, host_keep, counts),
               InternalError);
  EXPECT_THROW(
      ops::moe_capacity_drop(probs, to_gpu(host_indices.to(DType::F32)), 3, 1, false, keep, counts),
      InternalError);
}

TEST_F(CudaMoeRouterTest, MarkDroppedRejectsBadShapes) {
  const Tensor indices = to_gpu(Tensor::from_i32({2, 2}, {0, 1, 2, 0}));
  const Tensor keep = to_gpu(Tensor::from({2, 2}, {1, 0, 1, 1}));
  Tensor routed = poisoned_gpu({2, 2}, DType::I32);
  EXPECT_NO_THROW(ops::moe_mark_dropped(indices, keep, 3, routed));
  EXPECT_EQ(to_cpu(routed).to_vector(), (std::vector<float>{0, 3, 2, 0}));
  Tensor wide = poisoned_gpu({2, 3}, DType::I32), floats = poisoned_gpu({2, 2}, DType::F32);
  Tensor host_routed = Tensor::empty({2, 2}, DType::I32);
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep, 0, routed), InternalError);
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep, 3, wide), InternalError);
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep, 3, floats), InternalError);
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep, 3, host_routed), InternalError);
  EXPECT_THROW(ops::moe_mark_dropped(indices, keep.view({4}), 3, routed), InternalError);
  Tensor aliased = indices.clone();
  EXPECT_THROW(ops::moe_mark_dropped(aliased, keep, 3, aliased), InternalError);
}

TEST_F(CudaMoeRouterTest, FillsMatchCpu) {
  const uint64_t seed = testing::test_seed() + 750;
  SCOPED_TRACE(seed_trace(seed));
  for (int64_t n : {1, 1000, 100003}) {
    SCOPED_TRACE("n " + std::to_string(n));
    Tensor ref = Tensor::empty({n});
    Tensor got = poisoned_gpu({n}, DType::F32);
    ops::fill_uniform(ref, -2.0f, 3.0f, seed, 17);
    ops::fill_uniform(got, -2.0f, 3.0f, seed, 17);
    EXPECT_TRUE(bitwise_equal(got, ref)) << "uniform";

    // Box-Muller in fp64 rounded to fp32: the GPU's fp64 log and cos are within an fp64
    // ulp of the CPU's, so an fp32 result may differ only where it rounds at a tie-edge:
    // at most one fp32 ulp, and rarely.
    ops::fill_normal(ref, seed + 1, 3);
    got = poisoned_gpu({n}, DType::F32);
    ops::fill_normal(got, seed + 1, 3);
    const Tensor host = to_cpu(got);
    int64_t differing = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float a = host.f32()[i], b = ref.f32()[i];
      if (a == b) continue;
      ++differing;
      ASSERT_TRUE(a == std::nextafter(b, INFINITY) || a == std::nextafter(b, -INFINITY))
          << "normal element " << i << ": " << a << " vs " << b;
    }
    EXPECT_LE(differing, std::max<int64_t>(1, n / 10000)) << "normal values not bitwise equal";
    // Different streams and seeds give different values.
    Tensor other = poisoned_gpu({n}, DType::F32);
    ops::fill_normal(other, seed + 1, 4);
    if (n > 1) {
      EXPECT_FALSE(bitwise_equal(other, got)) << "streams 3 and 4 agree";
    }
  }
}

TEST_F(CudaMoeRouterTest, MulMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 760;
  SCOPED_TRACE(seed_trace(seed));
  struct MulCase {
    DType y, x;
  };
  for (const MulCase& c : {MulCase{DType::F32, DType::F32}, MulCase{DType::BF16, DType::F32},
                           MulCase{DType::BF16, DType::BF16}, MulCase{DType::F16, DType::F32},
                           MulCase{DType::F16, DType::F16}}) {
    for (int64_t n : {1, 37, 100003}) {
      SCOPED_TRACE(std::string(dtype_name(c.y)) + " *= " + std::string(dtype_name(c.x)) + " n " +
                   std::to_string(n));
      const Tensor y = randn({n}, seed + uint64_t(n)).to(c.y);
      const Tensor x = randn({n}, seed + uint64_t(n) + 1).to(c.x);
      Tensor ref = y.clone();
      ops::mul_(ref, x);
      Tensor got = to_gpu(y);
      ops::mul_(got, to_gpu(x));
      EXPECT_TRUE(bitwise_equal(got, ref)) << "y";
    }
  }
}

}  // namespace
}  // namespace megaton
#endif  // MEGATON_WITH_CUDA
