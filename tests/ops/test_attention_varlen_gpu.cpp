// GPU tests of packed-sequence causal attention (ops/attention_varlen.h: cuDNN ragged SDPA)
// against the CPU op, in BF16 and F16; cuDNN's dropout by its properties; a CUDA-graph
// capture replayed with another partition of the tokens into sequences.
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "common/testing.h"
#include "ops/attention_varlen.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"
#include "core/cuda/graph.h"

namespace megaton {
namespace {

using testing::all_finite;
using testing::allclose;
using testing::bitwise_equal;
using testing::poisoned_device;
using testing::randn;
using testing::rel_error;
using testing::seed_trace;
using testing::to_device;
using testing::to_host_f32;

// The dense op's GPU tolerances (test_cuda_attention_gpu.cpp says why): out 1e-2 relative
// (whole tensor), lse 1e-3 + 1e-3 |lse|, gradients 2e-2; F16 an eighth of BF16's.
constexpr double kOutRelTol = 1e-2, kLseAtol = 1e-3, kLseRtol = 1e-3, kGradRelTol = 2e-2;
constexpr double kOutRelTolF16 = kOutRelTol / 8, kGradRelTolF16 = kGradRelTol / 8;

std::vector<int32_t> cu_seqlens_values(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  std::partial_sum(lengths.begin(), lengths.end(), cu.begin() + 1);
  return cu;
}

Tensor cu_seqlens_host(const std::vector<int32_t>& lengths) {
  const std::vector<int32_t> cu = cu_seqlens_values(lengths);
  return Tensor::from_i32({int64_t(cu.size())}, cu);
}

struct VarlenCase {
  std::vector<int32_t> lengths;
  int64_t Hq, Hkv, D, Dv;
  float scale = 0.0f;      // <= 0: 1 / sqrt(D)
  int64_t max_seqlen = 0;  // 0: the longest length
  int64_t T() const { return std::accumulate(lengths.begin(), lengths.end(), int64_t(0)); }
  int64_t bound() const {
    return max_seqlen > 0 ? max_seqlen : *std::max_element(lengths.begin(), lengths.end());
  }
};

std::string case_name(const ::testing::TestParamInfo<VarlenCase>& info) {
  const VarlenCase& c = info.param;
  std::string lengths;
  for (int32_t l : c.lengths) lengths += fmt::format("_{}", l);
  return fmt::format("L{}_Hq{}_Hkv{}_D{}_Dv{}{}{}", lengths, c.Hq, c.Hkv, c.D, c.Dv,
                     c.scale > 0 ? "_scaled" : "",
                     c.max_seqlen > 0 ? fmt::format("_max{}", c.max_seqlen) : "");
}

class CudaAttentionVarlenTest : public ::testing::TestWithParam<VarlenCase> {};

void check_against_cpu(const VarlenCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(dtype_name(dtype));
  const int64_t T = c.T();
  const Shape q_shape{T, c.Hq, c.D}, k_shape{T, c.Hkv, c.D}, v_shape{T, c.Hkv, c.Dv},
      o_shape{T, c.Hq, c.Dv}, lse_shape{T, c.Hq};
  // Values the GPU's dtype holds exactly.
  auto rounded = [dtype](const Tensor& x) { return x.to(dtype).to(DType::F32); };
  const Tensor q = rounded(randn(q_shape, seed)), k = rounded(randn(k_shape, seed + 1)),
               v = rounded(randn(v_shape, seed + 2)), dout = rounded(randn(o_shape, seed + 3));
  const Tensor cu = cu_seqlens_host(c.lengths);

  Tensor out_ref = Tensor::empty(o_shape), lse_ref = Tensor::empty(lse_shape);
  ops::attention_varlen_forward(q, k, v, out_ref, lse_ref, cu, c.bound(), 0.0f, 0, 0, c.scale);
  Tensor dq_ref = Tensor::empty(q_shape), dk_ref = Tensor::empty(k_shape),
         dv_ref = Tensor::empty(v_shape);
  ops::attention_varlen_backward(dout, q, k, v, out_ref, lse_ref, cu, c.bound(), dq_ref, dk_ref,
                                 dv_ref, 0.0f, 0, 0, c.scale);

  const Tensor q_d = to_device(q, dtype), k_d = to_device(k, dtype), v_d = to_device(v, dtype),
               dout_d = to_device(dout, dtype), cu_d = cu.to(Device::CUDA);
  Tensor out_d = poisoned_device(o_shape, dtype), lse_d = poisoned_device(lse_shape, DType::F32);
  ops::attention_varlen_forward(q_d, k_d, v_d, out_d, lse_d, cu_d, c.bound(), 0.0f, 0, 0, c.scale);
  Tensor dq_d = poisoned_device(q_shape, dtype), dk_d = poisoned_device(k_shape, dtype),
         dv_d = poisoned_device(v_shape, dtype);
  ops::attention_varlen_backward(dout_d, q_d, k_d, v_d, out_d, lse_d, cu_d, c.bound(), dq_d, dk_d,
                                 dv_d, 0.0f, 0, 0, c.scale);
  cuda::synchronize();

  const Tensor out = to_host_f32(out_d), lse = to_host_f32(lse_d), dq = to_host_f32(dq_d),
               dk = to_host_f32(dk_d), dv = to_host_f32(dv_d);
  // Every row belongs to a sequence, so every element must have been written.
  ASSERT_TRUE(all_finite(out, "out"));
  ASSERT_TRUE(all_finite(lse, "lse"));
  ASSERT_TRUE(all_finite(dq, "dq"));
  ASSERT_TRUE(all_finite(dk, "dk"));
  ASSERT_TRUE(all_finite(dv, "dv"));
  const bool f16 = dtype == DType::F16;
  EXPECT_LE(rel_error(out, out_ref), f16 ? kOutRelTolF16 : kOutRelTol);
  // lse [T, Hq] token-major on both.
  EXPECT_TRUE(allclose(lse, lse_ref, kLseAtol, kLseRtol));
  const double grad_tol = f16 ? kGradRelTolF16 : kGradRelTol;
  EXPECT_LE(rel_error(dq, dq_ref), grad_tol);
  EXPECT_LE(rel_error(dk, dk_ref), grad_tol);
  EXPECT_LE(rel_error(dv, dv_ref), grad_tol);
}

TEST_P(CudaAttentionVarlenTest, ForwardAndBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1000;
  SCOPED_TRACE(seed_trace(seed));
  for (DType dtype : {DType::BF16, DType::F16}) check_against_cpu(GetParam(), dtype, seed);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionVarlenTest,
    ::testing::Values(
        // Unequal lengths with a length-1 sequence, GQA 4:1.
        VarlenCase{{100, 1, 37, 128}, 8, 2, 64, 64},
        VarlenCase{{256}, 4, 4, 128, 128},  // one sequence: the dense op's problem
        // MLA (DeepSeek-V3): qk head dim 192, v head dim 128, YaRN's scale; N = 3 runs in a
        // graph batch of 4 (one empty entry).
        VarlenCase{{60, 5, 130}, 4, 4, 192, 128, 0.135234f},
        // An empty sequence in cu_seqlens, Dv < D, GQA, max_seqlen above the longest.
        VarlenCase{{33, 0, 64, 7, 20}, 4, 2, 64, 32, 0.2f, 128},
        // MQA, a graph S (512) above T rounded to 64 minus one tile.
        VarlenCase{{300, 200, 17}, 2, 1, 128, 128}),
    case_name);

// cuDNN's dropout mask is its own Philox stream, not the CPU's, so it is checked by its
// properties (as test_cuda_attention_gpu.cpp does for the dense op).
TEST(CudaAttentionVarlen, DropoutIsDeterministicUnbiasedAndKeyedBySeedAndStream) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1100;
  SCOPED_TRACE(seed_trace(seed));
  const std::vector<int32_t> lengths{250, 130, 1, 131};
  const int64_t T = 512, Hq = 8, Hkv = 4, D = 64, max_seqlen = 250;
  const Shape q_shape{T, Hq, D}, kv_shape{T, Hkv, D}, lse_shape{T, Hq};
  const Tensor q_d = to_device(randn(q_shape, seed), DType::BF16);
  const Tensor k_d = to_device(randn(kv_shape, seed + 1), DType::BF16);
  const Tensor v_d = to_device(randn(kv_shape, seed + 2), DType::BF16);
  const Tensor dout_d = to_device(randn(q_shape, seed + 3), DType::BF16);
  const Tensor cu_d = cu_seqlens_host(lengths).to(Device::CUDA);
  const float p = 0.1f;

  struct Result {
    Tensor out, lse, dv;  // host fp32
  };
  auto run = [&](const Tensor& v_in, float dropout_p, uint64_t s, uint64_t stream) {
    Tensor out_d = poisoned_device(q_shape, DType::BF16),
           lse_d = poisoned_device(lse_shape, DType::F32);
    ops::attention_varlen_forward(q_d, k_d, v_in, out_d, lse_d, cu_d, max_seqlen, dropout_p, s,
                                  stream);
    Tensor dq_d = poisoned_device(q_shape, DType::BF16),
           dk_d = poisoned_device(kv_shape, DType::BF16),
           dv_d = poisoned_device(kv_shape, DType::BF16);
    ops::attention_varlen_backward(dout_d, q_d, k_d, v_in, out_d, lse_d, cu_d, max_seqlen, dq_d,
                                   dk_d, dv_d, dropout_p, s, stream);
    cuda::synchronize();
    Result r{to_host_f32(out_d), to_host_f32(lse_d), to_host_f32(dv_d)};
    EXPECT_TRUE(all_finite(to_host_f32(dq_d), "dq"));
    EXPECT_TRUE(all_finite(to_host_f32(dk_d), "dk"));
    return r;
  };

  const Result dropped = run(v_d, p, 11, 3);
  ASSERT_TRUE(all_finite(dropped.out, "out"));
  ASSERT_TRUE(all_finite(dropped.lse, "lse"));
  ASSERT_TRUE(all_finite(dropped.dv, "dv"));
  // The forward has no atomics: the same (seed, stream) gives the same bits.
  EXPECT_TRUE(bitwise_equal(run(v_d, p, 11, 3).out, dropped.out));
  // Dropout acts on the probabilities after the softmax: lse is that of p = 0 ...
  const Result plain = run(v_d, 0.0f, 11, 3);
  EXPECT_TRUE(allclose(dropped.lse, plain.lse, kLseAtol, kLseRtol));
  // ... and out, dv differ from p = 0 by far more than rounding.
  EXPECT_GT(rel_error(dropped.out, plain.out), 0.05);
  EXPECT_GT(rel_error(dropped.dv, plain.dv), 0.05);
  // Another stream or another seed draws another mask.
  EXPECT_GT(rel_error(run(v_d, p, 11, 4).out, dropped.out), 0.05);
  EXPECT_GT(rel_error(run(v_d, p, 12, 3).out, dropped.out), 0.05);
  // With v = 1, out = sum_j P_ij m_ij / (1 - p) has mean 1 whatever P is: over T * Hq = 4096
  // rows of variance <= p / (1 - p) = 0.11 the mean's standard deviation is <= 0.005, so
  // 0.03 is a > 6 sigma bound (a keep-probability reading of p would give 0.11).
  const Tensor ones_d =
      to_device(Tensor::from(kv_shape, std::vector<float>(T * Hkv * D, 1.0f)), DType::BF16);
  const Tensor ones_out = run(ones_d, p, 11, 3).out;
  double mean = 0;
  for (int64_t i = 0; i < ones_out.numel(); ++i) mean += ones_out.f32()[i];
  mean /= double(ones_out.numel());
  EXPECT_NEAR(mean, 1.0, 0.03);
}

// The op makes no host synchronization: captured once, a graph replays it with whatever
// cu_seqlens holds at replay time (same N and max_seqlen, as a captured step must keep).
TEST(CudaAttentionVarlen, CapturedGraphFollowsTheDeviceCuSeqlens) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1200;
  SCOPED_TRACE(seed_trace(seed));
  const std::vector<int32_t> first{50, 14, 64}, second{1, 100, 27};
  const int64_t T = 128, Hq = 4, Hkv = 2, D = 64, max_seqlen = 128;
  const DType dtype = DType::BF16;
  auto rounded = [dtype](const Tensor& x) { return x.to(dtype).to(DType::F32); };
  const Tensor q = rounded(randn({T, Hq, D}, seed)), k = rounded(randn({T, Hkv, D}, seed + 1)),
               v = rounded(randn({T, Hkv, D}, seed + 2));
  const Tensor q_d = to_device(q, dtype), k_d = to_device(k, dtype), v_d = to_device(v, dtype);
  Tensor cu_d = cu_seqlens_host(first).to(Device::CUDA);
  Tensor out_d = poisoned_device({T, Hq, D}, dtype), lse_d = poisoned_device({T, Hq}, DType::F32);
  // Warm up outside the capture: the cuDNN plan and the op's buffers are made here.
  ops::attention_varlen_forward(q_d, k_d, v_d, out_d, lse_d, cu_d, max_seqlen);
  cuda::synchronize();

  cuda::StepGraph graph;
  graph.capture("attention_varlen_forward", [&] {
    ops::attention_varlen_forward(q_d, k_d, v_d, out_d, lse_d, cu_d, max_seqlen);
  });
  ASSERT_TRUE(graph.captured());
  for (const auto& lengths : {first, second, first}) {
    cu_d.copy_from(cu_seqlens_host(lengths));
    graph.replay();
    cuda::synchronize();
    Tensor want = Tensor::empty({T, Hq, D}), want_lse = Tensor::empty({T, Hq});
    ops::attention_varlen_forward(q, k, v, want, want_lse, cu_seqlens_host(lengths), max_seqlen);
    EXPECT_LE(rel_error(to_host_f32(out_d), want), kOutRelTol);
    EXPECT_TRUE(allclose(to_host_f32(lse_d), want_lse, kLseAtol, kLseRtol));
  }
}

TEST(CudaAttentionVarlen, RejectsBadArguments) {
  MEGATON_SKIP_WITHOUT_GPU();
  const int64_t T = 16, H = 2, D = 64;
  const Tensor cu_d = cu_seqlens_host({6, 10}).to(Device::CUDA);
  const Tensor q = to_device(randn({T, H, D}, 1), DType::BF16);
  Tensor out = poisoned_device({T, H, D}, DType::BF16), lse = poisoned_device({T, H}, DType::F32);
  EXPECT_NO_THROW(ops::attention_varlen_forward(q, q, q, out, lse, cu_d, 10));
  // cu_seqlens on the host while q is on the GPU.
  EXPECT_THROW(ops::attention_varlen_forward(q, q, q, out, lse, cu_seqlens_host({6, 10}), 10),
               InternalError);
  // F32 is not a cuDNN fused-attention dtype.
  const Tensor q32 = to_device(randn({T, H, D}, 2), DType::F32);
  Tensor out32 = poisoned_device({T, H, D}, DType::F32);
  EXPECT_THROW(ops::attention_varlen_forward(q32, q32, q32, out32, lse, cu_d, 10), InternalError);
  // Head dims must be multiples of 8.
  const Tensor q12 = to_device(randn({T, H, 12}, 3), DType::BF16);
  Tensor out12 = poisoned_device({T, H, 12}, DType::BF16);
  EXPECT_THROW(ops::attention_varlen_forward(q12, q12, q12, out12, lse, cu_d, 10), InternalError);
  // The dense op's lse layout.
  Tensor dense_lse = poisoned_device({1, H, T}, DType::F32);
  EXPECT_THROW(ops::attention_varlen_forward(q, q, q, out, dense_lse, cu_d, 10), InternalError);
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
