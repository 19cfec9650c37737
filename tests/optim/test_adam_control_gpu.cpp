// AdamW steps decided on the device, on the GPU: the control path (adamw_step_control's
// kernel, multi_tensor_adamw reading control) updates to the same bits as the GPU host
// path, its scalars equal the CPU twin's, and the device-result reductions and the
// expert-bias update agree with the CPU ops.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "common/gpu_testing.h"
#include "ops/ops.h"
#include "optim/clip_grad.h"

namespace megaton {
namespace {

struct AdamLists {
  std::vector<Tensor> params, grads, m, v, copies;
  std::vector<float> decays;
};

AdamLists make_lists(uint64_t seed, Device device) {
  AdamLists l;
  // Sizes across the multi-tensor chunking: a float4 tail, a multi-chunk tensor.
  const std::vector<Shape> shapes = {{7, 5}, {70001}, {4, 4, 3}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    l.params.push_back(testing::randn(shapes[i], seed + 10 * i).to(device));
    l.grads.push_back(testing::randn(shapes[i], seed + 10 * i + 1).to(device));
    l.m.push_back(Tensor::zeros(shapes[i], DType::F32, device));
    l.v.push_back(Tensor::zeros(shapes[i], DType::F32, device));
    l.copies.push_back(i == 1 ? Tensor::empty(shapes[i], DType::BF16, device) : Tensor());
    l.decays.push_back(i == 2 ? 0.0f : 0.1f);
  }
  return l;
}

TEST(AdamControlGpu, UpdatesLikeTheHostPathAndTheCpuScalars) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  AdamLists host = make_lists(seed, Device::CUDA), device = make_lists(seed, Device::CUDA);
  Tensor state = Tensor::zeros({2}, DType::I64, Device::CUDA);
  Tensor control = Tensor::empty({ops::kAdamControlSize}, DType::F32, Device::CUDA);
  Tensor norm_bits = Tensor::empty({1}, DType::I64, Device::CUDA);
  Tensor cpu_state = Tensor::zeros({2}, DType::I64), cpu_control = Tensor::empty({ops::kAdamControlSize});
  Tensor cpu_norm = Tensor::empty({1}, DType::I64);
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, mean_scale = 0.25f;
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const double max_norm = step < 3 ? 1.0 : 1e4;  // clipped twice, then not
    Tensor parts = Tensor::empty({1}, DType::I64, Device::CUDA);
    ops::multi_tensor_sum_of_squares(device.grads, parts);
    const double sum_sq = ops::multi_tensor_sum_of_squares(host.grads);
    EXPECT_EQ(std::bit_cast<double>(parts.to(Device::CPU).i64()[0]), sum_sq);
    const double norm = std::sqrt(sum_sq) * double(mean_scale);
    const float scale = float(optim::clip_coefficient(max_norm, norm)) * mean_scale;
    ops::multi_tensor_adamw(host.params, host.grads, host.m, host.v, host.copies, host.decays, lr,
                            b1, b2, eps, step, scale);
    const Tensor lr_host = Tensor::from({1}, {lr});
    ops::adamw_step_control(parts, double(mean_scale), max_norm, mean_scale, Tensor(), true,
                            lr_host.to(Device::CUDA), b1, b2, state, control, norm_bits);
    ops::multi_tensor_adamw(device.params, device.grads, device.m, device.v, device.copies,
                            device.decays, b1, b2, eps, control);
    // The CPU twin of the prologue computes the same scalars.
    ops::adamw_step_control(parts.to(Device::CPU), double(mean_scale), max_norm, mean_scale,
                            Tensor(), true, lr_host, b1, b2, cpu_state, cpu_control, cpu_norm);
    const Tensor got = control.to(Device::CPU);
    for (int64_t i = 0; i < ops::kAdamControlSize; ++i)
      EXPECT_EQ(got.f32()[i], cpu_control.f32()[i]) << "control " << i;
    EXPECT_EQ(norm_bits.to(Device::CPU).i64()[0], cpu_norm.i64()[0]);
    EXPECT_EQ(std::bit_cast<double>(cpu_norm.i64()[0]), norm);
    EXPECT_EQ(got.f32()[ops::kAdamGradScale], scale);
    EXPECT_EQ(state.to(Device::CPU).i64()[0], step);
    for (size_t i = 0; i < host.params.size(); ++i) {
      EXPECT_TRUE(testing::allclose(device.params[i].to(Device::CPU), host.params[i].to(Device::CPU), 0, 0));
      EXPECT_TRUE(testing::allclose(device.m[i].to(Device::CPU), host.m[i].to(Device::CPU), 0, 0));
      EXPECT_TRUE(testing::allclose(device.v[i].to(Device::CPU), host.v[i].to(Device::CPU), 0, 0));
    }
    EXPECT_TRUE(testing::allclose(testing::to_host_f32(device.copies[1]),
                                  testing::to_host_f32(host.copies[1]), 0, 0));
  }
}

TEST(AdamControlGpu, SkippedStepWritesNothing) {
  MEGATON_SKIP_WITHOUT_GPU();
  AdamLists l = make_lists(testing::test_seed(), Device::CUDA);
  ops::cast(l.params[1], l.copies[1]);  // a known value to keep
  const Tensor before = l.params[1].to(Device::CPU), copy_before = testing::to_host_f32(l.copies[1]);
  Tensor state = Tensor::zeros({2}, DType::I64, Device::CUDA);
  Tensor control = Tensor::empty({ops::kAdamControlSize}, DType::F32, Device::CUDA);
  Tensor norm_bits = Tensor::empty({1}, DType::I64, Device::CUDA);
  Tensor parts = Tensor::empty({1}, DType::I64);
  parts.i64()[0] = std::bit_cast<int64_t>(std::numeric_limits<double>::infinity());
  ops::adamw_step_control(parts.to(Device::CUDA), 1.0, 1.0, 1.0f, Tensor(), false,
                          Tensor::from({1}, {1e-3f}).to(Device::CUDA), 0.9f, 0.999f, state, control,
                          norm_bits);
  ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 0.9f, 0.999f, 1e-8f,
                          control);
  EXPECT_TRUE(testing::allclose(l.params[1].to(Device::CPU), before, 0, 0));
  EXPECT_TRUE(testing::allclose(testing::to_host_f32(l.copies[1]), copy_before, 0, 0));
  EXPECT_EQ(state.to(Device::CPU).i64()[0], 0);
  EXPECT_EQ(control.to(Device::CPU).f32()[ops::kAdamSkip], 1.0f);
}

TEST(AdamControlGpu, DeviceResultReductionsAndExpertBias) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  const Tensor a = testing::randn({300, 777}, seed), b = testing::randn({233100}, seed + 1);
  Tensor out = Tensor::empty({1}, DType::F32, Device::CUDA), cpu_out = Tensor::empty({1});
  ops::dot(a.to(Device::CUDA), b.to(Device::CUDA), out);
  ops::dot(a, b, cpu_out);
  // fp64 sums in another order: equal after rounding to fp32 but for the last bit.
  EXPECT_NEAR(out.to(Device::CPU).f32()[0], cpu_out.f32()[0], 1e-6 * std::fabs(cpu_out.f32()[0]));
  ops::sum(a.to(Device::CUDA), out);
  ops::sum(a, cpu_out);
  EXPECT_NEAR(out.to(Device::CPU).f32()[0], cpu_out.f32()[0], 1e-6 * std::fabs(cpu_out.f32()[0]) + 1e-4);
  // The expert-bias update sums the counts in expert order on one thread: the CPU's bits.
  const Tensor counts = testing::randn({64}, seed + 2, 100.0f);
  Tensor bias = testing::randn({64}, seed + 3), gpu_bias = bias.to(Device::CUDA);
  ops::moe_expert_bias_update(counts, 1e-3f, bias);
  ops::moe_expert_bias_update(counts.to(Device::CUDA), 1e-3f, gpu_bias);
  EXPECT_TRUE(testing::allclose(gpu_bias.to(Device::CPU), bias, 0, 0));
}

}  // namespace
}  // namespace megaton

#else  // !MEGATON_WITH_CUDA

TEST(AdamControlGpu, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
