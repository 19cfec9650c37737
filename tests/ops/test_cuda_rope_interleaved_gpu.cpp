// GPU test of MLA's interleaved RoPE (ops/rope_interleaved.h) against the CPU op, in F32,
// BF16 and F16, forward and backward.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/testing.h"
#include "ops/rope_interleaved.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"

namespace megaton {
namespace {

TEST(CudaRopeInterleaved, ForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  // DeepSeek-V3's rope part: 64 dims, YaRN's ramp from plain RoPE to 1/40 of it (pairs
  // 10 to 23, docs/research/deepseek-v3.md 2.5), and its cos/sin scale for mscale 1 and
  // mscale_all_dim 0.707.
  std::vector<float> inv_freq;
  for (int j = 0; j < 32; ++j) {
    const double ramp = std::clamp((j - 10.0) / 13.0, 0.0, 1.0);
    inv_freq.push_back(float(std::pow(10000.0, -j / 32.0) * (1.0 - ramp * (1.0 - 1.0 / 40))));
  }
  const float scale = 1.085726f;
  const uint64_t seed = testing::test_seed() + 200;
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    // Values the dtype holds exactly; positions up to 4096 + 300.
    const Tensor x = testing::randn({2, 300, 4, 64}, seed).to(dtype).to(DType::F32);
    const Tensor dy = testing::randn(x.shape(), seed + 1).to(dtype).to(DType::F32);
    Tensor y = Tensor::empty(x.shape()), dx = Tensor::empty(x.shape());
    ops::rope_interleaved_forward(x, y, inv_freq, scale, 4096);
    ops::rope_interleaved_backward(dy, dx, inv_freq, scale, 4096);
    Tensor y_d = testing::poisoned_device(x.shape(), dtype),
           dx_d = testing::poisoned_device(x.shape(), dtype);
    ops::rope_interleaved_forward(testing::to_device(x, dtype), y_d, inv_freq, scale, 4096);
    ops::rope_interleaved_backward(testing::to_device(dy, dtype), dx_d, inv_freq, scale, 4096);
    // F32: the same fp32 angles and double trig, a few ulps apart at most; 16-bit: one
    // rounding of the output (2^-9 for BF16).
    const double tol = dtype == DType::F32 ? 1e-6 : dtype == DType::BF16 ? 4e-3 : 5e-4;
    EXPECT_LE(testing::rel_error(testing::to_host_f32(y_d), y), tol);
    EXPECT_LE(testing::rel_error(testing::to_host_f32(dx_d), dx), tol);
  }
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
