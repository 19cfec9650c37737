// The precision-aware AdamW on the GPU: multi_tensor_adamw with BF16 moments (and one
// moment F32) gives the CPU twin's bits, params, moments (stochastically rounded, the
// same random bits) and compute copies, on packs of four (aligned tensors), on the scalar
// path (tensors one element off alignment) and on the tails; from the host scalars and
// from adamw_step_control's device scalars; with the list-order keys of ops.h's overloads
// and with rounding keys that place the tensors at offsets (not multiples of 4) and in
// column slices or SwiGLU halves of larger parameters; more tensors than one
// precision-aware launch takes, mixed with fp32-moment tensors.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <cmath>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "ops/adam_precision.h"
#include "ops/ops.h"

namespace megaton {
namespace {

struct Lists {
  std::vector<Tensor> params, grads, m, v, copies;
  std::vector<float> decays;
};

// A tensor of `shape` and `dtype` with the values of `values` (F32, host), on `device`;
// misaligned: a view starting one element into a larger buffer (the scalar path).
Tensor place(const Tensor& values, DType dtype, Device device, bool misaligned) {
  if (!misaligned) return values.to(dtype).to(device);
  Tensor flat = values.view({values.numel()});
  Tensor buffer = Tensor::zeros({values.numel() + 1}, dtype, device);
  Tensor view = buffer.rows(1, values.numel());
  view.copy_from(flat.to(dtype).to(device));
  return view.view(values.shape());
}

// The same lists on `device`: moment dtypes per tensor cycle through (BF16, BF16),
// (BF16, F32), (F32, BF16); copies through BF16, none, F32; sizes cover a pack tail, a
// multi-chunk tensor and misaligned tensors. Moments start nonzero (v positive).
Lists make_lists(uint64_t seed, Device device) {
  struct Spec {
    Shape shape;
    bool misaligned;
  };
  const std::vector<Spec> specs = {{{7, 5}, false},  {{70001}, false}, {{4, 4, 3}, false},
                                   {{1031}, true},   {{33, 3}, true},  {{40000}, false}};
  const DType moment_dtypes[3][2] = {
      {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}, {DType::F32, DType::BF16}};
  Lists l;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Shape& s = specs[i].shape;
    const bool mis = specs[i].misaligned;
    const uint64_t base = seed + 100 * i;
    l.params.push_back(place(testing::randn(s, base, 0.5f), DType::F32, device, mis));
    l.grads.push_back(place(testing::randn(s, base + 1, 0.3f), DType::F32, device, mis));
    l.m.push_back(place(testing::randn(s, base + 2, 0.01f), moment_dtypes[i % 3][0], device, mis));
    Tensor v = testing::randn(s, base + 3, 1e-3f);
    for (int64_t k = 0; k < v.numel(); ++k) v.f32()[k] = v.f32()[k] * v.f32()[k];
    l.v.push_back(place(v, moment_dtypes[i % 3][1], device, mis));
    const DType copy_dtypes[3] = {DType::BF16, DType::F32, DType::F32};
    if (i % 3 == 1)
      l.copies.push_back(Tensor());
    else
      l.copies.push_back(place(Tensor::zeros(s), copy_dtypes[i % 3], device, mis));
    l.decays.push_back(i % 2 ? 0.0f : 0.1f);
  }
  return l;
}

::testing::AssertionResult same_bits(const Tensor& gpu, const Tensor& cpu) {
  return testing::bitwise_equal(testing::to_host_f32(gpu), testing::to_host_f32(cpu));
}

// Bitwise wherever a moment is bf16 (the precision-aware update, one formula on both
// backends). A tensor with both moments fp32 takes the default update, which the CPU
// computes per element in fp64 and the GPU in fp32 (ops.h): there, within fp32 rounding.
void expect_lists_equal(const Lists& gpu, const Lists& cpu) {
  for (size_t i = 0; i < cpu.params.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_EQ(gpu.m[i].dtype(), cpu.m[i].dtype());
    if (cpu.m[i].dtype() == DType::F32 && cpu.v[i].dtype() == DType::F32) {
      EXPECT_TRUE(testing::allclose(testing::to_host_f32(gpu.params[i]),
                                    testing::to_host_f32(cpu.params[i]), 1e-7, 1e-6));
      EXPECT_TRUE(testing::allclose(testing::to_host_f32(gpu.m[i]),
                                    testing::to_host_f32(cpu.m[i]), 1e-8, 1e-5));
      EXPECT_TRUE(testing::allclose(testing::to_host_f32(gpu.v[i]),
                                    testing::to_host_f32(cpu.v[i]), 1e-12, 1e-5));
      continue;
    }
    EXPECT_TRUE(same_bits(gpu.params[i], cpu.params[i]));
    EXPECT_TRUE(same_bits(gpu.m[i], cpu.m[i]));
    EXPECT_TRUE(same_bits(gpu.v[i], cpu.v[i]));
    if (cpu.copies[i].defined()) {
      EXPECT_TRUE(same_bits(gpu.copies[i], cpu.copies[i]));
    }
  }
}

TEST(AdamWPrecisionGpu, Bf16MomentsEqualTheCpuBitwise) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  Lists cpu = make_lists(seed, Device::CPU), gpu = make_lists(seed, Device::CUDA);
  const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const float lr = 1e-2f * float(step), scale = step == 2 ? 1.0f : 0.37f;
    ops::multi_tensor_adamw(cpu.params, cpu.grads, cpu.m, cpu.v, cpu.copies, cpu.decays, lr, b1,
                            b2, eps, step, scale);
    ops::multi_tensor_adamw(gpu.params, gpu.grads, gpu.m, gpu.v, gpu.copies, gpu.decays, lr, b1,
                            b2, eps, step, scale);
    expect_lists_equal(gpu, cpu);
  }
  // The update moved things (not a test of an op that wrote nothing).
  const Lists fresh = make_lists(seed, Device::CPU);
  EXPECT_FALSE(testing::bitwise_equal(testing::to_host_f32(cpu.m[0]),
                                      testing::to_host_f32(fresh.m[0])));
}

TEST(AdamWPrecisionGpu, DeviceControlEqualsTheCpuHostPath) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 17;
  SCOPED_TRACE(testing::seed_trace(seed));
  Lists cpu = make_lists(seed, Device::CPU), gpu = make_lists(seed, Device::CUDA);
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, lr = 3e-3f;
  Tensor state = Tensor::zeros({2}, DType::I64, Device::CUDA);
  Tensor control = Tensor::empty({ops::kAdamControlSize}, DType::F32, Device::CUDA);
  Tensor norm_bits = Tensor::empty({1}, DType::I64, Device::CUDA);
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Tensor parts = Tensor::empty({1}, DType::I64, Device::CUDA);
    ops::multi_tensor_sum_of_squares(gpu.grads, parts);
    // Clipped (max norm 1): the scale the device computes is the host's clip coefficient.
    ops::adamw_step_control(parts, 1.0, 1.0, 1.0f, Tensor(), false,
                            Tensor::from({1}, {lr}).to(Device::CUDA), b1, b2, state, control,
                            norm_bits);
    ops::multi_tensor_adamw(gpu.params, gpu.grads, gpu.m, gpu.v, gpu.copies, gpu.decays, b1, b2,
                            eps, control);
    const float scale = control.to(Device::CPU).f32()[ops::kAdamGradScale];
    EXPECT_LT(scale, 1.0f);
    ops::multi_tensor_adamw(cpu.params, cpu.grads, cpu.m, cpu.v, cpu.copies, cpu.decays, lr, b1,
                            b2, eps, step, scale);
    expect_lists_equal(gpu, cpu);
  }
}

// Rounding keys for make_lists' tensors: contiguous at offsets that are not multiples of
// 4, column slices (run > 0) and SwiGLU-like halves, so that Philox groups straddle packs.
std::vector<ops::MomentRoundingKey> make_keys(uint64_t seed) {
  std::vector<ops::MomentRoundingKey> keys(6);
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string name = "decoder.layers." + std::to_string(i) + ".weight";
    keys[i].param_key = ops::moment_rounding_param_key(name.data(), name.size()) ^ seed;
  }
  keys[1].offset = 13;  // 70001 elements of a shard
  keys[1].base = 5;
  keys[2] = {keys[2].param_key, 0, 6, 10, 2};            // [8, 6] columns 2..7 of [8, 10]
  keys[3].offset = 3;                                    // misaligned, shard offset 3
  keys[4] = {keys[4].param_key, 2, 3, 7, 1};             // 3-wide column slices
  keys[5] = {keys[5].param_key, 1, 20000, 30001, 5001};  // two halves
  return keys;
}

TEST(AdamWPrecisionGpu, RoundingKeysGiveTheCpuBitsOnHostAndDevicePaths) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 29;
  SCOPED_TRACE(testing::seed_trace(seed));
  // Twelve copies of the six tensors (72; every sixth with fp32 moments, below): more than
  // one precision-aware launch (32 tensors) and fp32 launches in between.
  Lists cpu, gpu;
  for (int copy = 0; copy < 12; ++copy) {
    Lists c = make_lists(seed + 1000 * copy, Device::CPU);
    Lists g = make_lists(seed + 1000 * copy, Device::CUDA);
    auto append = [](Lists& to, Lists& from) {
      for (size_t i = 0; i < from.params.size(); ++i) {
        to.params.push_back(from.params[i]);
        to.grads.push_back(from.grads[i]);
        to.m.push_back(from.m[i]);
        to.v.push_back(from.v[i]);
        to.copies.push_back(from.copies[i]);
        to.decays.push_back(from.decays[i]);
      }
    };
    append(cpu, c);
    append(gpu, g);
  }
  // Every sixth tensor with fp32 moments: the fp32-state launches, interleaved.
  for (size_t i = 0; i < cpu.params.size(); i += 6) {
    cpu.m[i] = cpu.m[i].to(DType::F32);
    cpu.v[i] = cpu.v[i].to(DType::F32);
    gpu.m[i] = gpu.m[i].to(DType::F32);
    gpu.v[i] = gpu.v[i].to(DType::F32);
  }
  std::vector<ops::MomentRoundingKey> keys;
  for (size_t first = 0; first < cpu.params.size(); first += 6) {
    const std::vector<ops::MomentRoundingKey> six = make_keys(seed + first);
    keys.insert(keys.end(), six.begin(), six.end());
  }
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE("host step " + std::to_string(step));
    ops::multi_tensor_adamw(cpu.params, cpu.grads, cpu.m, cpu.v, cpu.copies, cpu.decays, 2e-2f, b1,
                            b2, eps, step, 0.6f, keys);
    ops::multi_tensor_adamw(gpu.params, gpu.grads, gpu.m, gpu.v, gpu.copies, gpu.decays, 2e-2f, b1,
                            b2, eps, step, 0.6f, keys);
    expect_lists_equal(gpu, cpu);
  }
  Tensor state = Tensor::zeros({2}, DType::I64);
  state.i64()[0] = 2;  // two steps done: the device step is 3
  state = state.to(Device::CUDA);
  Tensor control = Tensor::empty({ops::kAdamControlSize}, DType::F32, Device::CUDA);
  Tensor norm_bits = Tensor::empty({1}, DType::I64, Device::CUDA);
  for (int step = 3; step <= 4; ++step) {
    SCOPED_TRACE("device step " + std::to_string(step));
    Tensor parts = Tensor::empty({1}, DType::I64, Device::CUDA);
    ops::multi_tensor_sum_of_squares(gpu.grads, parts);
    ops::adamw_step_control(parts, 1.0, 0.0, 1.0f, Tensor(), false,
                            Tensor::from({1}, {1e-2f}).to(Device::CUDA), b1, b2, state, control,
                            norm_bits);
    ops::multi_tensor_adamw(gpu.params, gpu.grads, gpu.m, gpu.v, gpu.copies, gpu.decays, b1, b2,
                            eps, control, keys);
    EXPECT_EQ(control.to(Device::CPU).f32()[ops::kAdamStep], float(step));
    ops::multi_tensor_adamw(cpu.params, cpu.grads, cpu.m, cpu.v, cpu.copies, cpu.decays, 1e-2f, b1,
                            b2, eps, step, 1.0f, keys);
    expect_lists_equal(gpu, cpu);
  }
}

}  // namespace
}  // namespace megaton

#else  // !MEGATON_WITH_CUDA

TEST(AdamWPrecisionGpu, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
