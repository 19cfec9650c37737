// MLA's interleaved RoPE (ops/rope_interleaved.h) against Hugging Face's DeepseekV3 formula
// written out in double (de-interleave, then rotate half with cat(freqs, freqs) x scale),
// and its backward as the transpose of the forward.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/testing.h"
#include "core/error.h"
#include "ops/rope_interleaved.h"

namespace megaton {
namespace {

using testing::dot;
using testing::randn;

// YaRN-like frequencies (model/rope_scaling.h gives the real ones): plain RoPE's for the
// first quarter, divided by 4 for the last, a ramp between.
std::vector<float> deepseek_frequencies(int64_t dim) {
  std::vector<float> out;
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const double ramp = std::clamp((double(j) - double(half) / 4) / (double(half) / 2), 0.0, 1.0);
    out.push_back(float(std::pow(10000.0, -2.0 * double(j) / double(dim)) * (1.0 - 0.75 * ramp)));
  }
  return out;
}

// Hugging Face's apply_rotary_pos_emb_interleave in double: x1 = x[0::2], x2 = x[1::2]
// (then cat(x1, x2) is rotated by rotate_half with cos = cat(cos, cos)).
Tensor reference(const Tensor& x, const std::vector<float>& inv_freq, double scale,
                 int64_t offset) {
  const int64_t B = x.dim(0), S = x.dim(1), H = x.dim(2), D = x.dim(3), half = D / 2;
  Tensor y = Tensor::empty(x.shape());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) {
        const float* in = x.f32() + ((b * S + s) * H + h) * D;
        float* out = y.f32() + ((b * S + s) * H + h) * D;
        std::vector<double> t(static_cast<size_t>(D));
        for (int64_t j = 0; j < half; ++j) {
          t[size_t(j)] = in[2 * j];
          t[size_t(j + half)] = in[2 * j + 1];
        }
        for (int64_t i = 0; i < D; ++i) {
          const int64_t j = i % half;
          const double angle = double(float(s + offset) * inv_freq[size_t(j)]);
          const double rotated = i < half ? -t[size_t(i + half)] : t[size_t(i - half)];
          out[i] = float(scale * (t[size_t(i)] * std::cos(angle) + rotated * std::sin(angle)));
        }
      }
  return y;
}

TEST(RopeInterleaved, ForwardMatchesHuggingFaceFormula) {
  const std::vector<float> inv_freq = deepseek_frequencies(8);
  const Tensor x = randn({2, 5, 3, 8}, testing::test_seed());
  for (int64_t offset : {int64_t(0), int64_t(7)}) {
    Tensor y = Tensor::empty(x.shape());
    ops::rope_interleaved_forward(x, y, inv_freq, 1.0857f, offset);
    EXPECT_LE(testing::rel_error(y, reference(x, inv_freq, 1.0857f, offset)), 1e-6) << offset;
  }
  // Scale 1 and a single pair at position 0 leave the pair's values in place.
  Tensor one = Tensor::from({1, 1, 1, 2}, {0.25f, -2.0f}), out = Tensor::empty({1, 1, 1, 2});
  ops::rope_interleaved_forward(one, out, {1.0f}, 1.0f);
  EXPECT_EQ(out.f32()[0], 0.25f);
  EXPECT_EQ(out.f32()[1], -2.0f);
}

TEST(RopeInterleaved, BackwardIsTheTranspose) {
  const std::vector<float> inv_freq = deepseek_frequencies(16);
  const uint64_t seed = testing::test_seed() + 1;
  const Tensor x = randn({2, 4, 2, 16}, seed), dy = randn(x.shape(), seed + 1);
  Tensor y = Tensor::empty(x.shape()), dx = Tensor::empty(x.shape());
  ops::rope_interleaved_forward(x, y, inv_freq, 0.9f, 3);
  ops::rope_interleaved_backward(dy, dx, inv_freq, 0.9f, 3);
  // <dy, f(x)> = <f^T(dy), x> for the linear map f.
  EXPECT_NEAR(dot(dy, y), dot(dx, x), 1e-4 * std::abs(dot(dy, y)) + 1e-5);
  // And the inverse up to scale^2: f^T(f(x)) = scale^2 x (a rotation's transpose undoes it).
  Tensor back = Tensor::empty(x.shape());
  ops::rope_interleaved_backward(y, back, inv_freq, 0.9f, 3);
  for (int64_t i = 0; i < x.numel(); ++i)
    EXPECT_NEAR(back.f32()[i], 0.81f * x.f32()[i], 1e-5) << i;
}

TEST(RopeInterleaved, RejectsBadArguments) {
  const Tensor x = randn({1, 2, 1, 8}, 3);
  Tensor y = Tensor::empty(x.shape());
  EXPECT_THROW(ops::rope_interleaved_forward(x, y, {1.0f, 1.0f}, 1.0f), InternalError);
  Tensor alias = x;
  EXPECT_THROW(ops::rope_interleaved_forward(x, alias, deepseek_frequencies(8), 1.0f),
               InternalError);
}

}  // namespace
}  // namespace megaton
