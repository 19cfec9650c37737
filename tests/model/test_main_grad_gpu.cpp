// BF16 main gradients on the GPU (model/main_grad.h), CUDA against the CPU: the bf16
// weight-gradient GEMM straight into a BF16 main grad (cuBLASLt, fp32 math, one rounding
// into C), the fp32 scratch path (grouped expert wgrads through CUTLASS's fp32 output,
// embedding scatter-add, norms, biases), add_ / scale_ / sum_of_squares on BF16 tensors,
// the scratch pool on the device, and a tiny bf16 GPT whose BF16 main grads stay within
// bf16 resolution of its fp32 main grads.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <vector>

#include "common/gpu_testing.h"
#include "model/gpt.h"
#include "model/main_grad.h"
#include "model/tiny_gpt_testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using Targets = std::vector<Tensor>;

// bf16 values, held in fp32 (the CPU reference's inputs) and as BF16 on the device.
struct Input {
  Tensor host, device;
};
Input input(const Shape& shape, uint64_t seed, float std = 1.0f) {
  const Tensor h = testing::round_to_bf16(testing::randn(shape, seed, std));
  return {h, testing::to_device(h, DType::BF16)};
}

// The CPU reference of an accumulation into a BF16 main grad: bf16(old + g), g the op's
// fp32 result on zeroed tensors.
Tensor reference(const Tensor& old_bf16_host, const Tensor& g) {
  Tensor out = Tensor::empty(g.shape(), DType::BF16);
  const Tensor old = old_bf16_host.to(DType::F32);
  for (int64_t k = 0; k < g.numel(); ++k)
    out.data<uint16_t>()[k] = float_to_bf16(old.f32()[k] + g.f32()[k]);
  return out;
}

// Runs `cpu` on zeroed fp32 host tensors and `gpu` through accumulate_main_grads into
// BF16 device main grads starting from the same random bf16 values; compares within bf16
// tolerance (the fp32 sums may differ in order, so a result may round the other way).
void check(const std::vector<Shape>& shapes, const std::function<void(Targets&)>& cpu,
           const std::function<void(Targets&)>& gpu, uint64_t seed) {
  std::vector<Tensor> old, dev, g;
  for (size_t i = 0; i < shapes.size(); ++i) {
    old.push_back(testing::randn(shapes[i], seed + 50 + i, 0.5f).to(DType::BF16));
    dev.push_back(old.back().to(Device::CUDA));
    g.push_back(Tensor::zeros(shapes[i]));
  }
  cpu(g);
  std::vector<Tensor*> ptrs;
  for (Tensor& t : dev) ptrs.push_back(&t);
  accumulate_main_grads(ptrs, gpu);
  for (size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_EQ(dev[i].dtype(), DType::BF16);
    EXPECT_GT(ops::sum_of_squares(g[i]), 0.0);
    EXPECT_TRUE(testing::allclose(testing::to_host_f32(dev[i]), reference(old[i], g[i]).to(DType::F32),
                                  1e-5, 1e-2))
        << "grad " << i;
  }
}

// The sums g (|g| ~ 16) often cancel the old value (|old| ~ 0.5), so a GEMM that rounded
// g to bf16 before adding old (cuBLASLt or cublasGemmEx in place: ops::cuda::gemm in
// gemm.cpp) would be off by up to hundreds of bf16 ulps of the result there. 96 x 160:
// cuBLASLt algorithms; 95 x 157 (odd rows of 2-byte elements): whatever path that takes.
TEST(MainGradGpu, Bf16GemmAccumulatesStraightIntoBf16MainGrad) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t s = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(s));
  for (const Shape& shape : {Shape{256, 96, 160}, Shape{255, 95, 157}}) {
    const int64_t K = shape[0], M = shape[1], N = shape[2];
    SCOPED_TRACE(shape_str(shape));
    const Input dy = input({K, M}, s + 1), x = input({K, N}, s + 2);
    Tensor old = testing::randn({M, N}, s + 3, 0.5f).to(DType::BF16);
    Tensor main_grad = old.to(Device::CUDA);
    ASSERT_TRUE(gemm_accumulates_into(dy.device, x.device, main_grad));
    release_main_grad_scratch();
    gemm_main_grad(dy.device, true, x.device, false, main_grad);
    EXPECT_EQ(main_grad_scratch_bytes(Device::CUDA), 0) << "the bf16 GEMM needs no scratch";
    Tensor g = Tensor::zeros({M, N});
    ops::gemm(dy.host, true, x.host, false, g, 1.0f, 1.0f);
    EXPECT_TRUE(testing::allclose(testing::to_host_f32(main_grad),
                                  reference(old, g).to(DType::F32), 1e-5, 1e-2));
    // fp32 inputs on the GPU cannot write a BF16 C: the scratch path.
    Tensor f32_dy = dy.host.to(Device::CUDA), f32_x = x.host.to(Device::CUDA);
    EXPECT_FALSE(gemm_accumulates_into(f32_dy, f32_x, main_grad));
    Tensor again = old.to(Device::CUDA);
    gemm_main_grad(f32_dy, true, f32_x, false, again);
    EXPECT_EQ(main_grad_scratch_bytes(Device::CUDA), M * N * 4);
    EXPECT_TRUE(testing::allclose(testing::to_host_f32(again), reference(old, g).to(DType::F32),
                                  1e-5, 1e-2));
  }
}

TEST(MainGradGpu, GroupedExpertWgradThroughScratch) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t s = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(s));
  // Multiples of 8: the CUTLASS grouped GEMM (fp32 output only).
  const std::vector<int64_t> rows = {40, 24, 56, 8};
  const Input a = input({128, 64}, s + 1), b = input({128, 32}, s + 2);
  Tensor counts = Tensor::empty({4}, DType::I64);
  for (int g = 0; g < 4; ++g) counts.i64()[g] = rows[size_t(g)];
  const Tensor counts_dev = counts.to(Device::CUDA);
  const std::vector<Shape> shapes(4, Shape{64, 32});
  check(shapes, [&](Targets& t) { ops::grouped_gemm_wgrad(a.host, b.host, t, rows); },
        [&](Targets& t) { ops::grouped_gemm_wgrad(a.device, b.device, t, rows); }, s);
  check(shapes, [&](Targets& t) { ops::grouped_gemm_wgrad(a.host, b.host, t, counts); },
        [&](Targets& t) { ops::grouped_gemm_wgrad(a.device, b.device, t, counts_dev); }, s + 9);
}

TEST(MainGradGpu, EmbeddingNormAndBiasGradsThroughScratch) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t s = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(s));
  const int64_t T = 64, H = 48, V = 40;
  const Input dout = input({T, H}, s + 1);
  const Tensor ids = testing::randint({T}, int32_t(V), s + 2);
  const Tensor ids_dev = ids.to(Device::CUDA);
  check({{V, H}}, [&](Targets& t) { ops::embedding_backward(dout.host, ids, t[0]); },
        [&](Targets& t) { ops::embedding_backward(dout.device, ids_dev, t[0]); }, s);
  check({{H}}, [&](Targets& t) { ops::bias_backward(dout.host, t[0]); },
        [&](Targets& t) { ops::bias_backward(dout.device, t[0]); }, s + 3);
  const Input x = input({T, H}, s + 4), w = input({H}, s + 5), bias = input({H}, s + 6);
  Tensor y = Tensor::empty({T, H}), mean = Tensor::empty({T}), rstd = Tensor::empty({T});
  ops::layernorm_forward(x.host, w.host, bias.host, 1e-5f, y, mean, rstd);
  const Tensor mean_dev = mean.to(Device::CUDA), rstd_dev = rstd.to(Device::CUDA);
  check({{H}, {H}},
        [&](Targets& t) {
          Tensor dx = Tensor::empty({T, H});
          ops::layernorm_backward(dout.host, x.host, w.host, mean, rstd, dx, t[0], t[1]);
        },
        [&](Targets& t) {
          Tensor dx = Tensor::empty({T, H}, DType::BF16, Device::CUDA);
          ops::layernorm_backward(dout.device, x.device, w.device, mean_dev, rstd_dev, dx, t[0],
                                  t[1]);
        },
        s + 7);
}

TEST(MainGradGpu, Bf16ElementwiseOpsMatchTheCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t s = testing::test_seed();
  const int64_t n = 100003;
  const Tensor y_host = testing::randn({n}, s + 1).to(DType::BF16);
  const Tensor x = testing::randn({n}, s + 2, 0.01f);
  Tensor y_cpu = y_host.clone(), y_gpu = y_host.to(Device::CUDA);
  const Tensor x_gpu = x.to(Device::CUDA);
  ops::add_(y_cpu, x);
  ops::add_(y_gpu, x_gpu);
  EXPECT_TRUE(testing::bitwise_equal(testing::to_host_f32(y_gpu), y_cpu.to(DType::F32)));
  ops::scale_(y_cpu, 0.37f);
  ops::scale_(y_gpu, 0.37f);
  EXPECT_TRUE(testing::bitwise_equal(testing::to_host_f32(y_gpu), y_cpu.to(DType::F32)));
  const double want = ops::sum_of_squares(y_cpu);
  EXPECT_NEAR(ops::sum_of_squares(y_gpu), want, 1e-12 * want);
  EXPECT_NEAR(ops::multi_tensor_sum_of_squares({y_gpu}), want, 1e-12 * want);
}

// One micro-batch of a tiny bf16 GPT on the GPU: BF16 main grads against the fp32 main
// grads of the same model and input (bf16 resolution: the GEMMs writing bf16 C may pick
// other algorithms than those writing fp32). fp8: the linear layers' and experts' GEMMs
// in FP8 (tensorwise), whose wgrad GEMMs (cuBLASLt, CUTLASS grouped) write the BF16 main
// grads with beta 1 themselves.
void check_tiny_gpt(bool fp8) {
  for (const testing::TinyGptVariant& v : testing::tiny_gpt_variants()) {
    if (fp8 && v.seq_length % 8 != 0) continue;  // 2 x seq_length tokens: a multiple of 16
    SCOPED_TRACE(v.name + (fp8 ? " fp8" : ""));
    std::vector<std::vector<Tensor>> grads;
    for (DType dtype : {DType::F32, DType::BF16}) {
      GPTConfig cfg = testing::tiny_gpt_config(v, Device::CUDA, /*bf16=*/true);
      cfg.main_grads_dtype = dtype;
      if (fp8) {
        cfg.fp8.enabled = true;
        cfg.fp8.recipe = Fp8Recipe::Tensorwise;
        cfg.moe_ffn_hidden_size = 32;
      }
      cfg.finalize();
      GPTModel model(cfg, 1234);
      testing::randomize_params(model, 1241);
      const int64_t B = 2, S = cfg.seq_length;
      ChunkInput in{B, S, testing::randint({B, S}, int32_t(cfg.vocab_size), 5),
                    testing::randint({B, S}, int32_t(cfg.vocab_size), 6), Tensor()};
      model.forward_chunk(in, ForwardContext{true, 1234, 3, 0});
      model.backward_chunk(testing::randn({B * S}, 7, 0.5f), 1.0f);
      std::vector<Tensor> g;
      for (Param* p : model.params()) {
        EXPECT_EQ(p->main_grad.dtype(), dtype) << p->name;
        g.push_back(testing::to_host_f32(p->main_grad));
      }
      grads.push_back(g);
    }
    for (size_t i = 0; i < grads[0].size(); ++i) {
      EXPECT_GT(ops::sum_of_squares(grads[0][i]), 0.0) << "param " << i;
      EXPECT_LE(testing::rel_error(grads[1][i], grads[0][i]), 1e-2) << "param " << i;
    }
  }
}

TEST(MainGradGpu, TinyGptBf16MainGradsWithinBf16OfFp32) {
  MEGATON_SKIP_WITHOUT_GPU();
  check_tiny_gpt(false);
}

TEST(MainGradGpu, TinyGptFp8Bf16MainGradsWithinBf16OfFp32) {
  MEGATON_SKIP_WITHOUT_GPU();
  check_tiny_gpt(true);
}

}  // namespace
}  // namespace megaton
#endif  // MEGATON_WITH_CUDA
