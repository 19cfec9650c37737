// GPU tests of causal GQA attention (cuDNN fused SDPA) and RoPE against the CPU reference ops,
// in BF16 and F16 (and F32 for RoPE).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "ops/ops.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"

namespace megaton {
namespace {

using testing::all_finite;
using testing::allclose;
using testing::bitwise_equal;
using testing::poison;
using testing::poisoned_device;
using testing::randn;
using testing::rel_error;
using testing::seed_trace;
using testing::to_device;
using testing::to_host_f32;

// ---------------------------------------------------------------------------------------
// Attention

struct AttentionCase {
  int64_t B, S, Hq, Hkv, D;
  int64_t Dv = 0;     // v's head dim (0: D)
  float scale = 0.0f;  // the softmax scale (0: 1 / sqrt(D))
  int64_t v_dim() const { return Dv > 0 ? Dv : D; }
};

std::string case_name(const ::testing::TestParamInfo<AttentionCase>& info) {
  const AttentionCase& c = info.param;
  return "B" + std::to_string(c.B) + "_S" + std::to_string(c.S) + "_Hq" + std::to_string(c.Hq) +
         "_Hkv" + std::to_string(c.Hkv) + "_D" + std::to_string(c.D) +
         (c.Dv > 0 ? "_Dv" + std::to_string(c.Dv) : std::string()) + (c.scale > 0 ? "_scaled" : "");
}

class CudaAttentionTest : public ::testing::TestWithParam<AttentionCase> {};

// Tolerances. out: whole-tensor bf16 (1e-2); the fused kernel rounds the probabilities to
// bf16 before the P V product and out itself to bf16, ~3e-3 together.
// lse: fp32 statistics of exact bf16 x bf16 products summed in fp32; only the summation
// order and the fp32 exp/log differ from the CPU, far below 1e-3 + 1e-3 |lse|.
// dq, dk, dv: 2e-2 rather than 1e-2. The backward rounds to bf16 three times on the way
// (P for dv, dS for dq and dk, and the outputs), reads the bf16 out rather than the fp32
// one for delta = dout . out, and with GQA dk, dv sum Hq/Hkv such terms; each rounding is
// 2^-9 relative, and the errors add to ~5e-3..1e-2 on these shapes.
constexpr double kOutRelTol = 1e-2, kLseAtol = 1e-3, kLseRtol = 1e-3, kGradRelTol = 2e-2;
// F16 (--fp16): the same roundings at 2^-12 instead of 2^-9 relative, so an eighth of the
// BF16 tolerances; a BF16 computation would exceed them.
constexpr double kOutRelTolF16 = kOutRelTol / 8, kGradRelTolF16 = kGradRelTol / 8;

void check_attention_against_cpu(const AttentionCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(dtype_name(dtype));
  const Shape q_shape{c.B, c.S, c.Hq, c.D}, kv_shape{c.B, c.S, c.Hkv, c.D};
  const Shape v_shape{c.B, c.S, c.Hkv, c.v_dim()}, o_shape{c.B, c.S, c.Hq, c.v_dim()};
  const Shape lse_shape{c.B, c.Hq, c.S};
  // Values the GPU's dtype holds exactly.
  auto rounded = [dtype](const Tensor& x) { return x.to(dtype).to(DType::F32); };
  Tensor q = rounded(randn(q_shape, seed));
  Tensor k = rounded(randn(kv_shape, seed + 1));
  Tensor v = rounded(randn(v_shape, seed + 2));
  Tensor dout = rounded(randn(o_shape, seed + 3));

  Tensor out_ref = Tensor::empty(o_shape), lse_ref = Tensor::empty(lse_shape);
  ops::attention_forward(q, k, v, out_ref, lse_ref, 0.0f, 0, 0, c.scale);
  Tensor dq_ref = Tensor::empty(q_shape), dk_ref = Tensor::empty(kv_shape),
         dv_ref = Tensor::empty(v_shape);
  ops::attention_backward(dout, q, k, v, out_ref, lse_ref, dq_ref, dk_ref, dv_ref, 0.0f, 0, 0,
                          c.scale);

  Tensor q_d = to_device(q, dtype), k_d = to_device(k, dtype), v_d = to_device(v, dtype),
         dout_d = to_device(dout, dtype);
  Tensor out_d = poisoned_device(o_shape, dtype), lse_d = poisoned_device(lse_shape, DType::F32);
  ops::attention_forward(q_d, k_d, v_d, out_d, lse_d, 0.0f, 0, 0, c.scale);
  Tensor dq_d = poisoned_device(q_shape, dtype), dk_d = poisoned_device(kv_shape, dtype),
         dv_d = poisoned_device(v_shape, dtype);
  ops::attention_backward(dout_d, q_d, k_d, v_d, out_d, lse_d, dq_d, dk_d, dv_d, 0.0f, 0, 0,
                          c.scale);
  cuda::synchronize();

  Tensor out = to_host_f32(out_d), lse = to_host_f32(lse_d);
  Tensor dq = to_host_f32(dq_d), dk = to_host_f32(dk_d), dv = to_host_f32(dv_d);
  ASSERT_TRUE(all_finite(out, "out"));
  ASSERT_TRUE(all_finite(lse, "lse"));
  ASSERT_TRUE(all_finite(dq, "dq"));
  ASSERT_TRUE(all_finite(dk, "dk"));
  ASSERT_TRUE(all_finite(dv, "dv"));
  const bool f16 = dtype == DType::F16;
  const double out_tol = f16 ? kOutRelTolF16 : kOutRelTol;
  const double grad_tol = f16 ? kGradRelTolF16 : kGradRelTol;
  EXPECT_LE(rel_error(out, out_ref), out_tol);
  // cuDNN's Stats: natural-log logsumexp of the scaled, masked scores, [B, Hq, S].
  EXPECT_TRUE(allclose(lse, lse_ref, kLseAtol, kLseRtol));
  EXPECT_LE(rel_error(dq, dq_ref), grad_tol);
  EXPECT_LE(rel_error(dk, dk_ref), grad_tol);
  EXPECT_LE(rel_error(dv, dv_ref), grad_tol);
}

TEST_P(CudaAttentionTest, ForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 100;
  SCOPED_TRACE(seed_trace(seed));
  for (DType dtype : {DType::BF16, DType::F16})
    check_attention_against_cpu(GetParam(), dtype, seed);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionTest,
    ::testing::Values(AttentionCase{2, 128, 8, 8, 64},    // MHA
                      AttentionCase{1, 256, 8, 2, 128},   // GQA, D = 128
                      AttentionCase{2, 100, 4, 2, 64},    // S not a tile multiple
                      AttentionCase{1, 100, 4, 1, 128},   // MQA, odd S, D = 128
                      // MLA (DeepSeek-V3): qk head dim 192, v head dim 128, YaRN's scale
                      // (mscale 1.368888^2 / sqrt(192), docs/research/deepseek-v3.md 2.5).
                      AttentionCase{1, 128, 4, 4, 192, 128, 0.135234f},
                      AttentionCase{2, 100, 4, 2, 64, 32, 0.2f}),  // GQA, Dv < D
    case_name);

// cuDNN's dropout mask is its own Philox stream, not the CPU's (see ops/cuda/attention.cpp),
// so it is checked by its properties rather than against the CPU op.
TEST(CudaAttention, DropoutIsDeterministicUnbiasedAndKeyedBySeedAndStream) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 200;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t B = 2, S = 256, Hq = 8, Hkv = 4, D = 64;
  const Shape q_shape{B, S, Hq, D}, kv_shape{B, S, Hkv, D}, lse_shape{B, Hq, S};
  Tensor q_d = to_device(randn(q_shape, seed), DType::BF16);
  Tensor k_d = to_device(randn(kv_shape, seed + 1), DType::BF16);
  Tensor v_d = to_device(randn(kv_shape, seed + 2), DType::BF16);
  Tensor dout_d = to_device(randn(q_shape, seed + 3), DType::BF16);
  const float p = 0.1f;

  struct Result {
    Tensor out, lse, dv;  // host fp32
  };
  auto run = [&](const Tensor& v_in, float dropout_p, uint64_t s, uint64_t stream) {
    Tensor out_d = poisoned_device(q_shape, DType::BF16),
           lse_d = poisoned_device(lse_shape, DType::F32);
    ops::attention_forward(q_d, k_d, v_in, out_d, lse_d, dropout_p, s, stream);
    Tensor dq_d = poisoned_device(q_shape, DType::BF16),
           dk_d = poisoned_device(kv_shape, DType::BF16),
           dv_d = poisoned_device(kv_shape, DType::BF16);
    ops::attention_backward(dout_d, q_d, k_d, v_in, out_d, lse_d, dq_d, dk_d, dv_d, dropout_p, s,
                            stream);
    cuda::synchronize();
    Result r{to_host_f32(out_d), to_host_f32(lse_d), to_host_f32(dv_d)};
    EXPECT_TRUE(all_finite(to_host_f32(dq_d), "dq"));
    EXPECT_TRUE(all_finite(to_host_f32(dk_d), "dk"));
    return r;
  };

  Result dropped = run(v_d, p, 11, 3);
  ASSERT_TRUE(all_finite(dropped.out, "out"));
  ASSERT_TRUE(all_finite(dropped.lse, "lse"));
  ASSERT_TRUE(all_finite(dropped.dv, "dv"));

  // The forward kernel has no atomics: the same (seed, stream) gives the same bits.
  Result again = run(v_d, p, 11, 3);
  EXPECT_TRUE(bitwise_equal(again.out, dropped.out));

  // Dropout acts on the probabilities after the softmax: lse is that of p = 0.
  Result plain = run(v_d, 0.0f, 11, 3);
  EXPECT_TRUE(allclose(dropped.lse, plain.lse, kLseAtol, kLseRtol));
  // ... and out, dv differ from p = 0 by far more than rounding.
  EXPECT_GT(rel_error(dropped.out, plain.out), 0.05);
  EXPECT_GT(rel_error(dropped.dv, plain.dv), 0.05);

  // Another stream or another seed draws another mask.
  EXPECT_GT(rel_error(run(v_d, p, 11, 4).out, dropped.out), 0.05);
  EXPECT_GT(rel_error(run(v_d, p, 12, 3).out, dropped.out), 0.05);

  // p is the probability of dropping, kept values are scaled by 1 / (1 - p): with v = 1,
  // out[i] = sum_j P_ij m_ij / (1 - p) has mean 1 whatever P is. Over B * S * Hq = 4096
  // rows with per-row variance <= p / (1 - p) = 0.11, the mean's standard deviation is
  // <= 0.005, so 0.03 is a > 6 sigma bound (a keep-probability reading of p would give
  // 0.11, a missing rescale 0.9).
  Tensor ones_d =
      to_device(Tensor::from(kv_shape, std::vector<float>(B * S * Hkv * D, 1.0f)), DType::BF16);
  Tensor ones_out = run(ones_d, p, 11, 3).out;
  double mean = 0;
  for (int64_t i = 0; i < ones_out.numel(); ++i) mean += ones_out.f32()[i];
  mean /= double(ones_out.numel());
  EXPECT_NEAR(mean, 1.0, 0.03);
}

TEST(CudaAttention, RejectsBadArguments) {
  MEGATON_SKIP_WITHOUT_GPU();
  Tensor q = to_device(randn({1, 8, 3, 64}, 1), DType::BF16);
  Tensor k = to_device(randn({1, 8, 2, 64}, 2), DType::BF16);
  Tensor out = Tensor::empty({1, 8, 3, 64}, DType::BF16, Device::CUDA);
  Tensor lse = Tensor::empty({1, 3, 8}, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::attention_forward(q, k, k, out, lse), InternalError);  // 3 % 2 != 0
  Tensor q4 = to_device(randn({1, 8, 4, 64}, 1), DType::BF16);
  Tensor out4 = Tensor::empty(q4.shape(), DType::BF16, Device::CUDA);
  Tensor lse_bf16 = Tensor::empty({1, 4, 8}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::attention_forward(q4, k, k, out4, lse_bf16), InternalError);
  Tensor lse4 = Tensor::empty({1, 4, 8}, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::attention_forward(q4, k, k, out4, lse4, 1.0f), InternalError);
}

// ---------------------------------------------------------------------------------------
// RoPE

// CUDA fp32, bf16 and fp16 tolerances of ../shared/CONVENTIONS.md. The GPU uses the CPU's
// fp32 frequencies and angles, so fp32 differs only by contraction of the final
// multiply-adds.
struct RopeTolerance {
  double atol, rtol;
};
RopeTolerance rope_tolerance(DType dtype) {
  if (dtype == DType::F32) return {1e-5, 1e-4};
  return dtype == DType::F16 ? RopeTolerance{1e-5, 1e-3} : RopeTolerance{1e-5, 1e-2};
}

TEST(CudaRope, ForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 300;
  SCOPED_TRACE(seed_trace(seed));
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t D : {64, 128}) {
      for (int64_t offset : {0, 5, 4000}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " D=" + std::to_string(D) +
                     " offset=" + std::to_string(offset));
        const float base = offset == 4000 ? 500000.0f : 10000.0f;
        const Shape shape{2, 37, 3, D};
        Tensor x = randn(shape, seed + D + offset);
        if (dtype != DType::F32) x = x.to(dtype).to(DType::F32);
        const RopeTolerance tol = rope_tolerance(dtype);

        Tensor y_ref = Tensor::empty(shape);
        ops::rope_forward(x, y_ref, base, offset);
        Tensor y_d = poisoned_device(shape, dtype);
        ops::rope_forward(to_device(x, dtype), y_d, base, offset);
        Tensor y = to_host_f32(y_d);
        ASSERT_TRUE(all_finite(y, "y"));
        EXPECT_TRUE(allclose(y, y_ref, tol.atol, tol.rtol));

        Tensor dx_ref = Tensor::empty(shape);
        ops::rope_backward(x, dx_ref, base, offset);
        Tensor dx_d = poisoned_device(shape, dtype);
        ops::rope_backward(to_device(x, dtype), dx_d, base, offset);
        Tensor dx = to_host_f32(dx_d);
        ASSERT_TRUE(all_finite(dx, "dx"));
        EXPECT_TRUE(allclose(dx, dx_ref, tol.atol, tol.rtol));
      }
    }
  }
}

TEST(CudaRope, InPlaceMatchesOutOfPlace) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 310;
  SCOPED_TRACE(seed_trace(seed));
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Shape shape{2, 19, 4, 64};
    Tensor x_d = to_device(randn(shape, seed), dtype);
    Tensor y_d = poisoned_device(shape, dtype);
    ops::rope_forward(x_d, y_d, 10000.0f, 2);
    Tensor alias_d = x_d.clone();
    ops::rope_forward(alias_d, alias_d, 10000.0f, 2);
    EXPECT_TRUE(bitwise_equal(to_host_f32(alias_d), to_host_f32(y_d)));

    Tensor dx_d = poisoned_device(shape, dtype);
    ops::rope_backward(y_d, dx_d, 10000.0f, 2);
    Tensor dy_alias_d = y_d.clone();
    ops::rope_backward(dy_alias_d, dy_alias_d, 10000.0f, 2);
    EXPECT_TRUE(bitwise_equal(to_host_f32(dy_alias_d), to_host_f32(dx_d)));
  }
}

// position_offset = o on a sequence equals positions o.. of a longer sequence: the tail of
// rope(x_long, offset 3) equals rope(x_tail, offset 3 + shift).
TEST(CudaRope, PositionOffsetShiftsPositions) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 320;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t S = 24, shift = 10, H = 2, D = 64;
  Tensor x_long = randn({1, S, H, D}, seed);
  Tensor x_tail = Tensor::empty({1, S - shift, H, D});
  std::copy(x_long.f32() + shift * H * D, x_long.f32() + S * H * D, x_tail.f32());
  Tensor y_long_d = poisoned_device(x_long.shape(), DType::F32);
  ops::rope_forward(x_long.to(Device::CUDA), y_long_d, 500000.0f, 3);
  Tensor y_tail_d = poisoned_device(x_tail.shape(), DType::F32);
  ops::rope_forward(x_tail.to(Device::CUDA), y_tail_d, 500000.0f, 3 + shift);
  Tensor y_long = to_host_f32(y_long_d), y_tail = to_host_f32(y_tail_d);
  Tensor y_long_tail = Tensor::empty(x_tail.shape());
  std::copy(y_long.f32() + shift * H * D, y_long.f32() + S * H * D, y_long_tail.f32());
  EXPECT_TRUE(bitwise_equal(y_tail, y_long_tail));
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
