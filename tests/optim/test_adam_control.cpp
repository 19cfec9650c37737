// AdamW steps decided on the device (ops.h "AdamW steps decided on the device"), CPU:
// the control path updates to the same bits as the host path, skips a non-finite step
// without counting it, stops for good under check_nan; and the device-result reductions
// (ops::dot, ops::sum(x, out), multi_tensor_sum_of_squares(..., out)) and the expert-bias
// update agree with their host formulas.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/ops.h"
#include "optim/clip_grad.h"
#include "common/testing.h"

namespace megaton {
namespace {

struct AdamLists {
  std::vector<Tensor> params, grads, m, v, copies;
  std::vector<float> decays;
};

AdamLists make_lists(uint64_t seed) {
  AdamLists l;
  const std::vector<Shape> shapes = {{7, 5}, {33}, {4, 4, 3}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    l.params.push_back(testing::randn(shapes[i], seed + 10 * i));
    l.grads.push_back(testing::randn(shapes[i], seed + 10 * i + 1));
    l.m.push_back(Tensor::zeros(shapes[i]));
    l.v.push_back(Tensor::zeros(shapes[i]));
    l.copies.push_back(i == 1 ? Tensor::empty(shapes[i], DType::BF16) : Tensor());
    l.decays.push_back(i == 2 ? 0.0f : 0.1f);
  }
  return l;
}

Tensor sum_sq_of(const std::vector<Tensor>& grads) {
  Tensor parts = Tensor::empty({1}, DType::I64);
  ops::multi_tensor_sum_of_squares(grads, parts);
  return parts;
}

// Three steps, the first two clipped (max norm below the norm), by both paths.
TEST(AdamControl, UpdatesLikeTheHostPath) {
  const uint64_t seed = testing::test_seed();
  AdamLists host = make_lists(seed), device = make_lists(seed);
  Tensor state = Tensor::zeros({2}, DType::I64), control = Tensor::empty({ops::kAdamControlSize});
  Tensor norm_bits = Tensor::empty({1}, DType::I64);
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, mean_scale = 0.5f;
  for (int step = 1; step <= 3; ++step) {
    const double max_norm = step < 3 ? 0.25 : 100.0;
    const double sum_sq = ops::multi_tensor_sum_of_squares(host.grads);
    const double norm = std::sqrt(sum_sq) * double(mean_scale);
    const float scale = float(optim::clip_coefficient(max_norm, norm)) * mean_scale;
    ops::multi_tensor_adamw(host.params, host.grads, host.m, host.v, host.copies, host.decays, lr,
                            b1, b2, eps, step, scale);
    ops::adamw_step_control(sum_sq_of(device.grads), double(mean_scale), max_norm, mean_scale,
                            Tensor(), true, Tensor::from({1}, {lr}), b1, b2, state, control,
                            norm_bits);
    EXPECT_EQ(std::bit_cast<double>(norm_bits.i64()[0]), norm);
    EXPECT_EQ(control.f32()[ops::kAdamGradScale], scale);
    EXPECT_EQ(control.f32()[ops::kAdamLr], lr);
    EXPECT_EQ(control.f32()[ops::kAdamSkip], 0.0f);
    ops::multi_tensor_adamw(device.params, device.grads, device.m, device.v, device.copies,
                            device.decays, b1, b2, eps, control);
    EXPECT_EQ(state.i64()[0], step);
    for (size_t i = 0; i < host.params.size(); ++i) {
      EXPECT_TRUE(testing::allclose(device.params[i], host.params[i], 0, 0)) << "step " << step;
      EXPECT_TRUE(testing::allclose(device.v[i], host.v[i], 0, 0)) << "step " << step;
    }
    EXPECT_TRUE(testing::allclose(device.copies[1].to(DType::F32), host.copies[1].to(DType::F32), 0, 0));
  }
}

TEST(AdamControl, NonFiniteNormSkipsAndCheckNanStops) {
  AdamLists l = make_lists(testing::test_seed());
  const std::vector<Tensor> before = {l.params[0].clone(), l.m[0].clone()};
  Tensor state = Tensor::zeros({2}, DType::I64), control = Tensor::empty({ops::kAdamControlSize});
  Tensor norm_bits = Tensor::empty({1}, DType::I64);
  Tensor nan_parts = Tensor::empty({1}, DType::I64);
  nan_parts.i64()[0] = std::bit_cast<int64_t>(std::numeric_limits<double>::quiet_NaN());
  auto step = [&](const Tensor& parts, const Tensor& loss, bool check_nan) {
    ops::adamw_step_control(parts, 1.0, 1.0, 1.0f, loss, check_nan, Tensor::from({1}, {1e-3f}),
                            0.9f, 0.999f, state, control, norm_bits);
    ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 0.9f, 0.999f, 1e-8f,
                            control);
  };
  // Without the check: skipped, not counted, not stopped; the next finite step updates
  // with step count 1.
  step(nan_parts, Tensor(), false);
  EXPECT_EQ(control.f32()[ops::kAdamSkip], 1.0f);
  EXPECT_TRUE(std::isnan(std::bit_cast<double>(norm_bits.i64()[0])));
  EXPECT_EQ(state.i64()[0], 0);
  EXPECT_EQ(state.i64()[1], 0);
  EXPECT_TRUE(testing::allclose(l.params[0], before[0], 0, 0));
  EXPECT_TRUE(testing::allclose(l.m[0], before[1], 0, 0));
  step(sum_sq_of(l.grads), Tensor(), false);
  EXPECT_EQ(state.i64()[0], 1);
  EXPECT_FALSE(testing::allclose(l.params[0], before[0], 0, 0));
  // With the check, a non-finite loss stops: this step and every later one are skipped.
  const Tensor updated = l.params[0].clone();
  step(sum_sq_of(l.grads), Tensor::from({1}, {std::numeric_limits<float>::infinity()}), true);
  EXPECT_EQ(state.i64()[1], 1);
  EXPECT_EQ(control.f32()[ops::kAdamSkip], 1.0f);
  step(sum_sq_of(l.grads), Tensor::from({1}, {2.0f}), true);
  EXPECT_EQ(control.f32()[ops::kAdamSkip], 1.0f);
  EXPECT_EQ(state.i64()[0], 1);
  EXPECT_TRUE(testing::allclose(l.params[0], updated, 0, 0));
}

TEST(AdamControl, DeviceResultReductions) {
  const uint64_t seed = testing::test_seed();
  const Tensor a = testing::randn({5, 37}, seed), b = testing::randn({185}, seed + 1);
  Tensor out = Tensor::empty({1});
  ops::dot(a, b, out);
  double want = 0;
  for (int64_t i = 0; i < a.numel(); ++i) want += double(a.f32()[i]) * double(b.f32()[i]);
  EXPECT_EQ(out.f32()[0], float(want));
  ops::sum(a, out);
  double total = 0;
  for (int64_t i = 0; i < a.numel(); ++i) total += double(a.f32()[i]);
  EXPECT_NEAR(out.f32()[0], float(total), 1e-6 * std::fabs(total));  // fp64 in chunks, fp32 out
  Tensor bits = Tensor::empty({1}, DType::I64);
  ops::multi_tensor_sum_of_squares({a, b}, bits);
  EXPECT_EQ(std::bit_cast<double>(bits.i64()[0]), ops::multi_tensor_sum_of_squares({a, b}));
  Tensor wrong = Tensor::empty({2});
  EXPECT_THROW(ops::dot(a, b, wrong), InternalError);
}

TEST(AdamControl, ExpertBiasUpdate) {
  const Tensor counts = Tensor::from({4}, {10.0f, 30.0f, 20.0f, 20.0f});  // mean 20
  Tensor bias = Tensor::from({4}, {0.5f, 0.5f, 0.5f, 0.5f});
  ops::moe_expert_bias_update(counts, 1e-3f, bias);
  EXPECT_EQ(bias.f32()[0], 0.5f + 1e-3f);  // below the mean: raised
  EXPECT_EQ(bias.f32()[1], 0.5f - 1e-3f);  // above: lowered
  EXPECT_EQ(bias.f32()[2], 0.5f);          // at the mean: unchanged
}

}  // namespace
}  // namespace megaton
