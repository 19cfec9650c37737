// BF16 main grads (--main-grads-dtype bf16) read by the Adam kernels: on the GPU a BF16
// grad updates bit for bit as an F32 grad holding the same values (every list kind: fp32
// moments, bf16 moments, one of each, param remainders; packs of four and the scalar path
// of tensors one element off alignment; host scalars and a device control tensor), and the
// GPU gives the CPU twin's bits wherever a moment is bf16 or the main param a remainder (the
// fp32-moment update within the fp32 tolerance, as test_adamw_precision_gpu states).
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <cstring>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "ops/adam_precision.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"

namespace megaton {
namespace {

// `values` (host) in `dtype` on `device`; misaligned: a view one element into a larger
// buffer (the kernels' scalar path).
Tensor place(const Tensor& values, DType dtype, Device device, bool misaligned) {
  const Tensor typed = values.dtype() == dtype ? values : values.to(dtype);
  if (!misaligned) return typed.to(device);
  Tensor buffer = Tensor::zeros({values.numel() + 1}, dtype, device);
  Tensor view = buffer.rows(1, values.numel());
  view.copy_from(typed.view({values.numel()}).to(device));
  return view.view(values.shape());
}

struct Spec {
  Shape shape;
  bool misaligned;
};
const std::vector<Spec> kSpecs = {{{7, 5}, false},  {{70001}, false}, {{4, 4, 3}, false},
                                  {{1031}, true},   {{33, 3}, true},  {{40000}, false}};

struct Lists {
  std::vector<Tensor> params, grads, m, v, copies;
  std::vector<float> decays;
  std::vector<ops::MomentRoundingKey> keys;
};

// Moments cycle through (F32, F32), (BF16, BF16), (BF16, F32); copies BF16, none, F16.
Lists make_lists(uint64_t seed, Device device) {
  const DType moments[3][2] = {
      {DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}};
  Lists l;
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    const Shape& s = kSpecs[i].shape;
    const bool mis = kSpecs[i].misaligned;
    const uint64_t base = seed + 100 * i;
    l.params.push_back(place(testing::randn(s, base, 0.5f), DType::F32, device, mis));
    l.m.push_back(place(testing::randn(s, base + 2, 0.01f), moments[i % 3][0], device, mis));
    Tensor v = testing::randn(s, base + 3, 1e-3f);
    for (int64_t k = 0; k < v.numel(); ++k) v.f32()[k] *= v.f32()[k];
    l.v.push_back(place(v, moments[i % 3][1], device, mis));
    const DType copy_dtypes[3] = {DType::BF16, DType::F32, DType::F16};
    l.copies.push_back(i % 3 == 1 ? Tensor()
                                  : place(Tensor::zeros(s), copy_dtypes[i % 3], device, mis));
    l.decays.push_back(i % 2 ? 0.0f : 0.1f);
    ops::MomentRoundingKey key;
    key.param_key = 91 + i;
    key.offset = int64_t(5 * i);
    l.keys.push_back(key);
  }
  return l;
}

// Gradients a BF16 tensor holds exactly, in `dtype` on `device`.
void set_grads(Lists& l, uint64_t seed, DType dtype, Device device) {
  l.grads.clear();
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    const Tensor values = testing::randn(kSpecs[i].shape, seed + 7 * i, 0.3f).to(DType::BF16);
    l.grads.push_back(place(values.to(DType::F32), dtype, device, kSpecs[i].misaligned));
  }
}

Tensor control_on(Device device, float lr, int64_t step, float grad_scale) {
  // The scalars adamw_step_control writes (ops.h), computed as it computes them.
  const ops::AdamPrecisionConstants c = ops::adam_precision_constants(lr, 0.9f, 0.95f, 1e-8f,
                                                                      step, grad_scale);
  Tensor host = Tensor::zeros({ops::kAdamControlSize});
  host.f32()[ops::kAdamStepSize] = c.step_size;
  host.f32()[ops::kAdamInvSqrtBc2] = c.inv_sqrt_bc2;
  host.f32()[ops::kAdamGradScale] = grad_scale;
  host.f32()[ops::kAdamStep] = float(step);
  host.f32()[ops::kAdamLr] = lr;
  return host.to(device);
}

void run_step(Lists& l, int64_t step, Device device) {
  const float lr = 1e-2f * float(step), scale = step == 2 ? 1.0f : 0.37f;
  if (step % 2)
    ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, lr, 0.9f, 0.95f,
                            1e-8f, step, scale, l.keys);
  else
    ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 0.9f, 0.95f, 1e-8f,
                            control_on(device, lr, step, scale), l.keys);
}

TEST(AdamWBf16GradsGpu, Bf16GradsUpdateAsTheirFp32ValuesAndAsTheCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  Lists gpu_bf = make_lists(seed, Device::CUDA), gpu_f32 = make_lists(seed, Device::CUDA);
  Lists cpu_bf = make_lists(seed, Device::CPU);
  for (int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    set_grads(gpu_bf, seed * 3 + step, DType::BF16, Device::CUDA);
    set_grads(gpu_f32, seed * 3 + step, DType::F32, Device::CUDA);
    set_grads(cpu_bf, seed * 3 + step, DType::BF16, Device::CPU);
    run_step(gpu_bf, step, Device::CUDA);
    run_step(gpu_f32, step, Device::CUDA);
    run_step(cpu_bf, step, Device::CPU);
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      SCOPED_TRACE("tensor " + std::to_string(i));
      const auto host = [](const Tensor& t) { return testing::to_host_f32(t); };
      // BF16 grads on the GPU are the F32 grads on the GPU, bit for bit, in every path.
      EXPECT_TRUE(testing::bitwise_equal(host(gpu_bf.params[i]), host(gpu_f32.params[i])));
      EXPECT_TRUE(testing::bitwise_equal(host(gpu_bf.m[i]), host(gpu_f32.m[i])));
      EXPECT_TRUE(testing::bitwise_equal(host(gpu_bf.v[i]), host(gpu_f32.v[i])));
      if (gpu_bf.copies[i].defined()) {
        EXPECT_TRUE(testing::bitwise_equal(host(gpu_bf.copies[i]), host(gpu_f32.copies[i])));
      }
      // And the CPU twin's: bitwise where a moment is bf16, within fp32 rounding otherwise.
      if (i % 3 == 0) {
        EXPECT_TRUE(testing::allclose(host(gpu_bf.params[i]), host(cpu_bf.params[i]), 1e-7, 1e-6));
        EXPECT_TRUE(testing::allclose(host(gpu_bf.m[i]), host(cpu_bf.m[i]), 1e-8, 1e-5));
        EXPECT_TRUE(testing::allclose(host(gpu_bf.v[i]), host(cpu_bf.v[i]), 1e-12, 1e-5));
      } else {
        EXPECT_TRUE(testing::bitwise_equal(host(gpu_bf.params[i]), host(cpu_bf.params[i])));
        EXPECT_TRUE(testing::bitwise_equal(host(gpu_bf.m[i]), host(cpu_bf.m[i])));
        EXPECT_TRUE(testing::bitwise_equal(host(gpu_bf.v[i]), host(cpu_bf.v[i])));
      }
    }
  }
  const Lists fresh = make_lists(seed, Device::CPU);
  EXPECT_FALSE(testing::bitwise_equal(testing::to_host_f32(gpu_bf.m[1]),
                                      testing::to_host_f32(fresh.m[1])));
}

TEST(AdamWBf16GradsGpu, ParamRemainderKernelReadsBf16GradsAsTheCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 9;
  SCOPED_TRACE(testing::seed_trace(seed));
  struct RemainderLists {
    std::vector<Tensor> weights, remainders, grads, m, v;
  };
  const std::vector<float> decays(kSpecs.size(), 0.1f);
  const std::vector<ops::MomentRoundingKey> keys = ops::list_order_rounding_keys(kSpecs.size());
  auto make = [&](Device device) {
    RemainderLists l;
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const Shape& s = kSpecs[i].shape;
      const bool mis = kSpecs[i].misaligned;
      const Tensor master = testing::randn(s, seed + i, 0.5f);
      Tensor w = Tensor::empty(s, DType::BF16), r = Tensor::empty(s, DType::I16);
      ops::split_param_remainders(master, w, r);
      l.weights.push_back(place(w, DType::BF16, device, mis));
      l.remainders.push_back(place(r, DType::I16, device, mis));
      l.m.push_back(place(Tensor::zeros(s), i % 2 ? DType::F32 : DType::BF16, device, mis));
      l.v.push_back(place(Tensor::zeros(s), DType::BF16, device, mis));
    }
    return l;
  };
  RemainderLists gpu = make(Device::CUDA), cpu = make(Device::CPU);
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (RemainderLists* l : {&gpu, &cpu}) {
      const Device device = l == &gpu ? Device::CUDA : Device::CPU;
      l->grads.clear();
      for (size_t i = 0; i < kSpecs.size(); ++i) {
        const Tensor values = testing::randn(kSpecs[i].shape, seed * 5 + 3 * i + step, 0.3f);
        l->grads.push_back(place(values, DType::BF16, device, kSpecs[i].misaligned));
      }
      if (step % 2)
        ops::multi_tensor_adamw_param_remainder(l->weights, l->remainders, l->grads, l->m, l->v,
                                                decays, 2e-3f, 0.9f, 0.95f, 1e-8f, step, 0.8f,
                                                keys);
      else
        ops::multi_tensor_adamw_param_remainder(l->weights, l->remainders, l->grads, l->m, l->v,
                                                decays, 0.9f, 0.95f, 1e-8f,
                                                control_on(device, 2e-3f, step, 0.8f), keys);
    }
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      SCOPED_TRACE("tensor " + std::to_string(i));
      const auto host = [](const Tensor& t) { return t.to(Device::CPU); };
      EXPECT_TRUE(testing::bitwise_equal(testing::to_host_f32(gpu.weights[i]),
                                         testing::to_host_f32(cpu.weights[i])));
      const Tensor rg = host(gpu.remainders[i]), rc = host(cpu.remainders[i]);
      EXPECT_EQ(0, std::memcmp(rg.raw(), rc.raw(), rc.nbytes()));
      EXPECT_TRUE(testing::bitwise_equal(testing::to_host_f32(gpu.m[i]),
                                         testing::to_host_f32(cpu.m[i])));
      EXPECT_TRUE(testing::bitwise_equal(testing::to_host_f32(gpu.v[i]),
                                         testing::to_host_f32(cpu.v[i])));
    }
  }
}

}  // namespace
}  // namespace megaton
#endif
