// The multi-tensor FP8 ops (ops/fp8.h: fp8_amax_multi, fp8_update_scale_multi,
// fp8_delayed_scaling_update_multi, fp8_quantize_multi) on the CPU: entry i is the
// single-tensor op on entry i, bit for bit, for expert-like lists (empty entries, entries
// whose out_t or amax is undefined, NaN / inf entries, mixed input dtypes for the amax),
// and the door refuses what the single ops refuse, unequal lengths and non-uniform
// dtypes / history lengths.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_testing.h"
#include "common/testing.h"
#include "ops/fp8.h"

namespace megaton {
namespace {

using ops::Fp8ScaleRule;
using testing::poisoned;
using testing::same_bits;
using testing::wide_values;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

const float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<Tensor> copies(const std::vector<Tensor>& list) {
  std::vector<Tensor> out;
  for (const Tensor& t : list) out.push_back(t.defined() ? t.clone() : Tensor());
  return out;
}

// Expert-like inputs: rows per expert (kExpertRows: 0 included), one width, wide values,
// a NaN in entry 4 and an inf in entry 2.
std::vector<Tensor> expert_inputs(const std::vector<int64_t>& rows, int64_t cols, DType dtype,
                                  uint64_t seed) {
  std::vector<Tensor> x;
  for (size_t g = 0; g < rows.size(); ++g) {
    Tensor values = wide_values({rows[g], cols}, seed + g);
    if (g == 4) values.f32()[values.numel() / 3] = kNaN;
    if (g == 2) values.f32()[values.numel() - 1] = -INFINITY;
    x.push_back(values.to(dtype));
  }
  return x;
}

const std::vector<int64_t> kExpertRows = {16, 0, 48, 5, 130, 0, 1, 64};

// ------------------------------------------------------------------------------ amax

TEST(Fp8Multi, AmaxIsSingleOpPerEntry) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // Mixed dtypes: fp8_amax_multi does not require one dtype.
  std::vector<Tensor> x = expert_inputs(kExpertRows, 96, DType::BF16, seed);
  x[3] = x[3].to(DType::F32);
  x.push_back(wide_values({2, 3, 5}, seed + 99));  // higher rank, odd sizes
  std::vector<Tensor> amax, want;
  for (size_t i = 0; i < x.size(); ++i) {
    amax.push_back(poisoned({1}, DType::F32));
    want.push_back(poisoned({1}, DType::F32));
    ops::fp8_amax(x[i], want[i]);
  }
  ops::fp8_amax_multi(x, amax);
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_TRUE(same_bits(amax[i], want[i], "amax[" + std::to_string(i) + "]"));
  // The behaviours behind those values: empty -> 0, NaN propagates, inf is the max.
  EXPECT_EQ(amax[1].item(0), 0.0f);
  EXPECT_EQ(amax[5].item(0), 0.0f);
  EXPECT_TRUE(std::isinf(amax[2].item(0)));
  EXPECT_TRUE(std::isnan(amax[4].item(0)));
}

TEST(Fp8Multi, AmaxNaNEntry) {
  std::vector<Tensor> x = {Tensor::from({3}, {1.0f, kNaN, -2.0f}),
                           Tensor::from({2}, {-3.0f, 0.5f})};
  std::vector<Tensor> amax = {poisoned({1}, DType::F32), poisoned({1}, DType::F32)};
  amax[0].fill(7.0f);
  ops::fp8_amax_multi(x, amax);
  EXPECT_TRUE(std::isnan(amax[0].item(0)));
  EXPECT_EQ(amax[1].item(0), 3.0f);
}

// -------------------------------------------------------------------- scale updates

TEST(Fp8Multi, UpdateScaleIsSingleOpPerEntry) {
  // Ordinary amaxes and the ones that keep the scale (0, negative, NaN, inf).
  const std::vector<float> amaxes = {1.0f, 3.7f, 0.0f, kNaN, INFINITY, 1e-38f, -1.0f, 448.0f};
  for (const Fp8ScaleRule& rule : {Fp8ScaleRule{DType::F8E4M3, 0.0f, 0.0f, false},
                                   Fp8ScaleRule{DType::F8E5M2, 1.0f, 1e-4f, true}}) {
    std::vector<Tensor> amax, scale, scale_inv;
    for (size_t i = 0; i < amaxes.size(); ++i) {
      amax.push_back(Tensor::from({1}, {amaxes[i]}));
      scale.push_back(Tensor::from({1}, {0.5f + float(i)}));
      scale_inv.push_back(Tensor::from({1}, {1.0f / (0.5f + float(i))}));
    }
    std::vector<Tensor> want_scale = copies(scale), want_scale_inv = copies(scale_inv);
    for (size_t i = 0; i < amaxes.size(); ++i)
      ops::fp8_update_scale(amax[i], rule, want_scale[i], want_scale_inv[i]);
    ops::fp8_update_scale_multi(amax, rule, scale, scale_inv);
    for (size_t i = 0; i < amaxes.size(); ++i) {
      SCOPED_TRACE("entry " + std::to_string(i));
      EXPECT_TRUE(same_bits(scale[i], want_scale[i], "scale"));
      EXPECT_TRUE(same_bits(scale_inv[i], want_scale_inv[i], "scale_inv"));
    }
    // Kept where the amax gives none.
    EXPECT_EQ(scale[2].item(0), 2.5f);
    EXPECT_EQ(scale[3].item(0), 3.5f);
    EXPECT_EQ(scale[4].item(0), 4.5f);
  }
}

TEST(Fp8Multi, DelayedScalingIsSingleOpPerEntry) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (int64_t length : {1, 4}) {
    for (bool max_algo : {false, true}) {
      SCOPED_TRACE("L " + std::to_string(length) + (max_algo ? " max" : " most_recent"));
      const Fp8ScaleRule rule{DType::F8E4M3, 1.0f, 0.0f, false};
      std::vector<Tensor> history, scale, scale_inv;
      for (int g = 0; g < 5; ++g) {
        Tensor h = wide_values({length, 1}, seed + 10 * g + length);
        for (int64_t i = 0; i < length; ++i) h.f32()[i] = std::fabs(h.f32()[i]);
        if (g == 1) h.zero();                    // keeps the scale
        if (g == 2) h.f32()[length - 1] = kNaN;  // NaN in the window
        history.push_back(h);
        scale.push_back(Tensor::from({1}, {0.75f}));
        scale_inv.push_back(Tensor::from({1}, {4.0f / 3.0f}));
      }
      std::vector<Tensor> want_history = copies(history), want_scale = copies(scale),
                          want_scale_inv = copies(scale_inv);
      for (int step = 0; step < 2; ++step) {  // the roll composes over steps
        for (size_t g = 0; g < history.size(); ++g) {
          ops::fp8_delayed_scaling_update(want_history[g], rule, max_algo, want_scale[g],
                                          want_scale_inv[g]);
        }
        ops::fp8_delayed_scaling_update_multi(history, rule, max_algo, scale, scale_inv);
        for (size_t g = 0; g < history.size(); ++g) {
          SCOPED_TRACE("step " + std::to_string(step) + " entry " + std::to_string(g));
          EXPECT_TRUE(same_bits(history[g], want_history[g], "amax_history"));
          EXPECT_TRUE(same_bits(scale[g], want_scale[g], "scale"));
          EXPECT_TRUE(same_bits(scale_inv[g], want_scale_inv[g], "scale_inv"));
          EXPECT_EQ(history[g].item(0), 0.0f);  // the next step's slot
        }
        for (size_t g = 0; g < history.size(); ++g) {  // the next step's amaxes
          history[g].f32()[0] = 2.5f + float(g);
          want_history[g].f32()[0] = 2.5f + float(g);
        }
      }
    }
  }
}

// ------------------------------------------------------------------ per-tensor cast

struct QuantizeCase {
  std::vector<Tensor> x, scale, out, out_t, amax;
};

// Outputs poisoned; out_t / amax defined per entry by the masks.
QuantizeCase quantize_case(const std::vector<Tensor>& x, DType fp8, const std::vector<bool>& with_t,
                           const std::vector<bool>& with_amax) {
  QuantizeCase c;
  c.x = x;
  for (size_t g = 0; g < x.size(); ++g) {
    const int64_t cols = x[g].dim(-1), rows = x[g].numel() / std::max<int64_t>(cols, 1);
    c.scale.push_back(Tensor::from({1}, {ops::fp8_max(fp8) / float(std::ldexp(1.0, 10 - int(g)))}));
    c.out.push_back(poisoned(x[g].shape(), fp8));
    c.out_t.push_back(with_t[g] ? poisoned({cols, rows}, fp8) : Tensor());
    c.amax.push_back(with_amax[g] ? poisoned({1}, DType::F32) : Tensor());
  }
  return c;
}

void expect_quantize_matches_single(const QuantizeCase& got_in) {
  QuantizeCase want;
  want.x = got_in.x;
  want.scale = got_in.scale;
  want.out = copies(got_in.out);
  want.out_t = copies(got_in.out_t);
  want.amax = copies(got_in.amax);
  for (size_t g = 0; g < want.x.size(); ++g)
    ops::fp8_quantize(want.x[g], want.scale[g], want.out[g], want.out_t[g], want.amax[g]);
  ops::fp8_quantize_multi(got_in.x, got_in.scale, got_in.out, got_in.out_t, got_in.amax);
  for (size_t g = 0; g < want.x.size(); ++g) {
    SCOPED_TRACE("entry " + std::to_string(g) + " " + shape_str(want.x[g].shape()));
    EXPECT_TRUE(same_bits(got_in.out[g], want.out[g], "out"));
    EXPECT_TRUE(same_bits(got_in.out_t[g], want.out_t[g], "out_t"));
    EXPECT_TRUE(same_bits(got_in.amax[g], want.amax[g], "amax"));
  }
}

TEST(Fp8Multi, QuantizeIsSingleOpPerEntry) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const size_t n = kExpertRows.size();
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " -> " + std::string(dtype_name(fp8)));
      const std::vector<Tensor> x = expert_inputs(kExpertRows, 160, dtype, seed);
      // All outputs, none, and a mix.
      expect_quantize_matches_single(
          quantize_case(x, fp8, std::vector<bool>(n, true), std::vector<bool>(n, true)));
      expect_quantize_matches_single(
          quantize_case(x, fp8, std::vector<bool>(n, false), std::vector<bool>(n, false)));
      std::vector<bool> with_t(n), with_amax(n);
      for (size_t g = 0; g < n; ++g) with_t[g] = g % 2 == 0, with_amax[g] = g % 3 != 1;
      expect_quantize_matches_single(quantize_case(x, fp8, with_t, with_amax));
    }
  }
}

TEST(Fp8Multi, QuantizeEmptyEntryWritesAmaxZero) {
  Tensor x = Tensor::empty({0, 32}, DType::BF16);
  Tensor out = poisoned({0, 32}, DType::F8E4M3), out_t = poisoned({32, 0}, DType::F8E4M3);
  Tensor amax = poisoned({1}, DType::F32);
  ops::fp8_quantize_multi({x}, {Tensor::from({1}, {1.0f})}, {out}, {out_t}, {amax});
  EXPECT_EQ(amax.item(0), 0.0f);
}

TEST(Fp8Multi, EmptyListsAreNoOps) {
  ops::fp8_amax_multi({}, {});
  ops::fp8_update_scale_multi({}, {}, {}, {});
  ops::fp8_delayed_scaling_update_multi({}, {}, true, {}, {});
  ops::fp8_quantize_multi({}, {}, {}, {}, {});
}

// ------------------------------------------------------------------------ the doors

TEST(Fp8Multi, DoorsRejectBadArguments) {
  const Tensor x = wide_values({4, 8}, 5), s = Tensor::from({1}, {1.0f});
  const Tensor q = Tensor::empty({4, 8}, DType::F8E4M3), a = Tensor::empty({1});
  const Tensor none;
  // Unequal lengths.
  EXPECT_THROW(ops::fp8_amax_multi({x, x}, {a}), InternalError);
  EXPECT_THROW(ops::fp8_update_scale_multi({a, a}, {}, {s, s}, {s}), InternalError);
  EXPECT_THROW(ops::fp8_quantize_multi({x}, {s}, {q, q}, {none}, {none}), InternalError);
  EXPECT_THROW(ops::fp8_quantize_multi({x}, {s}, {q}, {}, {none}), InternalError);
  // What the single op refuses, in any entry.
  EXPECT_THROW(ops::fp8_amax_multi({x, Tensor::empty({4, 8}, DType::I32)}, {a, a}), InternalError);
  EXPECT_THROW(ops::fp8_amax_multi({x, x}, {a, Tensor::empty({2})}), InternalError);
  EXPECT_THROW(ops::fp8_amax_multi({x, x}, {a, none}), InternalError);
  EXPECT_THROW(ops::fp8_update_scale_multi({a}, {DType::F32, 0, 0, false}, {s}, {s}),
               InternalError);
  EXPECT_THROW(ops::fp8_update_scale_multi({a}, {DType::F8E4M3, -1, 0, false}, {s}, {s}),
               InternalError);
  EXPECT_THROW(
      ops::fp8_update_scale_multi({a, a}, {}, {s, Tensor::empty({1}, DType::BF16)}, {s, s}),
      InternalError);
  const Tensor h4 = Tensor::zeros({4, 1}), h3 = Tensor::zeros({3, 1});
  EXPECT_THROW(
      ops::fp8_delayed_scaling_update_multi({h4, Tensor::zeros({4})}, {}, true, {s, s}, {s, s}),
      InternalError);  // [L] refused
  EXPECT_THROW(ops::fp8_delayed_scaling_update_multi({h4, h3}, {}, true, {s, s}, {s, s}),
               InternalError);  // one L for all
  EXPECT_THROW(ops::fp8_quantize_multi({x, x}, {s, s}, {q, Tensor::empty({4, 8}, DType::BF16)},
                                       {none, none}, {none, none}),
               InternalError);  // out not FP8
  EXPECT_THROW(ops::fp8_quantize_multi({x, x}, {s, s}, {q, Tensor::empty({4, 7}, DType::F8E4M3)},
                                       {none, none}, {none, none}),
               InternalError);  // out's shape
  EXPECT_THROW(ops::fp8_quantize_multi({x, x}, {s, s}, {q, q},
                                       {none, Tensor::empty({4, 8}, DType::F8E4M3)}, {none, none}),
               InternalError);  // out_t not [C, R]
  EXPECT_THROW(ops::fp8_quantize_multi({x, x}, {s, Tensor::from({2}, {1.0f, 1.0f})}, {q, q},
                                       {none, none}, {none, none}),
               InternalError);  // scale [2]
  EXPECT_THROW(ops::fp8_quantize_multi({x, x}, {s, s}, {q, q}, {none, none},
                                       {none, Tensor::empty({1}, DType::BF16)}),
               InternalError);  // amax not F32
  // One input dtype and one FP8 dtype for all entries.
  EXPECT_THROW(
      ops::fp8_quantize_multi({x, x.to(DType::BF16)}, {s, s}, {q, q}, {none, none}, {none, none}),
      InternalError);
  EXPECT_THROW(ops::fp8_quantize_multi({x, x}, {s, s}, {q, Tensor::empty({4, 8}, DType::F8E5M2)},
                                       {none, none}, {none, none}),
               InternalError);
}

}  // namespace
}  // namespace megaton
