// Per-token RoPE positions (packed sequences, --reset-position-ids) in the fused ops that
// rotate: qkv_split_rope / qkv_pack_rope_backward, qkv_split_norm_rope /
// qkv_pack_norm_rope_backward and mla_qkv_rope / mla_qkv_rope_backward (CPU reference).
// Each is checked against the same op without RoPE followed by the plain rotation of every
// token alone at its position (rope_forward / rope_backward or a one-row mla_qkv_rope with
// position_offset), so the position ids are followed token by token.
#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/mla.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randn;

// CPU vs CPU fp32 (../shared/CONVENTIONS.md): the fused and the reference loops evaluate
// the same fp32 expressions, but GCC may contract them into FMAs differently (one ulp).
constexpr double kAtol = 1e-6, kRtol = 5e-6;

constexpr int64_t B = 2, S = 9, kHeads = 4, kGroups = 2, D = 8;
constexpr float kBase = 10000.0f;

// Two samples of packed documents: positions restart after each document end (lengths 3, 5,
// 1 and 6, 3), plus, in the second sample, a run of large positions, where the angle's fp32
// rounding matters.
Tensor packed_positions() {
  const std::vector<int32_t> p{0, 1, 2, 0, 1, 2, 3,    4,    0,      // sample 0
                               0, 1, 2, 3, 4, 5, 4093, 4094, 4095};  // sample 1
  return Tensor::from_i32({B * S}, p);
}

// x [B, S, heads, D] rotated (sign +1) or un-rotated (-1) in place, token t alone by
// rope_forward / rope_backward at position_offset positions[t].
void rotate_each_token(Tensor& x, const Tensor& positions, bool forward) {
  const int64_t heads = x.dim(2);
  Tensor rows = x.view({B * S, heads, D});
  for (int64_t t = 0; t < B * S; ++t) {
    Tensor token = rows.rows(t, 1).view({1, 1, heads, D});
    if (forward) {
      ops::rope_forward(token, token, kBase, positions.i32()[t]);
    } else {
      ops::rope_backward(token, token, kBase, positions.i32()[t]);
    }
  }
}

Shape q_shape() { return {B, S, kHeads, D}; }
Shape kv_shape() { return {B, S, kGroups, D}; }
Shape qkv_shape() { return {B * S, (kHeads + 2 * kGroups) * D}; }

TEST(RopePositions, QkvSplitRopeRotatesEachTokenByItsPositionId) {
  const uint64_t seed = testing::test_seed() + 300;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Tensor qkv = randn(qkv_shape(), seed), positions = packed_positions();
  Tensor q = Tensor::empty(q_shape()), k = Tensor::empty(kv_shape()), v = Tensor::empty(kv_shape());
  ops::qkv_split_rope(qkv, B, kGroups, q, k, v, true, kBase, positions);
  Tensor q_ref = Tensor::empty(q_shape()), k_ref = Tensor::empty(kv_shape()),
         v_ref = Tensor::empty(kv_shape());
  ops::qkv_split_rope(qkv, B, kGroups, q_ref, k_ref, v_ref, false, kBase);
  rotate_each_token(q_ref, positions, true);
  rotate_each_token(k_ref, positions, true);
  EXPECT_TRUE(allclose(q, q_ref, kAtol, kRtol));
  EXPECT_TRUE(allclose(k, k_ref, kAtol, kRtol));
  EXPECT_TRUE(allclose(v, v_ref, 0, 0));

  // The gradient: the inverse rotation of each token, then the pack.
  const Tensor dq = randn(q_shape(), seed + 1), dk = randn(kv_shape(), seed + 2),
               dv = randn(kv_shape(), seed + 3);
  Tensor dqkv = Tensor::empty(qkv_shape());
  testing::poison(dqkv);
  ops::qkv_pack_rope_backward(dq, dk, dv, kGroups, true, kBase, dqkv, positions);
  Tensor dq_ref = dq.clone(), dk_ref = dk.clone(), dqkv_ref = Tensor::empty(qkv_shape());
  rotate_each_token(dq_ref, positions, false);
  rotate_each_token(dk_ref, positions, false);
  ops::qkv_pack_rope_backward(dq_ref, dk_ref, dv, kGroups, false, kBase, dqkv_ref);
  EXPECT_TRUE(allclose(dqkv, dqkv_ref, kAtol, kRtol));
}

// Position ids equal to s within each sequence are the default positions, bit for bit.
TEST(RopePositions, PositionIdsOfTheSequenceGiveTheDefault) {
  const uint64_t seed = testing::test_seed() + 310;
  const Tensor qkv = randn(qkv_shape(), seed);
  std::vector<int32_t> s_of_t;
  for (int64_t t = 0; t < B * S; ++t) s_of_t.push_back(int32_t(t % S));
  const Tensor positions = Tensor::from_i32({B * S}, s_of_t);
  Tensor q = Tensor::empty(q_shape()), k = Tensor::empty(kv_shape()), v = Tensor::empty(kv_shape());
  Tensor q_ref = Tensor::empty(q_shape()), k_ref = Tensor::empty(kv_shape()),
         v_ref = Tensor::empty(kv_shape());
  ops::qkv_split_rope(qkv, B, kGroups, q, k, v, true, kBase, positions);
  ops::qkv_split_rope(qkv, B, kGroups, q_ref, k_ref, v_ref, true, kBase);
  EXPECT_TRUE(allclose(q, q_ref, 0, 0));
  EXPECT_TRUE(allclose(k, k_ref, 0, 0));
}

ops::QkNorm random_norm(ops::QkNormType type, uint64_t seed) {
  ops::QkNorm n;
  n.type = type;
  n.q_weight = randn({D}, seed, 0.5f);
  n.k_weight = randn({D}, seed + 1, 0.5f);
  for (int64_t j = 0; j < D; ++j) {
    n.q_weight.f32()[j] += 1.0f;
    n.k_weight.f32()[j] += 1.0f;
  }
  if (type == ops::QkNormType::LayerNorm) {
    n.q_bias = randn({D}, seed + 2, 0.5f);
    n.k_bias = randn({D}, seed + 3, 0.5f);
  }
  return n;
}

ops::QkNormSaved empty_saved(ops::QkNormType type) {
  ops::QkNormSaved s;
  s.q_input = Tensor::empty(q_shape());
  s.k_input = Tensor::empty(kv_shape());
  s.q_rstd = Tensor::empty({B * S * kHeads});
  s.k_rstd = Tensor::empty({B * S * kGroups});
  if (type == ops::QkNormType::LayerNorm) {
    s.q_mean = Tensor::empty({B * S * kHeads});
    s.k_mean = Tensor::empty({B * S * kGroups});
  }
  return s;
}

ops::QkNormGrads zero_grads(bool bias) {
  ops::QkNormGrads g;
  g.q_weight = Tensor::zeros({D});
  g.k_weight = Tensor::zeros({D});
  if (bias) {
    g.q_bias = Tensor::zeros({D});
    g.k_bias = Tensor::zeros({D});
  }
  return g;
}

TEST(RopePositions, QkvSplitNormRopeRotatesEachTokenByItsPositionId) {
  for (ops::QkNormType type : {ops::QkNormType::RMSNorm, ops::QkNormType::LayerNorm}) {
    const bool layernorm = type == ops::QkNormType::LayerNorm;
    const uint64_t seed = testing::test_seed() + 320 + (layernorm ? 10 : 0);
    SCOPED_TRACE(std::string(layernorm ? "LayerNorm" : "RMSNorm") + ", seed " +
                 std::to_string(seed));
    const Tensor qkv = randn(qkv_shape(), seed), positions = packed_positions();
    const ops::QkNorm norm = random_norm(type, seed + 1);
    Tensor q = Tensor::empty(q_shape()), k = Tensor::empty(kv_shape()),
           v = Tensor::empty(kv_shape());
    ops::QkNormSaved saved = empty_saved(type);
    ops::qkv_split_norm_rope(qkv, B, kGroups, norm, true, kBase, q, k, v, saved, positions);
    Tensor q_ref = Tensor::empty(q_shape()), k_ref = Tensor::empty(kv_shape()),
           v_ref = Tensor::empty(kv_shape());
    ops::QkNormSaved saved_ref = empty_saved(type);
    ops::qkv_split_norm_rope(qkv, B, kGroups, norm, false, kBase, q_ref, k_ref, v_ref, saved_ref);
    rotate_each_token(q_ref, positions, true);
    rotate_each_token(k_ref, positions, true);
    EXPECT_TRUE(allclose(q, q_ref, kAtol, kRtol));
    EXPECT_TRUE(allclose(k, k_ref, kAtol, kRtol));
    EXPECT_TRUE(allclose(v, v_ref, 0, 0));
    EXPECT_TRUE(allclose(saved.q_rstd, saved_ref.q_rstd, 0, 0));

    const Tensor dq = randn(q_shape(), seed + 2), dk = randn(kv_shape(), seed + 3),
                 dv = randn(kv_shape(), seed + 4);
    Tensor dqkv = Tensor::empty(qkv_shape()), dqkv_ref = Tensor::empty(qkv_shape());
    testing::poison(dqkv);
    ops::QkNormGrads grads = zero_grads(layernorm), grads_ref = zero_grads(layernorm);
    ops::qkv_pack_norm_rope_backward(dq, dk, dv, saved, kGroups, norm, true, kBase, dqkv, grads,
                                     positions);
    Tensor dq_ref = dq.clone(), dk_ref = dk.clone();
    rotate_each_token(dq_ref, positions, false);
    rotate_each_token(dk_ref, positions, false);
    ops::qkv_pack_norm_rope_backward(dq_ref, dk_ref, dv, saved_ref, kGroups, norm, false, kBase,
                                     dqkv_ref, grads_ref);
    EXPECT_TRUE(allclose(dqkv, dqkv_ref, kAtol, kRtol));
    EXPECT_TRUE(allclose(grads.q_weight, grads_ref.q_weight, kAtol, kRtol));
    EXPECT_TRUE(allclose(grads.k_weight, grads_ref.k_weight, kAtol, kRtol));
    if (layernorm) {
      EXPECT_TRUE(allclose(grads.q_bias, grads_ref.q_bias, kAtol, kRtol));
      EXPECT_TRUE(allclose(grads.k_bias, grads_ref.k_bias, kAtol, kRtol));
    }
  }
}

// MLA: row t of the assembly equals the one-row op at position_offset = its position id
// plus the call's offset (the forward and the backward, the k_pe gradient included).
TEST(RopePositions, MlaQkvRopeRotatesEachRowByItsPositionId) {
  const int64_t n = 3, qk = 6, rope = 4, v = 5, offset = 2;
  const uint64_t seed = testing::test_seed() + 340;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> f{1.0f, 0.01f};
  const float scale = 1.07f;
  const Tensor positions = packed_positions();
  const Tensor q = randn({B, S, n, qk + rope}, seed), kv = randn({B, S, n, qk + v}, seed + 1),
               k_pe = randn({B, S, rope}, seed + 2);
  Tensor query = Tensor::empty(q.shape()), key = Tensor::empty(q.shape()),
         value = Tensor::empty({B, S, n, v});
  ops::mla_qkv_rope(q, kv, k_pe, qk, f, scale, query, key, value, offset, positions);
  const Tensor gq = randn(q.shape(), seed + 3), gk = randn(q.shape(), seed + 4),
               gv = randn(value.shape(), seed + 5);
  Tensor dq = Tensor::empty(q.shape()), dkv = Tensor::empty(kv.shape()),
         dk_pe = Tensor::empty(k_pe.shape());
  ops::mla_qkv_rope_backward(gq, gk, gv, qk, f, scale, dq, dkv, dk_pe, offset, positions);
  // Row views [1, 1, ...] of a [B, S, ...] tensor.
  auto row_of = [](const Tensor& t, int64_t r) {
    Shape one = t.shape();
    one[0] = 1;
    one[1] = 1;
    Shape flat = t.shape();
    flat.erase(flat.begin());
    flat[0] = B * S;
    return t.view(flat).rows(r, 1).view(one);
  };
  for (int64_t r = 0; r < B * S; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    const int64_t at = positions.i32()[r] + offset;
    Tensor query1 = Tensor::empty({1, 1, n, qk + rope}), key1 = Tensor::empty(query1.shape()),
           value1 = Tensor::empty({1, 1, n, v});
    ops::mla_qkv_rope(row_of(q, r), row_of(kv, r), row_of(k_pe, r), qk, f, scale, query1, key1,
                      value1, at);
    EXPECT_TRUE(allclose(row_of(query, r), query1, 0, 0));
    EXPECT_TRUE(allclose(row_of(key, r), key1, 0, 0));
    EXPECT_TRUE(allclose(row_of(value, r), value1, 0, 0));
    Tensor dq1 = Tensor::empty(query1.shape()), dkv1 = Tensor::empty({1, 1, n, qk + v}),
           dk_pe1 = Tensor::empty({1, 1, rope});
    ops::mla_qkv_rope_backward(row_of(gq, r), row_of(gk, r), row_of(gv, r), qk, f, scale, dq1, dkv1,
                               dk_pe1, at);
    EXPECT_TRUE(allclose(row_of(dq, r), dq1, 0, 0));
    EXPECT_TRUE(allclose(row_of(dkv, r), dkv1, 0, 0));
    EXPECT_TRUE(allclose(row_of(dk_pe, r), dk_pe1, 0, 0));
  }
}

TEST(RopePositions, BadPositionIdsAreRefused) {
  const Tensor qkv = randn(qkv_shape(), 1);
  Tensor q = Tensor::empty(q_shape()), k = Tensor::empty(kv_shape()), v = Tensor::empty(kv_shape());
  std::vector<int32_t> negative(B * S, 0);
  negative[5] = -1;
  const Tensor bad[] = {Tensor::from_i32({B * S - 1}, std::vector<int32_t>(B * S - 1, 0)),
                        Tensor::zeros({B * S}, DType::F32), Tensor::from_i32({B * S}, negative)};
  for (const Tensor& ids : bad) {
    EXPECT_THROW(ops::qkv_split_rope(qkv, B, kGroups, q, k, v, true, kBase, ids), InternalError);
    Tensor dqkv = Tensor::empty(qkv_shape());
    EXPECT_THROW(ops::qkv_pack_rope_backward(q, k, v, kGroups, true, kBase, dqkv, ids),
                 InternalError);
  }
  const std::vector<float> f{1.0f, 0.5f};
  const Tensor mq = randn({B, S, 2, 4 + 4}, 2), mkv = randn({B, S, 2, 4 + 3}, 3),
               k_pe = randn({B, S, 4}, 4);
  Tensor query = Tensor::empty(mq.shape()), key = Tensor::empty(mq.shape()),
         value = Tensor::empty({B, S, 2, 3});
  EXPECT_THROW(ops::mla_qkv_rope(mq, mkv, k_pe, 4, f, 1.0f, query, key, value, 0, bad[2]),
               InternalError);
}

}  // namespace
}  // namespace megaton
