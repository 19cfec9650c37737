// CPU multi-tensor ops (multi_tensor_sum_of_squares, multi_tensor_scale_,
// multi_tensor_adamw) against the single-tensor ops applied one tensor at a time: bitwise
// for scale_ and AdamW (and its param copies, and its grad_scale against scale_ first),
// and the sum of squares also against an fp64 sum written here. multi_tensor_count_zeros
// against the number of zeros planted among random values, NaNs and denormals. Lists hold
// odd sizes, 0-element tensors among them.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::poison;
using testing::randn;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

// Sizes with every remainder mod 4, a single element, empty tensors (also first and
// last) and tensors spanning several of the GPU's chunks.
const std::vector<int64_t> kSizes = {0, 5, 1, 4097, 0, 33, 1000, 70001, 2, 3, 0};

std::vector<Tensor> random_list(const std::vector<int64_t>& sizes, uint64_t seed, float std) {
  std::vector<Tensor> list;
  for (size_t i = 0; i < sizes.size(); ++i) list.push_back(randn({sizes[i]}, seed + i, std));
  return list;
}

std::vector<Tensor> clones(const std::vector<Tensor>& list) {
  std::vector<Tensor> out;
  for (const Tensor& t : list) out.push_back(t.defined() ? t.clone() : Tensor());
  return out;
}

// Same dtype, numel and bytes.
::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.numel() != b.numel())
    return ::testing::AssertionFailure()
           << dtype_name(a.dtype()) << " " << shape_str(a.shape()) << " vs "
           << dtype_name(b.dtype()) << " " << shape_str(b.shape());
  if (a.numel() > 0 && std::memcmp(a.raw(), b.raw(), a.nbytes()) != 0) {
    for (int64_t i = 0; i < a.numel(); ++i)
      if (std::memcmp(static_cast<const char*>(a.raw()) + i * dtype_size(a.dtype()),
                      static_cast<const char*>(b.raw()) + i * dtype_size(b.dtype()),
                      dtype_size(a.dtype())) != 0)
        return ::testing::AssertionFailure()
               << "element " << i << ": " << a.item(i) << " vs " << b.item(i);
  }
  return ::testing::AssertionSuccess();
}

// ------------------------------------------------------------------- sum of squares

TEST(MultiTensorSumOfSquares, EqualsSingleTensorSumsAndFp64Reference) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::vector<Tensor> list = random_list(kSizes, seed, 2.0f);
  double single = 0.0, reference = 0.0;
  for (const Tensor& t : list) {
    single += ops::sum_of_squares(t);
    for (int64_t i = 0; i < t.numel(); ++i) reference += double(t.f32()[i]) * t.f32()[i];
  }
  const double got = ops::multi_tensor_sum_of_squares(list);
  EXPECT_EQ(got, single);  // the same per-tensor sums, added in list order
  EXPECT_NEAR(got, reference, 1e-12 * reference);
  EXPECT_GT(got, 0.0);
}

TEST(MultiTensorSumOfSquares, EmptyListsAndEmptyTensorsGiveZero) {
  EXPECT_EQ(ops::multi_tensor_sum_of_squares({}), 0.0);
  EXPECT_EQ(ops::multi_tensor_sum_of_squares({Tensor::empty({0}), Tensor::empty({3, 0})}), 0.0);
}

TEST(MultiTensorSumOfSquares, RejectsUndefinedAndNonF32Tensors) {
  EXPECT_THROW(ops::multi_tensor_sum_of_squares({randn({3}, 1), Tensor()}), InternalError);
  EXPECT_THROW(ops::multi_tensor_sum_of_squares({randn({3}, 1), Tensor::zeros({3}, DType::I32)}),
               InternalError);
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

TEST(MultiTensorCountZeros, CountsPlantedZerosNotNanInfOrDenormals) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::vector<Tensor> list = random_list(kSizes, seed, 1.0f);
  std::vector<int64_t> planted_per_tensor(list.size());
  int64_t planted = 0, denormals = 0, nans = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    planted_per_tensor[i] = plant_zeros(list[i], seed + 101 * i, 7);
    planted += planted_per_tensor[i];
    for (int64_t j = 0; j < list[i].numel(); ++j) {
      denormals += std::fpclassify(list[i].f32()[j]) == FP_SUBNORMAL;
      nans += std::isnan(list[i].f32()[j]);
    }
  }
  // The inputs hold what the test is about: zeros of both signs, denormals and NaNs.
  ASSERT_GT(planted, 100);
  ASSERT_GT(denormals, 100);
  ASSERT_GT(nans, 10);
  bool negative_zero = false;
  for (const Tensor& t : list)
    for (int64_t j = 0; j < t.numel(); ++j)
      negative_zero |= std::bit_cast<uint32_t>(t.f32()[j]) == 0x80000000u;
  ASSERT_TRUE(negative_zero);
  EXPECT_EQ(ops::multi_tensor_count_zeros(list), planted);
  // Each tensor alone.
  for (size_t i = 0; i < list.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_EQ(ops::multi_tensor_count_zeros({list[i]}), planted_per_tensor[i]);
  }
}

TEST(MultiTensorCountZeros, CountsEveryShapeAndWholeZeroTensors) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // A 2-d and a 3-d tensor (the count ignores shape), an all-zero tensor of both signs,
  // and one past the parallel threshold.
  Tensor matrix = randn({37, 29}, seed, 0.5f), cube = randn({3, 5, 7}, seed + 1);
  Tensor big = randn({100003}, seed + 2);
  int64_t want = plant_zeros(matrix, seed + 3, 5) + plant_zeros(cube, seed + 4, 3) +
                 plant_zeros(big, seed + 5, 11);
  Tensor all_zero = Tensor::zeros({1001});
  for (int64_t j = 0; j < all_zero.numel(); j += 2) all_zero.f32()[j] = -0.0f;
  want += all_zero.numel();
  EXPECT_EQ(ops::multi_tensor_count_zeros({matrix, all_zero, cube, big}), want);
  // Nothing planted, nothing counted (random values made nonzero).
  Tensor clean = randn({4099}, seed + 6);
  EXPECT_EQ(plant_zeros(clean, seed + 7, std::numeric_limits<int>::max()), 0);
  EXPECT_EQ(ops::multi_tensor_count_zeros({clean}), 0);
}

TEST(MultiTensorCountZeros, EmptyListsAndEmptyTensorsGiveZero) {
  EXPECT_EQ(ops::multi_tensor_count_zeros({}), 0);
  EXPECT_EQ(ops::multi_tensor_count_zeros({Tensor::empty({0}), Tensor::empty({3, 0})}), 0);
}

TEST(MultiTensorCountZeros, RejectsUndefinedAndNonF32Tensors) {
  EXPECT_THROW(ops::multi_tensor_count_zeros({randn({3}, 1), Tensor()}), InternalError);
  EXPECT_THROW(ops::multi_tensor_count_zeros({randn({3}, 1), Tensor::zeros({3}, DType::I32)}),
               InternalError);
  EXPECT_THROW(ops::multi_tensor_count_zeros({Tensor::zeros({3}, DType::BF16)}), InternalError);
}

// --------------------------------------------------------------------------- scale_

TEST(MultiTensorScale, EqualsSingleTensorScaleBitwise) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::vector<Tensor> list = random_list(kSizes, seed, 3.0f);
  std::vector<Tensor> ref = clones(list);
  for (Tensor& t : ref) ops::scale_(t, 0.3712f);
  ops::multi_tensor_scale_(list, 0.3712f);
  for (size_t i = 0; i < list.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_TRUE(bitwise_equal(list[i], ref[i]));
    // The op did something: a nonzero element changed.
    if (list[i].numel() > 0) {
      Tensor original = randn({kSizes[i]}, seed + i, 3.0f);
      EXPECT_NE(list[i].f32()[0], original.f32()[0]);
    }
  }
  std::vector<Tensor> none;
  ops::multi_tensor_scale_(none, 2.0f);  // no-op
}

// ---------------------------------------------------------------------------- AdamW

struct AdamWState {
  std::vector<Tensor> params, exp_avg, exp_avg_sq, copies;
};

// Three steps with fresh gradients, lr changing per step, per-tensor weight decay (0 for
// some) and a mix of no copy, BF16 and F32 copies; the copies are poisoned before every
// step so each element must be rewritten.
TEST(MultiTensorAdamW, EqualsSingleTensorOpsBitwiseIncludingCopies) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const size_t n = kSizes.size();
  const float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  std::vector<float> weight_decays(n);
  for (size_t i = 0; i < n; ++i) weight_decays[i] = i % 3 == 1 ? 0.0f : 0.1f + 0.01f * float(i);

  AdamWState multi;
  multi.params = random_list(kSizes, seed, 0.5f);
  for (size_t i = 0; i < n; ++i) {
    multi.exp_avg.push_back(Tensor::zeros({kSizes[i]}));
    multi.exp_avg_sq.push_back(Tensor::zeros({kSizes[i]}));
    // i % 3: 0 no copy, 1 BF16, 2 F32 (shaped [1, n]: a copy need only match in numel).
    if (i % 3 == 0)
      multi.copies.emplace_back();
    else
      multi.copies.push_back(Tensor::empty({1, kSizes[i]}, i % 3 == 1 ? DType::BF16 : DType::F32));
  }
  AdamWState single{clones(multi.params), clones(multi.exp_avg), clones(multi.exp_avg_sq),
                    clones(multi.copies)};

  const float lrs[] = {1e-2f, 3e-3f, 7e-4f};
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const float lr = lrs[step - 1];
    std::vector<Tensor> grads = random_list(kSizes, seed + 1000 * step, 0.1f);
    for (size_t i = 0; i < n; ++i) {
      if (multi.copies[i].defined()) {
        poison(multi.copies[i]);
        poison(single.copies[i]);
      }
      ops::adamw_step(single.params[i], grads[i], single.exp_avg[i], single.exp_avg_sq[i], lr,
                      beta1, beta2, eps, weight_decays[i], step);
      if (single.copies[i].defined()) ops::cast(single.params[i], single.copies[i]);
    }
    ops::multi_tensor_adamw(multi.params, grads, multi.exp_avg, multi.exp_avg_sq, multi.copies,
                            weight_decays, lr, beta1, beta2, eps, step, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE("tensor " + std::to_string(i) + " of " + std::to_string(kSizes[i]));
      EXPECT_TRUE(bitwise_equal(multi.params[i], single.params[i]));
      EXPECT_TRUE(bitwise_equal(multi.exp_avg[i], single.exp_avg[i]));
      EXPECT_TRUE(bitwise_equal(multi.exp_avg_sq[i], single.exp_avg_sq[i]));
      if (multi.copies[i].defined()) {
        EXPECT_TRUE(bitwise_equal(multi.copies[i], single.copies[i]));
        // The copy holds the updated param (rounded to its dtype), not the poison.
        for (int64_t j = 0; j < kSizes[i]; ++j) {
          ASSERT_FALSE(std::isnan(multi.copies[i].item(j))) << "element " << j;
          ASSERT_EQ(
              multi.copies[i].item(j),
              Tensor::from({1}, {multi.params[i].f32()[j]}).to(multi.copies[i].dtype()).item())
              << "element " << j;
        }
      }
    }
  }
  // The per-tensor weight decay reached the update: tensor 5 (wd 0.15) moved differently
  // from the same update with weight decay 0.
  Tensor p = random_list(kSizes, seed, 0.5f)[5], m = Tensor::zeros({kSizes[5]}),
         v = Tensor::zeros({kSizes[5]});
  for (int64_t step = 1; step <= 3; ++step)
    ops::adamw_step(p, random_list(kSizes, seed + 1000 * step, 0.1f)[5], m, v, lrs[step - 1], beta1,
                    beta2, eps, 0.0f, step);
  EXPECT_FALSE(bitwise_equal(p, multi.params[5]));
}

// grad_scale (the folded clipping coefficient) against the path it replaces: scale_ on the
// gradients, then the single-tensor ops; bitwise, over steps with scales below one and
// exactly one, and the caller's gradients are left as they were.
TEST(MultiTensorAdamW, GradScaleEqualsScalingTheGradsFirstBitwiseAndLeavesGradsUnchanged) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const size_t n = kSizes.size();
  const float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  std::vector<float> weight_decays(n);
  for (size_t i = 0; i < n; ++i) weight_decays[i] = i % 3 == 1 ? 0.0f : 0.1f;

  AdamWState multi;
  multi.params = random_list(kSizes, seed, 0.5f);
  for (size_t i = 0; i < n; ++i) {
    multi.exp_avg.push_back(Tensor::zeros({kSizes[i]}));
    multi.exp_avg_sq.push_back(Tensor::zeros({kSizes[i]}));
    if (i % 2 == 0)
      multi.copies.emplace_back();
    else
      multi.copies.push_back(Tensor::empty({kSizes[i]}, DType::BF16));
  }
  AdamWState single{clones(multi.params), clones(multi.exp_avg), clones(multi.exp_avg_sq),
                    clones(multi.copies)};

  const float lrs[] = {1e-2f, 3e-3f, 7e-4f};
  const float grad_scales[] = {0.3712f, 1.0f, 0.0625f};
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const float lr = lrs[step - 1], grad_scale = grad_scales[step - 1];
    std::vector<Tensor> grads = random_list(kSizes, seed + 1000 * step, 2.0f);
    const std::vector<Tensor> grads_before = clones(grads);
    std::vector<Tensor> scaled_grads = clones(grads);
    for (size_t i = 0; i < n; ++i) {
      if (multi.copies[i].defined()) {
        poison(multi.copies[i]);
        poison(single.copies[i]);
      }
      ops::scale_(scaled_grads[i], grad_scale);
      ops::adamw_step(single.params[i], scaled_grads[i], single.exp_avg[i], single.exp_avg_sq[i],
                      lr, beta1, beta2, eps, weight_decays[i], step);
      if (single.copies[i].defined()) ops::cast(single.params[i], single.copies[i]);
    }
    ops::multi_tensor_adamw(multi.params, grads, multi.exp_avg, multi.exp_avg_sq, multi.copies,
                            weight_decays, lr, beta1, beta2, eps, step, grad_scale);
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE("tensor " + std::to_string(i) + " of " + std::to_string(kSizes[i]));
      EXPECT_TRUE(bitwise_equal(grads[i], grads_before[i]));
      EXPECT_TRUE(bitwise_equal(multi.params[i], single.params[i]));
      EXPECT_TRUE(bitwise_equal(multi.exp_avg[i], single.exp_avg[i]));
      EXPECT_TRUE(bitwise_equal(multi.exp_avg_sq[i], single.exp_avg_sq[i]));
      if (multi.copies[i].defined()) {
        EXPECT_TRUE(bitwise_equal(multi.copies[i], single.copies[i]));
      }
      // The scale reached the moments: from zero state, step 1 leaves
      // exp_avg = (1 - beta1) * grad * grad_scale.
      if (step == 1) {
        for (int64_t j = 0; j < kSizes[i]; ++j) {
          const double want = (1.0 - beta1) * double(grads[i].f32()[j]) * grad_scale;
          ASSERT_NEAR(multi.exp_avg[i].f32()[j], want, 1e-6 + 5e-6 * std::fabs(want))
              << "element " << j;
        }
      }
    }
  }
}

TEST(MultiTensorAdamW, RejectsNonFiniteGradScaleWithoutUpdatingAnything) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<int64_t> sizes = {4, 6};
  for (float grad_scale : {std::nanf(""), INFINITY}) {
    std::vector<Tensor> params = random_list(sizes, seed, 1.0f);
    const std::vector<Tensor> before = clones(params);
    std::vector<Tensor> grads = random_list(sizes, seed + 10, 1.0f);
    std::vector<Tensor> m = {Tensor::zeros({4}), Tensor::zeros({6})};
    std::vector<Tensor> v = clones(m), copies(2);
    EXPECT_THROW(ops::multi_tensor_adamw(params, grads, m, v, copies, {0.1f, 0.0f}, 1e-2f, 0.9f,
                                         0.999f, 1e-8f, 1, grad_scale),
                 InternalError);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], before[i]));
  }
}

TEST(MultiTensorAdamW, EmptyListIsANoOp) {
  std::vector<Tensor> none;
  ops::multi_tensor_adamw(none, none, none, none, none, {}, 1e-3f, 0.9f, 0.999f, 1e-8f, 1, 0.5f);
}

// A bad entry anywhere in the lists throws before any tensor is updated.
TEST(MultiTensorAdamW, RejectsBadListsWithoutUpdatingAnything) {
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<int64_t> sizes = {4, 6, 3};
  auto run = [&](auto&& spoil) {
    std::vector<Tensor> params = random_list(sizes, seed, 1.0f);
    std::vector<Tensor> before = clones(params);
    std::vector<Tensor> grads = random_list(sizes, seed + 10, 1.0f);
    std::vector<Tensor> m, v, copies(sizes.size());
    for (int64_t s : sizes) m.push_back(Tensor::zeros({s})), v.push_back(Tensor::zeros({s}));
    std::vector<float> wd(sizes.size(), 0.1f);
    int64_t step = 1;
    spoil(grads, copies, wd, step);
    EXPECT_THROW(ops::multi_tensor_adamw(params, grads, m, v, copies, wd, 1e-2f, 0.9f, 0.999f,
                                         1e-8f, step, 1.0f),
                 InternalError);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], before[i]));
  };
  using L = std::vector<Tensor>;
  using W = std::vector<float>;
  run([](L& g, L&, W&, int64_t&) { g.pop_back(); });                            // lengths
  run([](L&, L&, W& wd, int64_t&) { wd.push_back(0.0f); });                     // lengths
  run([](L& g, L&, W&, int64_t&) { g[2] = Tensor::zeros({4}); });               // numel
  run([](L& g, L&, W&, int64_t&) { g[2] = Tensor(); });                         // undefined
  run([](L&, L& c, W&, int64_t&) { c[2] = Tensor::zeros({3}, DType::I32); });   // copy dtype
  run([](L&, L& c, W&, int64_t&) { c[1] = Tensor::zeros({5}, DType::BF16); });  // copy numel
  run([](L&, L&, W&, int64_t& step) { step = 0; });                             // 1-based step
}

}  // namespace
}  // namespace megaton
