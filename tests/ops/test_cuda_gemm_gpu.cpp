// CUDA GEMM ops (cuBLASLt gemm, grouped_gemm, grouped_gemm_wgrad, the latter two with host
// or device counts) against the CPU ops.
// Inputs are rounded to BF16 first, so the F32 CPU op sees exactly the values the GPU
// sees in either dtype; outputs the GPU overwrites are poisoned with NaN first.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "core/cuda/cuda_check.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::poison;
using testing::randn;
using testing::rel_error;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))
#define SKIP_WITHOUT_GPU() \
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device"

// N(0, 1) values that BF16 represents exactly, stored as F32.
Tensor bf16_exact(const Shape& shape, uint64_t seed) {
  return randn(shape, seed).to(DType::BF16).to(DType::F32);
}

// The GPU copy, in `dtype`, of a host F32 tensor.
Tensor on_gpu(const Tensor& host, DType dtype) { return host.to(dtype).to(Device::CUDA); }

// A GPU tensor back on the host as F32.
Tensor on_host(const Tensor& device) { return device.to(Device::CPU).to(DType::F32); }

std::string name(DType d) { return std::string(dtype_name(d)); }

// CONVENTIONS.md tolerances for a GEMM output against the F32 CPU reference:
// BF16 output: whole-tensor rel error 1e-2 (one rounding per element after an fp32 sum).
// F32 output from BF16 inputs: the products are exact in fp32, only the summation order
// differs: whole-tensor 1e-5. F32 from F32: CUDA fp32 elementwise 1e-5/1e-4 for short
// sums (k <= 65), whole-tensor 1e-5 for longer ones (near-zero outputs of long sums
// carry ~sqrt(k) * eps * |partial sums| of order-dependent rounding).
void expect_gemm_close(const Tensor& got, const Tensor& ref, DType ab, DType c, int64_t k) {
  if (c == DType::BF16) {
    EXPECT_LE(rel_error(got, ref), 1e-2);
  } else if (ab == DType::BF16 || k > 65) {
    EXPECT_LE(rel_error(got, ref), 1e-5);
  } else {
    EXPECT_TRUE(allclose(got, ref, 1e-5, 1e-4));
  }
}

struct Dims {
  int64_t m, n, k;
};

// One ops::gemm on the GPU against the CPU, every transpose combination.
void check_gemm(Dims d, DType ab, DType c_dtype, float alpha, float beta, uint64_t seed) {
  for (bool trans_a : {false, true}) {
    for (bool trans_b : {false, true}) {
      SCOPED_TRACE(
          fmt::format("m={} n={} k={} trans_a={} trans_b={} a/b {} c {} alpha={} "
                      "beta={}",
                      d.m, d.n, d.k, trans_a, trans_b, name(ab), name(c_dtype), alpha, beta));
      Tensor a = bf16_exact(trans_a ? Shape{d.k, d.m} : Shape{d.m, d.k}, seed);
      Tensor b = bf16_exact(trans_b ? Shape{d.n, d.k} : Shape{d.k, d.n}, seed + 1);
      Tensor c0 = bf16_exact({d.m, d.n}, seed + 2);
      Tensor ref = c0.clone();
      ops::gemm(a, trans_a, b, trans_b, ref, alpha, beta);

      Tensor dc = on_gpu(c0, c_dtype);
      if (beta == 0.0f) poison(dc);  // beta == 0 must not read c
      ops::gemm(on_gpu(a, ab), trans_a, on_gpu(b, ab), trans_b, dc, alpha, beta);
      expect_gemm_close(on_host(dc), ref, ab, c_dtype, d.k);
    }
  }
}

const std::vector<Dims> kShapes = {{17, 33, 65}, {1, 1, 1}, {3, 130, 7}, {64, 48, 128}};

TEST(CudaGemm, F32AllTransposesAlphaBeta) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (Dims d : kShapes) {
    check_gemm(d, DType::F32, DType::F32, 1.0f, 0.0f, seed);
    check_gemm(d, DType::F32, DType::F32, 0.75f, -0.5f, seed + 10);
  }
}

TEST(CudaGemm, BF16AllTransposesAlphaBeta) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (Dims d : kShapes) {
    check_gemm(d, DType::BF16, DType::BF16, 1.0f, 0.0f, seed);
    check_gemm(d, DType::BF16, DType::BF16, 0.75f, -0.5f, seed + 10);
  }
  // Large enough for tensor-core tiles and split-K choices.
  check_gemm({256, 384, 1024}, DType::BF16, DType::BF16, 1.0f, 0.0f, seed + 20);
}

// The weight-gradient GEMM: BF16 activations and output grads into fp32 main_grad.
TEST(CudaGemm, BF16IntoF32Accumulates) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (Dims d : kShapes) {
    check_gemm(d, DType::BF16, DType::F32, 1.0f, 1.0f, seed);
    check_gemm(d, DType::BF16, DType::F32, 0.5f, 0.0f, seed + 10);
  }
  check_gemm({256, 384, 1024}, DType::BF16, DType::F32, 1.0f, 1.0f, seed + 20);
}

TEST(CudaGemm, MergesLeadingDimensions) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (DType ab : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(name(ab));
    // x [2, 3, 16] @ w^T, w [8, 16] -> y [2, 3, 8] (a linear layer's forward).
    Tensor x = bf16_exact({2, 3, 16}, seed), w = bf16_exact({8, 16}, seed + 1);
    Tensor ref = Tensor::empty({2, 3, 8});
    ops::gemm(x, false, w, true, ref);
    Tensor y = Tensor::empty({2, 3, 8}, ab, Device::CUDA);
    poison(y);
    ops::gemm(on_gpu(x, ab), false, on_gpu(w, ab), true, y);
    expect_gemm_close(on_host(y), ref, ab, ab, 16);

    // dw [8, 16] = dy^T [8, 6] @ x [6, 16] with dy [2, 3, 8]: the wgrad of the same layer.
    Tensor dy = bf16_exact({2, 3, 8}, seed + 2);
    Tensor dw_ref = Tensor::empty({8, 16});
    ops::gemm(dy, true, x, false, dw_ref);
    Tensor dw = Tensor::empty({8, 16}, DType::F32, Device::CUDA);
    poison(dw);
    ops::gemm(on_gpu(dy, ab), true, on_gpu(x, ab), false, dw);
    expect_gemm_close(on_host(dw), dw_ref, ab, DType::F32, 6);
  }
}

// Views that start off the 256-byte allocation boundary (rows of a bigger tensor): the
// algorithm must be chosen for the pointers' real alignment.
TEST(CudaGemm, UnalignedRowViews) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const int64_t m = 9, n = 11, k = 13;  // odd: a BF16 row of a is 26 bytes
  for (DType ab : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(name(ab));
    Tensor a_full = bf16_exact({m + 1, k}, seed), b = bf16_exact({k, n}, seed + 1);
    Tensor c_full = bf16_exact({m + 1, n}, seed + 2);
    Tensor ref = c_full.rows(1, m).clone();
    ops::gemm(a_full.rows(1, m), false, b, false, ref, 1.0f, 0.5f);

    Tensor da_full = on_gpu(a_full, ab), dc_full = on_gpu(c_full, ab);
    Tensor dc = dc_full.rows(1, m);
    ops::gemm(da_full.rows(1, m), false, on_gpu(b, ab), false, dc, 1.0f, 0.5f);
    expect_gemm_close(on_host(dc), ref, ab, ab, k);
    // The row outside the view is untouched.
    EXPECT_TRUE(
        allclose(on_host(dc_full.rows(0, 1)), c_full.rows(0, 1).to(ab).to(DType::F32), 0, 0));
  }
}

// The cached plan for a shape is reused with new pointers and values.
TEST(CudaGemm, RepeatedShapeReadsNewOperands) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    Tensor a = bf16_exact({20, 24}, seed + 10 * round),
           b = bf16_exact({24, 16}, seed + 10 * round + 1);
    Tensor ref = Tensor::empty({20, 16});
    ops::gemm(a, false, b, false, ref);
    Tensor c = Tensor::empty({20, 16}, DType::BF16, Device::CUDA);
    poison(c);
    ops::gemm(on_gpu(a, DType::BF16), false, on_gpu(b, DType::BF16), false, c);
    expect_gemm_close(on_host(c), ref, DType::BF16, DType::BF16, 24);
  }
}

// k == 0: op(a) @ op(b) is zero, so c = beta * c.
TEST(CudaGemm, EmptyInnerDimension) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor c0 = bf16_exact({4, 5}, seed);
  Tensor a = Tensor::empty({4, 0}, DType::BF16, Device::CUDA);
  Tensor b = Tensor::empty({0, 5}, DType::BF16, Device::CUDA);
  Tensor c = on_gpu(c0, DType::F32);
  poison(c);
  ops::gemm(a, false, b, false, c, 1.0f, 0.0f);
  EXPECT_TRUE(allclose(on_host(c), Tensor::zeros({4, 5}), 0, 0));
  c = on_gpu(c0, DType::F32);
  ops::gemm(a, false, b, false, c, 1.0f, 2.0f);
  Tensor doubled = c0.clone();
  for (int64_t i = 0; i < doubled.numel(); ++i) doubled.f32()[i] *= 2.0f;
  EXPECT_TRUE(allclose(on_host(c), doubled, 0, 0));
}

TEST(CudaGemm, RejectsBadShapesAndDtypes) {
  SKIP_WITHOUT_GPU();
  Tensor a = Tensor::zeros({4, 6}, DType::BF16, Device::CUDA);
  Tensor b = Tensor::zeros({5, 3}, DType::BF16, Device::CUDA);
  Tensor c = Tensor::zeros({4, 3}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::gemm(a, false, b, false, c), InternalError);  // k: 6 vs 5
  Tensor a32 = Tensor::zeros({4, 5}, DType::F32, Device::CUDA);
  Tensor b32 = Tensor::zeros({5, 3}, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::gemm(a32, false, b32, false, c), InternalError);  // F32 into BF16
  Tensor a16 = Tensor::zeros({4, 5}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::gemm(a16, false, b32, false, c), InternalError);  // mixed a/b
  Tensor c_host = Tensor::zeros({4, 3});
  EXPECT_THROW(ops::gemm(a32, false, b32, false, c_host), InternalError);
}

// ------------------------------------------------------------------------- grouped_gemm

const std::vector<int64_t> kGroupRows = {5, 0, 17, 3};
// (64, 48): every group's rows are 16-byte aligned, so BF16 cases of the three expert
// layouts take the CUTLASS Hopper kernel; (33, 17): odd rows, so the CUDA-core fallback.
const std::vector<std::pair<int64_t, int64_t>> kGroupedShapes = {{64, 48}, {33, 17}};

// Whole-output checks for the grouped ops: the GEMM tolerances, per output.
void check_grouped_gemm(int64_t k, int64_t n, DType ab, DType c_dtype, bool trans_b, float beta,
                        uint64_t seed, const std::vector<int64_t>& group_rows = kGroupRows) {
  SCOPED_TRACE(fmt::format("k={} n={} a/b {} c {} trans_b={} beta={} groups {}", k, n, name(ab),
                           name(c_dtype), trans_b, beta, fmt::join(group_rows, ",")));
  int64_t rows = 0;
  for (int64_t r : group_rows) rows += r;
  Tensor a = bf16_exact({rows, k}, seed);
  std::vector<Tensor> b, db;
  for (size_t g = 0; g < group_rows.size(); ++g) {
    b.push_back(bf16_exact(trans_b ? Shape{n, k} : Shape{k, n}, seed + 1 + g));
    db.push_back(on_gpu(b.back(), ab));
  }
  Tensor c0 = bf16_exact({rows, n}, seed + 9);
  Tensor ref = c0.clone();
  ops::grouped_gemm(a, b, trans_b, ref, group_rows, beta);

  Tensor dc = on_gpu(c0, c_dtype);
  if (beta == 0.0f) poison(dc);
  ops::grouped_gemm(on_gpu(a, ab), db, trans_b, dc, group_rows, beta);
  expect_gemm_close(on_host(dc), ref, ab, c_dtype, k);
}

TEST(CudaGroupedGemm, MatchesCpuAllPaths) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  struct Types {
    DType ab, c;
  };
  for (Types t : {Types{DType::F32, DType::F32}, Types{DType::BF16, DType::BF16},
                  Types{DType::BF16, DType::F32}})
    for (auto [k, n] : kGroupedShapes)
      for (bool trans_b : {false, true})
        for (float beta : {0.0f, 0.5f}) check_grouped_gemm(k, n, t.ab, t.c, trans_b, beta, seed);
}

// Several CUTLASS tiles per group (128 x 256 x 64), partial edge tiles, and row counts that
// are not multiples of anything: the MoE shapes at a small scale.
TEST(CudaGroupedGemm, ManyTilesPerGroup) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<int64_t> group_rows = {200, 0, 513, 64, 1};
  for (bool trans_b : {false, true})
    check_grouped_gemm(512, 392, DType::BF16, DType::BF16, trans_b, 0.0f, seed, group_rows);
}

TEST(CudaGroupedGemm, EmptyGroupsAndEmptyInnerDimension) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // Every group empty: nothing to do, no error.
  std::vector<Tensor> b = {Tensor::zeros({8, 16}, DType::BF16, Device::CUDA),
                           Tensor::zeros({8, 16}, DType::BF16, Device::CUDA)};
  Tensor a = Tensor::empty({0, 8}, DType::BF16, Device::CUDA);
  Tensor c = Tensor::empty({0, 16}, DType::BF16, Device::CUDA);
  ops::grouped_gemm(a, b, false, c, {0, 0}, 0.0f);

  // k == 0: c = beta * c.
  std::vector<Tensor> b0 = {Tensor::empty({0, 4}, DType::F32, Device::CUDA),
                            Tensor::empty({0, 4}, DType::F32, Device::CUDA)};
  Tensor a0 = Tensor::empty({5, 0}, DType::F32, Device::CUDA);
  Tensor c0 = bf16_exact({5, 4}, seed);
  Tensor dc = on_gpu(c0, DType::F32);
  poison(dc);
  ops::grouped_gemm(a0, b0, false, dc, {2, 3}, 0.0f);
  EXPECT_TRUE(allclose(on_host(dc), Tensor::zeros({5, 4}), 0, 0));
}

TEST(CudaGroupedGemm, RejectsBadShapes) {
  SKIP_WITHOUT_GPU();
  Tensor a = Tensor::zeros({8, 4}, DType::BF16, Device::CUDA);
  Tensor c = Tensor::zeros({8, 6}, DType::BF16, Device::CUDA);
  std::vector<Tensor> b = {Tensor::zeros({4, 6}, DType::BF16, Device::CUDA),
                           Tensor::zeros({4, 6}, DType::BF16, Device::CUDA)};
  EXPECT_THROW(ops::grouped_gemm(a, b, false, c, {3, 4}, 0.0f), InternalError);  // 7 rows
  EXPECT_THROW(ops::grouped_gemm(a, b, true, c, {3, 5}, 0.0f), InternalError);   // b shape
  EXPECT_THROW(ops::grouped_gemm(a, b, false, c, {8}, 0.0f), InternalError);     // groups
}

// --------------------------------------------------------------------- grouped_gemm_wgrad

void check_grouped_wgrad(int64_t m, int64_t n, DType ab, DType c_dtype, float beta,
                         const std::vector<int64_t>& group_rows, uint64_t seed) {
  SCOPED_TRACE(fmt::format("m={} n={} a/b {} c {} beta={} groups {}", m, n, name(ab), name(c_dtype),
                           beta, fmt::join(group_rows, ",")));
  int64_t rows = 0;
  for (int64_t r : group_rows) rows += r;
  Tensor a = bf16_exact({rows, m}, seed), b = bf16_exact({rows, n}, seed + 1);
  std::vector<Tensor> c0, ref, dc;
  for (size_t g = 0; g < group_rows.size(); ++g) {
    c0.push_back(bf16_exact({m, n}, seed + 2 + g));
    ref.push_back(c0.back().clone());
    dc.push_back(on_gpu(c0.back(), c_dtype));
    if (beta == 0.0f) poison(dc.back());
  }
  ops::grouped_gemm_wgrad(a, b, ref, group_rows, beta);
  ops::grouped_gemm_wgrad(on_gpu(a, ab), on_gpu(b, ab), dc, group_rows, beta);
  for (size_t g = 0; g < group_rows.size(); ++g) {
    SCOPED_TRACE(fmt::format("group {} ({} rows)", g, group_rows[g]));
    Tensor got = on_host(dc[g]);
    if (group_rows[g] == 0) {
      // beta * c, element by element (beta == 1 leaves c as it was, bit for bit).
      EXPECT_TRUE(allclose(got, ref[g], 0, c_dtype == DType::BF16 ? 1e-2 : 0));
    } else {
      expect_gemm_close(got, ref[g], ab, c_dtype, group_rows[g]);
    }
  }
}

TEST(CudaGroupedGemmWgrad, MatchesCpuAllPaths) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  struct Types {
    DType ab, c;
  };
  for (Types t : {Types{DType::BF16, DType::F32}, Types{DType::F32, DType::F32},
                  Types{DType::BF16, DType::BF16}})
    for (auto [m, n] : kGroupedShapes)
      for (float beta : {1.0f, 0.5f, 0.0f})
        check_grouped_wgrad(m, n, t.ab, t.c, beta, kGroupRows, seed);
}

TEST(CudaGroupedGemmWgrad, ManyTilesPerGroup) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  check_grouped_wgrad(392, 512, DType::BF16, DType::F32, 1.0f, {200, 0, 513, 64, 1}, seed);
}

TEST(CudaGroupedGemmWgrad, AllGroupsEmpty) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (float beta : {1.0f, 0.5f, 0.0f})
    check_grouped_wgrad(16, 8, DType::BF16, DType::F32, beta, {0, 0, 0}, seed);
}

TEST(CudaGroupedGemmWgrad, RejectsBadShapes) {
  SKIP_WITHOUT_GPU();
  Tensor a = Tensor::zeros({8, 4}, DType::BF16, Device::CUDA);
  Tensor b = Tensor::zeros({8, 6}, DType::BF16, Device::CUDA);
  std::vector<Tensor> c = {Tensor::zeros({4, 6}, DType::F32, Device::CUDA),
                           Tensor::zeros({6, 4}, DType::F32, Device::CUDA)};
  EXPECT_THROW(ops::grouped_gemm_wgrad(a, b, c, {3, 5}, 1.0f), InternalError);  // c[1] shape
  c[1] = Tensor::zeros({4, 6}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::grouped_gemm_wgrad(a, b, c, {3, 5}, 1.0f), InternalError);  // mixed c
}

// ---------------------------------------------- grouped GEMMs with the counts on the GPU
//
// ops::grouped_gemm / grouped_gemm_wgrad with `const Tensor& group_rows` on the device.
// Against the host-count GPU op over the first sum(cut counts) rows, bit for bit: both
// forms run the same kernel (CUTLASS's grouped GEMM, or the CUDA-core fallback, chosen by
// the same dtype and alignment rules) on the same groups; each output tile is computed by
// one CTA with the same k order in either (no split-K in either kernel), so only the grid
// and the scheduling differ, not the arithmetic. Against the CPU op within the GEMM
// tolerances. Rows past the groups are poisoned in the inputs (never read) and hold
// sentinel values in the output (never written).

// The counts as the ops take them on the GPU: negative as 0, each cut at the rows left of R.
std::vector<int64_t> cut_at(const std::vector<int64_t>& counts, int64_t rows) {
  std::vector<int64_t> cut;
  int64_t start = 0;
  for (int64_t n : counts) {
    cut.push_back(std::min(std::max<int64_t>(n, 0), rows - start));
    start += cut.back();
  }
  return cut;
}

Tensor device_counts(const std::vector<int64_t>& counts) {
  Tensor t = Tensor::empty({int64_t(counts.size())}, DType::I64);
  for (size_t g = 0; g < counts.size(); ++g) t.i64()[g] = counts[g];
  return t.to(Device::CUDA);
}

// Bit-for-bit equality of two GPU tensors of one dtype.
::testing::AssertionResult same_bits(const Tensor& got, const Tensor& want) {
  if (got.numel() != want.numel() || got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << "numel or dtype differ";
  if (got.numel() == 0) return ::testing::AssertionSuccess();
  Tensor g = got.to(Device::CPU), w = want.to(Device::CPU);
  const size_t size = dtype_size(got.dtype());
  const auto* gb = static_cast<const unsigned char*>(g.raw());
  const auto* wb = static_cast<const unsigned char*>(w.raw());
  for (int64_t i = 0; i < got.numel(); ++i)
    if (std::memcmp(gb + i * size, wb + i * size, size) != 0)
      return ::testing::AssertionFailure()
             << "element " << i << ": " << g.item(i) << " vs " << w.item(i);
  return ::testing::AssertionSuccess();
}

// NaN in rows [from, end) of a GPU tensor.
void poison_rows_from(Tensor& t, int64_t from) {
  if (from >= t.dim(0)) return;
  Tensor past = t.rows(from, t.dim(0) - from);
  poison(past);
}

void check_grouped_gemm_device_counts(int64_t k, int64_t n, DType ab, DType c_dtype, bool trans_b,
                                      float beta, const std::vector<int64_t>& counts, int64_t rows,
                                      uint64_t seed) {
  SCOPED_TRACE(fmt::format("k={} n={} a/b {} c {} trans_b={} beta={} counts {} R={}", k, n,
                           name(ab), name(c_dtype), trans_b, beta, fmt::join(counts, ","), rows));
  const std::vector<int64_t> cut = cut_at(counts, rows);
  int64_t used = 0;
  for (int64_t r : cut) used += r;
  Tensor a = bf16_exact({rows, k}, seed);
  std::vector<Tensor> b, db;
  for (size_t g = 0; g < counts.size(); ++g) {
    b.push_back(bf16_exact(trans_b ? Shape{n, k} : Shape{k, n}, seed + 1 + g));
    db.push_back(on_gpu(b.back(), ab));
  }
  Tensor c0 = bf16_exact({rows, n}, seed + 50);
  Tensor ref = c0.rows(0, used).clone();
  ops::grouped_gemm(a.rows(0, used), b, trans_b, ref, cut, beta);

  Tensor da = on_gpu(a, ab);
  poison_rows_from(da, used);
  // The host-count GPU op over the used rows.
  Tensor dc_host = on_gpu(c0, c_dtype).rows(0, used);
  if (beta == 0.0f) poison(dc_host);
  ops::grouped_gemm(da.rows(0, used), db, trans_b, dc_host, cut, beta);
  // The device-count op over all R rows.
  Tensor dc = on_gpu(c0, c_dtype);
  if (beta == 0.0f && used > 0) {
    Tensor head = dc.rows(0, used);
    poison(head);
  }
  ops::grouped_gemm(da, db, trans_b, dc, device_counts(counts), beta);

  EXPECT_TRUE(same_bits(dc.rows(0, used), dc_host));
  if (used > 0) expect_gemm_close(on_host(dc.rows(0, used)), ref, ab, c_dtype, k);
  if (used < rows) {  // the sentinel rows, as they were
    EXPECT_TRUE(same_bits(dc.rows(used, rows - used), on_gpu(c0, c_dtype).rows(used, rows - used)));
  }
}

// Empty groups first, in the middle and last, with rows past them; R = sum; a count past R
// (cut, and the groups after it empty); a negative count (as 0); no group with rows.
struct CountCase {
  std::vector<int64_t> counts;
  int64_t rows;
};
const std::vector<CountCase> kCountCases = {
    {{0, 5, 0, 17, 3, 0}, 32}, {{5, 17, 3}, 25}, {{5, 40, 9}, 30}, {{4, -3, 6}, 12}, {{0, 0}, 6}};

TEST(CudaGroupedGemmDeviceCounts, CutlassFpropAndDgrad) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // (64, 48): aligned rows, so the CUTLASS kernel. trans_b: fprop; no trans_b: dgrad.
  for (const CountCase& t : kCountCases)
    for (bool trans_b : {true, false})
      for (float beta : {0.0f, 0.5f})
        check_grouped_gemm_device_counts(64, 48, DType::BF16, DType::BF16, trans_b, beta, t.counts,
                                         t.rows, seed);
  // Several 128 x 256 tiles per group, partial edge tiles, R past the groups.
  for (bool trans_b : {true, false})
    check_grouped_gemm_device_counts(512, 392, DType::BF16, DType::BF16, trans_b, 0.0f,
                                     {200, 0, 513, 64, 1}, 900, seed + 10);
}

TEST(CudaGroupedGemmDeviceCounts, FallbackKernel) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  struct Types {
    DType ab, c;
  };
  // F32 operands (any shape), and BF16 with odd rows (33, 17): the CUDA-core kernel.
  for (const CountCase& t : kCountCases)
    for (bool trans_b : {false, true}) {
      check_grouped_gemm_device_counts(64, 48, DType::F32, DType::F32, trans_b, 0.5f, t.counts,
                                       t.rows, seed);
      check_grouped_gemm_device_counts(33, 17, DType::BF16, DType::BF16, trans_b, 0.0f, t.counts,
                                       t.rows, seed + 1);
      check_grouped_gemm_device_counts(33, 17, DType::BF16, DType::F32, trans_b, 0.5f, t.counts,
                                       t.rows, seed + 2);
    }
}

// k == 0: c[rows_g] = beta * c[rows_g] for the groups' rows only (the fallback kernel with no
// k step), the rows past them untouched. The host-count op scales c with another kernel
// (zero / scale_), equal bit for bit all the same: 0 and 0.5 * x are exact in either.
TEST(CudaGroupedGemmDeviceCounts, EmptyInnerDimension) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (DType ab : {DType::F32, DType::BF16})
    for (float beta : {0.0f, 0.5f})
      check_grouped_gemm_device_counts(0, 16, ab, ab, false, beta, {3, 0, 4}, 10, seed);
}

void check_grouped_wgrad_device_counts(int64_t m, int64_t n, DType ab, DType c_dtype,
                                       const std::vector<int64_t>& counts, int64_t rows,
                                       uint64_t seed) {
  SCOPED_TRACE(fmt::format("m={} n={} a/b {} c {} counts {} R={}", m, n, name(ab), name(c_dtype),
                           fmt::join(counts, ","), rows));
  const std::vector<int64_t> cut = cut_at(counts, rows);
  int64_t used = 0;
  for (int64_t r : cut) used += r;
  Tensor a = bf16_exact({rows, m}, seed), b = bf16_exact({rows, n}, seed + 1);
  std::vector<Tensor> c0, ref, dc_host, dc;
  for (size_t g = 0; g < counts.size(); ++g) {
    c0.push_back(bf16_exact({m, n}, seed + 2 + g));
    ref.push_back(c0.back().clone());
    dc_host.push_back(on_gpu(c0.back(), c_dtype));
    dc.push_back(on_gpu(c0.back(), c_dtype));
  }
  ops::grouped_gemm_wgrad(a.rows(0, used), b.rows(0, used), ref, cut, 1.0f);
  Tensor da = on_gpu(a, ab), db = on_gpu(b, ab);
  poison_rows_from(da, used);
  poison_rows_from(db, used);
  ops::grouped_gemm_wgrad(da.rows(0, used), db.rows(0, used), dc_host, cut, 1.0f);
  ops::grouped_gemm_wgrad(da, db, dc, device_counts(counts));
  for (size_t g = 0; g < counts.size(); ++g) {
    SCOPED_TRACE(fmt::format("group {} ({} rows)", g, cut[g]));
    EXPECT_TRUE(same_bits(dc[g], dc_host[g]));
    if (cut[g] == 0) {  // accumulates nothing: c[g] as it was
      EXPECT_TRUE(same_bits(dc[g], on_gpu(c0[g], c_dtype)));
    } else {
      expect_gemm_close(on_host(dc[g]), ref[g], ab, c_dtype, cut[g]);
    }
  }
}

TEST(CudaGroupedGemmDeviceCounts, WgradCutlassIntoF32) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (const CountCase& t : kCountCases)
    check_grouped_wgrad_device_counts(64, 48, DType::BF16, DType::F32, t.counts, t.rows, seed);
  check_grouped_wgrad_device_counts(392, 512, DType::BF16, DType::F32, {200, 0, 513, 64, 1}, 900,
                                    seed + 10);
}

TEST(CudaGroupedGemmDeviceCounts, WgradFallbackKernel) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (const CountCase& t : kCountCases) {
    check_grouped_wgrad_device_counts(64, 48, DType::F32, DType::F32, t.counts, t.rows, seed);
    check_grouped_wgrad_device_counts(33, 17, DType::BF16, DType::F32, t.counts, t.rows, seed + 1);
    check_grouped_wgrad_device_counts(64, 48, DType::BF16, DType::BF16, t.counts, t.rows, seed + 2);
  }
}

TEST(CudaGroupedGemmDeviceCounts, RejectsBadCountsAndShapes) {
  SKIP_WITHOUT_GPU();
  Tensor a = Tensor::zeros({8, 8}, DType::BF16, Device::CUDA);
  Tensor c = Tensor::zeros({8, 16}, DType::BF16, Device::CUDA);
  std::vector<Tensor> b = {Tensor::zeros({8, 16}, DType::BF16, Device::CUDA),
                           Tensor::zeros({8, 16}, DType::BF16, Device::CUDA)};
  Tensor counts = device_counts({3, 4});
  EXPECT_NO_THROW(ops::grouped_gemm(a, b, false, c, counts));
  // Counts on the host, of another dtype, or not one per group.
  Tensor host_counts = counts.to(Device::CPU);
  EXPECT_THROW(ops::grouped_gemm(a, b, false, c, host_counts), InternalError);
  Tensor i32_counts = Tensor::from_i32({2}, {3, 4}).to(Device::CUDA);
  EXPECT_THROW(ops::grouped_gemm(a, b, false, c, i32_counts), InternalError);
  EXPECT_THROW(ops::grouped_gemm(a, b, false, c, device_counts({3, 4, 1})), InternalError);
  // Every weight is checked (which group is empty is not known): b[1] of the wrong shape.
  std::vector<Tensor> bad_b = {b[0], Tensor::zeros({16, 8}, DType::BF16, Device::CUDA)};
  EXPECT_THROW(ops::grouped_gemm(a, bad_b, false, c, device_counts({7, 0})), InternalError);
  Tensor short_c = Tensor::zeros({7, 16}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::grouped_gemm(a, b, false, short_c, counts), InternalError);
  // wgrad: c[1] of the wrong shape, mixed c dtypes, counts on the host.
  Tensor wb = Tensor::zeros({8, 16}, DType::BF16, Device::CUDA);
  std::vector<Tensor> grads = {Tensor::zeros({8, 16}, DType::F32, Device::CUDA),
                               Tensor::zeros({16, 8}, DType::F32, Device::CUDA)};
  EXPECT_THROW(ops::grouped_gemm_wgrad(a, wb, grads, counts), InternalError);
  grads[1] = Tensor::zeros({8, 16}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::grouped_gemm_wgrad(a, wb, grads, counts), InternalError);
  grads[1] = Tensor::zeros({8, 16}, DType::F32, Device::CUDA);
  EXPECT_NO_THROW(ops::grouped_gemm_wgrad(a, wb, grads, counts));
  EXPECT_THROW(ops::grouped_gemm_wgrad(a, wb, grads, host_counts), InternalError);
}

}  // namespace
}  // namespace megaton

#else  // CPU-only build

TEST(CudaGemm, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
