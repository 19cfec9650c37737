// fp32 main params as bf16 weights plus int16 remainders on the GPU (ops/param_remainder.h):
// split and join give the CPU's bytes on every sampled pattern; the AdamW update over
// (weight, remainder) pairs gives the CPU twin's weights, remainders and moments bit for
// bit, with fp32 and bf16 moments (stochastically rounded with the same random bits), on
// packs of four and on the scalar path (tensors one element off alignment), over more
// tensors than one launch takes, from host scalars and from adamw_step_control's device
// scalars, a NaN included.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"

namespace megaton {
namespace {

// Byte equality of a device tensor and a host one. any_nan: two NaNs are equal whatever
// their bits (the moments: the GPU's arithmetic makes its own NaN, 0x7FFFFFFF, where the
// CPU's keeps the input's; the weights store one NaN, 0x7FC0, on both).
::testing::AssertionResult same_bytes(const Tensor& device, const Tensor& host,
                                      bool any_nan = false) {
  const Tensor a = device.to(Device::CPU);
  if (a.nbytes() != host.nbytes() || a.dtype() != host.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  const size_t elem = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.raw());
  const auto* pb = static_cast<const unsigned char*>(host.raw());
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i * elem, pb + i * elem, elem) == 0) continue;
    if (any_nan && std::isnan(a.item(i)) && std::isnan(host.item(i))) continue;
    return ::testing::AssertionFailure() << "element " << i << ": gpu " << a.item(i) << " cpu "
                                         << host.item(i);
  }
  return ::testing::AssertionSuccess();
}

// `values` on `device` in `dtype`; misaligned: a view one element into a larger buffer.
Tensor place(const Tensor& values, DType dtype, Device device, bool misaligned) {
  const Tensor typed = values.dtype() == dtype ? values : values.to(dtype);
  if (!misaligned) return typed.to(device);
  Tensor buffer = Tensor::zeros({values.numel() + 1}, dtype, device);
  Tensor view = buffer.rows(1, values.numel());
  view.copy_from(typed.view({values.numel()}).to(device));
  return view.view(values.shape());
}

struct Lists {
  std::vector<Tensor> weights, remainders, grads, m, v;
  std::vector<float> decays;
  std::vector<ops::MomentRoundingKey> keys;
};

// Six tensors per copy, moments cycling through fp32/fp32, bf16/bf16, bf16/fp32,
// fp32/bf16; sizes with a pack tail, several chunks, and two misaligned tensors; keys at
// offsets that are not multiples of four.
Lists make_lists(uint64_t seed, Device device, int copies) {
  struct Spec {
    Shape shape;
    bool misaligned;
  };
  const std::vector<Spec> specs = {{{7, 5}, false},  {{70001}, false}, {{4, 4, 3}, false},
                                   {{1031}, true},   {{33, 3}, true},  {{40000}, false}};
  const DType moment_dtypes[4][2] = {{DType::F32, DType::F32},
                                     {DType::BF16, DType::BF16},
                                     {DType::BF16, DType::F32},
                                     {DType::F32, DType::BF16}};
  Lists l;
  for (int copy = 0; copy < copies; ++copy)
    for (size_t i = 0; i < specs.size(); ++i) {
      const Shape& s = specs[i].shape;
      const bool mis = specs[i].misaligned;
      const size_t index = size_t(copy) * specs.size() + i;
      const uint64_t base = seed + 100 * index;
      Tensor master = testing::randn(s, base, 0.5f);
      auto* bits = static_cast<uint32_t*>(master.raw());
      for (int64_t k = 0; k < master.numel(); k += 5) bits[k] = (bits[k] & 0xFFFF0000u) | 0x8000u;
      Tensor w = Tensor::empty(s, DType::BF16), r = Tensor::empty(s, DType::I16);
      ops::split_param_remainders(master, w, r);
      l.weights.push_back(place(w, DType::BF16, device, mis));
      l.remainders.push_back(place(r, DType::I16, device, mis));
      Tensor g = testing::randn(s, base + 1, 0.3f);
      if (index == 8) g.f32()[3] = std::numeric_limits<float>::quiet_NaN();
      l.grads.push_back(place(g, DType::F32, device, mis));
      Tensor v = testing::randn(s, base + 3, 1e-3f);
      for (int64_t k = 0; k < v.numel(); ++k) v.f32()[k] *= v.f32()[k];
      l.m.push_back(place(testing::randn(s, base + 2, 0.01f), moment_dtypes[index % 4][0], device,
                          mis));
      l.v.push_back(place(v, moment_dtypes[index % 4][1], device, mis));
      l.decays.push_back(index % 2 ? 0.0f : 0.1f);
      const std::string name = "decoder.layers." + std::to_string(index) + ".weight";
      ops::MomentRoundingKey key;
      key.param_key = ops::moment_rounding_param_key(name.data(), name.size());
      key.offset = int64_t(index % 7);
      l.keys.push_back(key);
    }
  return l;
}

void expect_lists_equal(const Lists& gpu, const Lists& cpu) {
  for (size_t i = 0; i < cpu.weights.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_TRUE(same_bytes(gpu.weights[i], cpu.weights[i]));
    EXPECT_TRUE(same_bytes(gpu.remainders[i], cpu.remainders[i]));
    EXPECT_TRUE(same_bytes(gpu.m[i], cpu.m[i], true));
    EXPECT_TRUE(same_bytes(gpu.v[i], cpu.v[i], true));
  }
}

TEST(AdamWParamRemainderGpu, SplitAndJoinGiveTheCpuBytes) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  std::vector<uint32_t> patterns;
  for (uint32_t high : {0x3F80u, 0x7F7Fu, 0x7FFFu, 0x8000u, 0xFFFFu})
    for (uint32_t low = 0; low < 0x10000u; ++low) patterns.push_back((high << 16) | low);
  std::mt19937_64 gen(seed);
  for (int i = 0; i < (1 << 21); ++i) patterns.push_back(uint32_t(gen()));
  const int64_t n = int64_t(patterns.size());
  Tensor master = Tensor::empty({n});
  std::memcpy(master.raw(), patterns.data(), 4 * patterns.size());
  Tensor w = Tensor::empty({n}, DType::BF16), r = Tensor::empty({n}, DType::I16);
  ops::split_param_remainders(master, w, r);
  const Tensor master_gpu = master.to(Device::CUDA);
  Tensor w_gpu = Tensor::zeros({n}, DType::BF16, Device::CUDA);
  Tensor r_gpu = Tensor::zeros({n}, DType::I16, Device::CUDA);
  ops::split_param_remainders(master_gpu, w_gpu, r_gpu);
  EXPECT_TRUE(same_bytes(w_gpu, w));
  EXPECT_TRUE(same_bytes(r_gpu, r));
  Tensor joined_gpu = Tensor::zeros({n}, DType::F32, Device::CUDA);
  ops::join_param_remainders(w_gpu, r_gpu, joined_gpu);
  EXPECT_TRUE(same_bytes(joined_gpu, master));
}

// 72 tensors (three launches of 32 at most): three host steps, then two device steps.
TEST(AdamWParamRemainderGpu, UpdateEqualsTheCpuBitwise) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 5;
  SCOPED_TRACE(testing::seed_trace(seed));
  Lists cpu = make_lists(seed, Device::CPU, 12), gpu = make_lists(seed, Device::CUDA, 12);
  const Tensor start = cpu.weights[1].clone();
  const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("host step " + std::to_string(step));
    const float lr = 1e-2f * float(step), scale = step == 2 ? 1.0f : 0.37f;
    for (Lists* l : {&cpu, &gpu})
      ops::multi_tensor_adamw_param_remainder(l->weights, l->remainders, l->grads, l->m, l->v,
                                              l->decays, lr, b1, b2, eps, step, scale, l->keys);
    expect_lists_equal(gpu, cpu);
  }
  // The update moved the weights; the NaN gradient left a bf16 NaN weight, remainder 0.
  EXPECT_FALSE(same_bytes(cpu.weights[1], start));
  EXPECT_EQ(static_cast<const uint16_t*>(cpu.weights[8].raw())[3], 0x7FC0u);
  EXPECT_EQ(static_cast<const uint16_t*>(cpu.remainders[8].raw())[3], 0u);

  Tensor state = Tensor::zeros({2}, DType::I64);
  state.i64()[0] = 3;  // three steps done: the device step is 4
  state = state.to(Device::CUDA);
  Tensor control = Tensor::empty({ops::kAdamControlSize}, DType::F32, Device::CUDA);
  Tensor norm_bits = Tensor::empty({1}, DType::I64, Device::CUDA);
  for (int64_t step = 4; step <= 5; ++step) {
    SCOPED_TRACE("device step " + std::to_string(step));
    // The norm of the gradients but the NaN one's tensor: a finite norm, clipped at 1.
    std::vector<Tensor> finite;
    for (size_t i = 0; i < gpu.grads.size(); ++i)
      if (i != 8) finite.push_back(gpu.grads[i]);
    Tensor parts = Tensor::empty({1}, DType::I64, Device::CUDA);
    ops::multi_tensor_sum_of_squares(finite, parts);
    ops::adamw_step_control(parts, 1.0, 1.0, 1.0f, Tensor(), false,
                            Tensor::from({1}, {3e-3f}).to(Device::CUDA), b1, b2, state, control,
                            norm_bits);
    ops::multi_tensor_adamw_param_remainder(gpu.weights, gpu.remainders, gpu.grads, gpu.m, gpu.v,
                                            gpu.decays, b1, b2, eps, control, gpu.keys);
    const Tensor host_control = control.to(Device::CPU);
    EXPECT_EQ(host_control.f32()[ops::kAdamStep], float(step));
    const float scale = host_control.f32()[ops::kAdamGradScale];
    EXPECT_LT(scale, 1.0f);
    ops::multi_tensor_adamw_param_remainder(cpu.weights, cpu.remainders, cpu.grads, cpu.m, cpu.v,
                                            cpu.decays, 3e-3f, b1, b2, eps, step, scale, cpu.keys);
    expect_lists_equal(gpu, cpu);
  }
}

}  // namespace
}  // namespace megaton

#else  // !MEGATON_WITH_CUDA

TEST(AdamWParamRemainderGpu, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
