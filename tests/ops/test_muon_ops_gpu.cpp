// Muon's ops (ops/muon.h) on the GPU against the CPU reference: Newton-Schulz in F32 and
// BF16 on tall, wide, square and batched matrices (the tall ones exercise the transposed
// GEMM flags), in place, the momentum EMA and the QKV split.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "common/testing.h"
#include "ops/muon.h"

namespace megaton {
namespace {

using ops::NsCoefficients;
using testing::randn;
using testing::to_host_f32;

// The CPU op iterates in fp64; the GPU in fp32 GEMMs (rounding each product, as EO does in
// fp32: test_muon_golden holds EO within 2e-5 of the CPU op on random inputs) or in bf16
// (Megatron's default --muon-fp32-matmul-prec medium: every iterate rounded to bf16). On an
// H200 (2026-11-28) the cases below measured ||gpu - cpu|| / ||cpu|| <= 3.3e-6 in F32 and
// <= 1.9e-2 in BF16 (cans at 6 steps; quintic 5 steps 5e-3 to 9e-3).
constexpr double kF32RelTol = 2e-5, kBf16RelTol = 3e-2;

struct NsCase {
  Shape shape;
  NsCoefficients set;
  int steps;
};
const NsCase kCases[] = {
    {{96, 40}, NsCoefficients::Quintic, 5},   {{40, 96}, NsCoefficients::Quintic, 5},
    {{64, 64}, NsCoefficients::Quintic, 5},   {{96, 40}, NsCoefficients::PolarExpress, 8},
    {{40, 96}, NsCoefficients::Aol, 4},       {{3, 24, 40}, NsCoefficients::Quintic, 5},
    {{2, 40, 24}, NsCoefficients::Cans, 6},   {{256, 1024}, NsCoefficients::Quintic, 5},
    {{1024, 256}, NsCoefficients::Simple, 5},
};

std::string describe(const NsCase& c) {
  return shape_str(c.shape) + " " + ops::ns_coefficients_name(c.set) + " " +
         std::to_string(c.steps) + " steps";
}

TEST(MuonOpsGpu, NewtonSchulzMatchesTheCpuReference) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  for (const NsCase& c : kCases)
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(describe(c) + " " + std::string(dtype_name(dtype)));
      // The CPU sees exactly the values the GPU gets.
      const Tensor g = randn(c.shape, seed + uint64_t(c.steps)).to(dtype).to(DType::F32);
      Tensor want = Tensor::empty(c.shape);
      ops::newton_schulz(g, want, c.set, c.steps);
      const Tensor g_dev = testing::to_device(g, dtype);
      Tensor out = testing::poisoned_device(c.shape, dtype);
      ops::newton_schulz(g_dev, out, c.set, c.steps);
      const Tensor got = to_host_f32(out);
      ASSERT_TRUE(testing::all_finite(got, "out"));
      const double rel = testing::rel_error(got, want);
      std::printf("  %-36s %-4s ||gpu - cpu|| / ||cpu|| = %.2e\n", describe(c).c_str(),
                  std::string(dtype_name(dtype)).c_str(), rel);
      EXPECT_LE(rel, dtype == DType::F32 ? kF32RelTol : kBf16RelTol);
      // In place: the same bits.
      Tensor in_place = testing::to_device(g, dtype);
      ops::newton_schulz(in_place, in_place, c.set, c.steps);
      EXPECT_TRUE(testing::bitwise_equal(to_host_f32(in_place), got));
    }
}

TEST(MuonOpsGpu, NewtonSchulzZeroAndErrors) {
  MEGATON_SKIP_WITHOUT_GPU();
  Tensor zero = Tensor::zeros({8, 12}).to(Device::CUDA);
  Tensor out = testing::poisoned_device({8, 12}, DType::F32);
  ops::newton_schulz(zero, out, NsCoefficients::Quintic, 5);
  EXPECT_TRUE(testing::allclose(to_host_f32(out), Tensor::zeros({8, 12}), 0, 0));
  Tensor f16 = testing::to_device(randn({8, 12}, 1), DType::F16);
  Tensor f16_out = testing::poisoned_device({8, 12}, DType::F16);
  EXPECT_THROW(ops::newton_schulz(f16, f16_out, NsCoefficients::Quintic, 5), InternalError);
  Tensor bf16_out = testing::poisoned_device({8, 12}, DType::BF16);
  EXPECT_THROW(ops::newton_schulz(zero, bf16_out, NsCoefficients::Quintic, 5), InternalError);
}

TEST(MuonOpsGpu, MomentumMatchesTheCpuReference) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1;
  SCOPED_TRACE(testing::seed_trace(seed));
  for (bool nesterov : {false, true}) {
    Tensor m = randn({33, 65}, seed), g = randn({33, 65}, seed + 1);
    Tensor m_dev = m.to(Device::CUDA), g_dev = g.to(Device::CUDA);
    Tensor u = Tensor::empty(m.shape()), u_dev = testing::poisoned_device(m.shape(), DType::F32);
    for (int step = 0; step < 3; ++step) {
      ops::muon_momentum_update(m, g, 0.9f, nesterov, u);
      ops::muon_momentum_update(m_dev, g_dev, 0.9f, nesterov, u_dev);
    }
    // fp32 torch-style lerp on the GPU, fp64 on the CPU: a few fp32 ulps apart.
    EXPECT_TRUE(testing::allclose(to_host_f32(m_dev), m, 1e-6, 1e-5));
    EXPECT_TRUE(testing::allclose(to_host_f32(u_dev), u, 1e-6, 1e-5));
  }
}

TEST(MuonOpsGpu, QkvSplitAndJoin) {
  MEGATON_SKIP_WITHOUT_GPU();
  const std::vector<int64_t> shapes = ops::qkv_split_shapes(8, 2, 4, true);
  const Tensor u = randn({2 * 40, 6}, testing::test_seed() + 2);
  const std::vector<Tensor> want = ops::split_qkv_update(u, shapes);
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor u_dev = testing::to_device(u, dtype);
    const std::vector<Tensor> pieces = ops::split_qkv_update(u_dev, shapes);
    ASSERT_EQ(pieces.size(), want.size());
    for (size_t i = 0; i < pieces.size(); ++i)
      EXPECT_TRUE(testing::bitwise_equal(to_host_f32(pieces[i]), want[i].to(dtype).to(DType::F32)));
    Tensor joined = testing::poisoned_device(u.shape(), dtype);
    ops::join_qkv_update(pieces, shapes, joined);
    EXPECT_TRUE(testing::bitwise_equal(to_host_f32(joined), u.to(dtype).to(DType::F32)));
  }
}

}  // namespace
}  // namespace megaton
#endif  // MEGATON_WITH_CUDA
