// GPU tests of the fused QKV split + RoPE op and its gradient against the CPU reference.
#include <cmath>
#include <string>

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
using testing::seed_trace;
using testing::to_device;
using testing::to_host_f32;

struct QkvCase {
  int64_t B, S, heads, groups, D;
  Shape qkv_shape() const { return {B * S, (heads + 2 * groups) * D}; }
  Shape q_shape() const { return {B, S, heads, D}; }
  Shape kv_shape() const { return {B, S, groups, D}; }
};

std::string case_name(const ::testing::TestParamInfo<QkvCase>& info) {
  const QkvCase& c = info.param;
  return "B" + std::to_string(c.B) + "_S" + std::to_string(c.S) + "_np" + std::to_string(c.heads) +
         "_ng" + std::to_string(c.groups) + "_d" + std::to_string(c.D);
}

// CUDA fp32, bf16 and fp16 tolerances of ../shared/CONVENTIONS.md. The GPU uses the CPU's
// fp32 frequencies and angles, so fp32 differs only by contraction of the final
// multiply-adds; bf16 and fp16 add the rounding of the outputs (2^-9, 2^-12 relative).
struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance(DType dtype) {
  if (dtype == DType::F32) return {1e-5, 1e-4};
  return dtype == DType::F16 ? Tolerance{1e-5, 1e-3} : Tolerance{1e-5, 1e-2};
}

class CudaQkvTest : public ::testing::TestWithParam<QkvCase> {};

TEST_P(CudaQkvTest, SplitAndPackMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const QkvCase c = GetParam();
  const uint64_t seed = testing::test_seed() + 600 + c.D;
  SCOPED_TRACE(seed_trace(seed));
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    for (bool apply_rope : {true, false}) {
      if (apply_rope && c.D % 2 != 0) continue;
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (apply_rope ? " rope" : " no rope"));
      const float base = 500000.0f;
      // Without RoPE both ops are copies: exact in either dtype.
      const Tolerance tol = apply_rope ? tolerance(dtype) : Tolerance{0, 0};
      Tensor qkv = randn(c.qkv_shape(), seed), dq = randn(c.q_shape(), seed + 1),
             dk = randn(c.kv_shape(), seed + 2), dv = randn(c.kv_shape(), seed + 3);
      if (dtype != DType::F32) {  // values the GPU's dtype holds exactly
        for (Tensor* t : {&qkv, &dq, &dk, &dv}) *t = t->to(dtype).to(DType::F32);
      }

      Tensor q_ref = Tensor::empty(c.q_shape()), k_ref = Tensor::empty(c.kv_shape()),
             v_ref = Tensor::empty(c.kv_shape());
      ops::qkv_split_rope(qkv, c.B, c.groups, q_ref, k_ref, v_ref, apply_rope, base);
      Tensor dqkv_ref = Tensor::empty(c.qkv_shape());
      ops::qkv_pack_rope_backward(dq, dk, dv, c.groups, apply_rope, base, dqkv_ref);

      Tensor q_d = poisoned_device(c.q_shape(), dtype), k_d = poisoned_device(c.kv_shape(), dtype),
             v_d = poisoned_device(c.kv_shape(), dtype);
      ops::qkv_split_rope(to_device(qkv, dtype), c.B, c.groups, q_d, k_d, v_d, apply_rope, base);
      Tensor dqkv_d = poisoned_device(c.qkv_shape(), dtype);
      ops::qkv_pack_rope_backward(to_device(dq, dtype), to_device(dk, dtype), to_device(dv, dtype),
                                  c.groups, apply_rope, base, dqkv_d);
      cuda::synchronize();

      Tensor q = to_host_f32(q_d), k = to_host_f32(k_d), v = to_host_f32(v_d);
      Tensor dqkv = to_host_f32(dqkv_d);
      ASSERT_TRUE(all_finite(q, "q"));
      ASSERT_TRUE(all_finite(k, "k"));
      ASSERT_TRUE(all_finite(v, "v"));
      ASSERT_TRUE(all_finite(dqkv, "dqkv"));
      EXPECT_TRUE(allclose(q, q_ref, tol.atol, tol.rtol));
      EXPECT_TRUE(allclose(k, k_ref, tol.atol, tol.rtol));
      EXPECT_TRUE(allclose(v, v_ref, 0, 0));  // v is never rotated
      EXPECT_TRUE(allclose(dqkv, dqkv_ref, tol.atol, tol.rtol));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaQkvTest,
    ::testing::Values(QkvCase{2, 64, 8, 2, 64},    // GQA
                      QkvCase{2, 32, 12, 12, 64},  // MHA
                      QkvCase{1, 48, 8, 2, 128},   // GQA, D = 128
                      QkvCase{3, 37, 4, 1, 128},   // MQA, odd S
                      QkvCase{2, 19, 4, 2, 72},    // half = 36: one value per item in bf16
                      QkvCase{2, 9, 6, 3, 6},      // half = 3: one value per item in both
                      QkvCase{2, 7, 4, 2, 5}),     // odd D, no RoPE: unpaired copy
    case_name);

// Positions run 0..S-1 in every sequence of the batch, for the long positions of a
// 4096-token sequence too (where the angle's fp32 rounding matters; the GPU reproduces it).
TEST(CudaQkv, LongSequenceMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 610;
  SCOPED_TRACE(seed_trace(seed));
  const QkvCase c{1, 4096, 4, 2, 64};
  const float base = 10000.0f;
  Tensor qkv = randn(c.qkv_shape(), seed);
  Tensor q_ref = Tensor::empty(c.q_shape()), k_ref = Tensor::empty(c.kv_shape()),
         v_ref = Tensor::empty(c.kv_shape());
  ops::qkv_split_rope(qkv, c.B, c.groups, q_ref, k_ref, v_ref, true, base);
  Tensor q_d = poisoned_device(c.q_shape(), DType::F32),
         k_d = poisoned_device(c.kv_shape(), DType::F32),
         v_d = poisoned_device(c.kv_shape(), DType::F32);
  ops::qkv_split_rope(qkv.to(Device::CUDA), c.B, c.groups, q_d, k_d, v_d, true, base);
  const Tolerance tol = tolerance(DType::F32);
  EXPECT_TRUE(allclose(to_host_f32(q_d), q_ref, tol.atol, tol.rtol));
  EXPECT_TRUE(allclose(to_host_f32(k_d), k_ref, tol.atol, tol.rtol));
  EXPECT_TRUE(allclose(to_host_f32(v_d), v_ref, 0, 0));
}

TEST(CudaQkv, RejectsBadArguments) {
  MEGATON_SKIP_WITHOUT_GPU();
  const QkvCase c{2, 3, 4, 2, 8};
  Tensor qkv = to_device(randn(c.qkv_shape(), 1), DType::BF16);
  Tensor q = Tensor::empty(c.q_shape(), DType::BF16, Device::CUDA);
  Tensor k = Tensor::empty(c.kv_shape(), DType::BF16, Device::CUDA);
  Tensor v = Tensor::empty(c.kv_shape(), DType::BF16, Device::CUDA);
  Tensor v_f32 = Tensor::empty(c.kv_shape(), DType::F32, Device::CUDA);
  EXPECT_THROW(ops::qkv_split_rope(qkv, c.B, c.groups, q, k, v_f32, true, 1e4f), InternalError);
  EXPECT_THROW(ops::qkv_split_rope(qkv, c.B + 1, c.groups, q, k, v, true, 1e4f), InternalError);
  EXPECT_THROW(ops::qkv_split_rope(qkv, c.B, 1, q, k, v, true, 1e4f), InternalError);
  Tensor dqkv_short = Tensor::empty({c.B * c.S - 1, c.qkv_shape()[1]}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::qkv_pack_rope_backward(q, k, v, c.groups, true, 1e4f, dqkv_short),
               InternalError);
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
