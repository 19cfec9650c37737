// YaRN's frequencies and scales (model/rope_scaling.h).
#include "model/rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <utility>

#include "core/error.h"

namespace megaton {

double yarn_get_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

double yarn_correction_dim(double num_rotations, int64_t dim, double base,
                           int64_t original_max_position_embeddings) {
  return double(dim) *
         std::log(double(original_max_position_embeddings) / (num_rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(base));
}

std::pair<int64_t, int64_t> yarn_correction_range(int64_t dim, double base, const YarnConfig& c) {
  const int64_t low = int64_t(std::floor(
      yarn_correction_dim(c.beta_fast, dim, base, c.original_max_position_embeddings)));
  const int64_t high = int64_t(std::ceil(
      yarn_correction_dim(c.beta_slow, dim, base, c.original_max_position_embeddings)));
  return {std::max<int64_t>(low, 0), std::min<int64_t>(high, dim - 1)};
}

std::vector<double> yarn_inv_freq(int64_t dim, double base, const YarnConfig& c) {
  MEGATON_CHECK(dim > 0 && dim % 2 == 0, "yarn_inv_freq: rotary dim {} must be positive and even",
                dim);
  MEGATON_CHECK(base > 1.0 && c.factor > 0.0, "yarn_inv_freq: base {} must exceed 1 and factor {} be positive",
                base, c.factor);
  const auto [low, high_int] = yarn_correction_range(dim, base, c);
  const double high = high_int == low ? double(high_int) + 0.001 : double(high_int);
  std::vector<double> inv_freq(size_t(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double extra = std::pow(base, -2.0 * double(i) / double(dim));
    const double ramp = std::clamp((double(i) - double(low)) / (high - double(low)), 0.0, 1.0);
    inv_freq[size_t(i)] = extra * (1.0 - ramp) + extra / c.factor * ramp;
  }
  return inv_freq;
}

double yarn_cos_sin_scale(const YarnConfig& c) {
  if (c.mscale != 0.0 && c.mscale_all_dim != 0.0)
    return yarn_get_mscale(c.factor, c.mscale) / yarn_get_mscale(c.factor, c.mscale_all_dim);
  return yarn_get_mscale(c.factor);
}

double yarn_softmax_scale(const YarnConfig& c, int64_t head_dim) {
  MEGATON_CHECK(head_dim > 0, "yarn_softmax_scale: head dim {} must be positive", head_dim);
  const double m = yarn_get_mscale(c.factor, c.mscale_all_dim);  // 1 for mscale_all_dim 0
  return m * m / std::sqrt(double(head_dim));
}

}  // namespace megaton
