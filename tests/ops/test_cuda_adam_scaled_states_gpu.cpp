// fp16 and fp8 (E4M3) Adam moments with per-tensor scales on the GPU: the absmax pass, the
// update and the new scales give the CPU twin's bits for each moment dtype combination
// (with bf16 and fp32 partners), fp32 params with F32/BF16/F16/no compute copies and
// (bf16 weight, remainder) pairs, BF16 and F32 main grads, aligned and misaligned tensors
// (one element off), more tensors than one launch takes, host scalars and a device control
// tensor; a skipped control step leaves states and scales untouched.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/gpu_testing.h"
#include "core/dtype.h"
#include "ops/adam_precision.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"

namespace megaton {
namespace {

using ops::AdamMomentScales;

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
    {DType::F16, DType::F16},     {DType::F8E4M3, DType::F8E4M3}, {DType::F16, DType::F8E4M3},
    {DType::F8E4M3, DType::F16},  {DType::F16, DType::F32},       {DType::BF16, DType::F8E4M3},
    {DType::F8E4M3, DType::BF16}, {DType::F32, DType::F16}};

struct Lists {
  std::vector<Tensor> params, weights, remainders, grads, m, v, copies;
  std::vector<float> decays;
  std::vector<ops::MomentRoundingKey> keys;
  AdamMomentScales scales;
  Tensor scale_storage, absmax_storage;
};

// 40 tensors (more than one launch of 32): moment dtypes cycle through kCombos, copies
// through BF16, none, F16, F32; every third misaligned; grads BF16 on odd tensors. The
// moments start at zero with scale 0 (a fresh optimizer): the first step sets the scales.
Lists make_lists(uint64_t seed, Device device, bool remainders) {
  const Shape shapes[] = {{7, 5}, {70001}, {4, 4, 3}, {1031}, {33, 3}, {20000}, {9}};
  const int n = 40;
  Lists l;
  l.scale_storage = Tensor::zeros({n, 2}, DType::F32, device);
  l.absmax_storage = Tensor::zeros({n, 2}, DType::F32, device);
  for (int i = 0; i < n; ++i) {
    const Shape& s = shapes[i % 7];
    const bool mis = i % 3 == 2;
    const uint64_t base = seed + 100 * uint64_t(i);
    const Tensor master = testing::randn(s, base, 0.5f);
    if (remainders) {
      Tensor w = Tensor::empty(s, DType::BF16), r = Tensor::empty(s, DType::I16);
      ops::split_param_remainders(master, w, r);
      l.weights.push_back(place(w, DType::BF16, device, mis));
      l.remainders.push_back(place(r, DType::I16, device, mis));
    } else {
      l.params.push_back(place(master, DType::F32, device, mis));
      const DType copy_dtypes[4] = {DType::BF16, DType::F32, DType::F16, DType::F32};
      l.copies.push_back(i % 4 == 1 ? Tensor()
                                    : place(Tensor::zeros(s), copy_dtypes[i % 4], device, mis));
    }
    const auto [md, vd] = kCombos[size_t(i) % kCombos.size()];
    l.m.push_back(place(Tensor::zeros(s), md, device, mis));
    l.v.push_back(place(Tensor::zeros(s), vd, device, mis));
    l.decays.push_back(i % 2 ? 0.0f : 0.1f);
    ops::MomentRoundingKey key;
    key.param_key = 5000 + uint64_t(i);
    key.offset = int64_t(3 * i);
    l.keys.push_back(key);
    l.scales.scale.push_back(l.scale_storage.rows(i, 1).view({2}));
    l.scales.absmax.push_back(l.absmax_storage.rows(i, 1).view({2}));
  }
  return l;
}

void set_grads(Lists& l, uint64_t seed, Device device) {
  l.grads.clear();
  const size_t n = l.m.size();
  for (size_t i = 0; i < n; ++i) {
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

// Step `step` (odd: host scalars; even: control; skip: a skipped control step).
void run_step(Lists& l, int64_t step, Device device, bool remainders, bool skip) {
  const float lr = 1e-2f, scale = step == 2 ? 1.0f : 0.6f;
  const bool with_control = step % 2 == 0 || skip;
  const Tensor control = with_control ? control_on(device, lr, step, scale, skip) : Tensor();
  ops::multi_tensor_adamw_moment_absmax(l.grads, l.m, l.v, l.scales, 0.9f, 0.95f, scale, control);
  if (remainders) {
    if (with_control)
      ops::multi_tensor_adamw_param_remainder(l.weights, l.remainders, l.grads, l.m, l.v, l.decays,
                                              0.9f, 0.95f, 1e-8f, control, l.keys, l.scales);
    else
      ops::multi_tensor_adamw_param_remainder(l.weights, l.remainders, l.grads, l.m, l.v, l.decays,
                                              lr, 0.9f, 0.95f, 1e-8f, step, scale, l.keys,
                                              l.scales);
  } else {
    if (with_control)
      ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 0.9f, 0.95f, 1e-8f,
                              control, l.keys, l.scales);
    else
      ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, lr, 0.9f, 0.95f,
                              1e-8f, step, scale, l.keys, l.scales);
  }
}

void expect_equal(const Lists& gpu, const Lists& cpu, bool remainders) {
  for (size_t i = 0; i < cpu.m.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i) + " " + std::string(dtype_name(cpu.m[i].dtype())) +
                 "/" + std::string(dtype_name(cpu.v[i].dtype())));
    if (remainders) {
      ASSERT_TRUE(same_bytes(gpu.weights[i], cpu.weights[i]));
      ASSERT_TRUE(same_bytes(gpu.remainders[i], cpu.remainders[i]));
    } else {
      ASSERT_TRUE(same_bytes(gpu.params[i], cpu.params[i]));
      if (cpu.copies[i].defined()) {
        ASSERT_TRUE(same_bytes(gpu.copies[i], cpu.copies[i]));
      }
    }
    ASSERT_TRUE(same_bytes(gpu.m[i], cpu.m[i]));
    ASSERT_TRUE(same_bytes(gpu.v[i], cpu.v[i]));
  }
  ASSERT_TRUE(same_bytes(gpu.scale_storage, cpu.scale_storage));
}

void check(bool remainders) {
  const uint64_t seed = testing::test_seed() + (remainders ? 1 : 0);
  SCOPED_TRACE(testing::seed_trace(seed) + (remainders ? " remainders" : " fp32 params"));
  Lists gpu = make_lists(seed, Device::CUDA, remainders);
  Lists cpu = make_lists(seed, Device::CPU, remainders);
  for (int64_t step = 1; step <= 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    set_grads(gpu, seed * 3 + uint64_t(step), Device::CUDA);
    set_grads(cpu, seed * 3 + uint64_t(step), Device::CPU);
    const bool skip = step == 4;
    const Tensor before_scales = cpu.scale_storage.clone();
    const Tensor before_m = cpu.m[0].clone();
    run_step(gpu, step, Device::CUDA, remainders, skip);
    run_step(cpu, step, Device::CPU, remainders, skip);
    expect_equal(gpu, cpu, remainders);
    if (skip) {
      EXPECT_TRUE(same_bytes(gpu.scale_storage, before_scales));
      EXPECT_TRUE(same_bytes(gpu.m[0], before_m));
    } else {
      EXPECT_FALSE(same_bytes(gpu.scale_storage, before_scales));  // the scales move
    }
  }
}

TEST(AdamScaledStatesGpu, Fp32ParamsEqualTheCpuBitwise) {
  MEGATON_SKIP_WITHOUT_GPU();
  check(false);
}

TEST(AdamScaledStatesGpu, ParamRemaindersEqualTheCpuBitwise) {
  MEGATON_SKIP_WITHOUT_GPU();
  check(true);
}

}  // namespace
}  // namespace megaton
#endif
