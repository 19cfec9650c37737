// YaRN's frequencies and scales (model/rope_scaling.h) against the values Hugging Face
// transformers 5.23's _compute_yarn_parameters and DeepseekV3Attention give
// (docs/research/deepseek-v3.md section 2.5: factor 40, original 4096 positions, base 1e4,
// rope dim 64, q head dim 128 + 64).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/rope_scaling.h"

namespace megaton {
namespace {

YarnConfig deepseek_v3(double mscale, double mscale_all_dim) {
  YarnConfig c;
  c.factor = 40;
  c.original_max_position_embeddings = 4096;
  c.beta_fast = 32;
  c.beta_slow = 1;
  c.mscale = mscale;
  c.mscale_all_dim = mscale_all_dim;
  return c;
}

TEST(RopeScaling, CorrectionRangeAndFrequencies) {
  const YarnConfig c = deepseek_v3(1.0, 1.0);
  EXPECT_NEAR(yarn_correction_dim(32, 64, 1e4, 4096), 10.4722, 1e-4);
  EXPECT_NEAR(yarn_correction_dim(1, 64, 1e4, 4096), 22.5134, 1e-4);
  EXPECT_EQ(yarn_correction_range(64, 1e4, c), (std::pair<int64_t, int64_t>{10, 23}));
  const std::vector<double> f = yarn_inv_freq(64, 1e4, c);
  ASSERT_EQ(f.size(), 32u);
  EXPECT_NEAR(f[0], 1.0, 1e-12);
  EXPECT_NEAR(f[1], 0.74989, 1e-5);
  EXPECT_NEAR(f[2], 0.56234, 1e-5);
  EXPECT_NEAR(f[3], 0.42170, 1e-5);
  EXPECT_NEAR(f[22] / 1.7783e-4, 1.0, 1e-4);
  EXPECT_NEAR(f[23] / 3.3338e-5, 1.0, 1e-4);
  EXPECT_NEAR(f[31] / 3.3338e-6, 1.0, 1e-4);
  // The ramp: extrapolation (plain RoPE) up to i = 10, interpolation (/ 40) from 23,
  // linear in between (i = 11: 1 - (1/13) (1 - 1/40) = 0.925 of plain RoPE).
  for (int64_t i = 0; i < 32; ++i) {
    const double plain = std::pow(1e4, -2.0 * double(i) / 64.0);
    const double ramp = std::clamp((double(i) - 10.0) / 13.0, 0.0, 1.0);
    EXPECT_NEAR(f[size_t(i)] / plain, 1.0 - ramp * (1.0 - 1.0 / 40.0), 1e-12) << i;
  }
  // Factor 1 is plain RoPE.
  YarnConfig one = c;
  one.factor = 1;
  const std::vector<double> plain = yarn_inv_freq(64, 1e4, one);
  for (int64_t i = 0; i < 32; ++i)
    EXPECT_NEAR(plain[size_t(i)], std::pow(1e4, -2.0 * double(i) / 64.0), 1e-15) << i;
  EXPECT_THROW(yarn_inv_freq(63, 1e4, c), InternalError);
}

// The table of docs/research/deepseek-v3.md 2.5. The rows with mscale != mscale_all_dim are
// the ones where Megatron's old softmax scale (from mscale) was wrong.
TEST(RopeScaling, MscaleOnCosSinAndSoftmaxScale) {
  EXPECT_NEAR(yarn_get_mscale(40, 1.0), 1.368888, 1e-6);
  EXPECT_EQ(yarn_get_mscale(1.0, 1.0), 1.0);
  struct Row {
    double mscale, mscale_all_dim, cos_sin, softmax;
  };
  for (const Row& r : {Row{1.0, 1.0, 1.000000, 0.135234}, Row{1.0, 0.0, 1.368888, 0.072169},
                       Row{0.707, 0.707, 1.000000, 0.114721}, Row{1.0, 0.707, 1.085726, 0.114721},
                       Row{0.707, 1.0, 0.921042, 0.135234}}) {
    SCOPED_TRACE(testing::Message() << "mscale " << r.mscale << " all_dim " << r.mscale_all_dim);
    const YarnConfig c = deepseek_v3(r.mscale, r.mscale_all_dim);
    EXPECT_NEAR(yarn_cos_sin_scale(c), r.cos_sin, 1e-6);
    EXPECT_NEAR(yarn_softmax_scale(c, 192), r.softmax, 1e-6);
  }
}

}  // namespace
}  // namespace megaton
