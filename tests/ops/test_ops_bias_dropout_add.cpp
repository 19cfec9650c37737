// ops::bias_dropout_add on the CPU: the fused pass equals bias_add_, dropout_forward and
// add_ run one after the other, bit for bit, with and without a bias, with p 0 and p > 0,
// in place; and its door checks.
#include <gtest/gtest.h>

#include "common/testing.h"
#include "core/error.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::randn;

// residual + dropout(x + bias) by the three unfused ops.
Tensor unfused(const Tensor& x, const Tensor& bias, const Tensor& residual, float p,
               uint64_t seed, uint64_t stream) {
  Tensor t = x.clone();
  if (bias.defined()) ops::bias_add_(t, bias);
  Tensor d = Tensor::empty(t.shape());
  ops::dropout_forward(t, d, p, seed, stream);
  ops::add_(d, residual);
  return d;
}

TEST(BiasDropoutAdd, EqualsTheUnfusedOps) {
  const uint64_t seed = testing::test_seed();
  const Tensor x = randn({37, 96}, seed), residual = randn({37, 96}, seed + 1);
  const Tensor bias = randn({96}, seed + 2);
  for (bool with_bias : {false, true}) {
    for (float p : {0.0f, 0.1f, 0.5f}) {
      SCOPED_TRACE("bias " + std::to_string(with_bias) + " p " + std::to_string(p));
      const Tensor b = with_bias ? bias : Tensor();
      const Tensor want = unfused(x, b, residual, p, 1234, 9);
      Tensor out = Tensor::empty({37, 96});
      testing::poison(out);
      ops::bias_dropout_add(x, b, residual, out, p, 1234, 9);
      EXPECT_TRUE(testing::allclose(out, want, 0, 0));
      Tensor in_place = x.clone();  // out aliasing x, as TransformerLayer calls it
      ops::bias_dropout_add(in_place, b, residual, in_place, p, 1234, 9);
      EXPECT_TRUE(testing::allclose(in_place, want, 0, 0));
    }
  }
  // Another stream draws another mask.
  Tensor a = Tensor::empty({37, 96}), b = Tensor::empty({37, 96});
  ops::bias_dropout_add(x, bias, residual, a, 0.5f, 1234, 9);
  ops::bias_dropout_add(x, bias, residual, b, 0.5f, 1234, 10);
  EXPECT_FALSE(testing::allclose(a, b, 0, 0));
}

TEST(BiasDropoutAdd, DoorChecks) {
  const Tensor x = Tensor::zeros({4, 8}), residual = Tensor::zeros({4, 8});
  Tensor out = Tensor::zeros({4, 8});
  EXPECT_THROW(ops::bias_dropout_add(x, Tensor::zeros({7}), residual, out, 0.1f, 1, 2),
               InternalError);
  EXPECT_THROW(ops::bias_dropout_add(x, Tensor(), Tensor::zeros({4, 7}), out, 0.1f, 1, 2),
               InternalError);
  EXPECT_THROW(ops::bias_dropout_add(x, Tensor(), residual, out, 1.0f, 1, 2), InternalError);
}

}  // namespace
}  // namespace megaton
