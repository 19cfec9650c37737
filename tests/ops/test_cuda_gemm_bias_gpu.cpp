// ops::gemm_bias on the GPU (cuBLASLt's bias epilogue): F32 equals the CPU's gemm then
// bias_add_ within fp32 GEMM tolerance; BF16 is the fp32 result plus the bias rounded once,
// so it is within one bf16 ulp of gemm then bias_add_ (two roundings) and at least as close
// to the fp32 reference; leading dimensions are merged; the bias is checked at the door.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include "common/gpu_testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::to_device;
using testing::to_host_f32;

TEST(CudaGemmBias, MatchesGemmThenBiasAdd) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  for (auto [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{256, 512, 768}, {37, 64, 200}}) {
    SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n));
    const Tensor x = testing::round_to_bf16(testing::randn({m, k}, seed));
    const Tensor w = testing::round_to_bf16(testing::randn({n, k}, seed + 1, 0.05f));
    const Tensor b = testing::round_to_bf16(testing::randn({n}, seed + 2));
    Tensor ref = Tensor::empty({m, n});  // fp32 on the CPU: x w^T + b
    ops::gemm_bias(x, false, w, true, b, ref);
    Tensor product = Tensor::empty({m, n});  // x w^T alone: the unfused path rounds it
    ops::gemm(x, false, w, true, product);
    {  // F32
      Tensor y = testing::poisoned_device({m, n}, DType::F32);
      ops::gemm_bias(to_device(x, DType::F32), false, to_device(w, DType::F32), true,
                     to_device(b, DType::F32), y);
      EXPECT_TRUE(testing::allclose(to_host_f32(y), ref, 1e-4, 1e-4));
    }
    {  // BF16: one rounding of the fp32 result
      const Tensor xg = to_device(x, DType::BF16), wg = to_device(w, DType::BF16);
      const Tensor bg = to_device(b, DType::BF16);
      Tensor fused = testing::poisoned_device({m, n}, DType::BF16);
      ops::gemm_bias(xg, false, wg, true, bg, fused);
      Tensor unfused = testing::poisoned_device({m, n}, DType::BF16);
      ops::gemm(xg, false, wg, true, unfused);
      ops::bias_add_(unfused, bg);
      const Tensor f = to_host_f32(fused), u = to_host_f32(unfused);
      double err_fused = 0, err_unfused = 0;
      for (int64_t i = 0; i < m * n; ++i) {
        const float want = ref.f32()[i];
        // A bf16 ulp at the largest magnitude either path rounds (the product, under
        // cancellation by the bias, can be larger than the result).
        const float scale = std::max(std::fabs(want), std::fabs(product.f32()[i])) + 1e-30f;
        const float ulp = std::ldexp(1.0f, std::ilogb(scale) - 7);
        ASSERT_LE(std::fabs(f.f32()[i] - want), 1.01f * ulp + 1e-3f) << "element " << i;
        ASSERT_LE(std::fabs(f.f32()[i] - u.f32()[i]), 2.01f * ulp + 1e-3f) << "element " << i;
        err_fused += std::fabs(f.f32()[i] - want);
        err_unfused += std::fabs(u.f32()[i] - want);
      }
      EXPECT_LE(err_fused, err_unfused * 1.001 + 1e-6) << "one rounding is not closer than two";
    }
  }
}

TEST(CudaGemmBias, MergesLeadingDimensionsAndChecksTheBias) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  const Tensor x = testing::randn({2, 8, 32}, seed), w = testing::randn({48, 32}, seed + 1);
  const Tensor b = testing::randn({48}, seed + 2);
  Tensor ref = Tensor::empty({2, 8, 48});
  ops::gemm_bias(x, false, w, true, b, ref);
  Tensor y = testing::poisoned_device({2, 8, 48}, DType::F32);
  ops::gemm_bias(x.to(Device::CUDA), false, w.to(Device::CUDA), true, b.to(Device::CUDA), y);
  EXPECT_TRUE(testing::allclose(to_host_f32(y), ref, 1e-4, 1e-4));
  Tensor wrong = Tensor::zeros({47}, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::gemm_bias(x.to(Device::CUDA), false, w.to(Device::CUDA), true, wrong, y),
               InternalError);
}

}  // namespace
}  // namespace megaton
#else
TEST(CudaGemmBias, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }
#endif
