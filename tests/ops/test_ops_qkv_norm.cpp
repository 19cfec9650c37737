// Tests of the fused QKV split + q/k norm + RoPE op (--qk-layernorm) and its gradient (CPU
// reference): against the unfused ops it replaces, and against finite differences.
#include <cmath>
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

// CPU vs CPU fp32 (../shared/CONVENTIONS.md). Used where RoPE is involved: the fused and
// the unfused ops evaluate the same fp32 expression (x1 c - x2 s), but GCC contracts
// multiply-adds into FMAs (-ffp-contract=fast, x86-64-v3) per loop, and the two loops may
// contract differently: a difference of about one fp32 ulp. Without RoPE every value
// comes from the same fp64 expressions in the same order and must be equal bit for bit.
constexpr double kAtol = 1e-6, kRtol = 5e-6;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

struct QkvCase {
  int64_t B, S, heads, groups, D;
  int64_t tokens() const { return B * S; }
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
    {2, 64, 8, 2, 32},  // large enough (2^15 packed elements) for the threaded paths
};

// The three norm forms: RMSNorm, LayerNorm with and without bias.
struct NormForm {
  ops::QkNormType type;
  bool bias;
  std::string name() const {
    return type == ops::QkNormType::RMSNorm ? "RMSNorm" : bias ? "LayerNorm" : "LayerNorm no bias";
  }
};
const NormForm kForms[] = {{ops::QkNormType::RMSNorm, false},
                           {ops::QkNormType::LayerNorm, true},
                           {ops::QkNormType::LayerNorm, false}};

// Weights around 1 and biases around 0, random (a weight of exactly 1 would hide a
// missing multiply).
ops::QkNorm random_norm(const NormForm& form, int64_t D, uint64_t seed) {
  ops::QkNorm n;
  n.type = form.type;
  n.eps = 1e-5f;
  n.q_weight = randn({D}, seed, 0.5f);
  n.k_weight = randn({D}, seed + 1, 0.5f);
  for (int64_t j = 0; j < D; ++j) {
    n.q_weight.f32()[j] += 1.0f;
    n.k_weight.f32()[j] += 1.0f;
  }
  if (form.bias) {
    n.q_bias = randn({D}, seed + 2, 0.5f);
    n.k_bias = randn({D}, seed + 3, 0.5f);
  }
  return n;
}

ops::QkNormSaved poisoned_saved(const QkvCase& c, ops::QkNormType type) {
  ops::QkNormSaved s{Tensor::empty(c.q_shape()),
                     Tensor::empty(c.kv_shape()),
                     Tensor(),
                     Tensor::empty({c.tokens() * c.heads}),
                     Tensor(),
                     Tensor::empty({c.tokens() * c.groups})};
  if (type == ops::QkNormType::LayerNorm) {
    s.q_mean = Tensor::empty({c.tokens() * c.heads});
    s.k_mean = Tensor::empty({c.tokens() * c.groups});
  }
  for (Tensor* t : {&s.q_input, &s.k_input, &s.q_mean, &s.q_rstd, &s.k_mean, &s.k_rstd})
    if (t->defined()) poison(*t);
  return s;
}

struct Forward {
  Tensor q, k, v;
  ops::QkNormSaved saved;
};

Forward fused_forward(const Tensor& qkv, const QkvCase& c, const ops::QkNorm& norm, bool rope,
                      float base) {
  Forward f{Tensor::empty(c.q_shape()), Tensor::empty(c.kv_shape()), Tensor::empty(c.kv_shape()),
            poisoned_saved(c, norm.type)};
  poison(f.q);
  poison(f.k);
  poison(f.v);
  ops::qkv_split_norm_rope(qkv, c.B, c.groups, norm, rope, base, f.q, f.k, f.v, f.saved);
  return f;
}

// What attention.cpp ran before the fusion: split, a norm over each head's row, RoPE.
Forward unfused_forward(const Tensor& qkv, const QkvCase& c, const ops::QkNorm& norm, bool rope,
                        float base) {
  Forward f{Tensor::empty(c.q_shape()), Tensor::empty(c.kv_shape()), Tensor::empty(c.kv_shape()),
            poisoned_saved(c, norm.type)};
  ops::QkNormSaved& s = f.saved;
  ops::qkv_split_rope(qkv, c.B, c.groups, s.q_input, s.k_input, f.v, false, base);
  const Tensor* input[2] = {&s.q_input, &s.k_input};
  Tensor* out[2] = {&f.q, &f.k};
  const Tensor* weight[2] = {&norm.q_weight, &norm.k_weight};
  const Tensor* bias[2] = {&norm.q_bias, &norm.k_bias};
  Tensor* mean[2] = {&s.q_mean, &s.k_mean};
  Tensor* rstd[2] = {&s.q_rstd, &s.k_rstd};
  for (int p = 0; p < 2; ++p) {
    const Shape rows{input[p]->numel() / c.D, c.D};
    Tensor y = out[p]->view(rows);
    if (norm.type == ops::QkNormType::RMSNorm)
      ops::rmsnorm_forward(input[p]->view(rows), *weight[p], norm.eps, y, *rstd[p]);
    else
      ops::layernorm_forward(input[p]->view(rows), *weight[p], *bias[p], norm.eps, y, *mean[p],
                             *rstd[p]);
    if (rope) ops::rope_forward(*out[p], *out[p], base);
  }
  return f;
}

// Gradients of the norm parameters, F32 [d], starting at random nonzero values (the ops
// accumulate).
ops::QkNormGrads initial_grads(const ops::QkNorm& norm, int64_t D, uint64_t seed) {
  ops::QkNormGrads g{randn({D}, seed), randn({D}, seed + 1), Tensor(), Tensor()};
  if (norm.q_bias.defined()) {
    g.q_bias = randn({D}, seed + 2);
    g.k_bias = randn({D}, seed + 3);
  }
  return g;
}

ops::QkNormGrads clone(const ops::QkNormGrads& g) {
  auto copy = [](const Tensor& t) { return t.defined() ? t.clone() : Tensor(); };
  return {copy(g.q_weight), copy(g.k_weight), copy(g.q_bias), copy(g.k_bias)};
}

struct Grads {
  Tensor dq, dk, dv;
};

Tensor fused_backward(const Grads& d, const Forward& f, const QkvCase& c, const ops::QkNorm& norm,
                      bool rope, float base, ops::QkNormGrads& grads) {
  Tensor dqkv = Tensor::empty(c.qkv_shape());
  poison(dqkv);
  ops::qkv_pack_norm_rope_backward(d.dq, d.dk, d.dv, f.saved, c.groups, norm, rope, base, dqkv,
                                   grads);
  return dqkv;
}

// attention.cpp's backward before the fusion: rope_backward, the norms' backward, pack.
Tensor unfused_backward(const Grads& d, const Forward& f, const QkvCase& c, const ops::QkNorm& norm,
                        bool rope, float base, ops::QkNormGrads& grads) {
  const ops::QkNormSaved& s = f.saved;
  const Tensor* dy[2] = {&d.dq, &d.dk};
  const Tensor* input[2] = {&s.q_input, &s.k_input};
  const Tensor* weight[2] = {&norm.q_weight, &norm.k_weight};
  const Tensor* mean[2] = {&s.q_mean, &s.k_mean};
  const Tensor* rstd[2] = {&s.q_rstd, &s.k_rstd};
  Tensor* dweight[2] = {&grads.q_weight, &grads.k_weight};
  Tensor* dbias[2] = {&grads.q_bias, &grads.k_bias};
  Tensor dx[2];
  for (int p = 0; p < 2; ++p) {
    Tensor unrotated = Tensor::empty(dy[p]->shape());
    if (rope)
      ops::rope_backward(*dy[p], unrotated, base);
    else
      unrotated.copy_from(*dy[p]);
    const Shape rows{unrotated.numel() / c.D, c.D};
    dx[p] = Tensor::empty(dy[p]->shape());
    Tensor dx_rows = dx[p].view(rows);
    if (norm.type == ops::QkNormType::RMSNorm)
      ops::rmsnorm_backward(unrotated.view(rows), input[p]->view(rows), *weight[p], *rstd[p],
                            dx_rows, *dweight[p]);
    else
      ops::layernorm_backward(unrotated.view(rows), input[p]->view(rows), *weight[p], *mean[p],
                              *rstd[p], dx_rows, *dweight[p], *dbias[p]);
  }
  Tensor dqkv = Tensor::empty(c.qkv_shape());
  ops::qkv_pack_rope_backward(dx[0], dx[1], d.dv, c.groups, false, base, dqkv);
  return dqkv;
}

::testing::AssertionResult grads_close(const ops::QkNormGrads& a, const ops::QkNormGrads& b,
                                       double atol, double rtol) {
  const Tensor* x[4] = {&a.q_weight, &a.k_weight, &a.q_bias, &a.k_bias};
  const Tensor* y[4] = {&b.q_weight, &b.k_weight, &b.q_bias, &b.k_bias};
  const char* names[4] = {"q_weight", "k_weight", "q_bias", "k_bias"};
  for (int i = 0; i < 4; ++i) {
    if (x[i]->defined() != y[i]->defined())
      return ::testing::AssertionFailure() << names[i] << " defined on one side only";
    if (!x[i]->defined()) continue;
    auto r = allclose(*x[i], *y[i], atol, rtol);
    if (!r) return r << " (" << names[i] << ")";
  }
  return ::testing::AssertionSuccess();
}

TEST(QkvSplitNormRope, ForwardEqualsSplitNormThenRope) {
  const uint64_t seed = testing::test_seed() + 700;
  SCOPED_TRACE(seed_trace(seed));
  for (const QkvCase& c : kCases) {
    for (const NormForm& form : kForms) {
      for (bool rope : {false, true}) {
        SCOPED_TRACE(c.name() + " " + form.name() + (rope ? " rope" : " no rope"));
        const float base = 10000.0f;
        // A mean of 0.5 per value: LayerNorm's centring matters.
        Tensor qkv = randn(c.qkv_shape(), seed + c.D, 2.0f);
        for (int64_t i = 0; i < qkv.numel(); ++i) qkv.f32()[i] += 0.5f;
        const ops::QkNorm norm = random_norm(form, c.D, seed + 10);
        const Forward got = fused_forward(qkv, c, norm, rope, base);
        const Forward want = unfused_forward(qkv, c, norm, rope, base);
        const double atol = rope ? kAtol : 0, rtol = rope ? kRtol : 0;
        EXPECT_TRUE(allclose(got.q, want.q, atol, rtol));
        EXPECT_TRUE(allclose(got.k, want.k, atol, rtol));
        EXPECT_TRUE(allclose(got.v, want.v, 0, 0));
        EXPECT_TRUE(allclose(got.saved.q_input, want.saved.q_input, 0, 0));
        EXPECT_TRUE(allclose(got.saved.k_input, want.saved.k_input, 0, 0));
        EXPECT_TRUE(allclose(got.saved.q_rstd, want.saved.q_rstd, 0, 0));
        EXPECT_TRUE(allclose(got.saved.k_rstd, want.saved.k_rstd, 0, 0));
        if (form.type == ops::QkNormType::LayerNorm) {
          EXPECT_TRUE(allclose(got.saved.q_mean, want.saved.q_mean, 0, 0));
          EXPECT_TRUE(allclose(got.saved.k_mean, want.saved.k_mean, 0, 0));
        }
        // The norm did something: q is not the plain split.
        EXPECT_FALSE(allclose(got.q, got.saved.q_input, 1e-2, 0));
      }
    }
  }
}

// Each head is normalized on its own: scaling one query head's input scales nothing of
// the output (RMSNorm, eps negligible), while the other heads are untouched.
TEST(QkvSplitNormRope, NormalizesEachHeadOnItsOwn) {
  const uint64_t seed = testing::test_seed() + 701;
  SCOPED_TRACE(seed_trace(seed));
  const QkvCase c{1, 3, 4, 2, 8};
  ops::QkNorm norm = random_norm(kForms[0], c.D, seed + 1);
  norm.eps = 1e-12f;  // the scale invariance is exact but for eps
  Tensor qkv = randn(c.qkv_shape(), seed);
  const Forward before = fused_forward(qkv, c, norm, true, 10000.0f);
  // Query head 1 of token 2: group 0, slot 1 of the packed row.
  const int64_t row = c.qkv_shape()[1];
  for (int64_t i = 0; i < c.D; ++i) qkv.f32()[2 * row + 1 * c.D + i] *= 8.0f;
  const Forward after = fused_forward(qkv, c, norm, true, 10000.0f);
  EXPECT_TRUE(allclose(after.q, before.q, 1e-5, 1e-5));
  EXPECT_TRUE(allclose(after.k, before.k, 0, 0));
  const int64_t scaled_row = 2 * c.heads + 1;
  EXPECT_NEAR(after.saved.q_rstd.f32()[scaled_row], before.saved.q_rstd.f32()[scaled_row] / 8.0f,
              1e-6 * before.saved.q_rstd.f32()[scaled_row]);
  EXPECT_EQ(after.saved.q_rstd.f32()[scaled_row - 1], before.saved.q_rstd.f32()[scaled_row - 1]);
}

TEST(QkvSplitNormRope, BackwardEqualsRopeBackwardNormBackwardThenPack) {
  const uint64_t seed = testing::test_seed() + 702;
  SCOPED_TRACE(seed_trace(seed));
  for (const QkvCase& c : kCases) {
    for (const NormForm& form : kForms) {
      for (bool rope : {false, true}) {
        SCOPED_TRACE(c.name() + " " + form.name() + (rope ? " rope" : " no rope"));
        const float base = 500000.0f;
        Tensor qkv = randn(c.qkv_shape(), seed + c.D, 2.0f);
        const ops::QkNorm norm = random_norm(form, c.D, seed + 10);
        const Forward f = fused_forward(qkv, c, norm, rope, base);
        const Grads d{randn(c.q_shape(), seed + 20), randn(c.kv_shape(), seed + 21),
                      randn(c.kv_shape(), seed + 22)};
        const Grads d_before{d.dq.clone(), d.dk.clone(), d.dv.clone()};
        const ops::QkNormGrads initial = initial_grads(norm, c.D, seed + 30);
        ops::QkNormGrads got = clone(initial), want = clone(initial);
        Tensor dqkv = fused_backward(d, f, c, norm, rope, base, got);
        Tensor dqkv_ref = unfused_backward(d, f, c, norm, rope, base, want);
        const double atol = rope ? kAtol : 0, rtol = rope ? kRtol : 0;
        EXPECT_TRUE(allclose(dqkv, dqkv_ref, atol, rtol));
        // The weight gradients sum ~1e2-1e3 rows: the un-rotated dy's one-ulp differences
        // add up (still fp32-level relative to the sums' terms).
        EXPECT_TRUE(grads_close(got, want, rope ? 1e-5 : 0, rtol));
        // Accumulated, not overwritten: the initial values are not lost (each gradient's
        // increment is far from minus its initial value).
        EXPECT_FALSE(grads_close(got, initial, 1e-3, 0));
        // The inputs are not modified.
        EXPECT_TRUE(allclose(d.dq, d_before.dq, 0, 0));
        EXPECT_TRUE(allclose(d.dk, d_before.dk, 0, 0));
        EXPECT_TRUE(allclose(d.dv, d_before.dv, 0, 0));
      }
    }
  }
}

// d/dx of L = dot(wq, q) + dot(wk, k) + dot(wv, v), (q, k, v) = qkv_split_norm_rope(qkv),
// for x = qkv and the norm parameters, is what the backward gives for dq = wq, dk = wk,
// dv = wv.
TEST(QkvSplitNormRope, BackwardMatchesFiniteDifferences) {
  const uint64_t seed = testing::test_seed() + 703;
  SCOPED_TRACE(seed_trace(seed));
  // Finite differences with eps = 1e-2 in fp32: the loss's rounding (~1e-7 relative over
  // ~400 terms) divided by 2 eps, and the truncation error of a norm over 8 values of
  // scale 2 (third derivative ~ 1 / scale^3): both below 1e-3.
  constexpr double kFdAtol = 2e-3, kFdRtol = 2e-3;
  const QkvCase c{2, 3, 4, 2, 8};
  for (const NormForm& form : kForms) {
    SCOPED_TRACE(form.name());
    const float base = 10000.0f;
    Tensor qkv = randn(c.qkv_shape(), seed, 2.0f);
    ops::QkNorm norm = random_norm(form, c.D, seed + 1);
    const Grads w{randn(c.q_shape(), seed + 2), randn(c.kv_shape(), seed + 3),
                  randn(c.kv_shape(), seed + 4)};
    auto loss = [&]() {
      const Forward f = fused_forward(qkv, c, norm, true, base);
      return dot(w.dq, f.q) + dot(w.dk, f.k) + dot(w.dv, f.v);
    };
    const Forward f = fused_forward(qkv, c, norm, true, base);
    ops::QkNormGrads grads{Tensor::zeros({c.D}), Tensor::zeros({c.D}), Tensor(), Tensor()};
    if (form.bias) {
      grads.q_bias = Tensor::zeros({c.D});
      grads.k_bias = Tensor::zeros({c.D});
    }
    Tensor dqkv = fused_backward(w, f, c, norm, true, base, grads);
    EXPECT_TRUE(allclose(dqkv, finite_difference(qkv, loss), kFdAtol, kFdRtol));
    EXPECT_TRUE(allclose(grads.q_weight, finite_difference(norm.q_weight, loss), kFdAtol, kFdRtol));
    EXPECT_TRUE(allclose(grads.k_weight, finite_difference(norm.k_weight, loss), kFdAtol, kFdRtol));
    if (form.bias) {
      EXPECT_TRUE(allclose(grads.q_bias, finite_difference(norm.q_bias, loss), kFdAtol, kFdRtol));
      EXPECT_TRUE(allclose(grads.k_bias, finite_difference(norm.k_bias, loss), kFdAtol, kFdRtol));
    }
  }
}

TEST(QkvSplitNormRope, RejectsBadArguments) {
  const QkvCase c{2, 3, 4, 2, 8};
  const ops::QkNorm rms = random_norm(kForms[0], c.D, 1);
  const ops::QkNorm ln = random_norm(kForms[1], c.D, 1);
  Tensor qkv = randn(c.qkv_shape(), 1);
  Tensor q = Tensor::empty(c.q_shape()), k = Tensor::empty(c.kv_shape()),
         v = Tensor::empty(c.kv_shape());
  ops::QkNormSaved saved = poisoned_saved(c, ops::QkNormType::LayerNorm);
  auto forward = [&](const Tensor& x, int64_t batch, int64_t groups, const ops::QkNorm& norm,
                     bool rope, float base, Tensor& qo, ops::QkNormSaved& s) {
    ops::qkv_split_norm_rope(x, batch, groups, norm, rope, base, qo, k, v, s);
  };
  // The arguments as given here are accepted.
  EXPECT_NO_THROW(forward(qkv, c.B, c.groups, ln, true, 1e4f, q, saved));
  EXPECT_NO_THROW(forward(qkv, c.B, c.groups, rms, true, 1e4f, q, saved));
  // batch, num_query_groups.
  EXPECT_THROW(forward(qkv, c.B + 1, c.groups, ln, true, 1e4f, q, saved), InternalError);
  EXPECT_THROW(forward(qkv, c.B, 1, ln, true, 1e4f, q, saved), InternalError);
  // Non-positive base with RoPE.
  EXPECT_THROW(forward(qkv, c.B, c.groups, ln, true, 0.0f, q, saved), InternalError);
  // Non-F32 on the CPU.
  EXPECT_THROW(forward(qkv.to(DType::BF16), c.B, c.groups, ln, true, 1e4f, q, saved),
               InternalError);
  // Norm parameters: wrong size, a bias on RMSNorm, one bias only.
  ops::QkNorm bad = ln;
  bad.k_weight = randn({c.D + 1}, 2);
  EXPECT_THROW(forward(qkv, c.B, c.groups, bad, true, 1e4f, q, saved), InternalError);
  bad = ln;
  bad.type = ops::QkNormType::RMSNorm;
  EXPECT_THROW(forward(qkv, c.B, c.groups, bad, true, 1e4f, q, saved), InternalError);
  bad = ln;
  bad.k_bias = Tensor();
  EXPECT_THROW(forward(qkv, c.B, c.groups, bad, true, 1e4f, q, saved), InternalError);
  // Saved tensors: LayerNorm without means; a statistics vector of the wrong length; the
  // split heads of the wrong shape.
  ops::QkNormSaved bad_saved = poisoned_saved(c, ops::QkNormType::RMSNorm);
  EXPECT_THROW(forward(qkv, c.B, c.groups, ln, true, 1e4f, q, bad_saved), InternalError);
  bad_saved = poisoned_saved(c, ops::QkNormType::LayerNorm);
  bad_saved.k_rstd = Tensor::empty({c.tokens() * c.heads});
  EXPECT_THROW(forward(qkv, c.B, c.groups, ln, true, 1e4f, q, bad_saved), InternalError);
  bad_saved = poisoned_saved(c, ops::QkNormType::LayerNorm);
  bad_saved.q_input = Tensor::empty(c.kv_shape());
  EXPECT_THROW(forward(qkv, c.B, c.groups, ln, true, 1e4f, q, bad_saved), InternalError);
  // An output inside qkv: q as the first half of qkv's rows (T np d = T/2 rows of 8 d).
  Tensor q_in_qkv = qkv.rows(0, c.tokens() / 2).view(c.q_shape());
  EXPECT_THROW(forward(qkv, c.B, c.groups, ln, true, 1e4f, q_in_qkv, saved), InternalError);

  // Backward.
  ASSERT_NO_THROW(forward(qkv, c.B, c.groups, ln, true, 1e4f, q, saved));
  Tensor dqkv = Tensor::empty(c.qkv_shape());
  ops::QkNormGrads grads = initial_grads(ln, c.D, 3);
  auto backward = [&](const Tensor& dq, const ops::QkNorm& norm, Tensor& out, ops::QkNormGrads& g) {
    ops::qkv_pack_norm_rope_backward(dq, k, v, saved, c.groups, norm, true, 1e4f, out, g);
  };
  EXPECT_NO_THROW(backward(q, ln, dqkv, grads));
  // A gradient of the wrong size or dtype; bias gradients without a bias.
  ops::QkNormGrads bad_grads = initial_grads(ln, c.D, 3);
  bad_grads.q_weight = randn({c.D - 1}, 4);
  EXPECT_THROW(backward(q, ln, dqkv, bad_grads), InternalError);
  bad_grads = initial_grads(ln, c.D, 3);
  bad_grads.k_bias = bad_grads.k_bias.to(DType::BF16);
  EXPECT_THROW(backward(q, ln, dqkv, bad_grads), InternalError);
  ops::QkNorm ln_no_bias = ln;
  ln_no_bias.q_bias = ln_no_bias.k_bias = Tensor();
  bad_grads = initial_grads(ln, c.D, 3);
  EXPECT_THROW(backward(q, ln_no_bias, dqkv, bad_grads), InternalError);
  // dqkv of the wrong width; dqkv sharing memory with dq.
  Tensor wide = Tensor::empty({c.tokens(), c.qkv_shape()[1] + c.D});
  EXPECT_THROW(backward(q, ln, wide, grads), InternalError);
  Tensor dq_in_dqkv = dqkv.rows(0, c.tokens() / 2).view(c.q_shape());
  EXPECT_THROW(backward(dq_in_dqkv, ln, dqkv, grads), InternalError);
}

}  // namespace
}  // namespace megaton
