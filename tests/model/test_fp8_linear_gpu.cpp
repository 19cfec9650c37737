// The FP8 Linear on the GPU against the same Linear on the CPU (the exact emulation), in
// each recipe, through two steps (the delayed recipe's second uses its history): the
// quantizers, their scale tensors as cuBLASLt receives them, and the three FP8 GEMMs.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <cmath>

#include "common/gpu_testing.h"
#include "model/fp8.h"
#include "model/layers.h"

namespace megaton {
namespace {

using testing::randn;

struct Case {
  Fp8Recipe recipe;
  bool keep_input;  // false: forward(x, false) then backward(dy, x), as fc2 is called
};

class Fp8LinearGpu : public ::testing::TestWithParam<Case> {};

// fp32 compute on both devices, so the quantized operands are the same bits and only the
// GEMMs' accumulation differs: Hopper's FP8 MMA adds with ~14-bit partial sums (ops/fp8.h),
// a few 1e-4 of the output's norm; the forward GEMM's fast accumulation (per-tensor
// recipes) keeps them for the whole K loop. 5e-3 fails on a wrong scale or layout (O(1)).
TEST_P(Fp8LinearGpu, MatchesTheCpuEmulation) {
  MEGATON_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(std::string(fp8_recipe_name(c.recipe)) + (c.keep_input ? "" : " recomputed input") +
               " " + testing::seed_trace(seed));
  Fp8Config config;
  config.enabled = true;
  config.recipe = c.recipe;
  config.hybrid = true;
  constexpr int64_t T = 256, kIn = 384, kOut = 512;
  Linear cpu("l", kIn, kOut, false, 0.05f, seed, Placement{Device::CPU, DType::F32});
  Linear gpu("l", kIn, kOut, false, 0.05f, seed, Placement{Device::CUDA, DType::F32});
  cpu.enable_fp8(config);
  gpu.enable_fp8(config);
  cpu.weight.main_grad = Tensor::zeros({kOut, kIn});
  gpu.weight.main_grad = Tensor::zeros({kOut, kIn}, DType::F32, Device::CUDA);
  for (int step = 0; step < 2; ++step) {
    const Tensor x = randn({T, kIn}, seed + 10 * step + 1, step == 0 ? 1.0f : 2.0f);
    const Tensor dy = randn({T, kOut}, seed + 10 * step + 2, 0.01f);
    const Tensor x_gpu = x.to(Device::CUDA), dy_gpu = dy.to(Device::CUDA);
    const Tensor y_cpu = cpu.forward(x, c.keep_input);
    const Tensor y_gpu = gpu.forward(x_gpu, c.keep_input);
    const Tensor dx_cpu = c.keep_input ? cpu.backward(dy) : cpu.backward(dy, x);
    const Tensor dx_gpu = c.keep_input ? gpu.backward(dy_gpu) : gpu.backward(dy_gpu, x_gpu);
    SCOPED_TRACE("step " + std::to_string(step));
    const Tensor y = testing::to_host_f32(y_gpu), dx = testing::to_host_f32(dx_gpu);
    const Tensor dw = testing::to_host_f32(gpu.weight.main_grad);
    ASSERT_TRUE(testing::all_finite(y, "y"));
    ASSERT_TRUE(testing::all_finite(dx, "dx"));
    EXPECT_LT(testing::rel_error(y, y_cpu), 5e-3);
    EXPECT_LT(testing::rel_error(dx, dx_cpu), 5e-3);
    EXPECT_LT(testing::rel_error(dw, cpu.weight.main_grad), 5e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8LinearGpu,
    ::testing::Values(Case{Fp8Recipe::Tensorwise, true}, Case{Fp8Recipe::Tensorwise, false},
                      Case{Fp8Recipe::Delayed, true}, Case{Fp8Recipe::Delayed, false},
                      Case{Fp8Recipe::Blockwise, true}, Case{Fp8Recipe::Blockwise, false}),
    [](const auto& info) {
      return std::string(fp8_recipe_name(info.param.recipe)) +
             (info.param.keep_input ? "Kept" : "Recomputed");
    });

}  // namespace
}  // namespace megaton
#endif  // MEGATON_WITH_CUDA
