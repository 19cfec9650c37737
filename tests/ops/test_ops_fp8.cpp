// The CPU FP8 ops (ops/fp8.h): the cast (hand-worked codes, a brute-force nearest-even
// reference over every FP8 code, and PyTorch's casts in tests/golden/fp8_golden.safetensors
// from tools/make_fp8_golden.py, bit for bit), amax, the scale rule, delayed scaling's
// history, blockwise quantization, dequantization bounds and the FP8 GEMM against an fp64
// loop over the dequantized values.
#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "common/testing.h"
#include "ops/fp8.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using ops::Fp8ScaleRule;
using testing::poison;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

constexpr float kInf = INFINITY;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------------------
// An independent model of the formats (OCP FP8): E4M3 has bias 7, no inf, NaN at
// S.1111.111; E5M2 has bias 15 and IEEE inf/NaN at exponent 31.

double decode(uint8_t code, bool e4m3) {
  const int man_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, exp_max = e4m3 ? 15 : 31;
  const int e = (code & 0x7F) >> man_bits, m = code & ((1 << man_bits) - 1);
  double v;
  if (e4m3 && e == exp_max && m == 7)
    v = NAN;
  else if (!e4m3 && e == exp_max)
    v = m == 0 ? INFINITY : NAN;
  else if (e == 0)
    v = std::ldexp(double(m), 1 - bias - man_bits);
  else
    v = std::ldexp(double((1 << man_bits) + m), e - bias - man_bits);
  return code & 0x80 ? -v : v;
}

// fp8.h's cast of x * scale by brute force: the fp32 product, clamped to +-max, goes to
// the nearest finite code (ties to the even code); NaN to 0x7F with x's sign.
uint8_t reference_cast(float x, float scale, bool e4m3) {
  const float p = x * scale;
  if (std::isnan(p)) return std::signbit(x) ? 0xFF : 0x7F;
  const double a = std::min(std::fabs(double(p)), e4m3 ? 448.0 : 57344.0);
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < 128; ++c) {
    const double v = decode(uint8_t(c), e4m3);
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(v - a);
    if (best < 0 || d < best_d || (d == best_d && c % 2 == 0)) best = c, best_d = d;
  }
  return uint8_t((std::signbit(p) ? 0x80 : 0) | best);
}

const uint8_t* bytes(const Tensor& t) { return t.data<uint8_t>(); }
Tensor scalar(float v) { return Tensor::from({1}, {v}); }
Tensor fp8_tensor(const Shape& shape, DType t) {
  Tensor q = Tensor::empty(shape, t);
  poison(q);  // 0x7F / 0x7E: NaN codes, never the cast of a finite input
  return q;
}
// Values spanning many binades: sign * 2^U(lo, hi).
Tensor log_uniform(const Shape& shape, uint64_t seed, double lo, double hi) {
  Tensor t = Tensor::empty(shape);
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> e(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.f32()[i] = float((gen() & 1 ? -1 : 1) * std::exp2(e(gen)));
  return t;
}

// Quantizes one value with ops::fp8_quantize.
uint8_t cast_one(float x, float scale, DType t) {
  Tensor q = fp8_tensor({1, 1}, t), none;
  ops::fp8_quantize(Tensor::from({1, 1}, {x}), scalar(scale), q, none, none);
  return bytes(q)[0];
}

// Every code of `out` [rows, cols] against the reference cast of x * scale(r, c).
template <typename ScaleOf>
void expect_cast(const Tensor& x, const Tensor& out, int64_t rows, int64_t cols, ScaleOf scale_of,
                 const std::string& what) {
  const bool e4m3 = out.dtype() == DType::F8E4M3;
  int bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = x.item(r * cols + c);
      const uint8_t want = reference_cast(v, scale_of(r, c), e4m3), got = bytes(out)[r * cols + c];
      if (got != want && bad++ < 5)
        ADD_FAILURE() << what << " [" << r << ", " << c << "] x " << v << " scale "
                      << scale_of(r, c) << ": code 0x" << std::hex << int(got) << " vs 0x"
                      << int(want) << std::dec;
    }
}

// t [cols, rows] is exactly the transpose of s [rows, cols], byte for byte.
void expect_transpose(const Tensor& s, const Tensor& t, int64_t rows, int64_t cols) {
  const size_t esize = dtype_size(s.dtype());
  const auto* sb = static_cast<const char*>(s.raw());
  const auto* tb = static_cast<const char*>(t.raw());
  int bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (std::memcmp(sb + (r * cols + c) * esize, tb + (c * rows + r) * esize, esize) != 0 &&
          bad++ < 5)
        ADD_FAILURE() << "transpose differs at [" << r << ", " << c << "]";
}

// ---------------------------------------------------------------------------------------
// The cast, hand-worked

struct CastCase {
  float x, scale;
  uint8_t code;
  const char* why;
};

TEST(Fp8Cast, E4M3HandWorked) {
  const CastCase cases[] = {
      {1.0f, 1, 0x38, "1 = 2^0: exponent 7"},
      {448.0f, 1, 0x7E, "max finite 1.75 * 2^8"},
      {449.0f, 1, 0x7E, "saturates"},
      {464.0f, 1, 0x7E, "448 / 480 tie: saturates"},
      {1e30f, 1, 0x7E, "saturates"},
      {-500.0f, 1, 0xFE, "saturates, negative"},
      {kInf, 1, 0x7E, "+inf saturates"},
      {-kInf, 1, 0xFE, "-inf saturates"},
      {kNaN, 1, 0x7F, "NaN"},
      {-kNaN, 1, 0xFF, "NaN keeps its sign"},
      {0.0f, 1, 0x00, "zero"},
      {-0.0f, 1, 0x80, "negative zero"},
      {0x1p-9f, 1, 0x01, "smallest subnormal"},
      {0x1p-10f, 1, 0x00, "tie 0 / 2^-9: even 0"},
      {-0x1p-10f, 1, 0x80, "negative tie to -0"},
      {std::nextafter(0x1p-10f, 1.0f), 1, 0x01, "just above the tie"},
      {3 * 0x1p-10f, 1, 0x02, "tie 1 / 2 subnormal codes: even 2"},
      {5 * 0x1p-10f, 1, 0x02, "tie 2 / 3: even 2"},
      {7 * 0x1p-9f, 1, 0x07, "largest subnormal"},
      {15 * 0x1p-10f, 1, 0x08, "tie largest subnormal / smallest normal: even 0x08"},
      {0x1p-6f, 1, 0x08, "smallest normal"},
      {1.0625f, 1, 0x38, "tie 1 / 1.125: even 1"},
      {1.1875f, 1, 0x3A, "tie 1.125 / 1.25: even 1.25"},
      {100.0f, 4, 0x7C, "x * scale = 400: tie 384 / 416, even 384"},
      {0x1p-9f, 0.5f, 0x00, "x * scale = 2^-10: tie to 0"},
      {300.0f, 2, 0x7E, "x * scale = 600 saturates"},
      {1e38f, 1e10f, 0x7E, "x * scale overflows fp32 to inf, saturates"},
  };
  for (const CastCase& c : cases) {
    EXPECT_EQ(cast_one(c.x, c.scale, DType::F8E4M3), c.code) << c.why;
    EXPECT_EQ(reference_cast(c.x, c.scale, true), c.code) << "reference model: " << c.why;
  }
}

TEST(Fp8Cast, E5M2HandWorked) {
  const CastCase cases[] = {
      {1.0f, 1, 0x3C, "1 = 2^0: exponent 15"},
      {-2.0f, 1, 0xC0, "-2"},
      {57344.0f, 1, 0x7B, "max finite 1.75 * 2^15"},
      {60000.0f, 1, 0x7B, "saturates"},
      {61440.0f, 1, 0x7B, "57344 / 65536 tie: saturates (a plain cast rounds to inf)"},
      {1e30f, 1, 0x7B, "saturates"},
      {kInf, 1, 0x7B, "+inf saturates (TE's cast; dtype.h's plain cast keeps inf)"},
      {-kInf, 1, 0xFB, "-inf saturates"},
      {kNaN, 1, 0x7F, "NaN"},
      {-kNaN, 1, 0xFF, "NaN keeps its sign"},
      {-0.0f, 1, 0x80, "negative zero"},
      {0x1p-16f, 1, 0x01, "smallest subnormal"},
      {0x1p-17f, 1, 0x00, "tie 0 / 2^-16: even 0"},
      {3 * 0x1p-17f, 1, 0x02, "tie 1 / 2: even 2"},
      {3 * 0x1p-16f, 1, 0x03, "largest subnormal"},
      {7 * 0x1p-17f, 1, 0x04, "tie largest subnormal / smallest normal: even 0x04"},
      {0x1p-14f, 1, 0x04, "smallest normal"},
      {1.125f, 1, 0x3C, "tie 1 / 1.25: even 1"},
      {1.375f, 1, 0x3E, "tie 1.25 / 1.5: even 1.5"},
      {20000.0f, 4, 0x7B, "x * scale = 80000 saturates"},
  };
  for (const CastCase& c : cases) {
    EXPECT_EQ(cast_one(c.x, c.scale, DType::F8E5M2), c.code) << c.why;
    EXPECT_EQ(reference_cast(c.x, c.scale, false), c.code) << "reference model: " << c.why;
  }
}

TEST(Fp8Cast, Bf16InputWidenedExactly) {
  // bf16 holds 1.0625 and 1.1875 exactly (5 significant bits); times 2 they are E4M3's
  // 2 / 2.25 and 2.25 / 2.5 ties, which only an exact widening keeps ties.
  Tensor x = Tensor::from({1, 3}, {1.0625f, 1.1875f, -448.0f}).to(DType::BF16);
  Tensor q = fp8_tensor({1, 3}, DType::F8E4M3), none;
  ops::fp8_quantize(x, scalar(2.0f), q, none, none);
  EXPECT_EQ(bytes(q)[0], 0x40);  // 2.125: tie 2 / 2.25, even 2
  EXPECT_EQ(bytes(q)[1], 0x42);  // 2.375: tie 2.25 / 2.5, even 2.5
  EXPECT_EQ(bytes(q)[2], 0xFE);  // -896 saturates
}

// ---------------------------------------------------------------------------------------
// Per-tensor quantization of random tensors: every code against the reference, out_t,
// amax; the OpenMP path (>= 2^15 elements) and a serial one.

TEST(Fp8Quantize, RandomMatchesReferenceTransposeAndAmax) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  struct Case {
    int64_t rows, cols;
    DType in, fp8;
    float scale;
  };
  const Case cases[] = {{37, 133, DType::F32, DType::F8E4M3, 3.0f},
                        {37, 133, DType::BF16, DType::F8E5M2, 0.75f},
                        {256, 300, DType::F32, DType::F8E5M2, 1000.0f},
                        {200, 257, DType::BF16, DType::F8E4M3, 0.1f}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(dtype_name(c.in)) + " -> " + std::string(dtype_name(c.fp8)));
    // 2^-20 .. 2^10 times the scale covers both formats' subnormals and saturation.
    Tensor x = log_uniform({c.rows, c.cols}, seed + c.rows, -20, 10).to(c.in);
    Tensor out = fp8_tensor({c.rows, c.cols}, c.fp8), out_t = fp8_tensor({c.cols, c.rows}, c.fp8);
    Tensor amax = Tensor::empty({1});
    poison(amax);
    ops::fp8_quantize(x, scalar(c.scale), out, out_t, amax);
    expect_cast(
        x, out, c.rows, c.cols, [&](int64_t, int64_t) { return c.scale; }, "out");
    expect_transpose(out, out_t, c.rows, c.cols);
    double want = 0;
    for (int64_t i = 0; i < x.numel(); ++i) want = std::max(want, std::fabs(double(x.item(i))));
    EXPECT_EQ(amax.item(), float(want));
  }
}

TEST(Fp8Quantize, HigherRankIsRowsByLastDimAndOptionalOutputsSkipped) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor x = testing::randn({2, 3, 40}, seed);
  Tensor out = fp8_tensor({6, 40}, DType::F8E4M3), out_t = fp8_tensor({40, 6}, DType::F8E4M3);
  Tensor none;
  ops::fp8_quantize(x, scalar(16.0f), out, out_t, none);
  expect_cast(
      x, out, 6, 40, [](int64_t, int64_t) { return 16.0f; }, "out");
  expect_transpose(out, out_t, 6, 40);
}

// Current scaling, end to end: the element of largest |x| lands exactly on +-448.
TEST(Fp8Quantize, CurrentScalingMapsAmaxToFp8Max) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor x = testing::randn({64, 96}, seed, 3.0f);
  Tensor amax = Tensor::empty({1}), scale = scalar(1.0f), scale_inv = scalar(1.0f);
  ops::fp8_amax(x, amax);
  ops::fp8_update_scale(amax, {}, scale, scale_inv);
  Tensor out = fp8_tensor({64, 96}, DType::F8E4M3), none;
  ops::fp8_quantize(x, scale, out, none, none);
  int64_t argmax = 0;
  for (int64_t i = 0; i < x.numel(); ++i)
    if (std::fabs(x.f32()[i]) > std::fabs(x.f32()[argmax])) argmax = i;
  EXPECT_EQ(bytes(out)[argmax] & 0x7F, 0x7E);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_LE(std::fabs(decode(bytes(out)[i], true)), 448.0);
}

// ---------------------------------------------------------------------------------------
// amax

TEST(Fp8Amax, NegativeNaNZeroAndEmpty) {
  Tensor amax = Tensor::empty({1});
  poison(amax);
  ops::fp8_amax(Tensor::from({4}, {1.0f, -7.5f, 3.0f, 0.0f}), amax);
  EXPECT_EQ(amax.item(), 7.5f);
  ops::fp8_amax(Tensor::from({2, 2}, {1.0f, kNaN, 3.0f, -kInf}), amax);
  EXPECT_TRUE(std::isnan(amax.item()));
  ops::fp8_amax(Tensor::from({3}, {-kInf, 1.0f, 2.0f}), amax);
  EXPECT_EQ(amax.item(), kInf);
  ops::fp8_amax(Tensor::empty({0, 8}), amax);
  EXPECT_EQ(amax.item(), 0.0f);
  // A NaN at the end of a tensor large enough to be split over threads.
  Tensor big = testing::randn({1 << 17}, testing::test_seed());
  big.f32()[big.numel() - 1] = kNaN;
  ops::fp8_amax(big, amax);
  EXPECT_TRUE(std::isnan(amax.item()));
}

TEST(Fp8Amax, RandomF32AndBf16) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (DType t : {DType::F32, DType::BF16}) {
    Tensor x = log_uniform({300, 257}, seed, -30, 30).to(t);
    double want = 0;
    for (int64_t i = 0; i < x.numel(); ++i) want = std::max(want, std::fabs(double(x.item(i))));
    Tensor amax = Tensor::empty({1});
    poison(amax);
    ops::fp8_amax(x, amax);
    EXPECT_EQ(amax.item(), float(want)) << dtype_name(t);
  }
}

// ---------------------------------------------------------------------------------------
// The scale rule (fp8_update_scale)

struct ScaleCase {
  float amax;
  Fp8ScaleRule rule;
  float want;
  const char* why;
};

TEST(Fp8Scale, RuleHandWorked) {
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
  const ScaleCase cases[] = {
      {2.0f, {e4, 0, 0, false}, 224.0f, "448 / 2"},
      {2.0f, {e4, 1, 0, false}, 112.0f, "margin 1 halves"},
      {7.0f, {e5, 2, 0, false}, 2048.0f, "57344 / 7 / 4"},
      {1792.0f, {e4, 0, 0, false}, 0.25f, "448 / 1792"},
      {5.0f, {e4, 0, 0, false}, float(448.0 / 5.0), "89.6, rounded once to fp32"},
      {5.0f, {e4, 0, 0, true}, 64.0f, "89.6 rounded down to a power of two"},
      {3.0f, {e4, 0, 0, true}, 128.0f, "149.3 -> 128"},
      {7.0f, {e4, 0, 0, true}, 64.0f, "already a power of two"},
      {0.5f, {e4, 0, 0, true}, 512.0f, "896 -> 512"},
      {1e-3f, {e4, 0, 1.0f, false}, 448.0f, "amax below epsilon: epsilon used"},
      {2.0f, {e4, 0, 1.0f, false}, 224.0f, "amax above epsilon: amax used"},
      {0x1p-149f, {e4, 0, 0, false}, FLT_MAX, "448 / 2^-149 overflows: FLT_MAX"},
      {1e-37f, {e5, 0, 0, false}, FLT_MAX, "57344 / 1e-37 overflows: FLT_MAX"},
      {0x1p-149f, {e4, 0, 0, true}, 0x1p127f, "FLT_MAX, then its power of two"},
      // The margin divides the quotient (fp8.cpp's order): 448 / amax overflows here
      // though 224 / amax would not.
      {336.0f / FLT_MAX, {e4, 1, 0, false}, FLT_MAX, "margin after an overflowing quotient"},
  };
  for (const ScaleCase& c : cases) {
    Tensor scale = scalar(-1.0f), scale_inv = scalar(-1.0f);
    ops::fp8_update_scale(scalar(c.amax), c.rule, scale, scale_inv);
    EXPECT_EQ(scale.item(), c.want) << c.why;
    EXPECT_EQ(scale_inv.item(), float(1.0 / double(c.want))) << c.why;
  }
}

TEST(Fp8Scale, KeepsScaleWhereAmaxGivesNone) {
  for (float amax : {0.0f, -0.0f, kInf, -kInf, kNaN, -1.0f}) {
    Tensor scale = scalar(5.0f), scale_inv = scalar(0.25f);  // deliberately not 1 / 5
    ops::fp8_update_scale(scalar(amax), {DType::F8E4M3, 0, 1.0f, true}, scale, scale_inv);
    EXPECT_EQ(scale.item(), 5.0f) << "amax " << amax;
    EXPECT_EQ(scale_inv.item(), 0.25f) << "amax " << amax;
  }
}

// ---------------------------------------------------------------------------------------
// Delayed scaling: write the step's amax into row 0, update, check the scale and the
// rolled history (TE: roll by -1, zero row 0).

struct DelayedStep {
  float amax, want_scale;
  std::vector<float> want_history;
};

void run_delayed(int64_t length, bool max_algo, const std::vector<DelayedStep>& steps) {
  Tensor history = Tensor::zeros({length, 1}), scale = scalar(1.0f), scale_inv = scalar(1.0f);
  for (size_t s = 0; s < steps.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s + 1));
    history.f32()[0] = steps[s].amax;
    ops::fp8_delayed_scaling_update(history, {}, max_algo, scale, scale_inv);
    EXPECT_EQ(scale.item(), steps[s].want_scale);
    EXPECT_EQ(scale_inv.item(), float(1.0 / steps[s].want_scale));
    EXPECT_EQ(history.to_vector(), steps[s].want_history);
  }
}

TEST(Fp8DelayedScaling, LengthFourMax) {
  // Scale from the max of this step's and the previous three steps' amaxes.
  run_delayed(4, true,
              {{2.0f, 224.0f, {0, 0, 0, 2}},
               {8.0f, 56.0f, {0, 0, 2, 8}},
               {1.0f, 56.0f, {0, 2, 8, 1}},
               {4.0f, 56.0f, {0, 8, 1, 4}},  // step 1's 2 has left the window
               {0.5f, 56.0f, {0, 1, 4, 0.5f}},
               {0.25f, 112.0f, {0, 4, 0.5f, 0.25f}},  // 8 (step 2) has left: max 4
               {0.25f, 112.0f, {0, 0.5f, 0.25f, 0.25f}},
               {0.125f, 896.0f, {0, 0.25f, 0.25f, 0.125f}}});
}

TEST(Fp8DelayedScaling, LengthFourMostRecent) {
  run_delayed(4, false,
              {{2.0f, 224.0f, {0, 0, 0, 2}},
               {8.0f, 56.0f, {0, 0, 2, 8}},
               {1.0f, 448.0f, {0, 2, 8, 1}},
               {4.0f, 112.0f, {0, 8, 1, 4}},
               {0.0f, 112.0f, {0, 1, 4, 0}},  // amax 0: scale kept
               {0.5f, 896.0f, {0, 4, 0, 0.5f}}});
}

TEST(Fp8DelayedScaling, LengthOneMaxAndMostRecent) {
  for (bool max_algo : {true, false})
    run_delayed(1, max_algo,
                {{2.0f, 224.0f, {0}},
                 {8.0f, 56.0f, {0}},
                 {0.0f, 56.0f, {0}},  // kept
                 {0.5f, 896.0f, {0}}});
}

TEST(Fp8DelayedScaling, NaNInHistoryKeepsScale) {
  Tensor history = Tensor::from({3, 1}, {1.0f, kNaN, 2.0f});
  Tensor scale = scalar(3.0f), scale_inv = scalar(0.5f);
  ops::fp8_delayed_scaling_update(history, {}, true, scale, scale_inv);
  EXPECT_EQ(scale.item(), 3.0f);
  EXPECT_EQ(scale_inv.item(), 0.5f);
  EXPECT_EQ(history.item(0), 0.0f);
  EXPECT_EQ(history.item(1), 2.0f);
  EXPECT_EQ(history.item(2), 1.0f);
}

// ---------------------------------------------------------------------------------------
// Blockwise. Each block gets a peak |x| whose 448 / peak is a power of two (so the scale
// and scale_inv are exact: hand-known), the rest of the block below it.

// x [rows, cols] with block (br, bc) of block_rows x 128 peaking at peak(br, bc).
template <typename Peak>
Tensor blocky(int64_t rows, int64_t cols, int64_t block_rows, uint64_t seed, Peak peak) {
  Tensor x = Tensor::empty({rows, cols});
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-0.9f, 0.9f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      x.f32()[r * cols + c] = u(gen) * peak(r / block_rows, c / 128);
  // One element per block at exactly +-peak (the block's first row and column).
  for (int64_t r = 0; r < rows; r += block_rows)
    for (int64_t c = 0; c < cols; c += 128)
      x.f32()[r * cols + c] = ((r + c) % 3 ? 1.0f : -1.0f) * peak(r / block_rows, c / 128);
  return x;
}

const float kPeaks[] = {7.0f, 3.5f, 14.0f, 0.4375f, 28.0f, 1.75f, 56.0f, 0.875f};

TEST(Fp8Blockwise, OneBy128PartialBlocksAndZeroBlock) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 3, cols = 300;  // blocks of columns [0, 128), [128, 256), [256, 300)
  auto peak = [](int64_t br, int64_t bc) {
    return br == 1 && bc == 1 ? 0.0f : kPeaks[(br * 3 + bc) % 8];
  };
  Tensor x = blocky(rows, cols, 1, seed, peak);
  Tensor out = fp8_tensor({rows, cols}, DType::F8E4M3), scale_inv = Tensor::empty({3, 3}), none;
  poison(scale_inv);
  ops::fp8_quantize_blockwise(x, 1, {}, out, scale_inv, none, none);
  for (int64_t br = 0; br < 3; ++br)
    for (int64_t bc = 0; bc < 3; ++bc) {
      const float want = peak(br, bc) == 0 ? 1.0f : peak(br, bc) / 448.0f;  // zeros: scale 1
      EXPECT_EQ(scale_inv.item(br * 3 + bc), want) << "block " << br << ", " << bc;
    }
  expect_cast(
      x, out, rows, cols,
      [&](int64_t r, int64_t c) {
        return peak(r, c / 128) == 0 ? 1.0f : 448.0f / peak(r, c / 128);
      },
      "out");
  for (int64_t c = 128; c < 256; ++c) EXPECT_EQ(bytes(out)[cols + c] & 0x7F, 0x00);  // +-0
}

TEST(Fp8Blockwise, By128OutTAndScaleInvTAreTransposes) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 200, cols = 300;  // 2 x 3 blocks, partial in both dimensions
  auto peak = [](int64_t br, int64_t bc) { return kPeaks[(br * 3 + bc) % 8]; };
  for (DType in : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(in));
    Tensor x = blocky(rows, cols, 128, seed, peak).to(in);  // peaks are bf16 values
    Tensor out = fp8_tensor({rows, cols}, DType::F8E5M2),
           out_t = fp8_tensor({cols, rows}, DType::F8E5M2);
    Tensor scale_inv = Tensor::empty({2, 3}), scale_inv_t = Tensor::empty({3, 2});
    poison(scale_inv);
    poison(scale_inv_t);
    const Fp8ScaleRule rule{DType::F8E5M2, 0, 0, false};
    ops::fp8_quantize_blockwise(x, 128, rule, out, scale_inv, out_t, scale_inv_t);
    for (int64_t b = 0; b < 6; ++b) EXPECT_EQ(scale_inv.item(b), peak(b / 3, b % 3) / 57344.0f);
    expect_cast(
        x, out, rows, cols, [&](int64_t r, int64_t c) { return 57344.0f / peak(r / 128, c / 128); },
        "out");
    expect_transpose(out, out_t, rows, cols);
    expect_transpose(scale_inv, scale_inv_t, 2, 3);
  }
}

TEST(Fp8Blockwise, OneBy128OutTHasItsOwnColumnScales) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 300, cols = 5;  // x^T [5, 300]: 1x128 blocks run down x's columns
  // Column j, rows [128 b, 128 b + 128): peak kPeaks[(j + 2b) % 8]; rows see other peaks.
  auto col_peak = [](int64_t j, int64_t b) { return kPeaks[(j + 2 * b) % 8]; };
  Tensor x = Tensor::empty({rows, cols});
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-0.9f, 0.9f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      x.f32()[r * cols + j] = (r % 128 == 7 ? 1.0f : u(gen)) * col_peak(j, r / 128);
  Tensor out = fp8_tensor({rows, cols}, DType::F8E4M3),
         out_t = fp8_tensor({cols, rows}, DType::F8E4M3);
  Tensor scale_inv = Tensor::empty({rows, 1}), scale_inv_t = Tensor::empty({cols, 3});
  poison(scale_inv);
  poison(scale_inv_t);
  ops::fp8_quantize_blockwise(x, 1, {}, out, scale_inv, out_t, scale_inv_t);
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t b = 0; b < 3; ++b)
      EXPECT_EQ(scale_inv_t.item(j * 3 + b), col_peak(j, b) / 448.0f) << j << ", " << b;
  Tensor xt = Tensor::empty({cols, rows});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) xt.f32()[j * rows + r] = x.f32()[r * cols + j];
  expect_cast(
      xt, out_t, cols, rows, [&](int64_t j, int64_t r) { return 448.0f / col_peak(j, r / 128); },
      "out_t");
  // The row scales come from each row's own amax (an fp32 division: not hand-exact).
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0;
    for (int64_t j = 0; j < cols; ++j) m = std::max(m, std::fabs(double(x.f32()[r * cols + j])));
    const float scale = float(448.0 / m);
    EXPECT_EQ(scale_inv.item(r), float(1.0 / double(scale))) << "row " << r;
    expect_cast(
        x.rows(r, 1), out.rows(r, 1), 1, cols, [&](int64_t, int64_t) { return scale; },
        "row " + std::to_string(r));
  }
}

TEST(Fp8Blockwise, PowerOfTwoAndMarginPerBlock) {
  // Blocks 1x128 of [1, 256]: peaks 5 and 3 (E4M3, power of two: 89.6 -> 64, 149.3 ->
  // 128), then E5M2 with margin 1: 57344 / 7 / 2 = 4096 and 57344 / 0.875 / 2 = 32768.
  Tensor x = Tensor::empty({1, 256});
  for (int64_t c = 0; c < 256; ++c) x.f32()[c] = (c < 128 ? 5.0f : 3.0f) * float(c % 100) / 99.0f;
  Tensor out = fp8_tensor({1, 256}, DType::F8E4M3), scale_inv = Tensor::empty({1, 2}), none;
  ops::fp8_quantize_blockwise(x, 1, {DType::F8E4M3, 0, 0, true}, out, scale_inv, none, none);
  EXPECT_EQ(scale_inv.item(0), 1.0f / 64);
  EXPECT_EQ(scale_inv.item(1), 1.0f / 128);
  expect_cast(
      x, out, 1, 256, [](int64_t, int64_t c) { return c < 128 ? 64.0f : 128.0f; }, "pow2");
  for (int64_t c = 0; c < 256; ++c) x.f32()[c] = (c < 128 ? 7.0f : 0.875f) * float(c % 100) / 99.0f;
  Tensor out5 = fp8_tensor({1, 256}, DType::F8E5M2);
  ops::fp8_quantize_blockwise(x, 1, {DType::F8E5M2, 1, 0, false}, out5, scale_inv, none, none);
  EXPECT_EQ(scale_inv.item(0), 1.0f / 4096);
  EXPECT_EQ(scale_inv.item(1), 1.0f / 32768);
}

// ---------------------------------------------------------------------------------------
// Dequantization: |deq - x| within half an FP8 spacing of x * scale, divided by the scale:
// E4M3 2^-4 |x| (3 mantissa bits) or 2^-10 / scale (subnormals, spacing 2^-9); E5M2 2^-3
// |x| or 2^-17 / scale; plus 2^-22 |x| for the fp32 scale_inv and product roundings.

double half_spacing(double x, double scale, bool e4m3) {
  return (e4m3 ? 0x1p-4 : 0x1p-3) * std::fabs(x) + (e4m3 ? 0x1p-10 : 0x1p-17) / scale +
         0x1p-22 * std::fabs(x);
}

TEST(Fp8Dequantize, PerTensorRoundTripBound) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    const bool e4m3 = fp8 == DType::F8E4M3;
    Tensor x = log_uniform({48, 130}, seed, -25, 5);
    Tensor amax = Tensor::empty({1}), scale = scalar(1.0f), scale_inv = scalar(1.0f);
    ops::fp8_amax(x, amax);
    ops::fp8_update_scale(amax, {fp8, 0, 0, false}, scale, scale_inv);
    Tensor q = fp8_tensor({48, 130}, fp8), none;
    ops::fp8_quantize(x, scale, q, none, none);
    Tensor y = Tensor::empty({48, 130}), y16 = Tensor::empty({48, 130}, DType::BF16);
    poison(y);
    poison(y16);
    ops::fp8_dequantize(q, scale_inv, y);
    ops::fp8_dequantize(q, scale_inv, y16);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double xi = x.f32()[i], yi = y.f32()[i];
      ASSERT_LE(std::fabs(yi - xi), half_spacing(xi, scale.item(), e4m3)) << "element " << i;
      // The dequantized value itself: code times scale_inv, once rounded to fp32 / bf16.
      const double exact = decode(bytes(q)[i], e4m3) * scale_inv.item();
      ASSERT_LE(std::fabs(yi - exact), 0x1p-24 * std::fabs(exact)) << "element " << i;
      ASSERT_LE(std::fabs(y16.item(i) - exact), 0x1p-8 * std::fabs(exact)) << "element " << i;
    }
  }
}

TEST(Fp8Dequantize, BlockwiseRoundTripBound) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t rows = 150, cols = 260;
  for (int64_t block_rows : {1, 128}) {
    SCOPED_TRACE("block_rows " + std::to_string(block_rows));
    Tensor x = log_uniform({rows, cols}, seed + block_rows, -12, 6);
    const int64_t grid_rows = (rows + block_rows - 1) / block_rows;
    Tensor q = fp8_tensor({rows, cols}, DType::F8E4M3), scale_inv = Tensor::empty({grid_rows, 3});
    Tensor none, y = Tensor::empty({rows, cols});
    ops::fp8_quantize_blockwise(x, block_rows, {}, q, scale_inv, none, none);
    poison(y);
    ops::fp8_dequantize(q, scale_inv, y);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const double xi = x.f32()[r * cols + c], yi = y.f32()[r * cols + c];
        const double s_inv = scale_inv.item((r / block_rows) * 3 + c / 128);
        ASSERT_LE(std::fabs(yi - xi), half_spacing(xi, 1.0 / s_inv, true)) << r << ", " << c;
      }
  }
}

// ---------------------------------------------------------------------------------------
// FP8 GEMM: c = alpha * deq(a) deq(b)^T + beta * c against an fp64 loop over the codes
// times their scale_inv. Operands are random codes (no quantizer involved) and random
// scales. The CPU GEMM rounds each dequantized value to fp32 (2^-24 relative) and sums in
// fp32 sgemm: |c - ref| <= 1e-5 * sum_k |terms| (K <= 384: K * 2^-24 ~ 2e-5 worst case,
// ~1e-6 typical), plus bf16 rounding of the output (2^-8 |ref|) for a BF16 c.

Tensor random_codes(int64_t rows, int64_t cols, DType t, std::mt19937_64& gen) {
  Tensor q = Tensor::empty({rows, cols}, t);
  for (int64_t i = 0; i < q.numel(); ++i) {
    uint8_t c;
    do c = uint8_t(gen());
    while (!std::isfinite(decode(c, t == DType::F8E4M3)));
    q.data<uint8_t>()[i] = c;
  }
  return q;
}
Tensor random_scales(const Shape& shape, std::mt19937_64& gen) {
  std::uniform_real_distribution<float> u(1e-3f, 1e-1f);
  Tensor s = Tensor::empty(shape);
  for (int64_t i = 0; i < s.numel(); ++i) s.f32()[i] = u(gen);
  return s;
}
// scale_inv of element (r, k) for a scale tensor of layout [1], [rows, K/128] or
// [rows/128, K/128].
float scale_at(const Tensor& s, int64_t rows, int64_t r, int64_t k) {
  if (s.ndim() == 1) return s.f32()[0];
  const int64_t br = s.dim(0) == rows ? r : r / 128;
  return s.f32()[br * s.dim(1) + k / 128];
}

void check_gemm(DType a_t, DType b_t, DType c_t, int64_t m, int64_t n, int64_t k,
                const Shape& a_scale_shape, const Shape& b_scale_shape, float alpha, float beta,
                uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_name(a_t)) + " x " + std::string(dtype_name(b_t)) + " -> " +
               std::string(dtype_name(c_t)) + " b_scale_inv " + shape_str(b_scale_shape) +
               " alpha " + std::to_string(alpha) + " beta " + std::to_string(beta));
  std::mt19937_64 gen(seed);
  Tensor a = random_codes(m, k, a_t, gen), b = random_codes(n, k, b_t, gen);
  Tensor sa = random_scales(a_scale_shape, gen), sb = random_scales(b_scale_shape, gen);
  Tensor c = beta == 0 ? Tensor::empty({m, n}, c_t) : testing::randn({m, n}, seed + 1).to(c_t);
  if (beta == 0) poison(c);  // not read when beta is 0
  Tensor c0 = c.clone();
  ops::fp8_gemm(a, sa, b, sb, c, alpha, beta);
  // deq(x)[r, p] = code * scale_inv, exactly (a 4-bit by 24-bit product) in fp64.
  auto dequantized = [](const Tensor& q, const Tensor& s, int64_t rows, int64_t cols) {
    std::vector<double> d(rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0; p < cols; ++p)
        d[r * cols + p] = decode(bytes(q)[r * cols + p], q.dtype() == DType::F8E4M3) *
                          double(scale_at(s, rows, r, p));
    return d;
  };
  const std::vector<double> da = dequantized(a, sa, m, k), db = dequantized(b, sb, n, k);
  int bad = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0, mag = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double t = da[i * k + p] * db[j * k + p];
        sum += t;
        mag += std::fabs(t);
      }
      const double c_old = beta == 0 ? 0.0 : double(c0.item(i * n + j));
      const double ref = alpha * sum + beta * c_old;
      const double tol = 1e-5 * (std::fabs(alpha) * mag + std::fabs(beta * c_old)) +
                         (c_t == DType::BF16 ? 0x1p-8 * std::fabs(ref) : 0.0);
      const double got = c.item(i * n + j);
      if (!(std::fabs(got - ref) <= tol) && bad++ < 5)
        ADD_FAILURE() << "c[" << i << ", " << j << "] " << got << " vs fp64 " << ref;
    }
}

TEST(Fp8Gemm, PerTensorAlphaBeta) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
  check_gemm(e4, e4, DType::F32, 48, 64, 256, {1}, {1}, 1.0f, 0.0f, seed);
  check_gemm(e4, e5, DType::F32, 32, 48, 96, {1}, {1}, 0.5f, 2.0f, seed + 1);
  check_gemm(e5, e4, DType::BF16, 16, 32, 64, {1}, {1}, -1.5f, 1.0f, seed + 2);
  check_gemm(e4, e4, DType::BF16, 32, 16, 128, {1}, {1}, 1.0f, 0.0f, seed + 3);
}

TEST(Fp8Gemm, Blockwise) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
  // Forward / dgrad: a in 1x128 blocks, the weight b in 128x128 blocks.
  check_gemm(e4, e4, DType::F32, 32, 256, 384, {32, 3}, {2, 3}, 1.0f, 0.0f, seed);
  check_gemm(e5, e4, DType::BF16, 48, 256, 256, {48, 2}, {2, 2}, 0.5f, 1.0f, seed + 1);
  // Wgrad: both operands 1x128 along K.
  check_gemm(e4, e4, DType::F32, 64, 48, 256, {64, 2}, {48, 2}, 1.0f, 1.0f, seed + 2);
}

// ---------------------------------------------------------------------------------------
// Door checks

TEST(Fp8Doors, RejectBadArguments) {
  const DType e4 = DType::F8E4M3, e5 = DType::F8E5M2;
  Tensor x = testing::randn({4, 8}, 1), none, s = scalar(1.0f);
  Tensor q = Tensor::empty({4, 8}, e4), amax = Tensor::empty({1});
  EXPECT_THROW(ops::fp8_max(DType::F32), InternalError);
  EXPECT_EQ(ops::fp8_max(e4), 448.0f);
  EXPECT_EQ(ops::fp8_max(e5), 57344.0f);
  Tensor q32 = Tensor::empty({4, 8});
  EXPECT_THROW(ops::fp8_quantize(x, s, q32, none, none), InternalError);  // out not FP8
  Tensor s2 = Tensor::empty({2});
  EXPECT_THROW(ops::fp8_quantize(x, s2, q, none, none), InternalError);  // scale [2]
  Tensor q_t_bad = Tensor::empty({4, 8}, e4);
  EXPECT_THROW(ops::fp8_quantize(x, s, q, q_t_bad, none), InternalError);  // out_t not [8, 4]
  Tensor q_t_e5 = Tensor::empty({8, 4}, e5);
  EXPECT_THROW(ops::fp8_quantize(x, s, q, q_t_e5, none), InternalError);  // dtypes differ
  EXPECT_THROW(ops::fp8_amax(Tensor::empty({3}, DType::I32), amax), InternalError);
  EXPECT_THROW(ops::fp8_update_scale(amax, {e4, -1.0f, 0, false}, s, s), InternalError);
  Tensor history_1d = Tensor::zeros({4});
  EXPECT_THROW(ops::fp8_delayed_scaling_update(history_1d, {}, true, s, s), InternalError);

  Tensor si = Tensor::empty({4, 1});
  EXPECT_THROW(ops::fp8_quantize_blockwise(x, 64, {}, q, si, none, none), InternalError);
  EXPECT_THROW(ops::fp8_quantize_blockwise(x, 1, {e5}, q, si, none, none), InternalError);
  Tensor si_bad = Tensor::empty({1, 1});
  EXPECT_THROW(ops::fp8_quantize_blockwise(x, 1, {}, q, si_bad, none, none), InternalError);
  Tensor qt = Tensor::empty({8, 4}, e4), sit_bad = Tensor::empty({4, 1});
  EXPECT_THROW(ops::fp8_quantize_blockwise(x, 1, {}, q, si, qt, sit_bad), InternalError);
  EXPECT_THROW(ops::fp8_dequantize(q, Tensor::empty({2, 1}), x), InternalError);

  std::mt19937_64 gen(1);
  Tensor a = random_codes(32, 256, e4, gen), b = random_codes(16, 256, e4, gen);
  Tensor c = Tensor::empty({32, 16});
  EXPECT_NO_THROW(ops::fp8_gemm(a, s, b, s, c));
  Tensor a5 = Tensor::empty({32, 256}, e5), b5 = Tensor::empty({16, 256}, e5);
  EXPECT_THROW(ops::fp8_gemm(a5, s, b5, s, c), InternalError);  // E5M2 x E5M2
  Tensor a40 = Tensor::empty({40, 256}, e4), c40 = Tensor::empty({40, 16});
  EXPECT_THROW(ops::fp8_gemm(a40, s, b, s, c40), InternalError);  // M not a multiple of 16
  Tensor a_k = Tensor::empty({32, 272}, e4), b_k = Tensor::empty({16, 272}, e4);
  Tensor sa_k = Tensor::empty({32, 3}), sb_k = Tensor::empty({16, 3});
  EXPECT_THROW(ops::fp8_gemm(a_k, sa_k, b_k, sb_k, c), InternalError);  // blockwise K % 128
  Tensor sa = Tensor::empty({32, 2});
  EXPECT_THROW(ops::fp8_gemm(a, sa, b, s, c), InternalError);  // per tensor mixed with blocks
  Tensor c_bad = Tensor::empty({32, 32});
  EXPECT_THROW(ops::fp8_gemm(a, s, b, s, c_bad), InternalError);  // c not [M, N]
}

// ---------------------------------------------------------------------------------------
// PyTorch's casts (tools/make_fp8_golden.py): every code bit for bit, out_t its transpose,
// each output written twice over different poison bytes so that an unwritten element
// cannot match by chance.

TEST(Fp8Golden, QuantizeMatchesTorchBitForBit) {
  const ckpt::SafetensorsFile golden = ckpt::load_safetensors(
      std::string(MEGATON_SOURCE_DIR) + "/tests/golden/fp8_golden.safetensors");
  const Tensor& scales = golden.tensors.at("scales");
  ASSERT_EQ(scales.dtype(), DType::F32);
  int64_t compared = 0;
  for (const char* input : {"x", "x_bf16"}) {
    const Tensor& x = golden.tensors.at(input);
    const std::string prefix = std::string(input) == "x" ? "" : "bf16.";
    const int64_t rows = x.dim(0), cols = x.dim(1);
    for (int64_t s = 0; s < scales.numel(); ++s)
      for (const char* format : {"e4m3", "e5m2"}) {
        const std::string name = prefix + format + "." + std::to_string(s);
        SCOPED_TRACE(name + ", scale " + std::to_string(scales.f32()[s]));
        const Tensor& want = golden.tensors.at(name);
        ASSERT_EQ(want.shape(), x.shape());
        for (uint8_t fill : {0x00, 0xFF}) {
          Tensor out = Tensor::empty(x.shape(), want.dtype());
          Tensor out_t = Tensor::empty({cols, rows}, want.dtype()), none;
          std::memset(out.raw(), fill, out.nbytes());
          std::memset(out_t.raw(), fill, out_t.nbytes());
          ops::fp8_quantize(x, scales.rows(s, 1), out, out_t, none);
          int bad = 0;
          for (int64_t i = 0; i < x.numel(); ++i)
            if (bytes(out)[i] != bytes(want)[i] && bad++ < 5)
              ADD_FAILURE() << "element " << i << " x " << x.item(i) << ": 0x" << std::hex
                            << int(bytes(out)[i]) << " vs torch 0x" << int(bytes(want)[i])
                            << std::dec;
          expect_transpose(out, out_t, rows, cols);
        }
        compared += x.numel();
      }
  }
  EXPECT_EQ(compared, 2 * 6 * (64 * 64 + 32 * 32));
}

}  // namespace
}  // namespace megaton
