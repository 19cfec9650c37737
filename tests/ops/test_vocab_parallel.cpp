// CPU vocab-parallel embedding and cross entropy: a random vocabulary split into shards
// (one, two and three, even and uneven), each shard run as a tensor-parallel rank would,
// and the shards' results combined as the TP reductions would; the combination must
// reproduce the full-vocabulary ops (embedding_forward/backward, cross_entropy_forward/
// backward).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::poison;
using testing::randint;
using testing::randn;

// fp32 CPU vs CPU (CONVENTIONS.md).
constexpr double kAtol = 1e-6, kRtol = 5e-6;

constexpr int64_t kVocab = 37;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

// A vocabulary split: rank r holds [start_r, start_r + size_r).
struct Shard {
  int64_t start, size;
};
using Split = std::vector<Shard>;

Split split_of(const std::vector<int64_t>& sizes) {
  Split split;
  int64_t start = 0;
  for (int64_t size : sizes) {
    split.push_back({start, size});
    start += size;
  }
  EXPECT_EQ(start, kVocab) << "a split must cover the vocabulary";
  return split;
}

// One rank (the full-vocabulary case), two ranks (uneven: 37 is odd), three ranks even-ish
// and very uneven, and a rank of a single row.
std::vector<Split> splits() {
  return {split_of({37}), split_of({19, 18}), split_of({13, 12, 12}), split_of({5, 25, 7}),
          split_of({1, 35, 1})};
}

std::string describe(const Split& split) {
  std::string s = "shards";
  for (const Shard& shard : split)
    s += " [" + std::to_string(shard.start) + ", " + std::to_string(shard.start + shard.size) + ")";
  return s;
}

// Columns [start, start + size) of x [T, V], as a [T, size] tensor of its own.
Tensor columns(const Tensor& x, const Shard& shard) {
  const int64_t T = x.dim(0), V = x.dim(1);
  Tensor out = Tensor::empty({T, shard.size});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < shard.size; ++v)
      out.f32()[t * shard.size + v] = x.f32()[t * V + shard.start + v];
  return out;
}

// The labels or ids every split boundary and both ends of the vocabulary, then random ones:
// each shard sees ids on both sides of its range.
Tensor global_ids(int64_t n, uint64_t seed) {
  Tensor ids = randint({n}, int32_t(kVocab), seed);
  const std::vector<int32_t> edges = {0, 36, 1, 35, 4, 5, 12, 13, 18, 19, 24, 25, 29, 30};
  for (size_t i = 0; i < edges.size() && int64_t(i) < n; ++i) ids.i32()[i] = edges[i];
  return ids;
}

Tensor poisoned(const Shape& shape) {
  Tensor t = Tensor::empty(shape);
  poison(t);
  return t;
}

// ------------------------------------------------------------------------ embedding

TEST(VocabParallelEmbedding, ShardOutputsSumToTheLookup) {
  const uint64_t seed = testing::test_seed() + 700;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t hidden = 6, B = 3, S = 7, T = B * S;
  Tensor table = randn({kVocab, hidden}, seed);
  Tensor ids = global_ids(T, seed + 1).view({B, S});  // [B, S] ids, [B, S, H] output
  Tensor ref = poisoned({B, S, hidden});
  ops::embedding_forward(ids, table, ref);
  for (const Split& split : splits()) {
    SCOPED_TRACE(describe(split));
    Tensor sum = Tensor::zeros({B, S, hidden});
    for (const Shard& shard : split) {
      Tensor shard_table = table.rows(shard.start, shard.size).clone();
      Tensor out = poisoned({B, S, hidden});
      ops::embedding_forward_vocab_range(ids, shard_table, shard.start, out);
      // Each row is this shard's table row or exactly zero.
      for (int64_t t = 0; t < T; ++t) {
        const int64_t id = ids.i32()[t];
        const bool mine = id >= shard.start && id < shard.start + shard.size;
        for (int64_t j = 0; j < hidden; ++j)
          ASSERT_EQ(out.f32()[t * hidden + j], mine ? table.f32()[id * hidden + j] : 0.0f)
              << "token " << t << " id " << id << " shard start " << shard.start;
      }
      ops::add_(sum, out);
    }
    EXPECT_TRUE(allclose(sum, ref, kAtol, kRtol));
  }
}

TEST(VocabParallelEmbedding, ShardGradientsConcatenateToTheGradient) {
  const uint64_t seed = testing::test_seed() + 710;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t hidden = 40, T = 29;  // hidden not a multiple of the CPU's 32-column blocks
  Tensor ids = global_ids(T, seed + 1);
  ids.i32()[20] = ids.i32()[21] = ids.i32()[22] = 13;  // a repeated id sums its tokens
  Tensor dout = randn({T, hidden}, seed + 2);
  // Main grads accumulate: start from nonzero values.
  Tensor dtable0 = randn({kVocab, hidden}, seed + 3);
  Tensor ref = dtable0.clone();
  ops::embedding_backward(dout, ids, ref);
  for (const Split& split : splits()) {
    SCOPED_TRACE(describe(split));
    for (const Shard& shard : split) {
      SCOPED_TRACE("shard start " + std::to_string(shard.start));
      Tensor dtable = dtable0.rows(shard.start, shard.size).clone();
      ops::embedding_backward_vocab_range(dout, ids, shard.start, dtable);
      EXPECT_TRUE(allclose(dtable, ref.rows(shard.start, shard.size), kAtol, kRtol));
    }
  }
}

TEST(VocabParallelEmbedding, ManyThreadsMatchOne) {
  // T * H >= 2^15: the OpenMP path, still equal to the full-vocabulary ops.
  const uint64_t seed = testing::test_seed() + 720;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t hidden = 512, T = 100;
  Tensor table = randn({kVocab, hidden}, seed);
  Tensor ids = global_ids(T, seed + 1);
  Tensor dout = randn({T, hidden}, seed + 2);
  Tensor ref_out = poisoned({T, hidden}), ref_dtable = Tensor::zeros({kVocab, hidden});
  ops::embedding_forward(ids, table, ref_out);
  ops::embedding_backward(dout, ids, ref_dtable);
  const Split split = split_of({19, 18});
  Tensor sum = Tensor::zeros({T, hidden});
  for (const Shard& shard : split) {
    Tensor out = poisoned({T, hidden});
    ops::embedding_forward_vocab_range(ids, table.rows(shard.start, shard.size).clone(),
                                       shard.start, out);
    ops::add_(sum, out);
    Tensor dtable = Tensor::zeros({shard.size, hidden});
    ops::embedding_backward_vocab_range(dout, ids, shard.start, dtable);
    EXPECT_TRUE(allclose(dtable, ref_dtable.rows(shard.start, shard.size), kAtol, kRtol));
  }
  EXPECT_TRUE(allclose(sum, ref_out, kAtol, kRtol));
}

// ------------------------------------------------------------------------ cross entropy

// Logits whose shards have very different maxima, so the rescale matters: N(0, 2) values,
// one row lifted by 1000 and one lowered by 1000 (a naive exp would overflow), and one row
// whose first columns sit 30 below the rest.
Tensor cross_entropy_logits(int64_t T, int64_t V, uint64_t seed) {
  Tensor logits = randn({T, V}, seed, 2.0f);
  for (int64_t v = 0; v < V; ++v) {
    logits.f32()[1 * V + v] += 1000.0f;
    logits.f32()[2 * V + v] -= 1000.0f;
    if (v < 10) logits.f32()[3 * V + v] -= 30.0f;
  }
  return logits;
}

// Each shard's partial statistics against an fp64 computation on its columns.
void expect_partial_stats(const Tensor& shard_logits, const Tensor& labels, const Shard& shard,
                          const Tensor& row_max, const Tensor& sum_exp,
                          const Tensor& target_logit) {
  const int64_t T = shard_logits.dim(0), V = shard.size;
  Tensor want_max = Tensor::empty({T}), want_sum = Tensor::empty({T});
  for (int64_t t = 0; t < T; ++t) {
    const float* row = shard_logits.f32() + t * V;
    const float m = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - double(m));
    want_max.f32()[t] = m;
    want_sum.f32()[t] = float(sum);
    const int64_t local = int64_t(labels.i32()[t]) - shard.start;
    const float want_target = local >= 0 && local < V ? row[local] : 0.0f;
    ASSERT_EQ(target_logit.f32()[t], want_target) << "target logit of token " << t;
  }
  EXPECT_TRUE(allclose(row_max, want_max, 0, 0)) << "row_max";
  EXPECT_TRUE(allclose(sum_exp, want_sum, kAtol, kRtol)) << "sum_exp";
}

TEST(VocabParallelCrossEntropy, CombinedShardsMatchTheFullVocabulary) {
  const uint64_t seed = testing::test_seed() + 730;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 17;
  Tensor logits = cross_entropy_logits(T, kVocab, seed);
  Tensor labels = global_ids(T, seed + 1);
  Tensor ref_losses = poisoned({T}), ref_lse = poisoned({T});
  ops::cross_entropy_forward(logits, labels, ref_losses, ref_lse);

  for (const Split& split : splits()) {
    SCOPED_TRACE(describe(split));
    const size_t n = split.size();
    // Per rank: partial statistics; then the MAX "all-reduce" of row_max.
    std::vector<Tensor> row_max(n), sum_exp(n), target(n);
    Tensor global_max = Tensor::empty({T});
    global_max.fill(-std::numeric_limits<float>::infinity());
    for (size_t r = 0; r < n; ++r) {
      SCOPED_TRACE("shard start " + std::to_string(split[r].start));
      Tensor shard_logits = columns(logits, split[r]);
      row_max[r] = poisoned({T});
      sum_exp[r] = poisoned({T});
      target[r] = poisoned({T});
      ops::cross_entropy_partial_stats(shard_logits, labels, split[r].start, row_max[r], sum_exp[r],
                                       target[r]);
      expect_partial_stats(shard_logits, labels, split[r], row_max[r], sum_exp[r], target[r]);
      for (int64_t t = 0; t < T; ++t)
        global_max.f32()[t] = std::max(global_max.f32()[t], row_max[r].f32()[t]);
    }
    // Per rank: rescale to the global max; then the SUM "all-reduces".
    Tensor total_sum_exp = Tensor::zeros({T}), total_target = Tensor::zeros({T});
    for (size_t r = 0; r < n; ++r) {
      Tensor rescaled = sum_exp[r].clone();
      ops::cross_entropy_rescale_sum_exp(row_max[r], global_max, rescaled);
      for (int64_t t = 0; t < T; ++t) {
        const double factor = std::exp(double(row_max[r].f32()[t]) - global_max.f32()[t]);
        EXPECT_NEAR(rescaled.f32()[t], sum_exp[r].f32()[t] * factor,
                    kAtol + kRtol * sum_exp[r].f32()[t] * factor)
            << "rescaled sum_exp of token " << t;
      }
      ops::add_(total_sum_exp, rescaled);
      ops::add_(total_target, target[r]);
    }
    for (int64_t t = 0; t < T; ++t)
      ASSERT_EQ(total_target.f32()[t], logits.f32()[t * kVocab + labels.i32()[t]]);

    Tensor losses = poisoned({T}), lse = poisoned({T});
    ops::cross_entropy_finish(global_max, total_sum_exp, total_target, losses, lse);
    // lse near +-1000 (rows 1 and 2) is exact to an fp32 ulp there (6e-5): the relative
    // tolerance covers it.
    EXPECT_TRUE(allclose(lse, ref_lse, kAtol, kRtol)) << "lse";
    EXPECT_TRUE(allclose(losses, ref_losses, kAtol, kRtol)) << "losses";
  }
}

TEST(VocabParallelCrossEntropy, ShardGradientsConcatenateToTheGradient) {
  const uint64_t seed = testing::test_seed() + 740;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 17;
  Tensor logits = cross_entropy_logits(T, kVocab, seed);
  Tensor labels = global_ids(T, seed + 1);
  Tensor dlosses = randn({T}, seed + 2);
  Tensor losses = poisoned({T}), lse = poisoned({T});
  ops::cross_entropy_forward(logits, labels, losses, lse);
  Tensor ref = poisoned({T, kVocab});
  ops::cross_entropy_backward(dlosses, logits, labels, lse, ref);

  for (const Split& split : splits()) {
    SCOPED_TRACE(describe(split));
    for (const Shard& shard : split) {
      SCOPED_TRACE("shard start " + std::to_string(shard.start));
      Tensor shard_logits = columns(logits, shard);
      Tensor dlogits = poisoned({T, shard.size});
      ops::cross_entropy_backward_vocab_range(dlosses, shard_logits, labels, lse, shard.start,
                                              dlogits);
      EXPECT_TRUE(allclose(dlogits, columns(ref, shard), kAtol, kRtol));
      // In place over the logits shard (as the model runs it): the same values.
      Tensor in_place = shard_logits.clone();
      ops::cross_entropy_backward_vocab_range(dlosses, in_place, labels, lse, shard.start,
                                              in_place);
      EXPECT_TRUE(allclose(in_place, dlogits, 0, 0)) << "in place";
    }
  }
}

TEST(VocabParallelCrossEntropy, ManyThreadsMatchTheFullVocabulary) {
  // T * V_local >= 2^15: the OpenMP paths.
  const uint64_t seed = testing::test_seed() + 750;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 11, V = 8192;
  Tensor logits = cross_entropy_logits(T, V, seed);
  Tensor labels = randint({T}, int32_t(V), seed + 1);
  labels.i32()[0] = 4095;
  labels.i32()[1] = 4096;
  Tensor dlosses = randn({T}, seed + 2);
  Tensor ref_losses = poisoned({T}), ref_lse = poisoned({T}), ref_dlogits = poisoned({T, V});
  ops::cross_entropy_forward(logits, labels, ref_losses, ref_lse);
  ops::cross_entropy_backward(dlosses, logits, labels, ref_lse, ref_dlogits);
  const Split split = {{0, 4096}, {4096, 4096}};
  std::vector<Tensor> row_max, sum_exp, target;
  Tensor global_max = Tensor::empty({T});
  global_max.fill(-std::numeric_limits<float>::infinity());
  for (const Shard& shard : split) {
    row_max.push_back(poisoned({T}));
    sum_exp.push_back(poisoned({T}));
    target.push_back(poisoned({T}));
    ops::cross_entropy_partial_stats(columns(logits, shard), labels, shard.start, row_max.back(),
                                     sum_exp.back(), target.back());
    for (int64_t t = 0; t < T; ++t)
      global_max.f32()[t] = std::max(global_max.f32()[t], row_max.back().f32()[t]);
  }
  Tensor total_sum_exp = Tensor::zeros({T}), total_target = Tensor::zeros({T});
  for (size_t r = 0; r < split.size(); ++r) {
    ops::cross_entropy_rescale_sum_exp(row_max[r], global_max, sum_exp[r]);
    ops::add_(total_sum_exp, sum_exp[r]);
    ops::add_(total_target, target[r]);
  }
  Tensor losses = poisoned({T}), lse = poisoned({T});
  ops::cross_entropy_finish(global_max, total_sum_exp, total_target, losses, lse);
  EXPECT_TRUE(allclose(lse, ref_lse, kAtol, kRtol)) << "lse";
  EXPECT_TRUE(allclose(losses, ref_losses, kAtol, kRtol)) << "losses";
  for (const Shard& shard : split) {
    Tensor dlogits = poisoned({T, shard.size});
    ops::cross_entropy_backward_vocab_range(dlosses, columns(logits, shard), labels, lse,
                                            shard.start, dlogits);
    EXPECT_TRUE(allclose(dlogits, columns(ref_dlogits, shard), kAtol, kRtol));
  }
}

TEST(VocabParallelCrossEntropy, RescaleKeepsTheMaximumRanksSum) {
  // Where a rank's max is the global max its sum is unchanged, also for -inf maxima (an
  // all -inf row would give exp(-inf - -inf) = NaN); below it, the sum shrinks by exp.
  const float inf = std::numeric_limits<float>::infinity();
  Tensor row_max = Tensor::from({3}, {2.5f, -inf, 1.0f});
  Tensor global_max = Tensor::from({3}, {2.5f, -inf, 3.0f});
  Tensor sum_exp = Tensor::from({3}, {4.0f, 0.0f, 2.0f});
  ops::cross_entropy_rescale_sum_exp(row_max, global_max, sum_exp);
  EXPECT_EQ(sum_exp.f32()[0], 4.0f);
  EXPECT_EQ(sum_exp.f32()[1], 0.0f);
  EXPECT_NEAR(sum_exp.f32()[2], 2.0 * std::exp(-2.0), 1e-6);
}

// ------------------------------------------------------------------------ door checks

TEST(VocabParallel, DoorChecksThrowInternalError) {
  Tensor ids = Tensor::from_i32({3}, {0, 5, 9});
  Tensor table = Tensor::zeros({4, 6});
  Tensor out = Tensor::zeros({3, 6});
  // Embedding: wrong dtypes, shapes, a negative vocab_start or id.
  EXPECT_THROW(ops::embedding_forward_vocab_range(Tensor::zeros({3}), table, 0, out),
               InternalError);
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, table.to(DType::BF16), 0, out),
               InternalError);
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, Tensor::zeros({24}), 0, out), InternalError);
  Tensor out_wide = Tensor::zeros({3, 7}), out_long = Tensor::zeros({4, 6});
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, table, 0, out_wide), InternalError);
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, table, 0, out_long), InternalError);
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, table, -1, out), InternalError);
  Tensor negative_ids = Tensor::from_i32({3}, {0, -1, 9});
  EXPECT_THROW(ops::embedding_forward_vocab_range(negative_ids, table, 0, out), InternalError);
  Tensor dtable = Tensor::zeros({4, 6});
  EXPECT_THROW(ops::embedding_backward_vocab_range(out_wide, ids, 0, dtable), InternalError);
  EXPECT_THROW(ops::embedding_backward_vocab_range(out, ids, 0, out_wide), InternalError);
  EXPECT_THROW(ops::embedding_backward_vocab_range(out.to(DType::BF16), ids, 0, dtable),
               InternalError);
  EXPECT_THROW(ops::embedding_backward_vocab_range(out, negative_ids, 0, dtable), InternalError);
  EXPECT_THROW(ops::embedding_backward_vocab_range(out, ids, -3, dtable), InternalError);
  // An id beyond this shard (or the vocabulary, which a shard does not know) is not an error.
  EXPECT_NO_THROW(ops::embedding_forward_vocab_range(ids, table, 4, out));
  EXPECT_NO_THROW(ops::embedding_backward_vocab_range(out, ids, 100, dtable));

  // Cross entropy statistics.
  const int64_t T = 3;
  Tensor logits = randn({T, 5}, 1);
  Tensor labels = Tensor::from_i32({T}, {0, 7, 12});
  Tensor a = Tensor::zeros({T}), b = Tensor::zeros({T}), c = Tensor::zeros({T});
  Tensor wrong_len = Tensor::zeros({T + 1}), wrong_dtype = Tensor::zeros({T}, DType::I32);
  EXPECT_NO_THROW(ops::cross_entropy_partial_stats(logits, labels, 5, a, b, c));
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits.to(DType::BF16), labels, 5, a, b, c),
               InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits.view({15}), labels, 5, a, b, c),
               InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(Tensor::zeros({T, 0}), labels, 5, a, b, c),
               InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, Tensor::zeros({T}), 5, a, b, c),
               InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, Tensor::from_i32({2}, {0, 1}), 5, a, b, c),
               InternalError);
  EXPECT_THROW(
      ops::cross_entropy_partial_stats(logits, Tensor::from_i32({T}, {0, -2, 1}), 5, a, b, c),
      InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, labels, -5, a, b, c), InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, labels, 5, wrong_len, b, c), InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, labels, 5, a, wrong_dtype, c),
               InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, labels, 5, a, b, wrong_len), InternalError);
  EXPECT_THROW(ops::cross_entropy_rescale_sum_exp(a, wrong_len, b), InternalError);
  EXPECT_THROW(ops::cross_entropy_rescale_sum_exp(wrong_dtype, a, b), InternalError);
  EXPECT_THROW(ops::cross_entropy_rescale_sum_exp(a, b, wrong_dtype), InternalError);
  Tensor losses = Tensor::zeros({T}), lse = Tensor::zeros({T});
  EXPECT_THROW(ops::cross_entropy_finish(a, b, wrong_len, losses, lse), InternalError);
  EXPECT_THROW(ops::cross_entropy_finish(wrong_len, b, c, losses, lse), InternalError);
  EXPECT_THROW(ops::cross_entropy_finish(a, b, c, wrong_dtype, lse), InternalError);
  EXPECT_THROW(ops::cross_entropy_finish(a, b, c, losses, wrong_len), InternalError);

  // Cross entropy backward.
  Tensor dlosses = randn({T}, 2), dlogits = Tensor::zeros({T, 5});
  Tensor lse_ok = randn({T}, 3);
  EXPECT_NO_THROW(
      ops::cross_entropy_backward_vocab_range(dlosses, logits, labels, lse_ok, 5, dlogits));
  Tensor dlogits_wide = Tensor::zeros({T, 6}), dlogits_bf16 = dlogits.to(DType::BF16);
  EXPECT_THROW(
      ops::cross_entropy_backward_vocab_range(dlosses, logits, labels, lse_ok, 5, dlogits_wide),
      InternalError);
  EXPECT_THROW(
      ops::cross_entropy_backward_vocab_range(dlosses, logits, labels, lse_ok, 5, dlogits_bf16),
      InternalError);
  EXPECT_THROW(
      ops::cross_entropy_backward_vocab_range(wrong_len, logits, labels, lse_ok, 5, dlogits),
      InternalError);
  EXPECT_THROW(
      ops::cross_entropy_backward_vocab_range(dlosses, logits, labels, wrong_dtype, 5, dlogits),
      InternalError);
  EXPECT_THROW(ops::cross_entropy_backward_vocab_range(
                   dlosses, logits, Tensor::from_i32({T}, {0, 1, -1}), lse_ok, 5, dlogits),
               InternalError);
  EXPECT_THROW(
      ops::cross_entropy_backward_vocab_range(dlosses, logits, labels, lse_ok, -1, dlogits),
      InternalError);
}

}  // namespace
}  // namespace megaton
