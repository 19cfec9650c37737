// Partial RoPE (Megatron's --rotary-percent, ops' rotary_dim) in the ops that rotate:
// rope_forward / rope_backward, qkv_split_rope / qkv_pack_rope_backward and
// qkv_split_norm_rope / qkv_pack_norm_rope_backward (CPU reference), each against a hand
// reference written from Megatron's definition (RotaryEmbedding.__init__ and
// apply_rotary_pos_emb_bshd in megatron/core/models/common/embeddings/): the first R
// channels of a head rotated in the rotate-half form within them, with frequencies
// 1 / base^(2i / R), the channels [R, D) passed through.
#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::dot;
using testing::finite_difference;
using testing::poison;
using testing::randn;

// CPU vs CPU fp32 (../shared/CONVENTIONS.md). The reference rotates in fp64 from the same
// fp32 angles; the ops rotate in fp32: a few fp32 ulps apart.
constexpr double kAtol = 1e-6, kRtol = 5e-6;
constexpr float kBase = 10000.0f;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

// x [B, S, heads, D]: the first R channels of every head rotated by sign * angle of the
// token's position (positions[b * S + s]), rotate-half within those R channels; the tail
// copied. Megatron: inv_freq = 1 / base ** (arange(0, R, 2, float32) / R) in fp32, freqs =
// position * inv_freq in fp32, t_rot * cos + rotate_half(t_rot) * sin on t[..., :R],
// cat with t[..., R:].
Tensor reference_rope(const Tensor& x, int64_t R, float base, const std::vector<int64_t>& positions,
                      double sign) {
  const int64_t tokens = x.dim(0) * x.dim(1), heads = x.dim(2), D = x.dim(3), half = R / 2;
  Tensor y = x.clone();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float inv_freq = 1.0f / std::pow(base, float(2 * i) / float(R));
      const float angle = float(positions[size_t(t)]) * inv_freq;
      const double c = std::cos(double(angle)), s = sign * std::sin(double(angle));
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = x.f32() + (t * heads + h) * D;
        float* out = y.f32() + (t * heads + h) * D;
        out[i] = float(double(in[i]) * c - double(in[i + half]) * s);
        out[i + half] = float(double(in[i + half]) * c + double(in[i]) * s);
      }
    }
  }
  return y;
}

// Position s within each of B sequences of S tokens, plus an offset.
std::vector<int64_t> sequence_positions(int64_t B, int64_t S, int64_t offset = 0) {
  std::vector<int64_t> p;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) p.push_back(s + offset);
  return p;
}

// Packed documents: positions restarting (lengths 2 and 3, 4 and 1), with large ones.
std::vector<int64_t> packed_positions() { return {0, 1, 0, 1, 2, 0, 1, 2, 3, 4090}; }
Tensor to_i32(const std::vector<int64_t>& p) {
  return Tensor::from_i32({int64_t(p.size())}, std::vector<int32_t>(p.begin(), p.end()));
}

// x's channels [R, D) of every head, as a [rows, D - R] tensor (to compare exactly).
Tensor tail_of(const Tensor& x, int64_t R) {
  const int64_t D = x.dim(3), rows = x.numel() / D;
  Tensor t = Tensor::empty({rows, D - R});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = R; j < D; ++j) t.f32()[r * (D - R) + j - R] = x.f32()[r * D + j];
  return t;
}

struct RopeCase {
  int64_t D, R;
  std::string name() const {
    std::string out = "D";  // appended, not "D" + ...: GCC 12's -Wrestrict false positive
    out += std::to_string(D) + " R" + std::to_string(R);
    return out;
  }
};
// R/2 odd and even, the smallest R, R = D, and an odd D with an even R.
const RopeCase kRopeCases[] = {{8, 4}, {12, 6}, {10, 2}, {16, 8}, {8, 8}, {7, 4}};

TEST(PartialRope, RopeForwardAndBackwardMatchTheReference) {
  const uint64_t seed = testing::test_seed() + 1100;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t B = 2, S = 5, heads = 3;
  for (const RopeCase& c : kRopeCases) {
    for (int64_t offset : {int64_t(0), int64_t(4000)}) {
      SCOPED_TRACE(c.name() + " offset " + std::to_string(offset));
      const Tensor x = randn({B, S, heads, c.D}, seed + c.D + c.R);
      const std::vector<int64_t> pos = sequence_positions(B, S, offset);
      Tensor y = Tensor::empty(x.shape()), dx = Tensor::empty(x.shape());
      poison(y);
      poison(dx);
      ops::rope_forward(x, y, kBase, offset, c.R);
      ops::rope_backward(x, dx, kBase, offset, c.R);
      EXPECT_TRUE(allclose(y, reference_rope(x, c.R, kBase, pos, 1.0), kAtol, kRtol));
      EXPECT_TRUE(allclose(dx, reference_rope(x, c.R, kBase, pos, -1.0), kAtol, kRtol));
      // The tail passes through exactly; the rotated part moved.
      if (c.R < c.D) {
        EXPECT_TRUE(allclose(tail_of(y, c.R), tail_of(x, c.R), 0, 0));
        EXPECT_TRUE(allclose(tail_of(dx, c.R), tail_of(x, c.R), 0, 0));
      }
      EXPECT_FALSE(allclose(y, x, 1e-3, 0));
      // In place (y aliases x) gives the same values.
      Tensor in_place = x.clone();
      ops::rope_forward(in_place, in_place, kBase, offset, c.R);
      EXPECT_TRUE(allclose(in_place, y, 0, 0));
    }
  }
}

// rotary_dim = D is the default (0: the whole head), bit for bit.
TEST(PartialRope, RotaryDimOfTheWholeHeadIsTheDefault) {
  const Tensor x = randn({2, 4, 3, 8}, testing::test_seed() + 1110);
  Tensor a = Tensor::empty(x.shape()), b = Tensor::empty(x.shape());
  ops::rope_forward(x, a, kBase, 3);
  ops::rope_forward(x, b, kBase, 3, 8);
  EXPECT_TRUE(allclose(a, b, 0, 0));
}

struct QkvCase {
  int64_t B, S, heads, groups, D, R;
  int64_t tokens() const { return B * S; }
  Shape qkv_shape() const { return {B * S, (heads + 2 * groups) * D}; }
  Shape q_shape() const { return {B, S, heads, D}; }
  Shape kv_shape() const { return {B, S, groups, D}; }
  std::string name() const {
    std::string out = "np";
    out += std::to_string(heads) + " ng" + std::to_string(groups) + " D" + std::to_string(D) +
           " R" + std::to_string(R);
    return out;
  }
};
// B * S = 10 tokens (packed_positions' length).
const QkvCase kQkvCases[] = {{2, 5, 4, 2, 8, 4}, {1, 10, 3, 3, 12, 6}, {2, 5, 2, 1, 10, 2},
                             {2, 5, 4, 2, 7, 4}};

struct Parts {
  Tensor q, k, v;
};
Parts empty_parts(const QkvCase& c) {
  Parts p{Tensor::empty(c.q_shape()), Tensor::empty(c.kv_shape()), Tensor::empty(c.kv_shape())};
  poison(p.q);
  poison(p.k);
  poison(p.v);
  return p;
}

TEST(PartialRope, QkvSplitRopeAndPackMatchTheReference) {
  const uint64_t seed = testing::test_seed() + 1120;
  SCOPED_TRACE(seed_trace(seed));
  for (const QkvCase& c : kQkvCases) {
    for (bool packed : {false, true}) {
      SCOPED_TRACE(c.name() + (packed ? " position ids" : ""));
      const std::vector<int64_t> pos = packed ? packed_positions() : sequence_positions(c.B, c.S);
      const Tensor ids = packed ? to_i32(pos) : Tensor();
      const Tensor qkv = randn(c.qkv_shape(), seed + c.D);
      Parts got = empty_parts(c), split = empty_parts(c);
      ops::qkv_split_rope(qkv, c.B, c.groups, got.q, got.k, got.v, true, kBase, ids, c.R);
      ops::qkv_split_rope(qkv, c.B, c.groups, split.q, split.k, split.v, false, kBase);
      EXPECT_TRUE(allclose(got.q, reference_rope(split.q, c.R, kBase, pos, 1.0), kAtol, kRtol));
      EXPECT_TRUE(allclose(got.k, reference_rope(split.k, c.R, kBase, pos, 1.0), kAtol, kRtol));
      EXPECT_TRUE(allclose(got.v, split.v, 0, 0));  // v is never rotated
      EXPECT_TRUE(allclose(tail_of(got.q, c.R), tail_of(split.q, c.R), 0, 0));
      EXPECT_TRUE(allclose(tail_of(got.k, c.R), tail_of(split.k, c.R), 0, 0));

      // The gradient: the inverse rotation of dq and dk, then the plain pack.
      const Parts d{randn(c.q_shape(), seed + 1), randn(c.kv_shape(), seed + 2),
                    randn(c.kv_shape(), seed + 3)};
      Tensor dqkv = Tensor::empty(c.qkv_shape()), want = Tensor::empty(c.qkv_shape());
      poison(dqkv);
      ops::qkv_pack_rope_backward(d.q, d.k, d.v, c.groups, true, kBase, dqkv, ids, c.R);
      ops::qkv_pack_rope_backward(reference_rope(d.q, c.R, kBase, pos, -1.0),
                                  reference_rope(d.k, c.R, kBase, pos, -1.0), d.v, c.groups, false,
                                  kBase, want);
      EXPECT_TRUE(allclose(dqkv, want, kAtol, kRtol));
    }
  }
}

// d/dqkv of dot(wq, q) + dot(wk, k) + dot(wv, v) is the backward of (wq, wk, wv).
TEST(PartialRope, QkvPackRopeBackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 1130;
  SCOPED_TRACE(seed_trace(seed));
  // A linear map: only the fp32 rounding of the loss over ~1e3 terms, divided by 2 eps.
  constexpr double kFdAtol = 1e-3, kFdRtol = 1e-3;
  const QkvCase c{2, 3, 4, 2, 10, 6};
  Tensor qkv = randn(c.qkv_shape(), seed);
  const Parts w{randn(c.q_shape(), seed + 1), randn(c.kv_shape(), seed + 2),
                randn(c.kv_shape(), seed + 3)};
  auto loss = [&]() {
    Parts p = empty_parts(c);
    ops::qkv_split_rope(qkv, c.B, c.groups, p.q, p.k, p.v, true, kBase, Tensor(), c.R);
    return dot(w.q, p.q) + dot(w.k, p.k) + dot(w.v, p.v);
  };
  Tensor dqkv = Tensor::empty(c.qkv_shape());
  ops::qkv_pack_rope_backward(w.q, w.k, w.v, c.groups, true, kBase, dqkv, Tensor(), c.R);
  EXPECT_TRUE(allclose(dqkv, finite_difference(qkv, loss), kFdAtol, kFdRtol));
}

ops::QkNorm random_norm(ops::QkNormType type, int64_t D, uint64_t seed) {
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

ops::QkNormSaved empty_saved(const QkvCase& c, ops::QkNormType type) {
  ops::QkNormSaved s;
  s.q_input = Tensor::empty(c.q_shape());
  s.k_input = Tensor::empty(c.kv_shape());
  s.q_rstd = Tensor::empty({c.tokens() * c.heads});
  s.k_rstd = Tensor::empty({c.tokens() * c.groups});
  if (type == ops::QkNormType::LayerNorm) {
    s.q_mean = Tensor::empty({c.tokens() * c.heads});
    s.k_mean = Tensor::empty({c.tokens() * c.groups});
  }
  return s;
}

ops::QkNormGrads zero_grads(int64_t D, bool bias) {
  ops::QkNormGrads g{Tensor::zeros({D}), Tensor::zeros({D}), Tensor(), Tensor()};
  if (bias) {
    g.q_bias = Tensor::zeros({D});
    g.k_bias = Tensor::zeros({D});
  }
  return g;
}

// The norm covers the whole head; RoPE then rotates its first R channels.
TEST(PartialRope, QkvSplitNormRopeMatchesTheReference) {
  for (ops::QkNormType type : {ops::QkNormType::RMSNorm, ops::QkNormType::LayerNorm}) {
    const bool layernorm = type == ops::QkNormType::LayerNorm;
    const uint64_t seed = testing::test_seed() + 1140 + (layernorm ? 10 : 0);
    SCOPED_TRACE(std::string(layernorm ? "LayerNorm, " : "RMSNorm, ") + seed_trace(seed));
    for (const QkvCase& c : kQkvCases) {
      for (bool packed : {false, true}) {
        SCOPED_TRACE(c.name() + (packed ? " position ids" : ""));
        const std::vector<int64_t> pos =
            packed ? packed_positions() : sequence_positions(c.B, c.S);
        const Tensor ids = packed ? to_i32(pos) : Tensor();
        const Tensor qkv = randn(c.qkv_shape(), seed + c.D, 2.0f);
        const ops::QkNorm norm = random_norm(type, c.D, seed + 1);
        Parts got = empty_parts(c), normed = empty_parts(c);
        ops::QkNormSaved saved = empty_saved(c, type), saved_normed = empty_saved(c, type);
        ops::qkv_split_norm_rope(qkv, c.B, c.groups, norm, true, kBase, got.q, got.k, got.v, saved,
                                 ids, c.R);
        ops::qkv_split_norm_rope(qkv, c.B, c.groups, norm, false, kBase, normed.q, normed.k,
                                 normed.v, saved_normed);
        EXPECT_TRUE(allclose(got.q, reference_rope(normed.q, c.R, kBase, pos, 1.0), kAtol, kRtol));
        EXPECT_TRUE(allclose(got.k, reference_rope(normed.k, c.R, kBase, pos, 1.0), kAtol, kRtol));
        EXPECT_TRUE(allclose(got.v, normed.v, 0, 0));
        EXPECT_TRUE(allclose(tail_of(got.q, c.R), tail_of(normed.q, c.R), 0, 0));
        EXPECT_TRUE(allclose(saved.q_rstd, saved_normed.q_rstd, 0, 0));

        // Backward: the inverse rotation (hand reference), then the op without RoPE.
        const Parts d{randn(c.q_shape(), seed + 2), randn(c.kv_shape(), seed + 3),
                      randn(c.kv_shape(), seed + 4)};
        Tensor dqkv = Tensor::empty(c.qkv_shape()), want = Tensor::empty(c.qkv_shape());
        poison(dqkv);
        ops::QkNormGrads grads = zero_grads(c.D, layernorm);
        ops::QkNormGrads grads_want = zero_grads(c.D, layernorm);
        ops::qkv_pack_norm_rope_backward(d.q, d.k, d.v, saved, c.groups, norm, true, kBase, dqkv,
                                         grads, ids, c.R);
        ops::qkv_pack_norm_rope_backward(reference_rope(d.q, c.R, kBase, pos, -1.0),
                                         reference_rope(d.k, c.R, kBase, pos, -1.0), d.v,
                                         saved_normed, c.groups, norm, false, kBase, want,
                                         grads_want);
        EXPECT_TRUE(allclose(dqkv, want, 1e-5, kRtol));
        EXPECT_TRUE(allclose(grads.q_weight, grads_want.q_weight, 1e-5, kRtol));
        EXPECT_TRUE(allclose(grads.k_weight, grads_want.k_weight, 1e-5, kRtol));
        if (layernorm) {
          EXPECT_TRUE(allclose(grads.q_bias, grads_want.q_bias, 1e-5, kRtol));
          EXPECT_TRUE(allclose(grads.k_bias, grads_want.k_bias, 1e-5, kRtol));
        }
      }
    }
  }
}

TEST(PartialRope, QkvPackNormRopeBackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 1160;
  SCOPED_TRACE(seed_trace(seed));
  // As test_ops_qkv_norm.cpp's: fp32 rounding of the loss and the norm's truncation error.
  constexpr double kFdAtol = 2e-3, kFdRtol = 2e-3;
  const QkvCase c{2, 3, 4, 2, 10, 6};
  const ops::QkNormType type = ops::QkNormType::LayerNorm;
  Tensor qkv = randn(c.qkv_shape(), seed, 2.0f);
  ops::QkNorm norm = random_norm(type, c.D, seed + 1);
  const Parts w{randn(c.q_shape(), seed + 2), randn(c.kv_shape(), seed + 3),
                randn(c.kv_shape(), seed + 4)};
  auto forward = [&](Parts& p, ops::QkNormSaved& s) {
    ops::qkv_split_norm_rope(qkv, c.B, c.groups, norm, true, kBase, p.q, p.k, p.v, s, Tensor(),
                             c.R);
  };
  auto loss = [&]() {
    Parts p = empty_parts(c);
    ops::QkNormSaved s = empty_saved(c, type);
    forward(p, s);
    return dot(w.q, p.q) + dot(w.k, p.k) + dot(w.v, p.v);
  };
  Parts p = empty_parts(c);
  ops::QkNormSaved saved = empty_saved(c, type);
  forward(p, saved);
  ops::QkNormGrads grads = zero_grads(c.D, true);
  Tensor dqkv = Tensor::empty(c.qkv_shape());
  ops::qkv_pack_norm_rope_backward(w.q, w.k, w.v, saved, c.groups, norm, true, kBase, dqkv, grads,
                                   Tensor(), c.R);
  EXPECT_TRUE(allclose(dqkv, finite_difference(qkv, loss), kFdAtol, kFdRtol));
  EXPECT_TRUE(allclose(grads.q_weight, finite_difference(norm.q_weight, loss), kFdAtol, kFdRtol));
  EXPECT_TRUE(allclose(grads.k_bias, finite_difference(norm.k_bias, loss), kFdAtol, kFdRtol));
}

// An odd rotary dim, one past the head dim, or a negative one: InternalError in every op.
TEST(PartialRope, BadRotaryDimsAreRefused) {
  const QkvCase c{1, 2, 2, 1, 8, 4};
  const Tensor x = randn(c.q_shape(), 1), qkv = randn(c.qkv_shape(), 2);
  Tensor y = Tensor::empty(c.q_shape()), dqkv = Tensor::empty(c.qkv_shape());
  Parts p = empty_parts(c);
  const ops::QkNorm norm = random_norm(ops::QkNormType::RMSNorm, c.D, 3);
  ops::QkNormSaved saved = empty_saved(c, ops::QkNormType::RMSNorm);
  ops::QkNormGrads grads = zero_grads(c.D, false);
  for (int64_t bad : {int64_t(3), int64_t(10), int64_t(-2)}) {
    SCOPED_TRACE("rotary_dim " + std::to_string(bad));
    EXPECT_THROW(ops::rope_forward(x, y, kBase, 0, bad), InternalError);
    EXPECT_THROW(ops::rope_backward(x, y, kBase, 0, bad), InternalError);
    EXPECT_THROW(ops::qkv_split_rope(qkv, c.B, c.groups, p.q, p.k, p.v, true, kBase, Tensor(), bad),
                 InternalError);
    EXPECT_THROW(
        ops::qkv_pack_rope_backward(p.q, p.k, p.v, c.groups, true, kBase, dqkv, Tensor(), bad),
        InternalError);
    EXPECT_THROW(ops::qkv_split_norm_rope(qkv, c.B, c.groups, norm, true, kBase, p.q, p.k, p.v,
                                          saved, Tensor(), bad),
                 InternalError);
    EXPECT_THROW(ops::qkv_pack_norm_rope_backward(p.q, p.k, p.v, saved, c.groups, norm, true, kBase,
                                                  dqkv, grads, Tensor(), bad),
                 InternalError);
  }
  // Without RoPE the fused ops do not read it.
  EXPECT_NO_THROW(
      ops::qkv_split_rope(qkv, c.B, c.groups, p.q, p.k, p.v, false, kBase, Tensor(), 3));
}

}  // namespace
}  // namespace megaton
