// Tests of the MoE ops: top-k softmax routing, the aux load-balancing loss, and token
// permutation by expert.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
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

// Finite differences of fp32 forwards with eps = 1e-2: truncation O(eps^2) ~ 1e-4
// relative, fp32 rounding of the loss / (2 eps) ~ 1e-5 absolute; an order of magnitude
// of headroom above both.
constexpr double kFdAtol = 1e-3, kFdRtol = 1e-2;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

// Router logits [T, E] whose entries within a row are at least 0.2 apart, so a
// finite-difference step of 1e-2 never changes the top-k selection: each row is a random
// permutation of 0.3 * e plus jitter in [0, 0.1).
Tensor separated_logits(int64_t T, int64_t E, uint64_t seed) {
  Tensor t = Tensor::empty({T, E});
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> jitter(0.0f, 0.1f);
  std::vector<int> perm(E);
  for (int64_t r = 0; r < T; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), gen);
    for (int64_t e = 0; e < E; ++e) t.f32()[r * E + e] = 0.3f * float(perm[e]) - 1.0f + jitter(gen);
  }
  return t;
}

std::vector<double> softmax(const float* x, int64_t n) {
  double mx = *std::max_element(x, x + n), sum = 0;
  std::vector<double> y(n);
  for (int64_t i = 0; i < n; ++i) sum += (y[i] = std::exp(double(x[i]) - mx));
  for (double& v : y) v /= sum;
  return y;
}

// Expert ids of a row sorted by descending value, ties to the lower id.
std::vector<int32_t> ranked(const std::vector<double>& values) {
  std::vector<int32_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return values[a] > values[b]; });
  return order;
}

// ---------------------------------------------------------------------------------------
// Top-k softmax routing

TEST(MoeTopkSoftmax, ForwardMatchesReferenceBothWays) {
  const uint64_t seed = testing::test_seed() + 100;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 23, E = 8;
  const int k = 3;
  Tensor logits = randn({T, E}, seed, 2.0f);
  for (bool pre_softmax : {false, true}) {
    SCOPED_TRACE(pre_softmax ? "pre_softmax" : "softmax after top-k");
    Tensor probs = Tensor::empty({T, k}), indices = Tensor::empty({T, k}, DType::I32);
    poison(probs);
    indices.fill(-7);
    ops::moe_topk_softmax_forward(logits, k, pre_softmax, probs, indices);
    for (int64_t t = 0; t < T; ++t) {
      const float* row = logits.f32() + t * E;
      std::vector<double> all = softmax(row, E);
      std::vector<int32_t> order = ranked(std::vector<double>(row, row + E));
      std::vector<float> chosen_logits;
      for (int j = 0; j < k; ++j) chosen_logits.push_back(row[order[j]]);
      std::vector<double> chosen_softmax = softmax(chosen_logits.data(), k);
      double sum = 0, unchosen = 1;
      for (int j = 0; j < k; ++j) {
        unchosen -= all[order[j]];
        ASSERT_EQ(indices.i32()[t * k + j], order[j]) << "token " << t << " slot " << j;
        const double want = pre_softmax ? all[order[j]] : chosen_softmax[j];
        EXPECT_NEAR(probs.f32()[t * k + j], want, 1e-6 + 5e-6 * want);
        sum += probs.f32()[t * k + j];
      }
      // Renormalised over the chosen k without pre-softmax; with it, the chosen part of
      // the full softmax, missing the unchosen experts' mass (k < E).
      if (pre_softmax)
        EXPECT_NEAR(sum, 1.0 - unchosen, 1e-6);
      else
        EXPECT_NEAR(sum, 1.0, 1e-6);
    }
  }
}

TEST(MoeTopkSoftmax, TiesGoToLowerExpertIndex) {
  // Row 0: experts 1, 2 and 4 tie for first place. Row 1: everything ties.
  Tensor logits = Tensor::from({2, 5}, {1, 3, 3, 0, 3, /**/ 2, 2, 2, 2, 2});
  for (bool pre_softmax : {false, true}) {
    Tensor probs = Tensor::empty({2, 2}), indices = Tensor::empty({2, 2}, DType::I32);
    ops::moe_topk_softmax_forward(logits, 2, pre_softmax, probs, indices);
    EXPECT_EQ(indices.i32()[0], 1);
    EXPECT_EQ(indices.i32()[1], 2);
    EXPECT_EQ(indices.i32()[2], 0);
    EXPECT_EQ(indices.i32()[3], 1);
    const double e3 = std::exp(3.0);
    const float want_row0 = pre_softmax ? float(e3 / (3 * e3 + std::exp(1.0) + 1)) : 0.5f;
    EXPECT_NEAR(probs.f32()[0], want_row0, 1e-6);
    EXPECT_NEAR(probs.f32()[2], pre_softmax ? 0.2f : 0.5f, 1e-6);
  }
}

TEST(MoeTopkSoftmax, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 101;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 6, E = 7;
  for (int k : {1, 2, 3}) {
    for (bool pre_softmax : {false, true}) {
      SCOPED_TRACE("k " + std::to_string(k) + (pre_softmax ? " pre_softmax" : ""));
      Tensor logits = separated_logits(T, E, seed + k);
      Tensor w = randn({T, k}, seed + 7);
      Tensor probs = Tensor::empty({T, k}), indices = Tensor::empty({T, k}, DType::I32);
      Tensor fd = finite_difference(logits, [&] {
        ops::moe_topk_softmax_forward(logits, k, pre_softmax, probs, indices);
        return dot(w, probs);
      });
      ops::moe_topk_softmax_forward(logits, k, pre_softmax, probs, indices);
      Tensor dlogits = Tensor::empty({T, E});
      poison(dlogits);
      ops::moe_topk_softmax_backward(w, logits, probs, indices, pre_softmax, dlogits);
      EXPECT_TRUE(allclose(dlogits, fd, kFdAtol, kFdRtol));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Aux load-balancing loss

TEST(MoeAuxLoss, ForwardMatchesHandComputedReference) {
  const uint64_t seed = testing::test_seed() + 110;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 37, E = 6;
  const int k = 2;
  const float coeff = 0.01f;
  Tensor logits = randn({T, E}, seed, 1.5f);
  Tensor scores = Tensor::empty({T, E}), tokens_per_expert = Tensor::empty({E});
  poison(scores);
  poison(tokens_per_expert);
  const float aux = ops::moe_aux_loss_forward(logits, k, coeff, scores, tokens_per_expert);

  std::vector<double> score_sum(E, 0.0), count(E, 0.0);
  Tensor ref_scores = Tensor::empty({T, E});
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s = softmax(logits.f32() + t * E, E);
    std::vector<int32_t> order = ranked(s);
    for (int j = 0; j < k; ++j) count[order[j]] += 1;
    for (int64_t e = 0; e < E; ++e) {
      score_sum[e] += s[e];
      ref_scores.f32()[t * E + e] = float(s[e]);
    }
  }
  // switch_load_balancing_loss_func: coeff * E / (k * T^2) * sum_e (sum_t p) * n_e.
  double ref_aux = 0;
  for (int64_t e = 0; e < E; ++e) ref_aux += score_sum[e] * count[e];
  ref_aux *= double(coeff) * E / (double(k) * T * T);

  EXPECT_NEAR(aux, ref_aux, 1e-6 * ref_aux);
  EXPECT_TRUE(allclose(scores, ref_scores, 1e-6, 5e-6));
  double total = 0;
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(tokens_per_expert.f32()[e], float(count[e])) << "expert " << e;
    total += tokens_per_expert.f32()[e];
  }
  EXPECT_EQ(total, double(T * k));
  // Uniform scores give aux = coeff whatever the routing: sum_t p[t, e] = T / E for every
  // expert and sum_e n_e = T k.
  Tensor uniform = Tensor::zeros({T, E});
  const float aux_uniform = ops::moe_aux_loss_forward(uniform, k, coeff, scores, tokens_per_expert);
  EXPECT_NEAR(aux_uniform, coeff, 1e-6 * coeff);
}

TEST(MoeAuxLoss, BackwardMatchesFiniteDifferencesAndAccumulates) {
  const uint64_t seed = testing::test_seed() + 111;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 9, E = 5;
  const int k = 2;
  // coeff = 1 and grad_scale = 0.5 keep the loss O(1) so fp32 rounding stays small.
  const float coeff = 1.0f, grad_scale = 0.5f;
  // Separated logits: top-k never flips within +-eps, so the routing map (and with it
  // tokens_per_expert, a constant in Megatron's gradient) is the same in every forward
  // of the finite differences.
  Tensor logits = separated_logits(T, E, seed);
  Tensor scores = Tensor::empty({T, E}), tokens_per_expert = Tensor::empty({E});
  ops::moe_aux_loss_forward(logits, k, coeff, scores, tokens_per_expert);
  const Tensor counts = tokens_per_expert.clone();
  Tensor fd = finite_difference(logits, [&] {
    double aux = ops::moe_aux_loss_forward(logits, k, coeff, scores, tokens_per_expert);
    EXPECT_TRUE(allclose(tokens_per_expert, counts, 0, 0)) << "routing changed under fd";
    return grad_scale * aux;
  });
  ops::moe_aux_loss_forward(logits, k, coeff, scores, tokens_per_expert);
  Tensor initial = randn({T, E}, seed + 1);
  Tensor dlogits = initial.clone();
  ops::moe_aux_loss_backward(grad_scale, scores, tokens_per_expert, k, coeff, dlogits);
  for (int64_t i = 0; i < dlogits.numel(); ++i) dlogits.f32()[i] -= initial.f32()[i];
  EXPECT_TRUE(allclose(dlogits, fd, kFdAtol, kFdRtol));
}

// ---------------------------------------------------------------------------------------
// Permutation

struct Permuted {
  Tensor permuted, row_id_map, tokens_per_expert;
};

Permuted permute(const Tensor& x, const Tensor& indices, int E) {
  const int64_t copies = indices.numel();
  Permuted p{Tensor::empty({copies, x.dim(1)}), Tensor::empty({copies}, DType::I32),
             Tensor::empty({E}, DType::I64)};
  poison(p.permuted);
  p.row_id_map.fill(-1);
  p.tokens_per_expert.fill(-1);
  ops::moe_permute(x, indices, E, p.permuted, p.row_id_map, p.tokens_per_expert);
  return p;
}

TEST(MoePermute, HandWorkedExample) {
  // T = 3 tokens, k = 2, E = 4; expert 3 receives nothing.
  Tensor x = Tensor::from({3, 2}, {10, 11, 20, 21, 30, 31});
  Tensor indices = Tensor::from_i32({3, 2}, {1, 0, 1, 2, 0, 1});
  Permuted p = permute(x, indices, 4);
  // expert 0: copies 1 (t0), 4 (t2); expert 1: copies 0 (t0), 2 (t1), 5 (t2); expert 2: 3.
  const std::vector<int32_t> want_map = {1, 4, 0, 2, 5, 3};
  const std::vector<int64_t> want_counts = {2, 3, 1, 0};
  for (int r = 0; r < 6; ++r) EXPECT_EQ(p.row_id_map.i32()[r], want_map[r]) << "row " << r;
  for (int e = 0; e < 4; ++e) EXPECT_EQ(p.tokens_per_expert.i64()[e], want_counts[e]);
  const std::vector<float> want_rows = {10, 11, 30, 31, 10, 11, 20, 21, 30, 31, 20, 21};
  EXPECT_TRUE(allclose(p.permuted, Tensor::from({6, 2}, want_rows), 0, 0));
}

TEST(MoePermute, GroupsByExpertStablyAndRoundTrips) {
  const uint64_t seed = testing::test_seed() + 120;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 41, H = 13;
  const int k = 3, E = 7;
  // Distinct experts per token (as top-k gives), never expert 4.
  Tensor indices = Tensor::empty({T, k}, DType::I32);
  std::mt19937_64 gen(seed);
  std::vector<int32_t> allowed = {0, 1, 2, 3, 5, 6};
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(allowed.begin(), allowed.end(), gen);
    for (int j = 0; j < k; ++j) indices.i32()[t * k + j] = allowed[j];
  }
  Tensor x = randn({T, H}, seed + 1);
  Permuted p = permute(x, indices, E);

  // Counts per expert, zero for expert 4, summing to T * k.
  std::vector<int64_t> counts(E, 0);
  for (int64_t i = 0; i < T * k; ++i) ++counts[indices.i32()[i]];
  EXPECT_EQ(counts[4], 0);
  for (int e = 0; e < E; ++e) EXPECT_EQ(p.tokens_per_expert.i64()[e], counts[e]) << "expert " << e;

  // Row r belongs to the expert whose segment contains it; copies inside a segment
  // ascend (stable token order); every copy appears once; rows hold their token.
  std::vector<bool> seen(T * k, false);
  int64_t r = 0;
  for (int e = 0; e < E; ++e) {
    int32_t previous = -1;
    for (int64_t n = 0; n < counts[e]; ++n, ++r) {
      const int32_t copy = p.row_id_map.i32()[r];
      ASSERT_GE(copy, 0);
      ASSERT_LT(copy, T * k);
      EXPECT_FALSE(seen[copy]);
      seen[copy] = true;
      EXPECT_EQ(indices.i32()[copy], e) << "row " << r;
      EXPECT_GT(copy, previous) << "row " << r;
      previous = copy;
      const int64_t token = copy / k;
      for (int64_t c = 0; c < H; ++c)
        ASSERT_EQ(p.permuted.f32()[r * H + c], x.f32()[token * H + c]) << "row " << r;
    }
  }

  // Round trip: unpermute(permute(x)) = x * sum_j probs[t, j].
  Tensor probs = testing::randn({T, k}, seed + 2);
  Tensor out = Tensor::empty({T, H});
  poison(out);
  ops::moe_unpermute(p.permuted, p.row_id_map, probs, out);
  Tensor want = Tensor::empty({T, H});
  for (int64_t t = 0; t < T; ++t) {
    double s = 0;
    for (int j = 0; j < k; ++j) s += probs.f32()[t * k + j];
    for (int64_t c = 0; c < H; ++c) want.f32()[t * H + c] = float(s * x.f32()[t * H + c]);
  }
  EXPECT_TRUE(allclose(out, want, 1e-6, 5e-6));
}

TEST(MoePermute, BackwardsMatchFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 130;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 6, H = 5;
  const int k = 2, E = 4;
  Tensor indices = Tensor::from_i32({T, k}, {3, 1, 1, 0, 0, 3, 1, 3, 3, 0, 1, 0});
  Tensor x = randn({T, H}, seed);
  Permuted p = permute(x, indices, E);

  // permute: d/dx of dot(w, permuted(x)).
  Tensor w = randn({T * k, H}, seed + 1);
  Tensor fd_x = finite_difference(x, [&] {
    Permuted q = permute(x, indices, E);
    return dot(w, q.permuted);
  });
  Tensor dx = Tensor::empty({T, H});
  poison(dx);
  ops::moe_permute_backward(w, p.row_id_map, k, dx);
  EXPECT_TRUE(allclose(dx, fd_x, kFdAtol, kFdRtol));

  // unpermute: d/d(expert_out) and d/d(probs) of dot(g, unpermute(expert_out, probs)).
  Tensor expert_out = randn({T * k, H}, seed + 2);
  Tensor probs = randn({T, k}, seed + 3);
  Tensor g = randn({T, H}, seed + 4);
  Tensor out = Tensor::empty({T, H});
  auto loss = [&] {
    ops::moe_unpermute(expert_out, p.row_id_map, probs, out);
    return dot(g, out);
  };
  Tensor fd_expert_out = finite_difference(expert_out, loss);
  Tensor fd_probs = finite_difference(probs, loss);
  Tensor dexpert_out = Tensor::empty({T * k, H}), dprobs = Tensor::empty({T, k});
  poison(dexpert_out);
  poison(dprobs);
  ops::moe_unpermute_backward(g, expert_out, p.row_id_map, probs, dexpert_out, dprobs);
  EXPECT_TRUE(allclose(dexpert_out, fd_expert_out, kFdAtol, kFdRtol));
  EXPECT_TRUE(allclose(dprobs, fd_probs, kFdAtol, kFdRtol));
}

TEST(MoePermute, RejectsBadInputs) {
  Tensor x = randn({2, 3}, 1);
  Tensor indices = Tensor::from_i32({2, 2}, {0, 4, 1, 2});  // 4 >= E
  Tensor permuted = Tensor::empty({4, 3}), row_id_map = Tensor::empty({4}, DType::I32),
         tokens_per_expert = Tensor::empty({4}, DType::I64);
  EXPECT_THROW(ops::moe_permute(x, indices, 4, permuted, row_id_map, tokens_per_expert),
               InternalError);
  Tensor repeated = Tensor::from_i32({4}, {0, 1, 1, 3});  // not a permutation
  Tensor dx = Tensor::empty({2, 3});
  EXPECT_THROW(ops::moe_permute_backward(permuted, repeated, 2, dx), InternalError);
}

}  // namespace
}  // namespace megaton
