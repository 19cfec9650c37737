// The CUDA FP8 grouped GEMM (ops/cuda/grouped_gemm_fp8.cu, one CUTLASS launch for all
// groups) against the CPU reference (ops/cpu/fp8_grouped.cpp: ops::fp8_gemm per group), in
// the MoE experts' three shapes:
//   forward        M_g varies (0, 16, 48, 1024, 2000 tokens), N 512, K 768, E4M3 x E4M3 ->
//                  BF16, fast accumulation on and off;
//   input gradient the same M_g, E5M2 (the hybrid format's gradient) x E4M3 -> BF16;
//   weight grad.   M, N fixed, K_g (tokens) varies with a K_g = 0 group, E5M2 x E4M3 -> F32
//                  with beta 1 into a non-zero main_grad.
// Every group has its own a and b scales (magnitudes 2^-3 .. 2^3 apart), so an alpha taken
// from the wrong group is off by a factor of 2 or more. Outputs start as NaN where beta is 0
// (not read, must be written) and as random values where beta is 1; the K_g = 0 group's c
// must come back bit for bit.
#ifdef MEGATON_WITH_CUDA

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "ops/fp8.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::randn;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

// Tolerances against the CPU's fp32 GEMM of the dequantized operands, in the style of
// test_cuda_fp8_gpu.cpp (see its kGemm* constants for the derivation). The products of
// FP8 values are exact, so the difference is the summation: Hopper's FP8 tensor cores add
// one MMA's products (32 along K) with about 13 mantissa bits (DeepSeek-V3 report sec.
// 3.3.2), and the split accumulator (KernelPtrArrayTmaWarpSpecializedCooperative) adds
// those partial sums into fp32 registers every 4 MMAs, so each element is off by at most a
// few 2^-13 of the magnitudes it sums: |d| <= rel x |alpha| x sum_k |a_mk b_nk| +
// 1e-2 |reference|, rel = 2e-3 (the fp8_gemm tests' bound), plus 2^-8 for a BF16 output
// (one more rounding each side). Fast accumulation keeps the reduced-precision sum for the
// whole K loop: K / 32 MMAs, each losing up to ~2 ulps of a 13-bit mantissa of a running sum
// bounded by the product sum, so rel grows by (K / 32) x 2^-12 (5.9e-3 at K 768). A wrong
// alpha, operand or tile gives O(1).
constexpr double kProductSumRel = 2e-3, kBf16Rounding = 1.0 / 256, kRtol = 1e-2;
double fast_accumulation_rel(int64_t k) { return double(k) / 32 * std::ldexp(1.0, -12); }
// Whole tensor ||d|| / ||reference||: 1e-3 for F32 output, 1e-2 for BF16 (fp8_gemm's), 2e-2
// with fast accumulation (whose error is a few 1e-3 of the product sums, which exceed the
// results by ~sqrt(K) for random signs).
constexpr double kWholeF32 = 1e-3, kWholeBf16 = 1e-2, kWholeFast = 2e-2;

struct Operand {
  Tensor q, scale_inv;  // CPU
};

// x [rows, cols] = N(0, magnitude^2) quantized with current scaling (scale from amax).
Operand quantized(int64_t rows, int64_t cols, DType fp8, float magnitude, uint64_t seed) {
  Tensor x = randn({rows, cols}, seed, magnitude);
  Operand op{Tensor::empty({rows, cols}, fp8), Tensor::from({1}, {1.0f})};
  if (x.numel() == 0) return op;
  Tensor amax = Tensor::empty({1}), scale = Tensor::from({1}, {1.0f}), none;
  ops::fp8_amax(x, amax);
  ops::fp8_update_scale(amax, {fp8, 0.0f, 0.0f, false}, scale, op.scale_inv);
  ops::fp8_quantize(x, scale, op.q, none, none);
  return op;
}

// |deq(q)| as F32.
Tensor abs_dequantized(const Tensor& q, const Tensor& scale_inv) {
  Tensor x = Tensor::empty(q.shape());
  if (q.numel() == 0) return x;
  ops::fp8_dequantize(q, scale_inv, x);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = std::fabs(x.f32()[i]);
  return x;
}

std::vector<Tensor> to_gpu(const std::vector<Tensor>& list) {
  std::vector<Tensor> out;
  for (const Tensor& t : list) out.push_back(t.to(Device::CUDA));
  return out;
}

struct Case {
  std::vector<std::array<int64_t, 3>> mnk;  // per group
  DType a, b, c;
  float alpha, beta;
  bool fast;
};

std::string case_name(const Case& t) {
  return std::string(dtype_name(t.a)) + " x " + std::string(dtype_name(t.b)) + " -> " +
         std::string(dtype_name(t.c)) + " alpha " + std::to_string(t.alpha) + " beta " +
         std::to_string(t.beta) + (t.fast ? " fast accumulation" : " split accumulator");
}

void check_grouped(const Case& t, uint64_t seed) {
  SCOPED_TRACE(case_name(t));
  const size_t groups = t.mnk.size();
  std::vector<Tensor> a, a_s, b, b_s, c_cpu, c_gpu, start;
  for (size_t g = 0; g < groups; ++g) {
    const auto [m, n, k] = t.mnk[g];
    // a's magnitude 2^-3 .. 2^3 by group, b's 0.7 .. 2.2: alpha_g differs by group.
    Operand qa = quantized(m, k, t.a, std::ldexp(1.3f, int(g % 7) - 3), seed + 10 * g);
    Operand qb = quantized(n, k, t.b, 0.7f + 0.25f * float(g), seed + 10 * g + 1);
    a.push_back(qa.q);
    a_s.push_back(qa.scale_inv);
    b.push_back(qb.q);
    b_s.push_back(qb.scale_inv);
    Tensor c = randn({m, n}, seed + 10 * g + 2).to(t.c);
    if (t.beta == 0.0f) c.fill(NAN);  // not read, must be overwritten
    start.push_back(c);
    c_cpu.push_back(c.clone());
    c_gpu.push_back(c.to(Device::CUDA));
  }
  ops::fp8_grouped_gemm(a, a_s, b, b_s, c_cpu, t.alpha, t.beta, t.fast);
  ops::fp8_grouped_gemm(to_gpu(a), to_gpu(a_s), to_gpu(b), to_gpu(b_s), c_gpu, t.alpha, t.beta,
                        t.fast);
  const bool bf16 = t.c == DType::BF16;
  for (size_t g = 0; g < groups; ++g) {
    const auto [m, n, k] = t.mnk[g];
    SCOPED_TRACE("group " + std::to_string(g) + " M " + std::to_string(m) + " N " +
                 std::to_string(n) + " K " + std::to_string(k));
    Tensor got_raw = c_gpu[g].to(Device::CPU);
    if (m == 0 || n == 0) continue;
    if (k == 0) {  // skipped: c untouched, bit for bit
      EXPECT_EQ(std::memcmp(got_raw.raw(), start[g].raw(), start[g].nbytes()), 0);
      continue;
    }
    Tensor got = got_raw.to(DType::F32), want = c_cpu[g].to(DType::F32);
    Tensor product_sum = Tensor::empty({m, n});
    ops::gemm(abs_dequantized(a[g], a_s[g]), false, abs_dequantized(b[g], b_s[g]), true,
              product_sum, std::fabs(t.alpha));
    const double rel =
        kProductSumRel + (bf16 ? kBf16Rounding : 0.0) + (t.fast ? fast_accumulation_rel(k) : 0.0);
    double worst = 0;  // the largest |d| / (rel x product sum + rtol |ref|), for the log
    int64_t bad = -1;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double d = std::fabs(double(got.f32()[i]) - want.f32()[i]);
      const double bound = rel * product_sum.f32()[i] + kRtol * std::fabs(want.f32()[i]);
      if (!(d <= bound)) {  // NaN (an element not written) fails too
        if (bad < 0) bad = i;
        worst = INFINITY;
      } else if (bound > 0) {
        worst = std::max(worst, d / bound);
      }
    }
    const double error = testing::rel_error(got, want);
    std::printf(
        "%s group %zu M %lld N %lld K %lld: relative error %.3g, worst element %.3g of "
        "its bound\n",
        case_name(t).c_str(), g, static_cast<long long>(m), static_cast<long long>(n),
        static_cast<long long>(k), error, worst);
    EXPECT_LT(bad, 0) << "element " << bad << ": " << got.f32()[std::max<int64_t>(bad, 0)]
                      << " vs reference " << want.f32()[std::max<int64_t>(bad, 0)];
    EXPECT_LE(error, t.fast ? kWholeFast : bf16 ? kWholeBf16 : kWholeF32);
  }
}

// 2000 tokens is a multiple of 16 already (125 x 16).
const std::vector<int64_t> kTokens = {0, 16, 48, 1024, 2000};

TEST(CudaFp8Grouped, ForwardLikeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::vector<std::array<int64_t, 3>> mnk;
  for (int64_t m : kTokens) mnk.push_back({m, 512, 768});
  for (bool fast : {true, false})
    check_grouped({mnk, DType::F8E4M3, DType::F8E4M3, DType::BF16, 1.0f, 0.0f, fast}, seed);
}

TEST(CudaFp8Grouped, InputGradientLikeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::vector<std::array<int64_t, 3>> mnk;
  for (int64_t m : kTokens) mnk.push_back({m, 768, 512});
  check_grouped({mnk, DType::F8E5M2, DType::F8E4M3, DType::BF16, 0.5f, 0.0f, false}, seed + 1);
}

TEST(CudaFp8Grouped, WeightGradientLikeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // c[g] [512, 768] += dy_g^T [512, K_g] @ x_g^T [768, K_g]^T; K_g = 0 leaves c[g] alone.
  std::vector<std::array<int64_t, 3>> mnk;
  for (int64_t k : {1024, 0, 16, 48, 2000}) mnk.push_back({512, 768, k});
  check_grouped({mnk, DType::F8E5M2, DType::F8E4M3, DType::F32, 1.0f, 1.0f, false}, seed + 2);
}

// All groups empty: nothing launched, nothing written.
TEST(CudaFp8Grouped, AllEmptyLaunchesNothing) {
  MEGATON_SKIP_WITHOUT_GPU();
  Tensor s = Tensor::from({1}, {1.0f}).to(Device::CUDA);
  Tensor c = Tensor::empty({16, 32}, DType::F32, Device::CUDA);
  c.fill(3.0f);
  ops::fp8_grouped_gemm({Tensor::empty({0, 16}, DType::F8E4M3, Device::CUDA),
                         Tensor::empty({16, 0}, DType::F8E4M3, Device::CUDA)},
                        {s, s},
                        {Tensor::empty({32, 16}, DType::F8E4M3, Device::CUDA),
                         Tensor::empty({32, 0}, DType::F8E4M3, Device::CUDA)},
                        {s, s}, {Tensor::empty({0, 32}, DType::F32, Device::CUDA), c}, 1.0f, 0.0f);
  Tensor host = c.to(Device::CPU);
  for (int64_t i = 0; i < host.numel(); ++i) ASSERT_EQ(host.f32()[i], 3.0f) << "element " << i;
}

// Not a test (timings are benchmarks): run with --gtest_also_run_disabled_tests for the
// throughput of one forward-like call, 8 experts x 2048 tokens, N 8192, K 1536, against 8
// per-expert ops::fp8_gemm calls (cuBLASLt) in the same run.
double median_ms(const std::function<void()>& run) {
  for (int i = 0; i < 5; ++i) run();
  cudaEvent_t begin, end;
  MEGATON_CUDA_CHECK(cudaEventCreate(&begin));
  MEGATON_CUDA_CHECK(cudaEventCreate(&end));
  std::vector<float> times;
  for (int i = 0; i < 20; ++i) {
    MEGATON_CUDA_CHECK(cudaEventRecord(begin, cuda::stream()));
    run();
    MEGATON_CUDA_CHECK(cudaEventRecord(end, cuda::stream()));
    MEGATON_CUDA_CHECK(cudaEventSynchronize(end));
    float ms = 0;
    MEGATON_CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
    times.push_back(ms);
  }
  MEGATON_CUDA_CHECK(cudaEventDestroy(begin));
  MEGATON_CUDA_CHECK(cudaEventDestroy(end));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

TEST(CudaFp8Grouped, DISABLED_TimingForwardLike) {
  MEGATON_SKIP_WITHOUT_GPU();
  const int64_t groups = 8, m = 2048, n = 8192, k = 1536;
  std::vector<Tensor> a, s, b, c;
  for (int64_t g = 0; g < groups; ++g) {
    Tensor x = randn({m, k}, 100 + g).to(Device::CUDA), w = randn({n, k}, 200 + g).to(Device::CUDA);
    Tensor scale = Tensor::from({1}, {64.0f}).to(Device::CUDA), none;
    a.push_back(Tensor::empty({m, k}, DType::F8E4M3, Device::CUDA));
    b.push_back(Tensor::empty({n, k}, DType::F8E4M3, Device::CUDA));
    ops::fp8_quantize(x, scale, a.back(), none, none);
    ops::fp8_quantize(w, scale, b.back(), none, none);
    s.push_back(Tensor::from({1}, {1.0f / 64}).to(Device::CUDA));
    c.push_back(Tensor::empty({m, n}, DType::BF16, Device::CUDA));
  }
  const double tflop = 2.0 * groups * m * n * k / 1e12;
  for (bool fast : {true, false}) {
    const double grouped =
        median_ms([&] { ops::fp8_grouped_gemm(a, s, b, s, c, 1.0f, 0.0f, fast); });
    const double looped = median_ms([&] {
      for (int64_t g = 0; g < groups; ++g)
        ops::fp8_gemm(a[g], s[g], b[g], s[g], c[g], 1.0f, 0.0f, fast);
    });
    std::printf(
        "fp8 %s, %lld x [%lld, %lld, %lld] -> BF16: grouped %.3f ms (%.0f TFLOP/s), "
        "%lld fp8_gemm calls %.3f ms (%.0f TFLOP/s)\n",
        fast ? "fast accumulation" : "split accumulator", static_cast<long long>(groups),
        static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), grouped,
        tflop / (grouped * 1e-3), static_cast<long long>(groups), looped, tflop / (looped * 1e-3));
  }
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
