// Multi-latent attention's data movement (ops/mla.h): column split/concat, and the query /
// key / value assembly against the interleaved RoPE op it must agree with, its backward as
// the forward's transpose.
#include <cmath>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/mla.h"
#include "ops/rope_interleaved.h"

namespace megaton {
namespace {

using testing::dot;
using testing::randn;

std::vector<float> frequencies(int64_t rope) {
  std::vector<float> f;
  for (int64_t j = 0; j < rope / 2; ++j)
    f.push_back(float(std::pow(10000.0, -2.0 * double(j) / double(rope)) / (1.0 + 0.3 * double(j))));
  return f;
}

TEST(MlaOps, SplitAndConcatColumns) {
  const Tensor x = randn({5, 11}, testing::test_seed());
  std::vector<Tensor> parts{Tensor::empty({5, 3}), Tensor::empty({5, 8})};
  ops::split_columns(x, parts);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(parts[0].f32()[r * 3 + c], x.f32()[r * 11 + c]);
    for (int64_t c = 0; c < 8; ++c) EXPECT_EQ(parts[1].f32()[r * 8 + c], x.f32()[r * 11 + 3 + c]);
  }
  Tensor y = Tensor::empty({5, 11});
  ops::concat_columns(parts, y);
  EXPECT_TRUE(testing::allclose(y, x, 0, 0));
  std::vector<Tensor> wrong{Tensor::empty({5, 3}), Tensor::empty({5, 7})};
  EXPECT_THROW(ops::split_columns(x, wrong), InternalError);
  std::vector<Tensor> rows{Tensor::empty({4, 3}), Tensor::empty({4, 8})};
  EXPECT_THROW(ops::concat_columns(rows, y), InternalError);
}

// B 2, S 5, 3 heads, qk 6, rope 4, v 5: the query and key are [nope | rotated rope part],
// the value kv's tail, the key's rope part the one k_pe rotated for every head.
TEST(MlaOps, QkvRopeEqualsTheRopeOpOnEachPart) {
  const int64_t B = 2, S = 5, n = 3, qk = 6, rope = 4, v = 5;
  const uint64_t seed = testing::test_seed() + 10;
  const Tensor q = randn({B, S, n, qk + rope}, seed), kv = randn({B, S, n, qk + v}, seed + 1),
               k_pe = randn({B, S, rope}, seed + 2);
  const std::vector<float> f = frequencies(rope);
  const float scale = 1.0857f;
  const int64_t offset = 7;
  Tensor query = Tensor::empty({B, S, n, qk + rope}), key = Tensor::empty(query.shape()),
         value = Tensor::empty({B, S, n, v});
  ops::mla_qkv_rope(q, kv, k_pe, qk, f, scale, query, key, value, offset);
  // The rope parts through ops::rope_interleaved_forward.
  Tensor q_pe = Tensor::empty({B, S, n, rope}), q_rot = Tensor::empty(q_pe.shape());
  for (int64_t h = 0; h < B * S * n; ++h)
    for (int64_t i = 0; i < rope; ++i) q_pe.f32()[h * rope + i] = q.f32()[h * (qk + rope) + qk + i];
  ops::rope_interleaved_forward(q_pe, q_rot, f, scale, offset);
  Tensor k_rot = Tensor::empty({B, S, 1, rope});
  ops::rope_interleaved_forward(k_pe.view({B, S, 1, rope}), k_rot, f, scale, offset);
  for (int64_t row = 0; row < B * S; ++row)
    for (int64_t h = 0; h < n; ++h) {
      const int64_t head = row * n + h;
      for (int64_t i = 0; i < qk; ++i) {
        ASSERT_EQ(query.f32()[head * (qk + rope) + i], q.f32()[head * (qk + rope) + i]);
        ASSERT_EQ(key.f32()[head * (qk + rope) + i], kv.f32()[head * (qk + v) + i]);
      }
      for (int64_t i = 0; i < rope; ++i) {
        ASSERT_EQ(query.f32()[head * (qk + rope) + qk + i], q_rot.f32()[head * rope + i]);
        ASSERT_EQ(key.f32()[head * (qk + rope) + qk + i], k_rot.f32()[row * rope + i]);
      }
      for (int64_t i = 0; i < v; ++i)
        ASSERT_EQ(value.f32()[head * v + i], kv.f32()[head * (qk + v) + qk + i]);
    }
  Tensor bad = Tensor::empty({B, S, n, qk + rope + 2});
  EXPECT_THROW(ops::mla_qkv_rope(q, kv, k_pe, qk, f, scale, bad, key, value), InternalError);
  EXPECT_THROW(ops::mla_qkv_rope(q, kv, k_pe, qk + 1, f, scale, query, key, value),
               InternalError);
}

// The op is linear: <dquery, query(x)> + <dkey, key(x)> + <dvalue, value(x)> must equal
// <dq, q> + <dkv, kv> + <dk_pe, k_pe> for the backward's outputs.
TEST(MlaOps, QkvRopeBackwardIsTheTranspose) {
  const int64_t B = 2, S = 4, n = 4, qk = 8, rope = 6, v = 3;
  const uint64_t seed = testing::test_seed() + 20;
  const Tensor q = randn({B, S, n, qk + rope}, seed), kv = randn({B, S, n, qk + v}, seed + 1),
               k_pe = randn({B, S, rope}, seed + 2);
  const Tensor gq = randn({B, S, n, qk + rope}, seed + 3), gk = randn(gq.shape(), seed + 4),
               gv = randn({B, S, n, v}, seed + 5);
  const std::vector<float> f = frequencies(rope);
  const float scale = 0.93f;
  Tensor query = Tensor::empty(gq.shape()), key = Tensor::empty(gq.shape()),
         value = Tensor::empty(gv.shape());
  ops::mla_qkv_rope(q, kv, k_pe, qk, f, scale, query, key, value, 3);
  Tensor dq = Tensor::empty(q.shape()), dkv = Tensor::empty(kv.shape()),
         dk_pe = Tensor::empty(k_pe.shape());
  testing::poison(dq);
  testing::poison(dkv);
  testing::poison(dk_pe);
  ops::mla_qkv_rope_backward(gq, gk, gv, qk, f, scale, dq, dkv, dk_pe, 3);
  const double lhs = dot(gq, query) + dot(gk, key) + dot(gv, value);
  const double rhs = dot(dq, q) + dot(dkv, kv) + dot(dk_pe, k_pe);
  EXPECT_NEAR(lhs, rhs, 1e-5 * (std::fabs(lhs) + 1));
  // The identity covers k_pe's gradient (the sum over heads) only if it carries weight.
  EXPECT_GT(std::fabs(dot(dk_pe, k_pe)), 1e-2 * std::fabs(rhs) + 1e-3);
}

}  // namespace
}  // namespace megaton
