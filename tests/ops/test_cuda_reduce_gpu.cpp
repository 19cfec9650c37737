// CUDA elementwise ops, reductions and AdamW (cast, add_, scale_, bias_add_,
// bias_backward, sum, sum_of_squares, adamw_step) against the CPU ops, in F32, BF16 and
// F16. Inputs are rounded to values BF16 and F16 hold exactly, so the F32 CPU op sees
// exactly what the GPU sees in any dtype.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/cuda/cuda_check.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::poison;
using testing::randn;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))
#define SKIP_WITHOUT_GPU() \
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device"

// CONVENTIONS.md: CUDA fp32, bf16 and fp16 elementwise tolerances.
constexpr double kF32Atol = 1e-5, kF32Rtol = 1e-4;
constexpr double kBF16Atol = 1e-5, kBF16Rtol = 1e-2;
constexpr double kF16Atol = 1e-5, kF16Rtol = 1e-3;

// N(0, 1) values BF16 and F16 both hold exactly (BF16-rounded, then F16-rounded: only
// values below F16's normal range change).
Tensor bf16_exact(const Shape& shape, uint64_t seed) {
  return randn(shape, seed).to(DType::BF16).to(DType::F16).to(DType::F32);
}
Tensor on_gpu(const Tensor& host, DType dtype) { return host.to(dtype).to(Device::CUDA); }
Tensor on_host(const Tensor& device) { return device.to(Device::CPU).to(DType::F32); }
std::string name(DType d) { return std::string(dtype_name(d)); }

// Elementwise check of an output of dtype `out` (no long sums involved).
::testing::AssertionResult close_for(DType out, const Tensor& got, const Tensor& ref) {
  if (out == DType::BF16) return allclose(got, ref, kBF16Atol, kBF16Rtol);
  if (out == DType::F16) return allclose(got, ref, kF16Atol, kF16Rtol);
  return allclose(got, ref, kF32Atol, kF32Rtol);
}

const std::vector<DType> kFloatTypes = {DType::F32, DType::BF16, DType::F16};

// --------------------------------------------------------------------------------- cast

// Bit-exact against the CPU's round-to-nearest-even, ties included.
TEST(CudaCast, MatchesCpuRoundingExactly) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor x = randn({1000003}, seed, 3.0f);  // not BF16-exact: the rounding is what is tested
  // Exact ties (low 16 bits 0x8000), one with an even and one with an odd BF16 mantissa,
  // and values just either side of a tie.
  const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0xbf818000u, 0x3f817fffu, 0x3f818001u};
  for (int i = 0; i < 5; ++i) x.f32()[i] = std::bit_cast<float>(special[i]);
  for (DType src : kFloatTypes) {
    for (DType dst : kFloatTypes) {
      SCOPED_TRACE(name(src) + " -> " + name(dst));
      Tensor ref = x.to(src).to(dst);
      Tensor out = Tensor::empty(x.shape(), dst, Device::CUDA);
      poison(out);
      ops::cast(on_gpu(x, src), out);
      EXPECT_TRUE(allclose(on_host(out), ref.to(DType::F32), 0, 0));
    }
  }
}

// -------------------------------------------------------------------- add_ and scale_

TEST(CudaAdd, AllDtypeCombinations) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (int64_t n : {1, 1001, 65536}) {
    Tensor y = bf16_exact({n}, seed), x = bf16_exact({n}, seed + 1);
    Tensor ref = y.clone();
    ops::add_(ref, x, -0.75f);
    for (DType ydt : kFloatTypes) {
      for (DType xdt : kFloatTypes) {
        SCOPED_TRACE(fmt::format("n={} y {} x {}", n, name(ydt), name(xdt)));
        Tensor dy = on_gpu(y, ydt);
        ops::add_(dy, on_gpu(x, xdt), -0.75f);
        EXPECT_TRUE(close_for(ydt, on_host(dy), ref));
      }
    }
  }
}

TEST(CudaScale, F32BF16AndF16) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor x = bf16_exact({3, 1001}, seed);
  Tensor ref = x.clone();
  ops::scale_(ref, 0.3f);
  for (DType dt : kFloatTypes) {
    SCOPED_TRACE(name(dt));
    Tensor dx = on_gpu(x, dt);
    ops::scale_(dx, 0.3f);
    EXPECT_TRUE(close_for(dt, on_host(dx), ref));
  }
}

// ------------------------------------------------------------------------------- bias

TEST(CudaBiasAdd, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (Shape shape : {Shape{37, 65}, Shape{2, 5, 33}, Shape{1, 1}}) {
    Tensor y = bf16_exact(shape, seed), bias = bf16_exact({shape.back()}, seed + 1);
    Tensor ref = y.clone();
    ops::bias_add_(ref, bias);
    for (DType ydt : kFloatTypes) {
      for (DType bdt : kFloatTypes) {
        SCOPED_TRACE(fmt::format("y {} {} bias {}", shape_str(shape), name(ydt), name(bdt)));
        Tensor dy = on_gpu(y, ydt);
        ops::bias_add_(dy, on_gpu(bias, bdt));
        EXPECT_TRUE(close_for(ydt, on_host(dy), ref));
      }
    }
  }
}

// dbias accumulates in F32 from F32, BF16 or F16 dy; the sums are fp64 on both sides.
TEST(CudaBiasBackward, AccumulatesMatchingCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // (rows, cols): one row; few rows; one row slice; many slices (70000 rows -> 128).
  for (auto [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 37}, {1000, 130}, {70000, 3}}) {
    Tensor dy = bf16_exact({rows, cols}, seed), dbias0 = bf16_exact({cols}, seed + 1);
    Tensor ref = dbias0.clone();
    ops::bias_backward(dy, ref);
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(fmt::format("dy [{}, {}] {}", rows, cols, name(dt)));
      Tensor dbias = on_gpu(dbias0, DType::F32);
      ops::bias_backward(on_gpu(dy, dt), dbias);
      EXPECT_TRUE(allclose(on_host(dbias), ref, kF32Atol, kF32Rtol));
    }
  }
}

TEST(CudaBiasBackward, RejectsBF16Dbias) {
  SKIP_WITHOUT_GPU();
  Tensor dy = Tensor::zeros({4, 3}, DType::BF16, Device::CUDA);
  Tensor dbias = Tensor::zeros({3}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::bias_backward(dy, dbias), InternalError);
}

// ------------------------------------------------------------------- sum, sum_of_squares

// Both sides sum in fp64, in different orders: they agree to ~n * 1e-16 of sum |x|.
TEST(CudaSum, SumAndSumOfSquaresMatchCpuAndRepeat) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (int64_t n : {1, 7, 256, 1000, 4097, 262145, 1000000}) {
    Tensor x = bf16_exact({n}, seed + n);
    double abs_sum = 0;
    for (int64_t i = 0; i < n; ++i) abs_sum += std::fabs(x.f32()[i]);
    const double ref_sum = ops::sum(x), ref_squares = ops::sum_of_squares(x);
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(fmt::format("n={} {}", n, name(dt)));
      Tensor dx = on_gpu(x, dt);
      const double got_sum = ops::sum(dx), got_squares = ops::sum_of_squares(dx);
      EXPECT_NEAR(got_sum, ref_sum, 1e-12 * abs_sum + 1e-12);
      EXPECT_NEAR(got_squares, ref_squares, 1e-12 * ref_squares + 1e-12);
      // Deterministic: the same bits again.
      EXPECT_EQ(std::bit_cast<uint64_t>(ops::sum(dx)), std::bit_cast<uint64_t>(got_sum));
      EXPECT_EQ(std::bit_cast<uint64_t>(ops::sum_of_squares(dx)),
                std::bit_cast<uint64_t>(got_squares));
    }
  }
  Tensor empty = Tensor::empty({0}, DType::F32, Device::CUDA);
  EXPECT_EQ(ops::sum(empty), 0.0);
  EXPECT_EQ(ops::sum_of_squares(empty), 0.0);
}

// -------------------------------------------------------------------------------- AdamW

// Three steps with fresh gradients against the CPU (fp64 arithmetic there, fp32 here).
// n = 4096 takes the float4 path, 1000003 the float4 path and a scalar tail, and views
// offset by one element (4 bytes) the scalar path.
TEST(CudaAdamW, ThreeStepsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  for (int64_t n : {1, 4096, 1000003}) {
    for (bool offset_view : {false, true}) {
      SCOPED_TRACE(fmt::format("n={} offset_view={}", n, offset_view));
      Tensor p = randn({n}, seed);
      Tensor m = Tensor::zeros({n}), v = Tensor::zeros({n});
      // Device buffers one element longer; the op runs on [1, n + 1) when offset_view.
      const int64_t first = offset_view ? 1 : 0;
      Tensor dp_full = Tensor::zeros({n + 1}, DType::F32, Device::CUDA);
      Tensor dm_full = Tensor::zeros({n + 1}, DType::F32, Device::CUDA);
      Tensor dv_full = Tensor::zeros({n + 1}, DType::F32, Device::CUDA);
      Tensor dg_full = Tensor::zeros({n + 1}, DType::F32, Device::CUDA);
      Tensor dp = dp_full.rows(first, n), dm = dm_full.rows(first, n);
      Tensor dv = dv_full.rows(first, n), dg = dg_full.rows(first, n);
      dp.copy_from(p);
      for (int64_t step = 1; step <= 3; ++step) {
        Tensor g = randn({n}, seed + 100 * step, 0.1f);
        dg.copy_from(g);
        ops::adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step);
        ops::adamw_step(dp, dg, dm, dv, lr, beta1, beta2, eps, weight_decay, step);
      }
      EXPECT_TRUE(allclose(on_host(dp), p, kF32Atol, kF32Rtol));
      EXPECT_TRUE(allclose(on_host(dm), m, kF32Atol, kF32Rtol));
      EXPECT_TRUE(allclose(on_host(dv), v, kF32Atol, kF32Rtol));
    }
  }
}

}  // namespace
}  // namespace megaton

#else  // CPU-only build

TEST(CudaReduce, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
