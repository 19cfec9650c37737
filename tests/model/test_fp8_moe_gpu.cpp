// The MoE layer's FP8 experts on the GPU against the same layer on the CPU (the exact
// emulation), in each recipe, through two steps: each expert's quantizers, the rows padded
// per expert (16 per-tensor, 128 blockwise), one FP8 GEMM per expert on cuBLASLt.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "model/moe.h"

namespace megaton {
namespace {

using testing::randn;

class Fp8MoEGpu : public ::testing::TestWithParam<Fp8Recipe> {};

// 256 tokens, hidden 256, 4 experts of width 256 (SwiGLU), top-2: about 128 copies per
// expert, none a multiple of 16 in general, so every expert is padded. fp32 compute on both
// devices: the layer's input is quantized to the same bits and a single FP8 GEMM differs
// by its accumulation only (a few 1e-4, test_fp8_linear_gpu.cpp). But fc2's input (the
// SwiGLU of fc1's output) and the input gradients are quantized from results that already
// differ by that much, and an element that lands on the other side of an FP8 rounding
// midpoint moves by a whole e4m3 / e5m2 step (6-25%): measured on an H100, y, dx and the
// expert weight gradients differ by up to 7.9e-3. 2e-2 still fails on a wrong scale, a
// wrong expert's rows or a padding row that leaks (O(1)).
TEST_P(Fp8MoEGpu, MatchesTheCpuEmulation) {
  MEGATON_SKIP_WITHOUT_GPU();
  const Fp8Recipe recipe = GetParam();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(std::string(fp8_recipe_name(recipe)) + " " + testing::seed_trace(seed));
  constexpr int64_t kTokens = 256, kHidden = 256;
  constexpr double kTolerance = 2e-2;
  GPTConfig cfg;
  cfg.num_layers = 1;
  cfg.hidden_size = kHidden;
  cfg.num_experts = 4;
  cfg.moe_router_topk = 2;
  cfg.moe_ffn_hidden_size = 256;
  cfg.swiglu = true;
  cfg.disable_bias_linear = true;
  cfg.moe_aux_loss_coeff = 0.0f;
  cfg.init_method_std = 0.05f;
  cfg.fp8.enabled = true;
  cfg.fp8.hybrid = true;
  cfg.fp8.recipe = recipe;
  GPTConfig gpu_cfg = cfg;
  gpu_cfg.device = Device::CUDA;
  MoELayer cpu("decoder.layers.0.mlp", cfg, seed);
  MoELayer gpu("decoder.layers.0.mlp", gpu_cfg, seed);
  cpu.enable_fp8(cfg.fp8);
  gpu.enable_fp8(gpu_cfg.fp8);
  std::vector<Param*> cpu_params, gpu_params;
  cpu.collect_params(cpu_params);
  gpu.collect_params(gpu_params);
  ASSERT_EQ(cpu_params.size(), gpu_params.size());
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    cpu_params[i]->main_grad = Tensor::zeros(cpu_params[i]->weight.shape());
    gpu_params[i]->main_grad = Tensor::zeros(gpu_params[i]->weight.shape(), DType::F32, Device::CUDA);
  }
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Tensor x = randn({kTokens, kHidden}, seed + 10 * step + 1, step == 0 ? 1.0f : 2.0f);
    const Tensor dy = randn({kTokens, kHidden}, seed + 10 * step + 2, 0.01f);
    const Tensor y_cpu = cpu.forward(x, ForwardContext{});
    const Tensor y_gpu = gpu.forward(x.to(Device::CUDA), ForwardContext{});
    // The same routing: the router runs in fp32 on both devices.
    ASSERT_EQ(gpu.last_tokens_per_local_expert(), cpu.last_tokens_per_local_expert());
    const Tensor dx_cpu = cpu.backward(dy);
    const Tensor dx_gpu = gpu.backward(dy.to(Device::CUDA));
    const Tensor y = testing::to_host_f32(y_gpu), dx = testing::to_host_f32(dx_gpu);
    ASSERT_TRUE(testing::all_finite(y, "y"));
    ASSERT_TRUE(testing::all_finite(dx, "dx"));
    EXPECT_LT(testing::rel_error(y, y_cpu), kTolerance);
    EXPECT_LT(testing::rel_error(dx, dx_cpu), kTolerance);
    for (size_t i = 0; i < cpu_params.size(); ++i)
      EXPECT_LT(testing::rel_error(testing::to_host_f32(gpu_params[i]->main_grad),
                                   cpu_params[i]->main_grad),
                kTolerance)
          << cpu_params[i]->name;
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8MoEGpu,
                         ::testing::Values(Fp8Recipe::Tensorwise, Fp8Recipe::Delayed,
                                           Fp8Recipe::Blockwise),
                         [](const auto& info) { return std::string(fp8_recipe_name(info.param)); });

}  // namespace
}  // namespace megaton
#endif  // MEGATON_WITH_CUDA
