// Tests of the fused QKV split + RoPE op and its gradient (CPU reference).
#include <cmath>
#include <string>

#include "common/testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::dot;
using testing::finite_difference;
using testing::poison;
using testing::randn;

// CPU vs CPU fp32 (../shared/CONVENTIONS.md).
constexpr double kAtol = 1e-6, kRtol = 5e-6;
// Finite differences of a linear map with eps = 1e-2: no truncation error, only the fp32
// rounding of the outputs (~1e-7 relative) summed over ~1e3 terms and divided by 2 eps.
constexpr double kFdAtol = 1e-3, kFdRtol = 1e-3;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

struct QkvCase {
  int64_t B, S, heads, groups, D;
  int64_t tokens() const { return B * S; }
  int64_t qpg() const { return heads / groups; }
  Shape qkv_shape() const { return {B * S, (heads + 2 * groups) * D}; }
  Shape q_shape() const { return {B, S, heads, D}; }
  Shape kv_shape() const { return {B, S, groups, D}; }
  std::string name() const {
    return "B" + std::to_string(B) + " S" + std::to_string(S) + " np" + std::to_string(heads) +
           " ng" + std::to_string(groups) + " d" + std::to_string(D);
  }
};

const QkvCase kCases[] = {
    {2, 5, 8, 2, 8},    // GQA
    {2, 4, 3, 3, 6},    // MHA
    {1, 7, 4, 1, 4},    // MQA, odd S
    {3, 3, 2, 2, 2},    // D = 2: one frequency
    {2, 64, 8, 2, 32},  // large enough (2^15 packed elements) for the threaded path
};

struct Parts {
  Tensor q, k, v;
};

// Megatron's grouped layout read from its definition (SelfAttention.get_query_key_value_
// tensors: each token's row viewed as [ng, np/ng + 2, d]): query head h sits in group
// h / qpg at slot h % qpg, the group's key head at slot qpg, its value head at qpg + 1.
Parts reference_split(const Tensor& qkv, const QkvCase& c) {
  Parts p{Tensor::empty(c.q_shape()), Tensor::empty(c.kv_shape()), Tensor::empty(c.kv_shape())};
  const int64_t row = c.qkv_shape()[1], slots = c.qpg() + 2;
  for (int64_t t = 0; t < c.tokens(); ++t)
    for (int64_t i = 0; i < c.D; ++i) {
      for (int64_t h = 0; h < c.heads; ++h)
        p.q.f32()[(t * c.heads + h) * c.D + i] =
            qkv.f32()[t * row + ((h / c.qpg()) * slots + h % c.qpg()) * c.D + i];
      for (int64_t g = 0; g < c.groups; ++g) {
        p.k.f32()[(t * c.groups + g) * c.D + i] =
            qkv.f32()[t * row + (g * slots + c.qpg()) * c.D + i];
        p.v.f32()[(t * c.groups + g) * c.D + i] =
            qkv.f32()[t * row + (g * slots + c.qpg() + 1) * c.D + i];
      }
    }
  return p;
}

Parts poisoned_parts(const QkvCase& c) {
  Parts p{Tensor::empty(c.q_shape()), Tensor::empty(c.kv_shape()), Tensor::empty(c.kv_shape())};
  poison(p.q);
  poison(p.k);
  poison(p.v);
  return p;
}

Parts split(const Tensor& qkv, const QkvCase& c, bool apply_rope, float base) {
  Parts p = poisoned_parts(c);
  ops::qkv_split_rope(qkv, c.B, c.groups, p.q, p.k, p.v, apply_rope, base);
  return p;
}

Tensor pack(const Parts& d, const QkvCase& c, bool apply_rope, float base) {
  Tensor dqkv = Tensor::empty(c.qkv_shape());
  poison(dqkv);
  ops::qkv_pack_rope_backward(d.q, d.k, d.v, c.groups, apply_rope, base, dqkv);
  return dqkv;
}

TEST(QkvSplitRope, WithoutRopeSplitsMegatronLayoutAndPackInvertsIt) {
  const uint64_t seed = testing::test_seed() + 500;
  SCOPED_TRACE(seed_trace(seed));
  for (const QkvCase& c : kCases) {
    SCOPED_TRACE(c.name());
    Tensor qkv = randn(c.qkv_shape(), seed + c.D);
    Parts p = split(qkv, c, false, 10000.0f);
    Parts ref = reference_split(qkv, c);
    // A copy: exact. (Poisoned outputs would compare unequal: every element is written.)
    EXPECT_TRUE(allclose(p.q, ref.q, 0, 0));
    EXPECT_TRUE(allclose(p.k, ref.k, 0, 0));
    EXPECT_TRUE(allclose(p.v, ref.v, 0, 0));
    EXPECT_TRUE(allclose(pack(p, c, false, 10000.0f), qkv, 0, 0));
  }
}

// No RoPE, no pairing: an odd head dim is a plain copy.
TEST(QkvSplitRope, WithoutRopeAcceptsOddHeadDim) {
  const uint64_t seed = testing::test_seed() + 501;
  SCOPED_TRACE(seed_trace(seed));
  const QkvCase c{2, 3, 4, 2, 5};
  Tensor qkv = randn(c.qkv_shape(), seed);
  Parts p = split(qkv, c, false, 0.0f);  // rotary_base is not read without RoPE
  Parts ref = reference_split(qkv, c);
  EXPECT_TRUE(allclose(p.q, ref.q, 0, 0));
  EXPECT_TRUE(allclose(p.k, ref.k, 0, 0));
  EXPECT_TRUE(allclose(p.v, ref.v, 0, 0));
  EXPECT_TRUE(allclose(pack(p, c, false, 0.0f), qkv, 0, 0));
}

// The fused op is what attention.cpp did before it: split, then rope_forward on q and k
// (position s within each sequence); v is not rotated.
TEST(QkvSplitRope, WithRopeEqualsSplitThenRopeForward) {
  const uint64_t seed = testing::test_seed() + 502;
  SCOPED_TRACE(seed_trace(seed));
  for (const QkvCase& c : kCases) {
    for (float base : {10000.0f, 500000.0f}) {
      SCOPED_TRACE(c.name() + " base " + std::to_string(base));
      Tensor qkv = randn(c.qkv_shape(), seed + c.D + 1);
      Parts p = split(qkv, c, true, base);
      Parts ref = reference_split(qkv, c);
      ops::rope_forward(ref.q, ref.q, base);
      ops::rope_forward(ref.k, ref.k, base);
      EXPECT_TRUE(allclose(p.q, ref.q, kAtol, kRtol));
      EXPECT_TRUE(allclose(p.k, ref.k, kAtol, kRtol));
      EXPECT_TRUE(allclose(p.v, ref.v, 0, 0));
      // RoPE did something: q differs from the plain split beyond rounding.
      EXPECT_FALSE(allclose(p.q, reference_split(qkv, c).q, 1e-3, 0));
    }
  }
}

TEST(QkvSplitRope, BackwardEqualsRopeBackwardThenPack) {
  const uint64_t seed = testing::test_seed() + 503;
  SCOPED_TRACE(seed_trace(seed));
  for (const QkvCase& c : kCases) {
    SCOPED_TRACE(c.name());
    Parts d{randn(c.q_shape(), seed + 1), randn(c.kv_shape(), seed + 2),
            randn(c.kv_shape(), seed + 3)};
    const Parts d_before{d.q.clone(), d.k.clone(), d.v.clone()};
    Tensor dqkv = pack(d, c, true, 10000.0f);
    // The inputs are not modified.
    EXPECT_TRUE(allclose(d.q, d_before.q, 0, 0));
    EXPECT_TRUE(allclose(d.k, d_before.k, 0, 0));
    // Reference: rotate back with the existing op, then pack without RoPE (which the
    // round-trip test ties to the reference layout).
    Parts rotated{Tensor::empty(c.q_shape()), Tensor::empty(c.kv_shape()), d.v};
    ops::rope_backward(d.q, rotated.q, 10000.0f);
    ops::rope_backward(d.k, rotated.k, 10000.0f);
    Tensor ref = pack(rotated, c, false, 10000.0f);
    EXPECT_TRUE(allclose(dqkv, ref, kAtol, kRtol));
    // RoPE is a rotation, so its backward is its inverse: pack undoes split up to rounding.
    Tensor qkv = randn(c.qkv_shape(), seed + 4);
    EXPECT_TRUE(allclose(pack(split(qkv, c, true, 10000.0f), c, true, 10000.0f), qkv, 1e-5, 1e-5));
  }
}

// d/dqkv of dot(wq, q) + dot(wk, k) + dot(wv, v), q, k, v = qkv_split_rope(qkv), is
// qkv_pack_rope_backward(wq, wk, wv).
TEST(QkvSplitRope, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 504;
  SCOPED_TRACE(seed_trace(seed));
  for (const QkvCase& c : {QkvCase{2, 5, 4, 2, 6}, QkvCase{1, 3, 2, 2, 4}}) {
    SCOPED_TRACE(c.name());
    Tensor qkv = randn(c.qkv_shape(), seed);
    Parts w{randn(c.q_shape(), seed + 1), randn(c.kv_shape(), seed + 2),
            randn(c.kv_shape(), seed + 3)};
    const float base = 10000.0f;
    auto loss = [&]() {
      Parts p = split(qkv, c, true, base);
      return dot(w.q, p.q) + dot(w.k, p.k) + dot(w.v, p.v);
    };
    Tensor numeric = finite_difference(qkv, loss);
    EXPECT_TRUE(allclose(pack(w, c, true, base), numeric, kFdAtol, kFdRtol));
  }
}

TEST(QkvSplitRope, RejectsBadArguments) {
  const QkvCase c{2, 3, 4, 2, 8};
  Tensor qkv = randn(c.qkv_shape(), 1);
  Parts p = poisoned_parts(c);
  // batch does not match q.
  EXPECT_THROW(ops::qkv_split_rope(qkv, 3, c.groups, p.q, p.k, p.v, true, 1e4f), InternalError);
  // num_query_groups does not match k, v.
  EXPECT_THROW(ops::qkv_split_rope(qkv, c.B, 1, p.q, p.k, p.v, true, 1e4f), InternalError);
  // num_query_groups does not divide the query heads.
  Tensor q3 = Tensor::empty({c.B, c.S, 3, c.D});
  Tensor qkv3 = Tensor::empty({c.B * c.S, (3 + 4) * c.D});
  EXPECT_THROW(ops::qkv_split_rope(qkv3, c.B, 2, q3, p.k, p.v, true, 1e4f), InternalError);
  // Packed row of the wrong width.
  Tensor wide = Tensor::empty({c.B * c.S, c.qkv_shape()[1] + c.D});
  EXPECT_THROW(ops::qkv_split_rope(wide, c.B, c.groups, p.q, p.k, p.v, true, 1e4f), InternalError);
  EXPECT_THROW(ops::qkv_pack_rope_backward(p.q, p.k, p.v, c.groups, true, 1e4f, wide),
               InternalError);
  // Non-positive base with RoPE.
  EXPECT_THROW(ops::qkv_split_rope(qkv, c.B, c.groups, p.q, p.k, p.v, true, 0.0f), InternalError);
  // Odd head dim with RoPE.
  const QkvCase odd{1, 2, 2, 1, 5};
  Tensor qkv_odd = randn(odd.qkv_shape(), 2);
  Parts p_odd = poisoned_parts(odd);
  EXPECT_THROW(ops::qkv_split_rope(qkv_odd, 1, 1, p_odd.q, p_odd.k, p_odd.v, true, 1e4f),
               InternalError);
  // Non-F32 on the CPU.
  Tensor qkv_bf16 = qkv.to(DType::BF16);
  EXPECT_THROW(ops::qkv_split_rope(qkv_bf16, c.B, c.groups, p.q, p.k, p.v, true, 1e4f),
               InternalError);
}

}  // namespace
}  // namespace megaton
