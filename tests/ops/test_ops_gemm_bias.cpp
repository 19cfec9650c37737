// ops::gemm_bias on the CPU: the reference is gemm then bias_add_ (the GPU's epilogue is
// compared with it in test_cuda_gemm_bias_gpu), here checked against a direct loop.
#include <gtest/gtest.h>

#include <cmath>

#include "common/testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

TEST(GemmBias, IsTheProductPlusTheBiasOnEveryRow) {
  const uint64_t seed = testing::test_seed();
  const int64_t m = 5, k = 7, n = 3;
  const Tensor x = testing::randn({m, k}, seed), w = testing::randn({n, k}, seed + 1);
  const Tensor b = testing::randn({n}, seed + 2);
  Tensor y = Tensor::empty({m, n});
  testing::poison(y);
  ops::gemm_bias(x, false, w, true, b, y);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double want = b.f32()[j];
      for (int64_t t = 0; t < k; ++t) want += double(x.f32()[i * k + t]) * w.f32()[j * k + t];
      EXPECT_NEAR(y.f32()[i * n + j], want, 1e-5 * (1 + std::fabs(want))) << i << "," << j;
    }
  EXPECT_THROW(ops::gemm_bias(x, false, w, true, Tensor::zeros({4}), y), InternalError);
}

}  // namespace
}  // namespace megaton
