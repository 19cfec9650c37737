// ops::bias_dropout_add on the GPU: bit for bit the CUDA bias_add_, dropout_forward and add_
// run one after the other, in F32, BF16 and F16, with an F32, BF16 or F16 bias or none, p 0 and
// p > 0, in place and on shapes whose rows are not a multiple of the vector width; and in
// F32 the CPU op's bits (the same Philox mask).
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"
#include "ops/ops.h"

#include <string>
#include <utility>

namespace megaton {
namespace {

using testing::to_device;
using testing::to_host_f32;

Tensor unfused(const Tensor& x, const Tensor& bias, const Tensor& residual, float p,
               uint64_t seed, uint64_t stream) {
  Tensor t = x.clone();
  if (bias.defined()) ops::bias_add_(t, bias);
  Tensor d = Tensor::empty(t.shape(), t.dtype(), t.device());
  ops::dropout_forward(t, d, p, seed, stream);
  ops::add_(d, residual);
  return d;
}

TEST(CudaBiasDropoutAdd, EqualsTheUnfusedOpsAndTheCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 256}, {33, 257}}) {
    const Tensor x = testing::round_to_bf16(testing::randn({rows, cols}, seed));
    const Tensor residual = testing::round_to_bf16(testing::randn({rows, cols}, seed + 1));
    const Tensor bias = testing::round_to_bf16(testing::randn({cols}, seed + 2));
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      for (int bias_kind : {0, 1, 2, 3}) {  // none, F32, BF16, F16
        for (float p : {0.0f, 0.3f}) {
          SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " " +
                       std::string(dtype_name(dtype)) + " bias " + std::to_string(bias_kind) + " p " +
                       std::to_string(p));
          const Tensor xg = to_device(x, dtype), rg = to_device(residual, dtype);
          const DType bias_dtypes[] = {DType::F32, DType::F32, DType::BF16, DType::F16};
          const Tensor bg = bias_kind == 0 ? Tensor() : to_device(bias, bias_dtypes[bias_kind]);
          const Tensor want = to_host_f32(unfused(xg, bg, rg, p, 77, 5));
          Tensor out = testing::poisoned_device({rows, cols}, dtype);
          ops::bias_dropout_add(xg, bg, rg, out, p, 77, 5);
          EXPECT_TRUE(testing::bitwise_equal(to_host_f32(out), want));
          Tensor in_place = xg.clone();
          ops::bias_dropout_add(in_place, bg, rg, in_place, p, 77, 5);
          EXPECT_TRUE(testing::bitwise_equal(to_host_f32(in_place), want));
          if (dtype == DType::F32 && bias_kind < 2) {
            Tensor cpu = Tensor::empty({rows, cols});
            ops::bias_dropout_add(x, bias_kind ? bias : Tensor(), residual, cpu, p, 77, 5);
            EXPECT_TRUE(testing::bitwise_equal(to_host_f32(out), cpu)) << "vs the CPU";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace megaton
#else
TEST(CudaBiasDropoutAdd, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }
#endif
