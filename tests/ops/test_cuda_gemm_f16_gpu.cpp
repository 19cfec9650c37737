// F16 (--fp16) GEMMs on the GPU against the F32 CPU ops: cuBLASLt gemm (F16 x F16 -> F16,
// and -> F32 accumulated into a main grad), gemm_bias, and the grouped GEMMs of the MoE
// experts, which for F16 always take the CUDA-core tiled kernel (no CUTLASS instantiation),
// with host or device counts, including the weight gradient into fp32 main grads.
//
// Inputs are N(0, 1) rounded to F16, so the CPU sees exactly the GPU's values. F16 products
// are exact in fp32 (11 x 11 significant bits), so an F32 output differs from the CPU only
// by the summation order (whole-tensor 1e-5); an F16 output adds one rounding, 2^-11
// relative, checked as whole-tensor 1e-3: a BF16 computation (2^-8) would fail it.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::poison;
using testing::randn;
using testing::rel_error;
using testing::to_device;
using testing::to_host_f32;

constexpr double kF16WholeRel = 1e-3, kF32WholeRel = 1e-5;

// N(0, std) values F16 represents exactly, stored as F32.
Tensor f16_exact(const Shape& shape, uint64_t seed, float std = 1.0f) {
  return randn(shape, seed, std).to(DType::F16).to(DType::F32);
}

void expect_close(const Tensor& got, const Tensor& ref, DType c) {
  EXPECT_LE(rel_error(got, ref), c == DType::F16 ? kF16WholeRel : kF32WholeRel);
}

struct Dims {
  int64_t m, n, k;
};

void check_gemm(Dims d, DType c_dtype, float alpha, float beta, uint64_t seed) {
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      SCOPED_TRACE(fmt::format("m={} n={} k={} trans_a={} trans_b={} c {} alpha={} beta={}", d.m,
                               d.n, d.k, trans_a, trans_b, dtype_name(c_dtype), alpha, beta));
      Tensor a = f16_exact(trans_a ? Shape{d.k, d.m} : Shape{d.m, d.k}, seed);
      Tensor b = f16_exact(trans_b ? Shape{d.n, d.k} : Shape{d.k, d.n}, seed + 1);
      Tensor c0 = f16_exact({d.m, d.n}, seed + 2);
      Tensor ref = c0.clone();
      ops::gemm(a, trans_a, b, trans_b, ref, alpha, beta);
      Tensor dc = to_device(c0, c_dtype);
      if (beta == 0.0f) poison(dc);  // beta == 0 must not read c
      ops::gemm(to_device(a, DType::F16), trans_a, to_device(b, DType::F16), trans_b, dc, alpha,
                beta);
      expect_close(to_host_f32(dc), ref, c_dtype);
    }
  }
}

const std::vector<Dims> kShapes = {{17, 33, 65}, {1, 1, 1}, {3, 130, 7}, {64, 48, 128}};

TEST(CudaGemmF16, AllTransposesAlphaBeta) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  for (Dims d : kShapes) {
    check_gemm(d, DType::F16, 1.0f, 0.0f, seed);
    check_gemm(d, DType::F16, 0.75f, -0.5f, seed + 10);
  }
  // Large enough for tensor-core tiles and split-K choices.
  check_gemm({256, 384, 1024}, DType::F16, 1.0f, 0.0f, seed + 20);
}

// The weight-gradient GEMM: F16 activations and output grads into the fp32 main_grad.
TEST(CudaGemmF16, IntoF32MainGradAccumulates) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  for (Dims d : kShapes) {
    check_gemm(d, DType::F32, 1.0f, 1.0f, seed);
    check_gemm(d, DType::F32, 0.5f, 0.0f, seed + 10);
  }
  check_gemm({256, 384, 1024}, DType::F32, 1.0f, 1.0f, seed + 20);
}

// cuBLASLt's bias epilogue with F16 c: the fp32 result plus the bias, rounded at most twice
// (once fused, twice should cuBLASLt fall back to gemm then bias_add_), so within two F16
// ulps of the fp32 reference at the larger of the product's and the result's magnitude.
TEST(CudaGemmF16, BiasEpilogue) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  const int64_t m = 37, k = 64, n = 200;
  const Tensor x = f16_exact({m, k}, seed), w = f16_exact({n, k}, seed + 1, 0.05f);
  const Tensor b = f16_exact({n}, seed + 2);
  Tensor ref = Tensor::empty({m, n}), product = Tensor::empty({m, n});
  ops::gemm_bias(x, false, w, true, b, ref);
  ops::gemm(x, false, w, true, product);
  Tensor y = testing::poisoned_device({m, n}, DType::F16);
  ops::gemm_bias(to_device(x, DType::F16), false, to_device(w, DType::F16), true,
                 to_device(b, DType::F16), y);
  const Tensor got = to_host_f32(y);
  for (int64_t i = 0; i < m * n; ++i) {
    const float want = ref.f32()[i];
    const float scale = std::max(std::fabs(want), std::fabs(product.f32()[i])) + 1e-30f;
    const float ulp = std::ldexp(1.0f, std::ilogb(scale) - 10);
    ASSERT_LE(std::fabs(got.f32()[i] - want), 2.01f * ulp + 1e-5f) << "element " << i;
  }
  EXPECT_LE(rel_error(got, ref), kF16WholeRel);
}

TEST(CudaGemmF16, RejectsMixedDtypes) {
  MEGATON_SKIP_WITHOUT_GPU();
  Tensor a = Tensor::zeros({4, 6}, DType::F16, Device::CUDA);
  Tensor b = Tensor::zeros({6, 3}, DType::F16, Device::CUDA);
  Tensor b_bf16 = Tensor::zeros({6, 3}, DType::BF16, Device::CUDA);
  Tensor c = Tensor::zeros({4, 3}, DType::F16, Device::CUDA);
  Tensor c_bf16 = Tensor::zeros({4, 3}, DType::BF16, Device::CUDA);
  EXPECT_NO_THROW(ops::gemm(a, false, b, false, c));
  EXPECT_THROW(ops::gemm(a, false, b_bf16, false, c), InternalError);  // a, b differ
  EXPECT_THROW(ops::gemm(a, false, b, false, c_bf16), InternalError);  // F16 into BF16
  std::vector<Tensor> w = {b, b};
  Tensor rows = Tensor::zeros({4, 6}, DType::F16, Device::CUDA);
  EXPECT_THROW(ops::grouped_gemm(rows, w, false, c_bf16, {2, 2}, 0.0f), InternalError);
}

// ------------------------------------------------------------ grouped GEMMs (tiled kernel)

const std::vector<int64_t> kGroupRows = {5, 0, 17, 3};
// (64, 48): rows 16-byte aligned (BF16 would take CUTLASS; F16 takes the tiled kernel all
// the same); (33, 17): odd rows.
const std::vector<std::pair<int64_t, int64_t>> kGroupedShapes = {{64, 48}, {33, 17}};

void check_grouped_gemm(int64_t k, int64_t n, DType c_dtype, bool trans_b, float beta,
                        uint64_t seed, const std::vector<int64_t>& group_rows = kGroupRows) {
  SCOPED_TRACE(fmt::format("k={} n={} c {} trans_b={} beta={} groups {}", k, n, dtype_name(c_dtype),
                           trans_b, beta, fmt::join(group_rows, ",")));
  int64_t rows = 0;
  for (int64_t r : group_rows) rows += r;
  Tensor a = f16_exact({rows, k}, seed);
  std::vector<Tensor> b, db;
  for (size_t g = 0; g < group_rows.size(); ++g) {
    b.push_back(f16_exact(trans_b ? Shape{n, k} : Shape{k, n}, seed + 1 + g));
    db.push_back(to_device(b.back(), DType::F16));
  }
  Tensor c0 = f16_exact({rows, n}, seed + 9);
  Tensor ref = c0.clone();
  ops::grouped_gemm(a, b, trans_b, ref, group_rows, beta);
  Tensor dc = to_device(c0, c_dtype);
  if (beta == 0.0f) poison(dc);
  ops::grouped_gemm(to_device(a, DType::F16), db, trans_b, dc, group_rows, beta);
  expect_close(to_host_f32(dc), ref, c_dtype);
}

TEST(CudaGroupedGemmF16, ForwardAndInputGradientMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  for (DType c : {DType::F16, DType::F32})
    for (auto [k, n] : kGroupedShapes)
      for (bool trans_b : {false, true})
        for (float beta : {0.0f, 0.5f}) check_grouped_gemm(k, n, c, trans_b, beta, seed);
  // Several 64 x 64 tiles per group, partial edge tiles: the MoE shapes at a small scale.
  for (bool trans_b : {false, true})
    check_grouped_gemm(512, 392, DType::F16, trans_b, 0.0f, seed + 30, {200, 0, 513, 64, 1});
}

void check_grouped_wgrad(int64_t m, int64_t n, DType c_dtype, float beta,
                         const std::vector<int64_t>& group_rows, uint64_t seed) {
  SCOPED_TRACE(fmt::format("m={} n={} c {} beta={} groups {}", m, n, dtype_name(c_dtype), beta,
                           fmt::join(group_rows, ",")));
  int64_t rows = 0;
  for (int64_t r : group_rows) rows += r;
  Tensor a = f16_exact({rows, m}, seed), b = f16_exact({rows, n}, seed + 1);
  std::vector<Tensor> c0, ref, dc;
  for (size_t g = 0; g < group_rows.size(); ++g) {
    c0.push_back(f16_exact({m, n}, seed + 2 + g));
    ref.push_back(c0.back().clone());
    dc.push_back(to_device(c0.back(), c_dtype));
    if (beta == 0.0f) poison(dc.back());
  }
  ops::grouped_gemm_wgrad(a, b, ref, group_rows, beta);
  ops::grouped_gemm_wgrad(to_device(a, DType::F16), to_device(b, DType::F16), dc, group_rows, beta);
  for (size_t g = 0; g < group_rows.size(); ++g) {
    SCOPED_TRACE(fmt::format("group {} ({} rows)", g, group_rows[g]));
    Tensor got = to_host_f32(dc[g]);
    if (group_rows[g] == 0)  // beta * c: exact for these betas in either dtype
      EXPECT_TRUE(allclose(got, ref[g], 0, 0));
    else
      expect_close(got, ref[g], c_dtype);
  }
}

// The experts' weight gradient: F16 x F16 accumulated into the fp32 main_grad (beta 1), as
// the training step calls it, and the other betas and an F16 c.
TEST(CudaGroupedGemmF16, WeightGradientIntoMainGrad) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  for (auto [m, n] : kGroupedShapes) {
    for (float beta : {1.0f, 0.5f, 0.0f})
      check_grouped_wgrad(m, n, DType::F32, beta, kGroupRows, seed);
    check_grouped_wgrad(m, n, DType::F16, 1.0f, kGroupRows, seed + 5);
  }
  check_grouped_wgrad(392, 512, DType::F32, 1.0f, {200, 0, 513, 64, 1}, seed + 10);
}

Tensor device_counts(const std::vector<int64_t>& counts) {
  Tensor t = Tensor::empty({int64_t(counts.size())}, DType::I64);
  for (size_t g = 0; g < counts.size(); ++g) t.i64()[g] = counts[g];
  return t.to(Device::CUDA);
}

// The device-count forms (the one-GPU training step's): every count on the GPU, rows past
// the groups poisoned in the inputs (never read) and left as they were in the output.
TEST(CudaGroupedGemmF16, DeviceCountsMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  const std::vector<int64_t> counts = {0, 5, 0, 17, 3};
  const int64_t used = 25, rows = 32, k = 64, n = 48;
  Tensor a = f16_exact({rows, k}, seed), c0 = f16_exact({rows, n}, seed + 1);
  Tensor da = to_device(a, DType::F16);
  Tensor tail = da.rows(used, rows - used);
  poison(tail);
  for (bool trans_b : {true, false}) {
    SCOPED_TRACE(trans_b ? "fprop" : "dgrad");
    std::vector<Tensor> b, db;
    for (size_t g = 0; g < counts.size(); ++g) {
      b.push_back(f16_exact(trans_b ? Shape{n, k} : Shape{k, n}, seed + 2 + g));
      db.push_back(to_device(b.back(), DType::F16));
    }
    Tensor ref = c0.rows(0, used).clone();
    ops::grouped_gemm(a.rows(0, used), b, trans_b, ref, counts, 0.0f);
    Tensor dc = to_device(c0, DType::F16);
    Tensor head = dc.rows(0, used);
    poison(head);
    ops::grouped_gemm(da, db, trans_b, dc, device_counts(counts), 0.0f);
    expect_close(to_host_f32(dc.rows(0, used)), ref, DType::F16);
    EXPECT_TRUE(allclose(to_host_f32(dc.rows(used, rows - used)), c0.rows(used, rows - used), 0, 0))
        << "rows past the groups were written";
  }
  // wgrad into fp32 main grads: c[g] += a[rows_g]^T b[rows_g]; an empty group's c unchanged.
  const int64_t m = 40;
  Tensor wa = f16_exact({rows, m}, seed + 20), wb = f16_exact({rows, n}, seed + 21);
  Tensor dwa = to_device(wa, DType::F16), dwb = to_device(wb, DType::F16);
  Tensor wa_tail = dwa.rows(used, rows - used), wb_tail = dwb.rows(used, rows - used);
  poison(wa_tail);
  poison(wb_tail);
  std::vector<Tensor> ref, grads;
  for (size_t g = 0; g < counts.size(); ++g) {
    ref.push_back(randn({m, n}, seed + 30 + g));
    grads.push_back(ref.back().to(Device::CUDA));
  }
  ops::grouped_gemm_wgrad(wa.rows(0, used), wb.rows(0, used), ref, counts, 1.0f);
  ops::grouped_gemm_wgrad(dwa, dwb, grads, device_counts(counts));
  for (size_t g = 0; g < counts.size(); ++g) {
    SCOPED_TRACE(fmt::format("wgrad group {} ({} rows)", g, counts[g]));
    expect_close(to_host_f32(grads[g]), ref[g], DType::F32);
  }
}

}  // namespace
}  // namespace megaton

#else  // CPU-only build

TEST(CudaGemmF16, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
