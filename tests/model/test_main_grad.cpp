// BF16 main gradients on the CPU (model/main_grad.h): every op that accumulates a weight
// gradient, run through accumulate_main_grads into BF16 main grads, leaves
// bf16(old + the op's fp32 gradient), one rounding per accumulation; with F32 main grads the
// helper hands the op the main grads themselves (bitwise what the op alone computes). Also
// the BF16 cases of the elementwise ops the grad buffers go through (add_, scale_,
// sum_of_squares).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <vector>

#include "common/testing.h"
#include "model/main_grad.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using Targets = std::vector<Tensor>;
using Op = std::function<void(Targets&)>;

// Random main grads of these shapes in `dtype` (bf16 values either way: an F32 run and a
// BF16 run start from the same numbers).
std::vector<Tensor> start_grads(const std::vector<Shape>& shapes, DType dtype, uint64_t seed) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < shapes.size(); ++i)
    out.push_back(testing::randn(shapes[i], seed + 17 * i, 0.5f).to(DType::BF16).to(dtype));
  return out;
}

std::vector<Tensor*> pointers(std::vector<Tensor>& grads) {
  std::vector<Tensor*> p;
  for (Tensor& g : grads) p.push_back(&g);
  return p;
}

// Runs op three ways and compares: (1) F32 main grads through the helper against op on
// clones of them (bitwise; the helper must hand the op the main grads themselves); (2)
// BF16 main grads through the helper against bf16(old + g), where g is what op adds to
// zeroed fp32 tensors, rounded once (bitwise); (3) twice in a row, so the second
// accumulation starts from a rounded value.
void check_accumulates(const std::vector<Shape>& shapes, const Op& op) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  // (1)
  std::vector<Tensor> f32 = start_grads(shapes, DType::F32, seed);
  std::vector<Tensor> direct;
  for (const Tensor& g : f32) direct.push_back(g.clone());
  const std::vector<const void*> raw = [&] {
    std::vector<const void*> r;
    for (const Tensor& g : f32) r.push_back(g.raw());
    return r;
  }();
  accumulate_main_grads(pointers(f32), [&](Targets& t) {
    for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(t[i].raw(), raw[i]) << "target " << i;
    op(t);
  });
  op(direct);
  for (size_t i = 0; i < f32.size(); ++i)
    EXPECT_TRUE(testing::allclose(f32[i], direct[i], 0, 0)) << "F32 grad " << i;
  // (2), (3)
  std::vector<Tensor> bf16 = start_grads(shapes, DType::BF16, seed);
  for (int round = 0; round < 2; ++round) {
    std::vector<Tensor> want;
    std::vector<Tensor> g;
    for (const Shape& s : shapes) g.push_back(Tensor::zeros(s));
    op(g);
    for (size_t i = 0; i < bf16.size(); ++i) {
      Tensor w = Tensor::empty(shapes[i], DType::BF16);
      const Tensor old = bf16[i].to(DType::F32);
      for (int64_t k = 0; k < w.numel(); ++k)
        w.data<uint16_t>()[k] = float_to_bf16(old.f32()[k] + g[i].f32()[k]);
      want.push_back(w);
    }
    accumulate_main_grads(pointers(bf16), op);
    for (size_t i = 0; i < bf16.size(); ++i) {
      ASSERT_EQ(bf16[i].dtype(), DType::BF16);
      EXPECT_EQ(std::memcmp(bf16[i].raw(), want[i].raw(), size_t(want[i].nbytes())), 0)
          << "BF16 grad " << i << ", accumulation " << round;
      // The op did add something (a test on zeros proves nothing).
      EXPECT_GT(ops::sum_of_squares(g[i]), 0.0) << "grad " << i;
    }
  }
}

TEST(MainGrad, GemmWeightGradient) {
  const uint64_t s = testing::test_seed();
  const Tensor dy = testing::randn({24, 12}, s + 1), x = testing::randn({24, 20}, s + 2);
  check_accumulates({{12, 20}}, [&](Targets& t) {
    gemm_main_grad(dy, true, x, false, t[0]);  // F32 targets: straight into them
  });
  // And gemm_main_grad on the BF16 main grad itself (its own scratch path on the CPU).
  Tensor bf16 = testing::randn({12, 20}, s + 3).to(DType::BF16);
  Tensor want32 = bf16.to(DType::F32);
  Tensor g = Tensor::zeros({12, 20});
  ops::gemm(dy, true, x, false, g, 1.0f, 1.0f);
  gemm_main_grad(dy, true, x, false, bf16);
  for (int64_t k = 0; k < g.numel(); ++k)
    ASSERT_EQ(bf16.data<uint16_t>()[k], float_to_bf16(want32.f32()[k] + g.f32()[k])) << k;
  EXPECT_FALSE(gemm_accumulates_into(dy, x, bf16));  // the CPU gemm is fp32-only
  EXPECT_TRUE(gemm_accumulates_into(dy, x, g));
}

TEST(MainGrad, BiasBackwardAndWeighted) {
  const uint64_t s = testing::test_seed();
  const Tensor dy = testing::randn({30, 16}, s + 1), bias = testing::randn({16}, s + 2);
  const Tensor probs = testing::randn({30}, s + 3);
  check_accumulates({{16}}, [&](Targets& t) { ops::bias_backward(dy, t[0]); });
  check_accumulates({{16}}, [&](Targets& t) { ops::weighted_bias_backward(dy, bias, probs, t[0]); });
}

TEST(MainGrad, NormWeightAndBiasGradients) {
  const uint64_t s = testing::test_seed();
  const int64_t T = 10, H = 24;
  const Tensor x = testing::randn({T, H}, s + 1), dy = testing::randn({T, H}, s + 2);
  const Tensor w = testing::randn({H}, s + 3), b = testing::randn({H}, s + 4);
  Tensor y = Tensor::empty({T, H}), mean = Tensor::empty({T}), rstd = Tensor::empty({T});
  ops::layernorm_forward(x, w, b, 1e-5f, y, mean, rstd);
  check_accumulates({{H}, {H}}, [&](Targets& t) {
    Tensor dx = Tensor::empty({T, H});
    ops::layernorm_backward(dy, x, w, mean, rstd, dx, t[0], t[1]);
  });
  ops::rmsnorm_forward(x, w, 1e-5f, y, rstd);
  check_accumulates({{H}}, [&](Targets& t) {
    Tensor dx = Tensor::empty({T, H});
    ops::rmsnorm_backward(dy, x, w, rstd, dx, t[0]);
  });
}

TEST(MainGrad, EmbeddingScatterAdd) {
  const uint64_t s = testing::test_seed();
  const Tensor dout = testing::randn({40, 8}, s + 1);
  const Tensor ids = testing::randint({40}, 12, s + 2);  // repeated ids: sums within a row
  check_accumulates({{12, 8}}, [&](Targets& t) { ops::embedding_backward(dout, ids, t[0]); });
  check_accumulates({{6, 8}}, [&](Targets& t) {
    ops::embedding_backward_vocab_range(dout, ids, 6, t[0]);  // rows 6..11 of the vocabulary
  });
}

TEST(MainGrad, GroupedExpertWeightGradients) {
  const uint64_t s = testing::test_seed();
  const std::vector<int64_t> rows = {5, 0, 7, 3};  // an empty group keeps its grad
  const Tensor a = testing::randn({15, 6}, s + 1), b = testing::randn({15, 10}, s + 2);
  Tensor counts = Tensor::empty({4}, DType::I64);
  for (int g = 0; g < 4; ++g) counts.i64()[g] = rows[size_t(g)];
  const std::vector<Shape> shapes(4, Shape{6, 10});
  // Group 1 is empty: its g is zero; check_accumulates wants every g nonzero, so the
  // empty group is checked apart below.
  const std::vector<int64_t> full = {5, 2, 5, 3};
  check_accumulates(shapes, [&](Targets& t) { ops::grouped_gemm_wgrad(a, b, t, full); });
  Tensor full_counts = Tensor::empty({4}, DType::I64);
  for (int g = 0; g < 4; ++g) full_counts.i64()[g] = full[size_t(g)];
  check_accumulates(shapes, [&](Targets& t) { ops::grouped_gemm_wgrad(a, b, t, full_counts); });
  std::vector<Tensor> bf16 = start_grads(shapes, DType::BF16, s);
  const Tensor before = bf16[1].clone();
  accumulate_main_grads(pointers(bf16),
                        [&](Targets& t) { ops::grouped_gemm_wgrad(a, b, t, counts); });
  EXPECT_EQ(std::memcmp(bf16[1].raw(), before.raw(), size_t(before.nbytes())), 0);
}

TEST(MainGrad, MixedListAndUndefinedEntries) {
  // An undefined main grad (a LayerNorm without bias) gets an undefined target; F32 and
  // BF16 entries in one call each get their rule.
  std::vector<Tensor> grads = {testing::randn({8}, 1).to(DType::BF16), Tensor(),
                               testing::randn({8}, 2)};
  const Tensor add = testing::randn({8}, 3);
  const Tensor old0 = grads[0].to(DType::F32), old2 = grads[2].clone();
  accumulate_main_grads(pointers(grads), [&](Targets& t) {
    EXPECT_FALSE(t[1].defined());
    EXPECT_EQ(t[0].dtype(), DType::F32);
    EXPECT_EQ(t[2].raw(), grads[2].raw());
    ops::add_(t[0], add);
    ops::add_(t[2], add);
  });
  for (int64_t k = 0; k < 8; ++k) {
    EXPECT_EQ(grads[0].data<uint16_t>()[k], float_to_bf16(old0.f32()[k] + add.f32()[k]));
    EXPECT_EQ(grads[2].f32()[k], old2.f32()[k] + add.f32()[k]);
  }
}

TEST(MainGrad, ScratchIsPooledAndSizedByTheLargestCall) {
  release_main_grad_scratch();
  EXPECT_EQ(main_grad_scratch_bytes(Device::CPU), 0);
  Tensor big = Tensor::zeros({100}, DType::BF16), small = Tensor::zeros({10}, DType::BF16);
  Tensor f32 = Tensor::zeros({1000});
  accumulate_main_grad(f32, [](Tensor&) {});
  EXPECT_EQ(main_grad_scratch_bytes(Device::CPU), 0) << "F32 main grads need no scratch";
  const void* first = nullptr;
  accumulate_main_grad(big, [&](Tensor& t) { first = t.raw(); });
  EXPECT_EQ(main_grad_scratch_bytes(Device::CPU), 400);
  accumulate_main_grad(small, [&](Tensor& t) { EXPECT_EQ(t.raw(), first) << "not reused"; });
  EXPECT_EQ(main_grad_scratch_bytes(Device::CPU), 400);
  // The scratch handed out is zeroed even after a call left values in it.
  accumulate_main_grad(big, [](Tensor& t) { t.fill(3.0f); });
  accumulate_main_grad(small, [](Tensor& t) {
    for (int64_t k = 0; k < t.numel(); ++k) EXPECT_EQ(t.f32()[k], 0.0f);
  });
  EXPECT_THROW(accumulate_main_grad(big, [&](Tensor&) {
                 accumulate_main_grad(small, [](Tensor&) {});
               }),
               InternalError);
  // The pool is usable again after the refused nested call.
  accumulate_main_grad(small, [](Tensor&) {});
  Tensor ints = Tensor::zeros({4}, DType::I32);
  EXPECT_THROW(accumulate_main_grad(ints, [](Tensor&) {}), InternalError);
  release_main_grad_scratch();
  EXPECT_EQ(main_grad_scratch_bytes(Device::CPU), 0);
}

// The elementwise ops on BF16 grad buffers: one fp32 computation, one rounding.
TEST(MainGrad, Bf16AddScaleSumOfSquares) {
  const uint64_t s = testing::test_seed();
  const int64_t n = 70000;  // above the parallel threshold
  Tensor y = testing::randn({n}, s + 1).to(DType::BF16);
  const Tensor x = testing::randn({n}, s + 2, 0.01f);
  const Tensor y0 = y.to(DType::F32);
  ops::add_(y, x, 0.5f);
  for (int64_t k = 0; k < n; ++k)
    ASSERT_EQ(y.data<uint16_t>()[k], float_to_bf16(y0.f32()[k] + 0.5f * x.f32()[k])) << k;
  const Tensor y1 = y.to(DType::F32);
  ops::scale_(y, 0.3f);
  for (int64_t k = 0; k < n; ++k)
    ASSERT_EQ(y.data<uint16_t>()[k], float_to_bf16(y1.f32()[k] * 0.3f)) << k;
  const Tensor wide = y.to(DType::F32);
  EXPECT_EQ(ops::sum_of_squares(y), ops::sum_of_squares(wide));  // same chunked fp64 sum
  std::vector<Tensor> list = {y, wide};
  EXPECT_EQ(ops::multi_tensor_sum_of_squares(list), 2 * ops::sum_of_squares(wide));
}

}  // namespace
}  // namespace megaton
