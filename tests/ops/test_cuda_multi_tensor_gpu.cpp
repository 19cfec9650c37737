// CUDA multi-tensor ops against the single-tensor GPU ops (bitwise: multi_tensor_adamw with
// its BF16/F16/F32 param copies and its grad_scale, multi_tensor_scale_), the sum of squares
// against an fp64 sum on the CPU and the zero count against the CPU op and the number of
// zeros planted among random values, NaNs and denormals. Lists have 1..500 tensors of odd sizes,
// 0-element tensors among them, more tensors than one launch takes, and views offset by
// one element so that both the vectorized and the scalar paths run.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
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

// CONVENTIONS.md: CUDA fp32 elementwise tolerance (GPU fp32 arithmetic vs CPU fp64).
constexpr double kF32Atol = 1e-5, kF32Rtol = 1e-4;

// `count` sizes: about 1 in 8 empty, most below a few thousand with every remainder mod 4,
// and about 1 in 16 larger than several chunks of either kernel (16384 and 65536).
std::vector<int64_t> random_sizes(size_t count, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> kind(0, 15);
  std::uniform_int_distribution<int64_t> small(1, 67), medium(68, 5003), large(60000, 300001);
  std::vector<int64_t> sizes(count);
  for (int64_t& s : sizes) {
    const int k = kind(gen);
    s = k < 2 ? 0 : k < 8 ? small(gen) : k < 15 ? medium(gen) : large(gen);
  }
  return sizes;
}

// `host` (F32) as `dtype` on the GPU; with `offset`, a view starting one element into its
// buffer (4 or 2 bytes: not aligned for vector access).
Tensor upload(const Tensor& host, DType dtype, bool offset) {
  const int64_t n = host.numel();
  Tensor buffer = Tensor::zeros({n + 1}, dtype, Device::CUDA);
  Tensor view = buffer.rows(offset ? 1 : 0, n).view(host.shape());
  view.copy_from(host.to(dtype));
  return view;
}

// Same dtype, numel and bytes (device tensors are copied to the host first).
::testing::AssertionResult bitwise_equal(const Tensor& a_any, const Tensor& b_any) {
  const Tensor a = a_any.to(Device::CPU), b = b_any.to(Device::CPU);
  if (a.dtype() != b.dtype() || a.numel() != b.numel())
    return ::testing::AssertionFailure()
           << dtype_name(a.dtype()) << " " << shape_str(a.shape()) << " vs "
           << dtype_name(b.dtype()) << " " << shape_str(b.shape());
  const size_t es = dtype_size(a.dtype());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(static_cast<const char*>(a.raw()) + i * es,
                    static_cast<const char*>(b.raw()) + i * es, es) != 0)
      return ::testing::AssertionFailure()
             << "element " << i << " of " << a.numel() << ": " << a.item(i) << " vs " << b.item(i);
  return ::testing::AssertionSuccess();
}

// ------------------------------------------------------------------- sum of squares

// Both sides sum in fp64 in different orders; CPU reference from the values the GPU holds.
TEST(CudaMultiTensorSumOfSquares, MatchesCpuFp64AndRepeatsOverListsOf1To500) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::mt19937_64 gen(seed);
  for (size_t count : {1, 2, 7, 159, 160, 161, 333, 500}) {
    const std::vector<int64_t> sizes = random_sizes(count, seed + count);
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(fmt::format("{} tensors, {}", count, dtype_name(dtype)));
      std::vector<Tensor> list;
      double reference = 0.0;
      for (size_t i = 0; i < count; ++i) {
        // Values as the GPU holds them (rounded for BF16 and F16).
        Tensor host = randn({sizes[i]}, seed + 7919 * i + count, 2.0f).to(dtype).to(DType::F32);
        for (int64_t j = 0; j < host.numel(); ++j)
          reference += double(host.f32()[j]) * host.f32()[j];
        list.push_back(upload(host, dtype, gen() % 3 == 0));
      }
      const double got = ops::multi_tensor_sum_of_squares(list);
      EXPECT_NEAR(got, reference, 1e-6 * reference);
      // Deterministic: the same bits again.
      EXPECT_EQ(std::bit_cast<uint64_t>(ops::multi_tensor_sum_of_squares(list)),
                std::bit_cast<uint64_t>(got));
    }
  }
}

// The sum does not depend on whether a tensor is read with vector or scalar loads.
TEST(CudaMultiTensorSumOfSquares, SameBitsForAlignedAndOffsetViews) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<int64_t> sizes = random_sizes(40, seed);
  std::vector<Tensor> aligned, offset;
  for (size_t i = 0; i < sizes.size(); ++i) {
    Tensor host = randn({sizes[i]}, seed + i);
    aligned.push_back(upload(host, DType::F32, false));
    offset.push_back(upload(host, DType::F32, true));
  }
  EXPECT_EQ(std::bit_cast<uint64_t>(ops::multi_tensor_sum_of_squares(aligned)),
            std::bit_cast<uint64_t>(ops::multi_tensor_sum_of_squares(offset)));
}

TEST(CudaMultiTensorSumOfSquares, EmptyTensorsAndMixedDevices) {
  SKIP_WITHOUT_GPU();
  std::vector<Tensor> empties = {Tensor::empty({0}, DType::F32, Device::CUDA),
                                 Tensor::empty({4, 0}, DType::BF16, Device::CUDA)};
  EXPECT_EQ(ops::multi_tensor_sum_of_squares(empties), 0.0);
  std::vector<Tensor> mixed = {Tensor::zeros({3}, DType::F32, Device::CUDA), Tensor::zeros({3})};
  EXPECT_THROW(ops::multi_tensor_sum_of_squares(mixed), InternalError);
}

// ---------------------------------------------------------------------- count zeros

// Overwrites about 1 in `every` elements of x (F32, CPU) with a special value: +0, -0,
// NaN (both signs), +-Inf, the smallest and largest denormals of both signs, or 1e-40f;
// random values that happen to be exactly 0 become 1. Returns the number of elements now
// equal to +0 or -0: only those planted, so the count is known without the op's test.
int64_t plant_zeros(Tensor& x, uint64_t seed, int every) {
  const float denorm_min = std::numeric_limits<float>::denorm_min();
  const float denorm_max = std::bit_cast<float>(uint32_t(0x007fffff));
  const float specials[] = {0.0f,       -0.0f,       std::nanf(""), -std::nanf(""),
                            INFINITY,   -INFINITY,   denorm_min,    -denorm_min,
                            denorm_max, -denorm_max, 1e-40f};
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> pick(0, every - 1);
  std::uniform_int_distribution<size_t> kind(0, std::size(specials) - 1);
  int64_t zeros = 0;
  float* v = x.f32();
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (v[i] == 0.0f) v[i] = 1.0f;
    if (pick(gen) != 0) continue;
    const size_t k = kind(gen);
    v[i] = specials[k];
    zeros += k < 2;
  }
  return zeros;
}

// 1, 65537 and 2,000,003 elements: one element, a chunk and one more, and 31 chunks of
// 65536; aligned and offset (scalar path) views. The count equals the CPU op's and the
// planted number, and a chunk of only zeros counts in full.
TEST(CudaMultiTensorCountZeros, MatchesCpuAndPlantedCountOverChunks) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<int64_t> sizes = {1, 65537, 2000003};
  for (bool offset : {false, true}) {
    SCOPED_TRACE(offset ? "offset views" : "aligned views");
    std::vector<Tensor> host, device;
    int64_t planted = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      Tensor x = randn({sizes[i]}, seed + 31 * i, 0.01f);
      planted += plant_zeros(x, seed + 31 * i + 1, 13);
      host.push_back(x);
    }
    // The one-element tensor holds -0, and the whole second chunk of the largest tensor
    // is zero (-0 and +0 alternating).
    auto make_zero = [&](float& v, float zero) {
      if ((std::bit_cast<uint32_t>(v) << 1) != 0) ++planted;
      v = zero;
    };
    make_zero(host[0].f32()[0], -0.0f);
    for (int64_t j = 65536; j < 2 * 65536; ++j) make_zero(host[2].f32()[j], j % 2 ? -0.0f : 0.0f);
    for (const Tensor& x : host) device.push_back(upload(x, DType::F32, offset));
    ASSERT_GT(planted, 65536);
    const int64_t cpu = ops::multi_tensor_count_zeros(host);
    EXPECT_EQ(cpu, planted);
    const int64_t got = ops::multi_tensor_count_zeros(device);
    EXPECT_EQ(got, cpu);
    EXPECT_EQ(ops::multi_tensor_count_zeros(device), got);  // repeatable
    for (size_t i = 0; i < sizes.size(); ++i)
      EXPECT_EQ(ops::multi_tensor_count_zeros({device[i]}),
                ops::multi_tensor_count_zeros({host[i]}))
          << "tensor " << i;
  }
}

// More tensors than one launch takes (160), 0-element tensors among them.
TEST(CudaMultiTensorCountZeros, MatchesCpuOverListsOf1To500) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::mt19937_64 gen(seed);
  for (size_t count : {1, 159, 160, 161, 500}) {
    SCOPED_TRACE(fmt::format("{} tensors", count));
    const std::vector<int64_t> sizes = random_sizes(count, seed + count);
    std::vector<Tensor> host, device;
    int64_t planted = 0;
    for (size_t i = 0; i < count; ++i) {
      Tensor x = randn({sizes[i]}, seed + 7919 * i + count);
      planted += plant_zeros(x, seed + 7919 * i + count + 1, 9);
      device.push_back(upload(x, DType::F32, gen() % 3 == 0));
      host.push_back(x);
    }
    EXPECT_EQ(ops::multi_tensor_count_zeros(host), planted);
    EXPECT_EQ(ops::multi_tensor_count_zeros(device), planted);
  }
}

TEST(CudaMultiTensorCountZeros, EmptyTensorsMixedDevicesAndNonF32) {
  SKIP_WITHOUT_GPU();
  std::vector<Tensor> empties = {Tensor::empty({0}, DType::F32, Device::CUDA),
                                 Tensor::empty({4, 0}, DType::F32, Device::CUDA)};
  EXPECT_EQ(ops::multi_tensor_count_zeros(empties), 0);
  std::vector<Tensor> mixed = {Tensor::zeros({3}, DType::F32, Device::CUDA), Tensor::zeros({3})};
  EXPECT_THROW(ops::multi_tensor_count_zeros(mixed), InternalError);
  std::vector<Tensor> mixed_cpu_first = {Tensor::zeros({3}),
                                         Tensor::zeros({3}, DType::F32, Device::CUDA)};
  EXPECT_THROW(ops::multi_tensor_count_zeros(mixed_cpu_first), InternalError);
  std::vector<Tensor> bf16 = {Tensor::zeros({3}, DType::F32, Device::CUDA),
                              Tensor::zeros({3}, DType::BF16, Device::CUDA)};
  EXPECT_THROW(ops::multi_tensor_count_zeros(bf16), InternalError);
}

// --------------------------------------------------------------------------- scale_

TEST(CudaMultiTensorScale, EqualsSingleTensorScaleBitwise) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::mt19937_64 gen(seed);
  const std::vector<int64_t> sizes = random_sizes(170, seed);  // two launches
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<Tensor> multi, single;
    for (size_t i = 0; i < sizes.size(); ++i) {
      Tensor host = randn({sizes[i]}, seed + i, 3.0f);
      const bool offset = gen() % 3 == 0;
      multi.push_back(upload(host, dtype, offset));
      single.push_back(upload(host, dtype, offset));
    }
    for (Tensor& t : single) ops::scale_(t, 0.3712f);
    ops::multi_tensor_scale_(multi, 0.3712f);
    for (size_t i = 0; i < sizes.size(); ++i)
      EXPECT_TRUE(bitwise_equal(multi[i], single[i])) << "tensor " << i << " of " << sizes[i];
  }
}

// ---------------------------------------------------------------------------- AdamW

struct AdamWLists {
  std::vector<Tensor> params, exp_avg, exp_avg_sq, copies;
};

// The compute copies AdamW may write after the update.
const DType kCopyDtypes[] = {DType::BF16, DType::F32, DType::F16};

// 150 tensors (three launches of at most 64), one of 1000003 elements (62 chunks); the
// buffers of each tensor independently aligned or offset; copies none / BF16 / F32 / F16
// (--fp16's compute weights: the param rounded to nearest even, as the CPU rounds). Three
// steps of the multi-tensor op against adamw_step + cast per tensor on the GPU, bitwise,
// with the copies poisoned before every step; and the params against the CPU op.
TEST(CudaMultiTensorAdamW, EqualsSingleTensorGpuOpsBitwiseIncludingCopies) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::mt19937_64 gen(seed);
  std::vector<int64_t> sizes = random_sizes(150, seed);
  sizes[3] = 1000003;
  sizes[0] = 0;
  const size_t n = sizes.size();
  const float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  std::vector<float> weight_decays(n);
  for (size_t i = 0; i < n; ++i) weight_decays[i] = i % 4 == 1 ? 0.0f : 0.1f + 1e-3f * float(i);

  AdamWLists multi, single, cpu;
  std::vector<bool> grad_offset(n);
  for (size_t i = 0; i < n; ++i) {
    Tensor p = randn({sizes[i]}, seed + i, 0.5f);
    Tensor zeros = Tensor::zeros({sizes[i]});
    const bool p_off = gen() % 4 == 0, m_off = gen() % 8 == 0, v_off = gen() % 8 == 0;
    grad_offset[i] = gen() % 8 == 0;
    for (AdamWLists* l : {&multi, &single}) {
      l->params.push_back(upload(p, DType::F32, p_off));
      l->exp_avg.push_back(upload(zeros, DType::F32, m_off));
      l->exp_avg_sq.push_back(upload(zeros, DType::F32, v_off));
    }
    cpu.params.push_back(p.clone());
    cpu.exp_avg.push_back(zeros.clone());
    cpu.exp_avg_sq.push_back(zeros.clone());
    cpu.copies.emplace_back();
    const int kind = int(i % 4);  // 0 no copy, then BF16, F32, F16
    const bool copy_off = gen() % 4 == 0;
    for (AdamWLists* l : {&multi, &single}) {
      if (kind == 0)
        l->copies.emplace_back();
      else
        l->copies.push_back(upload(zeros, kCopyDtypes[kind - 1], copy_off));
    }
  }

  const float lrs[] = {1e-2f, 3e-3f, 7e-4f};
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const float lr = lrs[step - 1];
    std::vector<Tensor> grads, cpu_grads;
    for (size_t i = 0; i < n; ++i) {
      cpu_grads.push_back(randn({sizes[i]}, seed + 100003 * step + i, 0.1f));
      grads.push_back(upload(cpu_grads.back(), DType::F32, grad_offset[i]));
      if (multi.copies[i].defined()) {
        poison(multi.copies[i]);
        poison(single.copies[i]);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      ops::adamw_step(single.params[i], grads[i], single.exp_avg[i], single.exp_avg_sq[i], lr,
                      beta1, beta2, eps, weight_decays[i], step);
      if (single.copies[i].defined()) ops::cast(single.params[i], single.copies[i]);
    }
    ops::multi_tensor_adamw(multi.params, grads, multi.exp_avg, multi.exp_avg_sq, multi.copies,
                            weight_decays, lr, beta1, beta2, eps, step, 1.0f);
    ops::multi_tensor_adamw(cpu.params, cpu_grads, cpu.exp_avg, cpu.exp_avg_sq, cpu.copies,
                            weight_decays, lr, beta1, beta2, eps, step, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE(fmt::format("tensor {} of {} elements", i, sizes[i]));
      ASSERT_TRUE(bitwise_equal(multi.params[i], single.params[i]));
      ASSERT_TRUE(bitwise_equal(multi.exp_avg[i], single.exp_avg[i]));
      ASSERT_TRUE(bitwise_equal(multi.exp_avg_sq[i], single.exp_avg_sq[i]));
      if (multi.copies[i].defined()) {
        ASSERT_TRUE(bitwise_equal(multi.copies[i], single.copies[i]));
      }
    }
  }
  for (size_t i = 0; i < n; ++i) {
    SCOPED_TRACE(fmt::format("tensor {} of {} elements", i, sizes[i]));
    EXPECT_TRUE(allclose(multi.params[i].to(Device::CPU), cpu.params[i], kF32Atol, kF32Rtol));
    // No poison left in a copy: each holds the final param rounded to its dtype.
    if (multi.copies[i].defined()) {
      EXPECT_TRUE(bitwise_equal(multi.copies[i],
                                multi.params[i].to(Device::CPU).to(multi.copies[i].dtype())));
    }
  }
}

// grad_scale (the folded clipping coefficient) against the path it replaces, on the GPU:
// scale_ on a copy of each gradient (same alignment), then adamw_step + cast per tensor;
// bitwise over three steps (scales below one and exactly one), with 100 tensors (two
// launches), offset views and all four copy kinds. The gradients passed to the
// multi-tensor op keep their bits, and the params match the CPU op with the same scale.
TEST(CudaMultiTensorAdamW, GradScaleEqualsScalingTheGradsFirstBitwiseAndLeavesGradsUnchanged) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::mt19937_64 gen(seed);
  std::vector<int64_t> sizes = random_sizes(100, seed + 17);
  sizes[5] = 100003;
  const size_t n = sizes.size();
  const float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  std::vector<float> weight_decays(n);
  for (size_t i = 0; i < n; ++i) weight_decays[i] = i % 4 == 1 ? 0.0f : 0.1f;

  AdamWLists multi, single, cpu;
  std::vector<bool> grad_offset(n);
  for (size_t i = 0; i < n; ++i) {
    Tensor p = randn({sizes[i]}, seed + 31 * i, 0.5f);
    Tensor zeros = Tensor::zeros({sizes[i]});
    const bool p_off = gen() % 4 == 0, state_off = gen() % 8 == 0, copy_off = gen() % 4 == 0;
    grad_offset[i] = gen() % 4 == 0;
    const int kind = int(i % 4);  // 0 no copy, then BF16, F32, F16
    for (AdamWLists* l : {&multi, &single}) {
      l->params.push_back(upload(p, DType::F32, p_off));
      l->exp_avg.push_back(upload(zeros, DType::F32, state_off));
      l->exp_avg_sq.push_back(upload(zeros, DType::F32, state_off));
      if (kind == 0)
        l->copies.emplace_back();
      else
        l->copies.push_back(upload(zeros, kCopyDtypes[kind - 1], copy_off));
    }
    cpu.params.push_back(p.clone());
    cpu.exp_avg.push_back(zeros.clone());
    cpu.exp_avg_sq.push_back(zeros.clone());
    cpu.copies.emplace_back();
  }

  const float lrs[] = {1e-2f, 3e-3f, 7e-4f};
  const float grad_scales[] = {0.3712f, 1.0f, 0.0625f};
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const float lr = lrs[step - 1], grad_scale = grad_scales[step - 1];
    std::vector<Tensor> grads, scaled_grads, cpu_grads;
    for (size_t i = 0; i < n; ++i) {
      cpu_grads.push_back(randn({sizes[i]}, seed + 100003 * step + i, 2.0f));
      grads.push_back(upload(cpu_grads.back(), DType::F32, grad_offset[i]));
      scaled_grads.push_back(upload(cpu_grads.back(), DType::F32, grad_offset[i]));
      ops::scale_(scaled_grads.back(), grad_scale);
      if (multi.copies[i].defined()) {
        poison(multi.copies[i]);
        poison(single.copies[i]);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      ops::adamw_step(single.params[i], scaled_grads[i], single.exp_avg[i], single.exp_avg_sq[i],
                      lr, beta1, beta2, eps, weight_decays[i], step);
      if (single.copies[i].defined()) ops::cast(single.params[i], single.copies[i]);
    }
    ops::multi_tensor_adamw(multi.params, grads, multi.exp_avg, multi.exp_avg_sq, multi.copies,
                            weight_decays, lr, beta1, beta2, eps, step, grad_scale);
    ops::multi_tensor_adamw(cpu.params, cpu_grads, cpu.exp_avg, cpu.exp_avg_sq, cpu.copies,
                            weight_decays, lr, beta1, beta2, eps, step, grad_scale);
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE(fmt::format("tensor {} of {} elements", i, sizes[i]));
      ASSERT_TRUE(bitwise_equal(grads[i], cpu_grads[i]));  // not scaled in place
      ASSERT_TRUE(bitwise_equal(multi.params[i], single.params[i]));
      ASSERT_TRUE(bitwise_equal(multi.exp_avg[i], single.exp_avg[i]));
      ASSERT_TRUE(bitwise_equal(multi.exp_avg_sq[i], single.exp_avg_sq[i]));
      if (multi.copies[i].defined()) {
        ASSERT_TRUE(bitwise_equal(multi.copies[i], single.copies[i]));
      }
    }
  }
  for (size_t i = 0; i < n; ++i) {
    SCOPED_TRACE(fmt::format("tensor {} of {} elements", i, sizes[i]));
    EXPECT_TRUE(allclose(multi.params[i].to(Device::CPU), cpu.params[i], kF32Atol, kF32Rtol));
    EXPECT_TRUE(allclose(multi.exp_avg[i].to(Device::CPU), cpu.exp_avg[i], kF32Atol, kF32Rtol));
  }
}

// The precision-aware optimizer's kernel (BF16 moments) writes the same copies: F16 and
// BF16 copies are the updated fp32 param rounded to nearest even, F32 copies the param.
TEST(CudaMultiTensorAdamW, PrecisionAwareUpdateWritesEveryCopyDtype) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<int64_t> sizes = {1000, 37, 4099, 0, 65537};
  AdamWLists l;
  std::vector<Tensor> grads;
  std::vector<float> weight_decays;
  for (size_t i = 0; i < sizes.size(); ++i) {
    Tensor zeros = Tensor::zeros({sizes[i]});
    l.params.push_back(upload(randn({sizes[i]}, seed + i, 0.5f), DType::F32, i == 1));
    l.exp_avg.push_back(upload(zeros, DType::BF16, false));
    l.exp_avg_sq.push_back(upload(zeros, DType::BF16, i == 2));
    l.copies.push_back(upload(zeros, kCopyDtypes[i % 3], i == 4));
    grads.push_back(upload(randn({sizes[i]}, seed + 100 + i, 0.1f), DType::F32, false));
    weight_decays.push_back(0.1f);
  }
  for (int64_t step = 1; step <= 2; ++step) {
    for (Tensor& copy : l.copies) poison(copy);
    ops::multi_tensor_adamw(l.params, grads, l.exp_avg, l.exp_avg_sq, l.copies, weight_decays,
                            1e-2f, 0.9f, 0.95f, 1e-8f, step, 1.0f);
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    SCOPED_TRACE(fmt::format("tensor {} of {} elements, {} copy", i, sizes[i],
                             dtype_name(l.copies[i].dtype())));
    const Tensor param = l.params[i].to(Device::CPU);
    EXPECT_TRUE(bitwise_equal(l.copies[i], param.to(l.copies[i].dtype())));
  }
}

TEST(CudaMultiTensorAdamW, RejectsBadListsWithoutUpdatingAnything) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  auto make = [&](int64_t n, uint64_t s) { return upload(randn({n}, s), DType::F32, false); };
  std::vector<Tensor> params = {make(5, seed), make(7, seed + 1)};
  const Tensor before0 = params[0].to(Device::CPU);
  std::vector<Tensor> grads = {make(5, seed + 2), make(7, seed + 3)};
  std::vector<Tensor> m = {make(5, seed + 4), make(7, seed + 5)};
  std::vector<Tensor> v = {make(5, seed + 6).to(Device::CPU), make(7, seed + 7)};
  std::vector<Tensor> copies(2);
  std::vector<float> wd = {0.1f, 0.0f};
  // exp_avg_sq[0] on the CPU.
  EXPECT_THROW(
      ops::multi_tensor_adamw(params, grads, m, v, copies, wd, 1e-2f, 0.9f, 0.999f, 1e-8f, 1, 1.0f),
      InternalError);
  // A copy of the wrong numel in the second entry.
  v[0] = make(5, seed + 6);
  copies[1] = Tensor::zeros({6}, DType::BF16, Device::CUDA);
  EXPECT_THROW(
      ops::multi_tensor_adamw(params, grads, m, v, copies, wd, 1e-2f, 0.9f, 0.999f, 1e-8f, 1, 1.0f),
      InternalError);
  // A non-finite grad_scale.
  copies[1] = Tensor();
  EXPECT_THROW(ops::multi_tensor_adamw(params, grads, m, v, copies, wd, 1e-2f, 0.9f, 0.999f, 1e-8f,
                                       1, std::nanf("")),
               InternalError);
  EXPECT_TRUE(bitwise_equal(params[0], before0));
}

}  // namespace
}  // namespace megaton

#else  // CPU-only build

TEST(CudaMultiTensor, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
