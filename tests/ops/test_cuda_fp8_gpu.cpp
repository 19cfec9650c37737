// The CUDA FP8 ops (ops/cuda/fp8.cu, fp8_gemm.cpp) against the CPU reference
// (ops/cpu/fp8.cpp), which ops/fp8.h makes the definition:
//   - quantization (out, out_t, amax, scales, blockwise scale_inv) bit for bit, F32 and
//     BF16 inputs, E4M3 and E5M2, shapes that are and are not multiples of the 128 x 128
//     tiles and of the 8- and 16-element vector widths (so both the vectorized and the
//     scalar paths of the tile kernel run), inputs spanning ~24 binades so that the casts
//     hit normals, subnormals, underflow, saturation and round-to-even ties, and, on the
//     elementwise path, NaN, -NaN, +-inf, -0 and huge values;
//   - the scale rule and delayed scaling (history roll included) bit for bit;
//   - dequantization bit for bit;
//   - the GEMM to a tolerance (see kGemmF32WholeRel).
// Outputs are poisoned first (NaN; 0x7F for FP8), so an element a kernel skips fails the
// comparison.
#ifdef MEGATON_WITH_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_testing.h"
#include "common/gpu_testing.h"
#include "ops/fp8.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using ops::Fp8ScaleRule;
using testing::insert_specials;
using testing::kScaleRuleAmaxes;
using testing::max_abs_finite;
using testing::poisoned_device;
using testing::randn;
using testing::rule_name;
using testing::same_bits;
using testing::scale_rules;
using testing::wide_values;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

const float kNaN = std::numeric_limits<float>::quiet_NaN();

std::string case_name(const Shape& shape, DType x, DType fp8) {
  return shape_str(shape) + " " + std::string(dtype_name(x)) + " -> " +
         std::string(dtype_name(fp8));
}

const DType kInputs[] = {DType::F32, DType::BF16};
const DType kFormats[] = {DType::F8E4M3, DType::F8E5M2};

// Rows x cols: one row; rows and columns around the 128 tile (127, 129) and off the
// vector widths (odd columns, rows not a multiple of 16); training-like widths; tiles
// only partly filled but vectorizable (144 x 200).
const std::vector<Shape> kShapes = {{1, 4096},    {127, 4096},  {129, 4096},
                                    {1000, 4096}, {8192, 1024}, {144, 200},
                                    {127, 129},   {3, 1},       {256, 384}};
// Above this many elements only two of the four dtype combinations run (the CPU
// reference converts element by element).
constexpr int64_t kLargeNumel = int64_t(1) << 20;
bool skip_large(const Shape& shape, DType x, DType fp8) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n > kLargeNumel &&
         !((x == DType::BF16 && fp8 == DType::F8E4M3) || (x == DType::F32 && fp8 == DType::F8E5M2));
}

// ------------------------------------------------------------------------------ amax

TEST(CudaFp8, AmaxMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (const Shape& shape : kShapes) {
    for (DType dtype : kInputs) {
      for (int variant = 0; variant < 3; ++variant) {  // finite, with inf, with NaN
        SCOPED_TRACE(shape_str(shape) + " " + std::string(dtype_name(dtype)) + " variant " +
                     std::to_string(variant));
        Tensor values = wide_values(shape, seed + 1);
        if (variant == 1) values.f32()[values.numel() / 2] = -INFINITY;
        if (variant == 2) values.f32()[values.numel() - 1] = kNaN;
        Tensor x = values.to(dtype);
        Tensor want = Tensor::empty({1});
        ops::fp8_amax(x, want);
        Tensor got = poisoned_device({1}, DType::F32);
        ops::fp8_amax(x.to(Device::CUDA), got);
        EXPECT_TRUE(same_bits(got, want, "amax"));
      }
    }
  }
  // An empty tensor gives 0 (and the output is still overwritten).
  Tensor got = poisoned_device({1}, DType::F32);
  ops::fp8_amax(Tensor::empty({0, 16}, DType::BF16, Device::CUDA), got);
  EXPECT_EQ(got.item(0), 0.0f);
}

// -------------------------------------------------------------------- scale updates

TEST(CudaFp8, UpdateScaleMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  for (const Fp8ScaleRule& rule : scale_rules({0.0f, 1.0f, 2.5f})) {
    for (float amax_value : kScaleRuleAmaxes) {
      SCOPED_TRACE(rule_name(rule) + " amax " + std::to_string(amax_value));
      Tensor amax = Tensor::from({1}, {amax_value});
      Tensor scale = Tensor::from({1}, {0.75f}), scale_inv = Tensor::from({1}, {5.0f});
      Tensor scale_gpu = scale.to(Device::CUDA), scale_inv_gpu = scale_inv.to(Device::CUDA);
      ops::fp8_update_scale(amax, rule, scale, scale_inv);
      ops::fp8_update_scale(amax.to(Device::CUDA), rule, scale_gpu, scale_inv_gpu);
      EXPECT_TRUE(same_bits(scale_gpu, scale, "scale"));
      EXPECT_TRUE(same_bits(scale_inv_gpu, scale_inv, "scale_inv"));
    }
  }
}

TEST(CudaFp8, DelayedScalingUpdateMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // 9000 rows take the kernel's path for histories too long for shared memory.
  for (int64_t length : {1, 5, 1024, 9000}) {
    for (bool max_algo : {false, true}) {
      for (int variant = 0; variant < 3; ++variant) {  // amaxes, a NaN in row 3, all zero
        SCOPED_TRACE("L " + std::to_string(length) + (max_algo ? " max" : " most_recent") +
                     " variant " + std::to_string(variant));
        Tensor history = wide_values({length, 1}, seed + length);
        for (int64_t i = 0; i < length; ++i) history.f32()[i] = std::fabs(history.f32()[i]);
        if (variant == 1 && length > 3) history.f32()[3] = kNaN;
        if (variant == 2) history.zero();
        const Fp8ScaleRule rule{DType::F8E4M3, 1.0f, 0.0f, max_algo};
        Tensor scale = Tensor::from({1}, {0.75f}), scale_inv = Tensor::from({1}, {5.0f});
        Tensor history_gpu = history.to(Device::CUDA), scale_gpu = scale.to(Device::CUDA),
               scale_inv_gpu = scale_inv.to(Device::CUDA);
        for (int step = 0; step < 2; ++step) {  // the roll composes over steps
          SCOPED_TRACE("step " + std::to_string(step));
          if (step == 1) {  // the next step's amax lands in row 0
            history.f32()[0] = 2.5f;
            Tensor row0 = Tensor::from({1}, {2.5f});
            Tensor row0_gpu = history_gpu.rows(0, 1);
            row0_gpu.copy_from(row0.view({1, 1}));
          }
          ops::fp8_delayed_scaling_update(history, rule, max_algo, scale, scale_inv);
          ops::fp8_delayed_scaling_update(history_gpu, rule, max_algo, scale_gpu, scale_inv_gpu);
          EXPECT_TRUE(same_bits(history_gpu, history, "amax_history"));
          EXPECT_TRUE(same_bits(scale_gpu, scale, "scale"));
          EXPECT_TRUE(same_bits(scale_inv_gpu, scale_inv, "scale_inv"));
        }
      }
    }
  }
}

// ------------------------------------------------------------------ per-tensor cast

TEST(CudaFp8, QuantizeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::vector<Shape> shapes = kShapes;
  shapes.push_back({2, 64, 96});  // higher rank: viewed as [128, 96]
  for (const Shape& shape : shapes) {
    for (DType dtype : kInputs) {
      for (DType fp8 : kFormats) {
        if (skip_large(shape, dtype, fp8)) continue;
        Tensor values = wide_values(shape, seed + 2);
        // Current scaling's scale (fp8_max / amax of the values before the specials go in)
        // and a power of two, which with BF16 inputs makes round-to-even ties frequent.
        const float current = ops::fp8_max(fp8) / max_abs_finite(values);
        insert_specials(values);
        Tensor x = values.to(dtype);
        for (float scale_value : {current, 0.0625f}) {
          // Outputs: out only, + amax, + out_t, + out_t and amax (large shapes: the last).
          for (int outputs = 0; outputs < 4; ++outputs) {
            if (x.numel() > kLargeNumel && outputs != 3) continue;
            const bool with_t = outputs >= 2, with_amax = outputs % 2 == 1;
            SCOPED_TRACE(case_name(shape, dtype, fp8) + " scale " + std::to_string(scale_value) +
                         (with_t ? " out_t" : "") + (with_amax ? " amax" : ""));
            const int64_t cols = shape.back(), rows = x.numel() / cols;
            Tensor scale = Tensor::from({1}, {scale_value});
            Tensor out = Tensor::empty(shape, fp8);
            Tensor out_t = with_t ? Tensor::empty({cols, rows}, fp8) : Tensor();
            Tensor amax = with_amax ? Tensor::empty({1}) : Tensor();
            ops::fp8_quantize(x, scale, out, out_t, amax);

            Tensor out_gpu = poisoned_device(shape, fp8);
            Tensor out_t_gpu = with_t ? poisoned_device({cols, rows}, fp8) : Tensor();
            Tensor amax_gpu = with_amax ? poisoned_device({1}, DType::F32) : Tensor();
            ops::fp8_quantize(x.to(Device::CUDA), scale.to(Device::CUDA), out_gpu, out_t_gpu,
                              amax_gpu);
            EXPECT_TRUE(same_bits(out_gpu, out, "out"));
            if (with_t) {
              EXPECT_TRUE(same_bits(out_t_gpu, out_t, "out_t"));
            }
            if (with_amax) {
              EXPECT_TRUE(same_bits(amax_gpu, amax, "amax"));
            }
          }
        }
      }
    }
  }
}

TEST(CudaFp8, QuantizeUnalignedViewMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // Rows 1.. of a [257, 1000] BF16 tensor start 2000 bytes in: not 16-byte aligned, so the
  // scalar paths run on an otherwise vectorizable shape.
  Tensor values = wide_values({257, 1000}, seed + 3);
  Tensor x_all = values.to(DType::BF16);
  Tensor x = x_all.rows(1, 256);
  Tensor x_gpu = x_all.to(Device::CUDA).rows(1, 256);
  Tensor scale = Tensor::from({1}, {448.0f / max_abs_finite(values)});
  Tensor out = Tensor::empty({256, 1000}, DType::F8E4M3);
  Tensor out_t = Tensor::empty({1000, 256}, DType::F8E4M3), amax = Tensor::empty({1});
  ops::fp8_quantize(x, scale, out, out_t, amax);
  Tensor out_gpu = poisoned_device({256, 1000}, DType::F8E4M3);
  Tensor out_t_gpu = poisoned_device({1000, 256}, DType::F8E4M3),
         amax_gpu = poisoned_device({1}, DType::F32);
  ops::fp8_quantize(x_gpu, scale.to(Device::CUDA), out_gpu, out_t_gpu, amax_gpu);
  EXPECT_TRUE(same_bits(out_gpu, out, "out"));
  EXPECT_TRUE(same_bits(out_t_gpu, out_t, "out_t"));
  EXPECT_TRUE(same_bits(amax_gpu, amax, "amax"));
  Tensor none, out_only = poisoned_device({256, 1000}, DType::F8E4M3);
  ops::fp8_quantize(x_gpu, scale.to(Device::CUDA), out_only, none, none);
  EXPECT_TRUE(same_bits(out_only, out, "out (no out_t)"));
}

// ------------------------------------------------------------------------ blockwise

// wide_values with magnitudes that differ by row and by 128-column block (so block scales
// differ and a scale applied to the wrong block shows), an all-zero 128 x 128 region (its
// blocks keep scale 1), a block of tiny values (amax_epsilon bites) and, when asked, a
// NaN and an inf (their blocks keep scale 1 too).
Tensor blockwise_values(int64_t rows, int64_t cols, uint64_t seed, bool specials) {
  Tensor t = wide_values({rows, cols}, seed, 8);
  std::mt19937_64 gen(seed + 17);
  std::uniform_int_distribution<int> exponent(-10, 10);
  std::vector<int> row_e(rows), block_e((cols + 127) / 128);
  for (int& e : row_e) e = exponent(gen);
  for (int& e : block_e) e = exponent(gen);
  float* p = t.f32();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      p[r * cols + c] = std::ldexp(p[r * cols + c], row_e[r] + block_e[c / 128]);
  if (rows > 128 && cols > 128)
    for (int64_t r = 128; r < std::min<int64_t>(rows, 256); ++r)
      for (int64_t c = 0; c < 128; ++c) p[r * cols + c] = 0.0f;
  if (cols > 128)
    for (int64_t c = 128; c < std::min<int64_t>(cols, 256); ++c) p[c] *= 1e-30f;
  if (specials && rows * cols > 1000) {
    p[rows * cols - 1] = kNaN;
    p[(rows / 2) * cols + cols / 2] = -INFINITY;
  }
  return t;
}

TEST(CudaFp8, QuantizeBlockwiseMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 300}, {127, 129}, {129, 4096}, {256, 1024}, {1000, 640}, {144, 200}, {8192, 1024}};
  for (auto [rows, cols] : shapes) {
    for (DType dtype : kInputs) {
      for (DType fp8 : kFormats) {
        if (skip_large({rows, cols}, dtype, fp8)) continue;
        Tensor x = blockwise_values(rows, cols, seed + 4, true).to(dtype);
        for (int64_t block_rows : {1, 128}) {
          for (bool with_t : {false, true}) {
            // TE's blockwise default (power-of-two scales), and plain fp32 scales with an
            // epsilon and a margin.
            for (Fp8ScaleRule rule :
                 {Fp8ScaleRule{fp8, 0.0f, 0.0f, true}, Fp8ScaleRule{fp8, 1.0f, 1e-20f, false}}) {
              SCOPED_TRACE(case_name({rows, cols}, dtype, fp8) + " block_rows " +
                           std::to_string(block_rows) + (with_t ? " out_t " : " ") +
                           rule_name(rule));
              const Shape s_shape{(rows + block_rows - 1) / block_rows, (cols + 127) / 128};
              const Shape s_t_shape{(cols + block_rows - 1) / block_rows, (rows + 127) / 128};
              Tensor out = Tensor::empty({rows, cols}, fp8), scale_inv = Tensor::empty(s_shape);
              Tensor out_t = with_t ? Tensor::empty({cols, rows}, fp8) : Tensor();
              Tensor scale_inv_t = with_t ? Tensor::empty(s_t_shape) : Tensor();
              ops::fp8_quantize_blockwise(x, block_rows, rule, out, scale_inv, out_t, scale_inv_t);

              Tensor out_gpu = poisoned_device({rows, cols}, fp8);
              Tensor scale_inv_gpu = poisoned_device(s_shape, DType::F32);
              Tensor out_t_gpu = with_t ? poisoned_device({cols, rows}, fp8) : Tensor();
              Tensor scale_inv_t_gpu = with_t ? poisoned_device(s_t_shape, DType::F32) : Tensor();
              ops::fp8_quantize_blockwise(x.to(Device::CUDA), block_rows, rule, out_gpu,
                                          scale_inv_gpu, out_t_gpu, scale_inv_t_gpu);
              EXPECT_TRUE(same_bits(out_gpu, out, "out"));
              EXPECT_TRUE(same_bits(scale_inv_gpu, scale_inv, "scale_inv"));
              if (with_t) {
                EXPECT_TRUE(same_bits(out_t_gpu, out_t, "out_t"));
                EXPECT_TRUE(same_bits(scale_inv_t_gpu, scale_inv_t, "scale_inv_t"));
              }
            }
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------- dequantization

// The FP8 weights' transpose (--fp8-param-gather): bytes equal to the CPU's, for shapes
// around the 64 x 64 tile and training widths.
TEST(CudaFp8, TransposeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (const Shape& shape : kShapes) {
    const int64_t rows = shape[0], cols = shape[1];
    SCOPED_TRACE(shape_str(shape));
    Tensor x = wide_values(shape, seed + 11);
    Tensor q = Tensor::empty(shape, DType::F8E4M3), none;
    Tensor scale = Tensor::from({1}, {ops::fp8_max(DType::F8E4M3) / max_abs_finite(x)});
    ops::fp8_quantize(x, scale, q, none, none);
    Tensor q_t = Tensor::empty({cols, rows}, DType::F8E4M3);
    ops::fp8_transpose(q, q_t);
    Tensor gpu_t = poisoned_device({cols, rows}, DType::F8E4M3);
    ops::fp8_transpose(q.to(Device::CUDA), gpu_t);
    EXPECT_TRUE(same_bits(gpu_t, q_t, "q_t"));
  }
}

TEST(CudaFp8, DequantizeMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{127, 129}, {256, 1024}}) {
    for (DType fp8 : kFormats) {
      Tensor x = blockwise_values(rows, cols, seed + 5, false);
      // Per tensor and both block shapes.
      std::vector<std::pair<Tensor, Tensor>> quantized;  // (q, scale_inv)
      Tensor q = Tensor::empty({rows, cols}, fp8), none;
      Tensor scale = Tensor::from({1}, {ops::fp8_max(fp8) / max_abs_finite(x)});
      ops::fp8_quantize(x, scale, q, none, none);
      quantized.push_back({q, Tensor::from({1}, {1.0f / scale.f32()[0]})});
      for (int64_t block_rows : {1, 128}) {
        Tensor qb = Tensor::empty({rows, cols}, fp8);
        Tensor sb = Tensor::empty({(rows + block_rows - 1) / block_rows, (cols + 127) / 128});
        ops::fp8_quantize_blockwise(x, block_rows, {fp8, 0.0f, 0.0f, true}, qb, sb, none, none);
        quantized.push_back({qb, sb});
      }
      for (auto& [qc, sc] : quantized) {
        for (DType out_dtype : kInputs) {
          SCOPED_TRACE(case_name({rows, cols}, out_dtype, fp8) + " scale_inv " +
                       shape_str(sc.shape()));
          Tensor want = Tensor::empty({rows, cols}, out_dtype);
          ops::fp8_dequantize(qc, sc, want);
          Tensor got = poisoned_device({rows, cols}, out_dtype);
          ops::fp8_dequantize(qc.to(Device::CUDA), sc.to(Device::CUDA), got);
          EXPECT_TRUE(same_bits(got, want, "x"));
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------- GEMM

// Tolerances against the CPU's fp32 GEMM of the dequantized operands. The products of
// FP8 values are exact, so the difference is summation only, but not only its order:
// Hopper's FP8 tensor cores add the products of one MMA with their alignment shifts
// truncated to a ~13-bit mantissa (an e8m13 accumulator; DeepSeek-V3 report sec. 3.3.2:
// "around 14 bits"), and cuBLAS's split accumulator promotes those partial sums to fp32
// every few MMAs. That leaves a relative error of order 2^-13 x (max product / rms
// product) / sqrt(MMA length), a few 1e-4 at worst for these inputs, far above fp32's
// ~1e-7 (the 1e-5 of fp32 GEMMs would be wrong here). A wrong layout, a scale on the wrong
// block or a missed tile gives O(1). BF16 outputs add one bf16 rounding (2^-9 relative).
constexpr double kGemmF32WholeRel = 1e-3, kGemmBf16WholeRel = 1e-2;
// Elementwise: the accumulation error of one output element scales with the sum of the
// magnitudes of its products, sum_k |a_mk b_nk|, not with the element itself (an element
// whose products cancel is small: on an H200, M 256 N 384 K 1024 seed 1234, one was 11%
// off while the whole tensor's error was 2.6e-4). So every element must meet
// |d| <= rel x sum_k |a_mk b_nk| + 1e-2 |reference|, rel = 2e-3 for F32 output. For BF16
// output cuBLASLt rounds alpha x (a @ b^T) to bf16 before adding beta x c (measured: a
// result of 0.0043 came back as 0.0078 where the product sum was 2.2), one more rounding
// of up to 2^-9 of the product sum: rel = 2e-3 + 2^-8.
constexpr double kGemmProductSumRel = 2e-3, kGemmProductSumRelBf16 = 2e-3 + 1.0 / 256,
                 kGemmRtol = 1e-2;

// ::testing::AssertionResult of the elementwise bound above; product_sum [M, N] F32.
::testing::AssertionResult within_product_sum(const Tensor& got, const Tensor& want,
                                              const Tensor& product_sum, double rel) {
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = std::fabs(double(got.f32()[i]) - want.f32()[i]);
    const double bound = rel * product_sum.f32()[i] + kGemmRtol * std::fabs(want.f32()[i]);
    if (!(d <= bound))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << got.f32()[i] << " vs reference " << want.f32()[i]
             << " (bound " << bound << ")";
  }
  return ::testing::AssertionSuccess();
}

// |deq(q)| as F32: the magnitudes behind product_sum.
Tensor abs_dequantized(const Tensor& q, const Tensor& scale_inv) {
  Tensor x = Tensor::empty(q.shape());
  ops::fp8_dequantize(q, scale_inv, x);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = std::fabs(x.f32()[i]);
  return x;
}

struct GemmOperand {
  Tensor q, scale_inv;  // CPU
};

// x [rows, K] quantized per tensor (current scaling) or in blocks of block_rows x 128.
GemmOperand quantize_operand(const Tensor& x, DType fp8, int64_t block_rows) {
  const int64_t rows = x.dim(0), cols = x.dim(1);
  GemmOperand op{Tensor::empty({rows, cols}, fp8), Tensor()};
  Tensor none;
  if (block_rows == 0) {
    Tensor amax = Tensor::empty({1}), scale = Tensor::from({1}, {1.0f});
    op.scale_inv = Tensor::from({1}, {1.0f});
    ops::fp8_amax(x, amax);
    ops::fp8_update_scale(amax, {fp8, 0.0f, 0.0f, false}, scale, op.scale_inv);
    ops::fp8_quantize(x, scale, op.q, none, none);
  } else {
    op.scale_inv = Tensor::empty({(rows + block_rows - 1) / block_rows, (cols + 127) / 128});
    ops::fp8_quantize_blockwise(x, block_rows, {fp8, 0.0f, 0.0f, true}, op.q, op.scale_inv, none,
                                none);
  }
  return op;
}

void check_gemm(int64_t m, int64_t n, int64_t k, DType a_fp8, DType b_fp8, int64_t a_blocks,
                int64_t b_blocks, uint64_t seed) {
  // Magnitudes vary by row and by 128-column block (see blockwise_values), so blockwise
  // scales differ from block to block.
  const GemmOperand a = quantize_operand(blockwise_values(m, k, seed + 6, false), a_fp8, a_blocks);
  const GemmOperand b = quantize_operand(blockwise_values(n, k, seed + 7, false), b_fp8, b_blocks);
  const Tensor a_gpu = a.q.to(Device::CUDA), a_s_gpu = a.scale_inv.to(Device::CUDA);
  const Tensor b_gpu = b.q.to(Device::CUDA), b_s_gpu = b.scale_inv.to(Device::CUDA);
  Tensor product_sum = Tensor::empty({m, n});
  ops::gemm(abs_dequantized(a.q, a.scale_inv), false, abs_dequantized(b.q, b.scale_inv), true,
            product_sum);
  for (DType c_dtype : kInputs) {
    for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, std::pair{0.5f, 1.0f}}) {
      SCOPED_TRACE("M " + std::to_string(m) + " N " + std::to_string(n) + " K " +
                   std::to_string(k) + " a " + std::string(dtype_name(a_fp8)) + " b " +
                   std::string(dtype_name(b_fp8)) + " scales " + shape_str(a.scale_inv.shape()) +
                   " x " + shape_str(b.scale_inv.shape()) + " c " +
                   std::string(dtype_name(c_dtype)) + " alpha " + std::to_string(alpha) + " beta " +
                   std::to_string(beta));
      // beta 0: c starts as NaN and must not be read; beta 1: c holds values to add to
      // (rounded to c's dtype), the same on both devices.
      Tensor start = randn({m, n}, seed + 8);
      Tensor c_cpu = start.to(c_dtype);
      if (beta == 0.0f) c_cpu.fill(NAN);
      Tensor c_gpu = c_cpu.to(Device::CUDA);
      ops::fp8_gemm(a.q, a.scale_inv, b.q, b.scale_inv, c_cpu, alpha, beta);
      ops::fp8_gemm(a_gpu, a_s_gpu, b_gpu, b_s_gpu, c_gpu, alpha, beta);
      Tensor want = c_cpu.to(DType::F32), got = c_gpu.to(Device::CPU).to(DType::F32);
      const double error = testing::rel_error(got, want);
      const bool bf16 = c_dtype == DType::BF16;
      // The measured error, for tightening the tolerance on a given GPU.
      std::printf(
          "fp8_gemm M %lld N %lld K %lld %s x %s (scales %s x %s) c %s beta %g: "
          "relative error %.3g\n",
          static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
          std::string(dtype_name(a_fp8)).c_str(), std::string(dtype_name(b_fp8)).c_str(),
          shape_str(a.scale_inv.shape()).c_str(), shape_str(b.scale_inv.shape()).c_str(),
          std::string(dtype_name(c_dtype)).c_str(), double(beta), error);
      EXPECT_LE(error, bf16 ? kGemmBf16WholeRel : kGemmF32WholeRel);
      Tensor scaled_sum = product_sum.clone();
      ops::scale_(scaled_sum, alpha);
      EXPECT_TRUE(within_product_sum(got, want, scaled_sum,
                                     bf16 ? kGemmProductSumRelBf16 : kGemmProductSumRel));
    }
  }
}

TEST(CudaFp8, GemmPerTensorMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // E4M3 x E4M3 (forward), E5M2 x E4M3 (hybrid dgrad: the E5M2 gradient times the
  // weight), E4M3 x E5M2 (hybrid wgrad with the gradient as b).
  const std::pair<DType, DType> formats[] = {{DType::F8E4M3, DType::F8E4M3},
                                             {DType::F8E5M2, DType::F8E4M3},
                                             {DType::F8E4M3, DType::F8E5M2}};
  const int64_t shapes[][3] = {{16, 16, 16}, {48, 80, 112}, {256, 384, 1024}, {512, 1024, 4096}};
  for (auto [a_fp8, b_fp8] : formats)
    for (const auto& s : shapes) check_gemm(s[0], s[1], s[2], a_fp8, b_fp8, 0, 0, seed);
}

TEST(CudaFp8, GemmBlockwiseMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // a in 1x128 blocks; b in 128x128 blocks (fprop, dgrad: the weight) or 1x128 (wgrad).
  // K = 640 has 5 K-blocks: the 128x128 scales are repacked to cuBLAS's stride of 8.
  // N = 144 ends in a partial 128-row block.
  const int64_t shapes[][3] = {
      {128, 256, 128}, {256, 384, 1024}, {48, 144, 640}, {512, 1024, 4096}};
  for (const auto& s : shapes) {
    for (int64_t b_blocks : {128, 1}) {
      check_gemm(s[0], s[1], s[2], DType::F8E4M3, DType::F8E4M3, 1, b_blocks, seed);
      check_gemm(s[0], s[1], s[2], DType::F8E5M2, DType::F8E4M3, 1, b_blocks, seed);
    }
  }
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
