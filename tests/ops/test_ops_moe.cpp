// Tests of the MoE token permutation by expert, of the padding of expert inputs per
// group, and of the experts' grouped GEMMs with the tokens per expert in a tensor (the
// router ops: test_ops_moe_router*.cpp; the GPU grouped GEMMs: test_cuda_gemm_gpu.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
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

// ---------------------------------------------------------------------------------------
// Chunks put in a new order (the all-to-all dispatcher's regrouping)

TEST(MoeSortChunks, HandWorkedExample) {
  // Chunks of 2, 0, 1 and 2 rows (rows 0-1, none, 2, 3-4) in the order 3, 1, 0, 2.
  Tensor src = Tensor::from({5, 2}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  Tensor dst = Tensor::empty({5, 2});
  poison(dst);
  ops::moe_sort_chunks(src, {2, 0, 1, 2}, {3, 1, 0, 2}, dst);
  EXPECT_TRUE(allclose(dst, Tensor::from({5, 2}, {7, 8, 9, 10, 1, 2, 3, 4, 5, 6}), 0, 0));
  // Any dtype: int32 rows of 3.
  Tensor ids = Tensor::from_i32({3, 3}, {0, 1, 2, 10, 11, 12, 20, 21, 22});
  Tensor sorted = Tensor::empty({3, 3}, DType::I32);
  ops::moe_sort_chunks(ids, {1, 2}, {1, 0}, sorted);
  const std::vector<int32_t> want = {10, 11, 12, 20, 21, 22, 0, 1, 2};
  EXPECT_EQ(std::vector<int32_t>(sorted.i32(), sorted.i32() + 9), want);
}

TEST(MoeSortChunks, RejectsBadChunksAndOrders) {
  Tensor src = randn({5, 2}, 7), dst = Tensor::empty({5, 2});
  Tensor narrow = Tensor::empty({5, 3});
  EXPECT_THROW(ops::moe_sort_chunks(src, {2, 3}, {1, 0}, narrow), InternalError);
  EXPECT_THROW(ops::moe_sort_chunks(src, {2, 2}, {1, 0}, dst), InternalError);   // sums to 4
  EXPECT_THROW(ops::moe_sort_chunks(src, {6, -1}, {1, 0}, dst), InternalError);  // negative
  EXPECT_THROW(ops::moe_sort_chunks(src, {2, 3}, {1, 1}, dst), InternalError);   // repeated
  EXPECT_THROW(ops::moe_sort_chunks(src, {2, 3}, {0, 2}, dst), InternalError);   // outside
  EXPECT_THROW(ops::moe_sort_chunks(src, {2, 3}, {0}, dst), InternalError);      // too short
}

// ---------------------------------------------------------------------------------------
// Padding per group (--moe-pad-expert-input-to-capacity; FP8 GEMM tiles)

TEST(MoePadRows, HandWorkedExample) {
  // Groups of 2, 0 and 3 rows padded to 3 rows each.
  Tensor rows = Tensor::from({5, 2}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  const std::vector<int64_t> groups = {2, 0, 3}, capacity = {3, 3, 3};
  Tensor padded = Tensor::empty({9, 2});
  poison(padded);
  ops::moe_pad_rows(rows, groups, capacity, padded);
  const std::vector<float> want = {1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 5, 6, 7, 8, 9, 10};
  EXPECT_TRUE(allclose(padded, Tensor::from({9, 2}, want), 0, 0));
  // Unpadding reads the groups' rows only: NaN padding rows do not reach the result.
  for (int64_t r : {2, 3, 4, 5}) padded.rows(r, 1).fill(NAN);
  Tensor back = Tensor::empty({5, 2});
  poison(back);
  ops::moe_unpad_rows(padded, groups, capacity, back);
  EXPECT_TRUE(allclose(back, rows, 0, 0));
}

TEST(MoePadRows, HandWorkedUnequalPadding) {
  // Groups of 2, 0, 3, 0 and 1 rows padded to 4, 2, 3 (none), 0 (none, empty) and 1 (none).
  Tensor rows = Tensor::from({6, 2}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  const std::vector<int64_t> groups = {2, 0, 3, 0, 1}, padded_rows = {4, 2, 3, 0, 1};
  Tensor padded = Tensor::empty({10, 2});
  poison(padded);
  ops::moe_pad_rows(rows, groups, padded_rows, padded);
  // Group 0: 2 rows, 2 zero rows; group 1: 2 zero rows; group 2: 3 rows; group 4: 1 row.
  const std::vector<float> want = {1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_TRUE(allclose(padded, Tensor::from({10, 2}, want), 0, 0));
  for (int64_t r : {2, 3, 4, 5}) padded.rows(r, 1).fill(NAN);
  Tensor back = Tensor::empty({6, 2});
  poison(back);
  ops::moe_unpad_rows(padded, groups, padded_rows, back);
  EXPECT_TRUE(allclose(back, rows, 0, 0));
}

// Pads random rows of `groups` to `padded_rows`, checks every padded element (the group's
// rows in order, then +0), the round trip, and that unpadding is the adjoint of padding.
void check_round_trip(const std::vector<int64_t>& groups, const std::vector<int64_t>& padded_rows,
                      int64_t H, uint64_t seed) {
  const int64_t G = int64_t(groups.size());
  const int64_t R = std::accumulate(groups.begin(), groups.end(), int64_t(0));
  const int64_t P = std::accumulate(padded_rows.begin(), padded_rows.end(), int64_t(0));
  Tensor rows = randn({R, H}, seed + 1);
  Tensor padded = Tensor::empty({P, H});
  poison(padded);
  ops::moe_pad_rows(rows, groups, padded_rows, padded);
  int64_t start = 0, padded_start = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < padded_rows[g]; ++i)
      for (int64_t c = 0; c < H; ++c) {
        const float got = padded.f32()[(padded_start + i) * H + c];
        const float want = i < groups[g] ? rows.f32()[(start + i) * H + c] : 0.0f;
        ASSERT_EQ(got, want) << "group " << g << " row " << i << " column " << c;
        ASSERT_FALSE(std::signbit(got) && want == 0.0f) << "padding must be +0";
      }
    start += groups[g];
    padded_start += padded_rows[g];
  }
  Tensor back = Tensor::empty({R, H});
  poison(back);
  ops::moe_unpad_rows(padded, groups, padded_rows, back);
  EXPECT_TRUE(allclose(back, rows, 0, 0));
  // <pad(x), w> = <x, unpad(w)>: unpadding is the gradient of padding (and the reverse).
  Tensor w = randn({P, H}, seed + 2);
  Tensor unpadded_w = Tensor::empty({R, H});
  ops::moe_unpad_rows(w, groups, padded_rows, unpadded_w);
  EXPECT_NEAR(dot(padded, w), dot(rows, unpadded_w), 1e-9 * double(P * H));
}

TEST(MoePadRows, ToCapacityRoundTripsAndIsItsOwnAdjoint) {
  const uint64_t seed = testing::test_seed() + 140;
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937_64 gen(seed);
  const int64_t H = 7, capacity = 9;
  // Empty, full and partial groups.
  std::vector<int64_t> groups = {0, capacity, 1};
  std::uniform_int_distribution<int64_t> count(0, capacity);
  for (int g = 0; g < 8; ++g) groups.push_back(count(gen));
  check_round_trip(groups, std::vector<int64_t>(groups.size(), capacity), H, seed);
}

TEST(MoePadRows, UnequalPaddingRoundTripsAndIsItsOwnAdjoint) {
  const uint64_t seed = testing::test_seed() + 150;
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937_64 gen(seed);
  const int64_t H = 5;
  // Rows rounded up to a multiple of 16 (the FP8 GEMMs' padding): an empty group (no
  // padded rows), exact multiples (no padding), and partial groups.
  std::vector<int64_t> groups = {0, 16, 3, 32, 0, 17};
  std::uniform_int_distribution<int64_t> count(0, 40);
  for (int g = 0; g < 10; ++g) groups.push_back(count(gen));
  std::vector<int64_t> to_16(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) to_16[g] = (groups[g] + 15) / 16 * 16;
  check_round_trip(groups, to_16, H, seed);
  // Any padding per group: empty groups with and without padded rows, groups without
  // padding, groups with more padding than rows.
  std::vector<int64_t> padded_rows(groups.size());
  std::uniform_int_distribution<int64_t> extra(0, 5);
  for (size_t g = 0; g < groups.size(); ++g) padded_rows[g] = groups[g] + extra(gen);
  padded_rows[0] = 0;   // 0 rows, no padding
  padded_rows[1] = 16;  // 16 rows, no padding
  padded_rows[4] = 7;   // 0 rows, 7 zero rows
  padded_rows[5] = 40;  // 17 rows, 23 zero rows
  check_round_trip(groups, padded_rows, H, seed + 10);
}

TEST(MoePadRows, NoRowsAndNoGroups) {
  Tensor none = Tensor::empty({0, 3});
  Tensor padded = Tensor::empty({0, 3});
  EXPECT_NO_THROW(ops::moe_pad_rows(none, {0, 0}, {0, 0}, padded));
  EXPECT_NO_THROW(ops::moe_unpad_rows(padded, {0, 0}, {0, 0}, none));
  EXPECT_NO_THROW(ops::moe_pad_rows(none, {}, {}, padded));
  EXPECT_NO_THROW(ops::moe_unpad_rows(padded, {}, {}, none));
  // Empty groups padded: zeros only.
  Tensor zeros = Tensor::empty({3, 3});
  poison(zeros);
  ops::moe_pad_rows(none, {0, 0, 0}, {2, 0, 1}, zeros);
  EXPECT_TRUE(allclose(zeros, Tensor::from({3, 3}, std::vector<float>(9, 0.0f)), 0, 0));
  EXPECT_NO_THROW(ops::moe_unpad_rows(zeros, {0, 0, 0}, {2, 0, 1}, none));
}

TEST(MoePadRows, RejectsBadInputs) {
  Tensor rows = randn({5, 2}, 3);
  Tensor padded = Tensor::empty({9, 2});
  const std::vector<int64_t> groups = {2, 0, 3}, capacity = {3, 3, 3};
  EXPECT_NO_THROW(ops::moe_pad_rows(rows, groups, capacity, padded));
  EXPECT_NO_THROW(ops::moe_pad_rows(rows, groups, {4, 2, 3}, padded));
  // A group above its padded rows, counts not summing to the rows, a negative count,
  // counts of different lengths, a wrong padded shape or dtype.
  Tensor padded2 = Tensor::empty({6, 2});
  EXPECT_THROW(ops::moe_pad_rows(rows, {5, 0}, {3, 3}, padded2), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, {3, 4, 2}, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, {2, 0, 2}, capacity, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, {2, -1, 4}, {4, 1, 4}, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, {3, -3, 9}, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, {3, 3}, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, {3, 3, 3, 0}, padded), InternalError);
  Tensor short_padded = Tensor::empty({8, 2}), wide_padded = Tensor::empty({9, 3});
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, capacity, short_padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, capacity, wide_padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, {3, 3, 4}, padded), InternalError);  // 10 rows
  Tensor int_padded = Tensor::empty({9, 2}, DType::I32);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, capacity, int_padded), InternalError);
  EXPECT_THROW(ops::moe_unpad_rows(padded, {2, 0, 2}, capacity, rows), InternalError);
  EXPECT_THROW(ops::moe_unpad_rows(padded, {4, 0, 1}, capacity, rows), InternalError);
  EXPECT_THROW(ops::moe_unpad_rows(padded, groups, {3, 3}, rows), InternalError);
  EXPECT_THROW(ops::moe_unpad_rows(short_padded, groups, capacity, rows), InternalError);
}

// ---------------------------------------------------------------------------------------
// Grouped GEMMs with the counts in a tensor (ops::grouped_gemm / grouped_gemm_wgrad with
// `const Tensor& group_rows`): the same math as the host-vector ops, over the first
// sum(counts) rows of R.

Tensor counts_tensor(const std::vector<int64_t>& counts) {
  Tensor t = Tensor::empty({int64_t(counts.size())}, DType::I64);
  for (size_t g = 0; g < counts.size(); ++g) t.i64()[g] = counts[g];
  return t;
}

// Bit-for-bit equality of two F32 tensors (NaN included, so an unwritten poisoned output
// fails only if the other side was written).
::testing::AssertionResult same_bits(const Tensor& got, const Tensor& want) {
  if (got.numel() != want.numel())
    return ::testing::AssertionFailure() << "numel " << got.numel() << " vs " << want.numel();
  for (int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(got.f32() + i, want.f32() + i, sizeof(float)) != 0)
      return ::testing::AssertionFailure()
             << "element " << i << ": " << got.f32()[i] << " vs " << want.f32()[i];
  return ::testing::AssertionSuccess();
}

// The counts as the ops take them: each cut at the rows left of R.
std::vector<int64_t> cut_at(const std::vector<int64_t>& counts, int64_t rows) {
  std::vector<int64_t> cut;
  int64_t start = 0;
  for (int64_t n : counts) {
    cut.push_back(std::min(n, rows - start));
    start += cut.back();
  }
  return cut;
}

int64_t sum_of(const std::vector<int64_t>& counts) {
  return std::accumulate(counts.begin(), counts.end(), int64_t(0));
}

// grouped_gemm with tensor counts over R rows against the vector op over the first
// sum(cut counts) rows; rows past them poisoned in a (must not be read) and holding
// sentinel values in c (must not be written).
void check_grouped_gemm_counts(const std::vector<int64_t>& counts, int64_t rows, bool trans_b,
                               float beta, uint64_t seed) {
  SCOPED_TRACE(seed_trace(seed) + " rows " + std::to_string(rows) + " trans_b " +
               std::to_string(trans_b) + " beta " + std::to_string(beta));
  const int64_t k = 7, n = 5;
  const std::vector<int64_t> cut = cut_at(counts, rows);
  const int64_t used = sum_of(cut);
  Tensor a = randn({rows, k}, seed);
  if (used < rows) {
    Tensor past = a.rows(used, rows - used);
    poison(past);
  }
  std::vector<Tensor> b;
  for (size_t g = 0; g < counts.size(); ++g)
    b.push_back(randn(trans_b ? Shape{n, k} : Shape{k, n}, seed + 1 + g));
  Tensor c0 = randn({rows, n}, seed + 100);
  Tensor want = c0.clone(), got = c0.clone();
  if (beta == 0.0f && used > 0) {  // beta == 0 overwrites: every group row must be written
    Tensor head = got.rows(0, used);
    poison(head);
  }
  Tensor want_head = want.rows(0, used);
  ops::grouped_gemm(a.rows(0, used), b, trans_b, want_head, cut, beta);
  ops::grouped_gemm(a, b, trans_b, got, counts_tensor(counts), beta);
  EXPECT_TRUE(same_bits(got, want));  // the rows past `used` included: still c0
  EXPECT_TRUE(same_bits(got.rows(used, rows - used), c0.rows(used, rows - used)));
}

TEST(GroupedGemmTensorCounts, MatchesVectorCountsBitForBit) {
  const uint64_t seed = testing::test_seed();
  for (bool trans_b : {false, true})
    for (float beta : {0.0f, 0.5f}) {
      // Empty groups first, in the middle and last; 6 rows past the groups.
      check_grouped_gemm_counts({0, 3, 0, 4, 2, 0}, 15, trans_b, beta, seed);
      // R = sum: every row in a group.
      check_grouped_gemm_counts({4, 1, 3}, 8, trans_b, beta, seed + 10);
      // Counts past R: the second group cut at R, the third empty.
      check_grouped_gemm_counts({3, 9, 4}, 8, trans_b, beta, seed + 20);
      // No group has rows: c untouched.
      check_grouped_gemm_counts({0, 0}, 3, trans_b, beta, seed + 30);
    }
}

void check_grouped_wgrad_counts(const std::vector<int64_t>& counts, int64_t rows, uint64_t seed) {
  SCOPED_TRACE(seed_trace(seed) + " rows " + std::to_string(rows));
  const int64_t m = 6, n = 4;
  const std::vector<int64_t> cut = cut_at(counts, rows);
  const int64_t used = sum_of(cut);
  Tensor a = randn({rows, m}, seed), b = randn({rows, n}, seed + 1);
  if (used < rows) {
    Tensor a_past = a.rows(used, rows - used), b_past = b.rows(used, rows - used);
    poison(a_past);
    poison(b_past);
  }
  std::vector<Tensor> c0, want, got;
  for (size_t g = 0; g < counts.size(); ++g) {
    c0.push_back(randn({m, n}, seed + 2 + g));
    want.push_back(c0.back().clone());
    got.push_back(c0.back().clone());
  }
  ops::grouped_gemm_wgrad(a.rows(0, used), b.rows(0, used), want, cut, 1.0f);
  ops::grouped_gemm_wgrad(a, b, got, counts_tensor(counts));
  for (size_t g = 0; g < counts.size(); ++g) {
    SCOPED_TRACE("group " + std::to_string(g));
    EXPECT_TRUE(same_bits(got[g], want[g]));
    if (cut[g] == 0) {
      EXPECT_TRUE(same_bits(got[g], c0[g]));  // accumulates nothing
    }
  }
}

TEST(GroupedGemmTensorCounts, WgradMatchesVectorCountsBitForBit) {
  const uint64_t seed = testing::test_seed();
  check_grouped_wgrad_counts({0, 3, 0, 4, 2, 0}, 15, seed);
  check_grouped_wgrad_counts({4, 1, 3}, 8, seed + 10);
  check_grouped_wgrad_counts({3, 9, 4}, 8, seed + 20);
  check_grouped_wgrad_counts({0, 0, 0}, 5, seed + 30);
}

TEST(GroupedGemmTensorCounts, RejectsBadCounts) {
  Tensor a = randn({8, 4}, 1), c = Tensor::empty({8, 6});
  std::vector<Tensor> b = {randn({4, 6}, 2), randn({4, 6}, 3)};
  Tensor wa = randn({8, 4}, 4), wb = randn({8, 6}, 5);
  std::vector<Tensor> grads = {Tensor::zeros({4, 6}), Tensor::zeros({4, 6})};
  // A negative count: refused, naming the group and the value.
  try {
    ops::grouped_gemm(a, b, false, c, counts_tensor({3, -2}));
    ADD_FAILURE() << "a negative count was accepted";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("group_rows[1] = -2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops::grouped_gemm_wgrad(wa, wb, grads, counts_tensor({-1, 2})), InternalError);
  // Not one count per group, not I64, not 1-d.
  EXPECT_THROW(ops::grouped_gemm(a, b, false, c, counts_tensor({3, 4, 1})), InternalError);
  EXPECT_THROW(ops::grouped_gemm_wgrad(wa, wb, grads, counts_tensor({3})), InternalError);
  Tensor i32_counts = Tensor::from_i32({2}, {3, 4});
  EXPECT_THROW(ops::grouped_gemm(a, b, false, c, i32_counts), InternalError);
  EXPECT_THROW(ops::grouped_gemm(a, b, false, c, counts_tensor({3, 4}).view({1, 2})),
               InternalError);
  // A weight of the wrong shape, even for a group with no rows; c with other rows than a.
  std::vector<Tensor> bad_b = {randn({4, 6}, 2), randn({6, 4}, 3)};
  EXPECT_THROW(ops::grouped_gemm(a, bad_b, false, c, counts_tensor({3, 0})), InternalError);
  Tensor short_c = Tensor::empty({7, 6});
  EXPECT_THROW(ops::grouped_gemm(a, b, false, short_c, counts_tensor({3, 4})), InternalError);
  std::vector<Tensor> bad_grads = {Tensor::zeros({4, 6}), Tensor::zeros({6, 4})};
  EXPECT_THROW(ops::grouped_gemm_wgrad(wa, wb, bad_grads, counts_tensor({3, 0})), InternalError);
}

}  // namespace
}  // namespace megaton
