// The gradient norm, clipping and zero count over BF16 main grads (--main-grads-dtype
// bf16 / --grad-reduce-in-bf16): each BF16 element is read as its exact fp32 value.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/testing.h"
#include "optim/clip_grad.h"

namespace megaton {
namespace {

Param grad_param(const char* name, Tensor grad) {
  Param p;
  p.name = name;
  p.weight = Tensor::zeros(grad.shape());
  p.main_grad = grad;
  return p;
}

TEST(Bf16GradNorm, NormAndClipReadTheWidenedValues) {
  const uint64_t s = testing::test_seed();
  Param a = grad_param("a", testing::randn({5000}, s + 1).to(DType::BF16));
  Param b = grad_param("b", testing::randn({300}, s + 2));
  const Tensor a32 = a.main_grad.to(DType::F32);
  Param a_wide = grad_param("a", a32.clone());
  const double want = optim::global_grad_norm({&a_wide, &b});
  EXPECT_EQ(optim::global_grad_norm({&a, &b}), want);
  EXPECT_GT(want, 10.0);
  // Clipping multiplies in fp32 and rounds each BF16 element once.
  const double coeff = optim::clip_grad_by_norm({&a, &b}, 1.0, want);
  ASSERT_LT(coeff, 1.0);
  for (int64_t k = 0; k < a32.numel(); ++k)
    ASSERT_EQ(a.main_grad.data<uint16_t>()[k], float_to_bf16(a32.f32()[k] * float(coeff))) << k;
}

TEST(MainGrad, ZeroCountOfBf16Grads) {
  Tensor a = testing::randn({1000}, 5).to(DType::BF16);
  Tensor b = testing::randn({300}, 6);
  int64_t zeros = 0;
  for (int64_t k = 0; k < 1000; k += 7) {
    a.data<uint16_t>()[k] = k % 2 ? 0x8000 : 0x0000;  // -0 and +0
    ++zeros;
  }
  a.data<uint16_t>()[3] = 0x0001;  // a denormal is not zero
  for (int64_t k = 0; k < 300; k += 11, ++zeros) b.f32()[k] = 0.0f;
  EXPECT_EQ(optim::count_zeros_in_grads({a, b}), zeros);
  EXPECT_EQ(optim::count_zeros_in_grads({}), 0);
}

}  // namespace
}  // namespace megaton
