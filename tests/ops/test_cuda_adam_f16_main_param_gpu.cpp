// fp16 main params with per-tensor scales on the GPU (ops/adam_f16_main_param.h): the
// main-param absmax pass, the update (with the compute weight written from the fp32 value)
// and the new scales give the CPU twin's bits, for moments of every dtype (fp32, bf16,
// scaled fp16 / fp8), BF16 and F16 compute weights, BF16 and F32 main grads, aligned and
// misaligned tensors (one element off), host scalars and a device control tensor; a skipped
// control step leaves everything untouched.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/gpu_testing.h"
#include "core/dtype.h"
#include "ops/adam_f16_main_param.h"
#include "ops/adam_precision.h"
#include "ops/ops.h"

namespace megaton {
namespace {

Tensor place(const Tensor& values, DType dtype, Device device, bool misaligned) {
  const Tensor typed = values.dtype() == dtype ? values : values.to(dtype);
  if (!misaligned) return typed.to(device);
  Tensor buffer = Tensor::zeros({values.numel() + 1}, dtype, device);
  Tensor view = buffer.rows(1, values.numel());
  view.copy_from(typed.view({values.numel()}).to(device));
  return view.view(values.shape());
}

::testing::AssertionResult same_bytes(const Tensor& a_any, const Tensor& b_any) {
  const Tensor a = a_any.to(Device::CPU), b = b_any.to(Device::CPU);
  if (a.nbytes() != b.nbytes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  const size_t elem = dtype_size(a.dtype());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(static_cast<const char*>(a.raw()) + i * elem,
                    static_cast<const char*>(b.raw()) + i * elem, elem) != 0)
      return ::testing::AssertionFailure()
             << "element " << i << ": " << a.item(i) << " vs " << b.item(i);
  return ::testing::AssertionSuccess();
}

const std::vector<std::pair<DType, DType>> kCombos = {
    {DType::F32, DType::F32}, {DType::BF16, DType::BF16},   {DType::F16, DType::F16},
    {DType::F16, DType::F32}, {DType::F8E4M3, DType::F16}, {DType::BF16, DType::F8E4M3}};

struct Lists {
  std::vector<Tensor> masters, copies, grads, m, v;
  std::vector<float> decays;
  std::vector<ops::MomentRoundingKey> keys;
  ops::AdamMomentScales moment_scales;
  ops::AdamMainParamScales main_scales;
  Tensor moment_scale, moment_absmax, scale, absmax;
};

// 12 tensors: moment dtypes cycle through kCombos, copies BF16 / F16, every third
// misaligned. The main params are quantized from random values (their first scale); the
// moments start at zero with scale 0.
Lists make_lists(uint64_t seed, Device device) {
  const Shape shapes[] = {{7, 5}, {70001}, {4, 4, 3}, {1031}, {33, 3}, {20000}, {9}};
  const int n = 12;
  Lists l;
  l.moment_scale = Tensor::zeros({n, 2}, DType::F32, device);
  l.moment_absmax = Tensor::zeros({n, 2}, DType::F32, device);
  Tensor scale_host = Tensor::zeros({n});
  for (int i = 0; i < n; ++i) {
    const Shape& s = shapes[i % 7];
    const bool mis = i % 3 == 2;
    const uint64_t base = seed + 100 * uint64_t(i);
    const Tensor value = testing::randn(s, base, 0.5f);
    Tensor stored = Tensor::empty(s, DType::F16), scale = Tensor::zeros({1});
    ops::f16_main_param_quantize(value, ops::f16_main_param_scale(ops::f16_main_param_absmax(value)),
                                 stored, scale);
    scale_host.f32()[i] = scale.f32()[0];
    l.masters.push_back(place(stored, DType::F16, device, mis));
    l.copies.push_back(place(Tensor::zeros(s), i % 2 ? DType::F16 : DType::BF16, device, mis));
    const auto [md, vd] = kCombos[size_t(i) % kCombos.size()];
    l.m.push_back(place(Tensor::zeros(s), md, device, mis));
    l.v.push_back(place(Tensor::zeros(s), vd, device, mis));
    l.decays.push_back(i % 2 ? 0.0f : 0.1f);
    ops::MomentRoundingKey key;
    key.param_key = 7000 + uint64_t(i);
    key.offset = int64_t(5 * i);
    l.keys.push_back(key);
    l.moment_scales.scale.push_back(l.moment_scale.rows(i, 1).view({2}));
    l.moment_scales.absmax.push_back(l.moment_absmax.rows(i, 1).view({2}));
  }
  l.scale = scale_host.to(device);
  l.absmax = Tensor::zeros({n}, DType::F32, device);
  for (int i = 0; i < n; ++i) {
    l.main_scales.scale.push_back(l.scale.rows(i, 1));
    l.main_scales.absmax.push_back(l.absmax.rows(i, 1));
  }
  return l;
}

void set_grads(Lists& l, uint64_t seed, Device device) {
  l.grads.clear();
  for (size_t i = 0; i < l.m.size(); ++i) {
    const Tensor values = testing::randn(l.m[i].shape(), seed + 7 * i, 0.3f);
    l.grads.push_back(place(values, i % 2 ? DType::BF16 : DType::F32, device, i % 3 == 2));
  }
}

Tensor control_on(Device device, float lr, int64_t step, float grad_scale, bool skip) {
  const ops::AdamPrecisionConstants c =
      ops::adam_precision_constants(lr, 0.9f, 0.95f, 1e-8f, step, grad_scale);
  Tensor host = Tensor::zeros({ops::kAdamControlSize});
  host.f32()[ops::kAdamStepSize] = c.step_size;
  host.f32()[ops::kAdamInvSqrtBc2] = c.inv_sqrt_bc2;
  host.f32()[ops::kAdamGradScale] = grad_scale;
  host.f32()[ops::kAdamStep] = float(step);
  host.f32()[ops::kAdamLr] = lr;
  host.f32()[ops::kAdamSkip] = skip ? 1.0f : 0.0f;
  return host.to(device);
}

// Step `step` (odd: host scalars; even: control; skip: a skipped control step), as AdamW
// runs it: absmax slots zeroed, the moments' pass, the main params' pass, the update.
void run_step(Lists& l, int64_t step, Device device, bool skip) {
  const float lr = 1e-2f, scale = step == 2 ? 1.0f : 0.6f;
  const bool with_control = step % 2 == 0 || skip;
  const Tensor control = with_control ? control_on(device, lr, step, scale, skip) : Tensor();
  l.moment_absmax.zero();
  l.absmax.zero();
  ops::multi_tensor_adamw_moment_absmax(l.grads, l.m, l.v, l.moment_scales, 0.9f, 0.95f, scale,
                                        control);
  ops::multi_tensor_adamw_f16_main_param_absmax(l.masters, l.grads, l.m, l.v, l.moment_scales,
                                                l.main_scales, l.decays, lr, 0.9f, 0.95f, 1e-8f,
                                                step, scale, control);
  ops::multi_tensor_adamw_f16_main_param(l.masters, l.copies, l.grads, l.m, l.v, l.decays, lr,
                                         0.9f, 0.95f, 1e-8f, step, scale, control, l.keys,
                                         l.moment_scales, l.main_scales);
}

void expect_equal(const Lists& gpu, const Lists& cpu) {
  for (size_t i = 0; i < cpu.m.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i) + " " + std::string(dtype_name(cpu.m[i].dtype())) +
                 "/" + std::string(dtype_name(cpu.v[i].dtype())));
    ASSERT_TRUE(same_bytes(gpu.masters[i], cpu.masters[i]));
    ASSERT_TRUE(same_bytes(gpu.copies[i], cpu.copies[i]));
    ASSERT_TRUE(same_bytes(gpu.m[i], cpu.m[i]));
    ASSERT_TRUE(same_bytes(gpu.v[i], cpu.v[i]));
  }
  ASSERT_TRUE(same_bytes(gpu.absmax, cpu.absmax));
  ASSERT_TRUE(same_bytes(gpu.scale, cpu.scale));
  ASSERT_TRUE(same_bytes(gpu.moment_scale, cpu.moment_scale));
}

TEST(AdamF16MainParamGpu, EqualsTheCpuBitwise) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  Lists gpu = make_lists(seed, Device::CUDA);
  Lists cpu = make_lists(seed, Device::CPU);
  expect_equal(gpu, cpu);
  for (int64_t step = 1; step <= 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    set_grads(gpu, seed * 3 + uint64_t(step), Device::CUDA);
    set_grads(cpu, seed * 3 + uint64_t(step), Device::CPU);
    const bool skip = step == 4;
    const Tensor before_scale = cpu.scale.clone(), before_master = cpu.masters[1].clone();
    run_step(gpu, step, Device::CUDA, skip);
    run_step(cpu, step, Device::CPU, skip);
    expect_equal(gpu, cpu);
    if (skip) {
      EXPECT_TRUE(same_bytes(gpu.scale, before_scale));
      EXPECT_TRUE(same_bytes(gpu.masters[1], before_master));
    } else {
      EXPECT_FALSE(same_bytes(gpu.scale, before_scale));  // the scales move
    }
  }
}

}  // namespace
}  // namespace megaton
#endif
