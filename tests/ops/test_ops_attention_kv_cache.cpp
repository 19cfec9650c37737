// ops::attention_kv_cache (CPU) against the causal attention of the training path: a
// query at position p over a cache holding positions 0..p gives row p of
// ops::attention_forward over the whole sequence, also with a value head dim apart from the
// key head dim and a given softmax scale (multi-latent attention).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

#include "common/testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

struct KvCacheCase {
  int64_t S, Hq, Hkv, D;  // sequence, query heads, key/value heads, q and k head dim
  int64_t first, n;       // the queries: positions [first, first + n)
  int64_t max_positions;  // cache rows (>= S)
  int64_t Dv = 0;         // v head dim (0: D)
  float scale = 0.0f;     // softmax scale (0: 1 / sqrt(D))
  int64_t v_dim() const { return Dv > 0 ? Dv : D; }
};

class AttentionKvCacheTest : public ::testing::TestWithParam<KvCacheCase> {};

TEST_P(AttentionKvCacheTest, MatchesRowsOfCausalAttention) {
  const KvCacheCase c = GetParam();
  const uint64_t seed = testing::test_seed() + 500;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Tensor q = testing::randn({1, c.S, c.Hq, c.D}, seed);
  const Tensor k = testing::randn({1, c.S, c.Hkv, c.D}, seed + 1);
  const Tensor v = testing::randn({1, c.S, c.Hkv, c.v_dim()}, seed + 2);
  Tensor want = Tensor::empty({1, c.S, c.Hq, c.v_dim()}), lse = Tensor::empty({1, c.Hq, c.S});
  ops::attention_forward(q, k, v, want, lse, 0.0f, 0, 0, c.scale);

  // The cache holds the sequence's keys and values; rows past the last query's position
  // are NaN: reading one would poison the output.
  Tensor key_cache = Tensor::empty({c.max_positions, c.Hkv, c.D});
  Tensor value_cache = Tensor::empty({c.max_positions, c.Hkv, c.v_dim()});
  testing::poison(key_cache);
  testing::poison(value_cache);
  const int64_t filled = c.first + c.n;
  key_cache.rows(0, filled).copy_from(k.view({c.S, c.Hkv, c.D}).rows(0, filled));
  value_cache.rows(0, filled).copy_from(v.view({c.S, c.Hkv, c.v_dim()}).rows(0, filled));
  const Tensor q_rows = q.view({c.S, c.Hq, c.D}).rows(c.first, c.n).clone();
  Tensor out = Tensor::empty({c.n, c.Hq, c.v_dim()});
  testing::poison(out);
  ops::attention_kv_cache(q_rows, key_cache, value_cache, c.first, out, c.scale);
  const Tensor want_rows = want.view({c.S, c.Hq, c.v_dim()}).rows(c.first, c.n);
  EXPECT_TRUE(testing::allclose(out, want_rows, 1e-6, 5e-6));
}

std::string case_name(const ::testing::TestParamInfo<KvCacheCase>& info) {
  const KvCacheCase& c = info.param;
  return fmt::format("S{}_Hq{}_Hkv{}_D{}_first{}_n{}_max{}{}{}", c.S, c.Hq, c.Hkv, c.D, c.first,
                     c.n, c.max_positions, c.Dv > 0 ? fmt::format("_Dv{}", c.Dv) : "",
                     c.scale > 0 ? "_scaled" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AttentionKvCacheTest,
    ::testing::Values(KvCacheCase{1, 2, 2, 8, 0, 1, 4},         // the first token alone
                      KvCacheCase{17, 4, 4, 16, 16, 1, 32},     // one decode step, MHA
                      KvCacheCase{33, 8, 2, 24, 20, 1, 40},     // decode, GQA 4:1
                      KvCacheCase{12, 6, 3, 8, 0, 12, 12},      // a prefill filling the cache
                      KvCacheCase{40, 4, 1, 64, 9, 23, 64},     // a chunk in the middle, MQA
                      KvCacheCase{300, 4, 2, 32, 0, 300, 300},  // large enough for threads
                      // MLA: Dqk != Dv (24 vs 16) with a given scale, decode and a chunk.
                      KvCacheCase{21, 4, 4, 24, 20, 1, 24, 16, 0.3f},
                      KvCacheCase{30, 4, 2, 24, 5, 11, 32, 16, 0.3f},
                      KvCacheCase{9, 2, 1, 8, 0, 9, 9, 40}),  // Dv > Dqk, default scale
    case_name);

TEST(AttentionKvCache, RejectsPositionsOutsideTheCache) {
  const Tensor q = testing::randn({2, 2, 8}, 1);
  const Tensor cache = testing::randn({4, 1, 8}, 2);
  Tensor out = Tensor::empty({2, 2, 8});
  EXPECT_THROW(ops::attention_kv_cache(q, cache, cache, 3, out), InternalError);
  EXPECT_THROW(ops::attention_kv_cache(q, cache, cache, -1, out), InternalError);
  const Tensor odd_heads = testing::randn({4, 3, 8}, 3);
  EXPECT_THROW(ops::attention_kv_cache(q, odd_heads, odd_heads, 0, out), InternalError);
  // value_cache [max, Hkv, Dv] with Dv = 4: out must then be [n, Hq, 4].
  const Tensor narrow_values = testing::randn({4, 1, 4}, 4);
  EXPECT_THROW(ops::attention_kv_cache(q, cache, narrow_values, 0, out), InternalError);
  Tensor narrow_out = Tensor::empty({2, 2, 4});
  EXPECT_NO_THROW(ops::attention_kv_cache(q, cache, narrow_values, 0, narrow_out));
  const Tensor short_values = testing::randn({3, 1, 8}, 5);  // fewer positions than the keys
  EXPECT_THROW(ops::attention_kv_cache(q, cache, short_values, 0, out), InternalError);
  EXPECT_NO_THROW(ops::attention_kv_cache(q, cache, cache, 2, out));
}

}  // namespace
}  // namespace megaton
