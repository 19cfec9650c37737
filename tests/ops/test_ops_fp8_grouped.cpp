// The CPU FP8 grouped GEMM (ops/fp8.h fp8_grouped_gemm): each group equals ops::fp8_gemm
// on that group bit for bit (the contract's definition), groups with a zero dimension leave
// their c untouched (also when K is 0 and beta is not 1, where a GEMM would scale c), and
// every mismatch the contract names raises InternalError.
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/fp8.h"

namespace megaton {
namespace {

using testing::randn;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

// An FP8 operand with its per-tensor dequantization factor.
struct Operand {
  Tensor q, scale_inv;
};

// x [rows, cols] = N(0, 1) * magnitude, quantized with current scaling (scale from amax).
// Different magnitudes give the groups different scales.
Operand quantized(int64_t rows, int64_t cols, DType fp8, float magnitude, uint64_t seed) {
  Tensor x = randn({rows, cols}, seed, magnitude);
  Operand op{Tensor::empty({rows, cols}, fp8), Tensor::from({1}, {1.0f})};
  Tensor amax = Tensor::empty({1}), scale = Tensor::from({1}, {1.0f}), none;
  ops::fp8_amax(x, amax);
  ops::fp8_update_scale(amax, {fp8, 0.0f, 0.0f, false}, scale, op.scale_inv);
  ops::fp8_quantize(x, scale, op.q, none, none);
  return op;
}

::testing::AssertionResult same_bytes(const Tensor& got, const Tensor& want, const char* what) {
  if (got.dtype() != want.dtype() || got.shape() != want.shape())
    return ::testing::AssertionFailure()
           << what << ": " << dtype_name(got.dtype()) << " " << shape_str(got.shape()) << " vs "
           << dtype_name(want.dtype()) << " " << shape_str(want.shape());
  const size_t size = dtype_size(got.dtype());
  const auto* a = static_cast<const unsigned char*>(got.raw());
  const auto* b = static_cast<const unsigned char*>(want.raw());
  for (int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(a + i * size, b + i * size, size) != 0)
      return ::testing::AssertionFailure()
             << what << " element " << i << ": " << got.item(i) << " vs " << want.item(i);
  return ::testing::AssertionSuccess();
}

// Groups of one grouped call: shapes [M_g, K_g] x [N_g, K_g] -> [M_g, N_g].
struct Groups {
  std::vector<Tensor> a, a_scale_inv, b, b_scale_inv, c;
};

Groups make_groups(const std::vector<std::array<int64_t, 3>>& mnk, DType a_fp8, DType b_fp8,
                   DType c_dtype, uint64_t seed) {
  Groups out;
  for (size_t g = 0; g < mnk.size(); ++g) {
    const auto [m, n, k] = mnk[g];
    // Magnitudes 2^-3 .. 2^3 apart: each group its own scales.
    const float magnitude = std::ldexp(1.3f, int(g % 7) - 3);
    Operand a = quantized(m, k, a_fp8, magnitude, seed + 10 * g);
    Operand b = quantized(n, k, b_fp8, 1.0f / magnitude, seed + 10 * g + 1);
    out.a.push_back(a.q);
    out.a_scale_inv.push_back(a.scale_inv);
    out.b.push_back(b.q);
    out.b_scale_inv.push_back(b.scale_inv);
    out.c.push_back(randn({m, n}, seed + 10 * g + 2).to(c_dtype));  // beta != 0 reads it
  }
  return out;
}

std::vector<Tensor> clones(const std::vector<Tensor>& list) {
  std::vector<Tensor> out;
  for (const Tensor& t : list) out.push_back(t.clone());
  return out;
}

TEST(OpsFp8Grouped, EachGroupEqualsFp8Gemm) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  struct Case {
    std::vector<std::array<int64_t, 3>> mnk;
    DType a, b, c;
    float alpha, beta;
    bool fast;
  };
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2, bf16 = DType::BF16, f32 = DType::F32;
  const std::vector<Case> cases = {
      // forward-like: M_g varies, N and K fixed
      {{{16, 32, 64}, {48, 32, 64}, {32, 32, 64}}, e4, e4, bf16, 1.0f, 0.0f, true},
      // input-gradient-like (hybrid: the E5M2 gradient times the E4M3 weight)
      {{{32, 48, 32}, {16, 48, 32}}, e5, e4, bf16, 0.5f, 0.0f, false},
      // weight-gradient-like: M, N fixed, K_g (tokens) varies, accumulating into F32
      {{{32, 16, 48}, {32, 16, 16}, {32, 16, 96}}, e5, e4, f32, 1.0f, 1.0f, false},
      {{{16, 16, 32}, {48, 32, 16}}, e4, e5, bf16, 2.0f, 0.5f, false},
  };
  for (const Case& t : cases) {
    SCOPED_TRACE(std::string(dtype_name(t.a)) + " x " + std::string(dtype_name(t.b)) + " -> " +
                 std::string(dtype_name(t.c)) + " alpha " + std::to_string(t.alpha) + " beta " +
                 std::to_string(t.beta));
    Groups groups = make_groups(t.mnk, t.a, t.b, t.c, seed);
    std::vector<Tensor> want = clones(groups.c);
    for (size_t g = 0; g < t.mnk.size(); ++g)
      ops::fp8_gemm(groups.a[g], groups.a_scale_inv[g], groups.b[g], groups.b_scale_inv[g], want[g],
                    t.alpha, t.beta);
    ops::fp8_grouped_gemm(groups.a, groups.a_scale_inv, groups.b, groups.b_scale_inv, groups.c,
                          t.alpha, t.beta, t.fast);
    for (size_t g = 0; g < t.mnk.size(); ++g) {
      SCOPED_TRACE("group " + std::to_string(g));
      EXPECT_TRUE(same_bytes(groups.c[g], want[g], "c"));
    }
  }
}

TEST(OpsFp8Grouped, GroupsWithAZeroDimensionAreSkipped) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // Group 1 has no tokens along K (the weight gradient of an expert that got none): its
  // c keeps its values even with beta 0 and 0.5, where a GEMM would scale them. Group 2
  // has no rows, group 3 no columns; groups 0 and 4 are ordinary.
  const std::vector<std::array<int64_t, 3>> mnk = {
      {32, 16, 48}, {32, 16, 0}, {0, 16, 48}, {32, 0, 48}, {16, 32, 32}};
  for (float beta : {0.0f, 0.5f, 1.0f}) {
    SCOPED_TRACE("beta " + std::to_string(beta));
    Groups groups = make_groups(mnk, DType::F8E5M2, DType::F8E4M3, DType::F32, seed);
    std::vector<Tensor> start = clones(groups.c);
    ops::fp8_grouped_gemm(groups.a, groups.a_scale_inv, groups.b, groups.b_scale_inv, groups.c,
                          1.0f, beta);
    EXPECT_TRUE(same_bytes(groups.c[1], start[1], "c[1] (K 0)"));
    for (size_t g : {size_t(0), size_t(4)}) {
      Tensor want = start[g].clone();
      ops::fp8_gemm(groups.a[g], groups.a_scale_inv[g], groups.b[g], groups.b_scale_inv[g], want,
                    1.0f, beta);
      EXPECT_TRUE(same_bytes(groups.c[g], want, "c"));
    }
  }
  // All groups empty, and no groups at all: nothing to do.
  Groups empty =
      make_groups({{0, 16, 16}, {16, 16, 0}}, DType::F8E4M3, DType::F8E4M3, DType::BF16, seed);
  Tensor kept = empty.c[1].clone();
  ops::fp8_grouped_gemm(empty.a, empty.a_scale_inv, empty.b, empty.b_scale_inv, empty.c);
  EXPECT_TRUE(same_bytes(empty.c[1], kept, "c[1]"));
  ops::fp8_grouped_gemm({}, {}, {}, {}, {});
}

TEST(OpsFp8Grouped, DoorChecksThrow) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<std::array<int64_t, 3>> mnk = {{16, 32, 64}, {32, 32, 64}};
  const Groups good = make_groups(mnk, DType::F8E4M3, DType::F8E4M3, DType::BF16, seed);
  auto call = [](const Groups& g) {
    ops::fp8_grouped_gemm(g.a, g.a_scale_inv, g.b, g.b_scale_inv, g.c);
  };
  EXPECT_NO_THROW(call(good));
  auto with = [&](auto edit) {
    Groups g = good;
    edit(g);
    return g;
  };
  const Tensor e4 = Tensor::empty({32, 64}, DType::F8E4M3);
  // List lengths.
  EXPECT_THROW(call(with([](Groups& g) { g.c.pop_back(); })), InternalError);
  EXPECT_THROW(call(with([](Groups& g) { g.b_scale_inv.pop_back(); })), InternalError);
  EXPECT_THROW(call(with([](Groups& g) { g.a_scale_inv.push_back(g.a_scale_inv[0]); })),
               InternalError);
  // Undefined entries.
  EXPECT_THROW(call(with([](Groups& g) { g.b[1] = Tensor(); })), InternalError);
  EXPECT_THROW(call(with([](Groups& g) { g.a_scale_inv[1] = Tensor(); })), InternalError);
  // Dtypes: a not FP8, one group's a of another format, both E5M2, c not F32/BF16, c
  // dtypes differ between groups.
  EXPECT_THROW(call(with([](Groups& g) { g.a[1] = Tensor::zeros({32, 64}); })), InternalError);
  EXPECT_THROW(call(with([](Groups& g) {
                 g.a[1] = Tensor::empty({32, 64}, DType::F8E5M2);
               })),
               InternalError);
  EXPECT_THROW(
      call(with([](Groups& g) {
        g.a = {Tensor::empty({16, 64}, DType::F8E5M2), Tensor::empty({32, 64}, DType::F8E5M2)};
        g.b = {Tensor::empty({32, 64}, DType::F8E5M2), Tensor::empty({32, 64}, DType::F8E5M2)};
      })),
      InternalError);
  EXPECT_THROW(call(with([](Groups& g) {
                 g.c = {Tensor::empty({16, 32}, DType::I32), Tensor::empty({32, 32}, DType::I32)};
               })),
               InternalError);
  EXPECT_THROW(call(with([](Groups& g) { g.c[1] = Tensor::zeros({32, 32}); })), InternalError);
  // Shapes: K of a and b differ, c not [M, N], a not a matrix, a dimension not a multiple
  // of 16 (M, N, K in turn).
  EXPECT_THROW(call(with([](Groups& g) {
                 g.b[1] = Tensor::empty({32, 48}, DType::F8E4M3);
               })),
               InternalError);
  EXPECT_THROW(call(with([](Groups& g) {
                 g.c[0] = Tensor::empty({16, 48}, DType::BF16);
               })),
               InternalError);
  EXPECT_THROW(call(with([&](Groups& g) { g.a[1] = e4.view({32, 64, 1}); })), InternalError);
  EXPECT_THROW(call(with([](Groups& g) {
                 g.a[0] = Tensor::empty({8, 64}, DType::F8E4M3);
                 g.c[0] = Tensor::empty({8, 32}, DType::BF16);
               })),
               InternalError);
  EXPECT_THROW(call(with([](Groups& g) {
                 g.b[0] = Tensor::empty({24, 64}, DType::F8E4M3);
                 g.c[0] = Tensor::empty({16, 24}, DType::BF16);
               })),
               InternalError);
  EXPECT_THROW(call(with([](Groups& g) {
                 g.a[0] = Tensor::empty({16, 40}, DType::F8E4M3);
                 g.b[0] = Tensor::empty({32, 40}, DType::F8E4M3);
               })),
               InternalError);
  // Scales: not [1] (a blockwise shape), not F32.
  EXPECT_THROW(call(with([](Groups& g) {
                 g.a_scale_inv[1] = Tensor::zeros({32, 1});
               })),
               InternalError);
  EXPECT_THROW(call(with([](Groups& g) { g.b_scale_inv[0] = Tensor::zeros({1}, DType::BF16); })),
               InternalError);
  // A failed check leaves c as it was (the checks come before any group runs).
  Groups bad = with([](Groups& g) { g.b_scale_inv[1] = Tensor::zeros({2}); });
  std::vector<Tensor> before = clones(bad.c);
  EXPECT_THROW(call(bad), InternalError);
  EXPECT_TRUE(same_bytes(bad.c[0], before[0], "c[0]"));
}

}  // namespace
}  // namespace megaton
