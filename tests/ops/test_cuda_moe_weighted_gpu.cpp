// CUDA row-weighted MoE expert ops against their CPU twins: weighted SwiGLU / GeLU / squared
// ReLU (the routing probabilities applied after the activation), the probability-weighted
// bias and moe_permute_rows. Inputs rounded to the run's dtype on both devices; outputs
// poisoned before each CUDA op runs.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/cuda/cuda_check.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randn;
using testing::rel_error;

// CONVENTIONS.md: CUDA fp32, bf16 and fp16 outputs (one rounding of an fp32 result).
constexpr double kF32Atol = 1e-5, kF32Rtol = 1e-4, kF32Rel = 1e-5;
constexpr double kBf16Atol = 1e-2, kBf16Rtol = 2e-2, kBf16Rel = 1e-2;
constexpr double kF16Atol = 1e-5, kF16Rtol = 1e-3, kF16Rel = 1e-3;
// F32 row sums (dweights) of up to ~4000 O(1) products: fp32 against the CPU's fp64 sums.
constexpr double kSumAtol = 1e-3, kSumRtol = 1e-4;

class CudaMoeWeightedTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

Tensor to_gpu(const Tensor& t) { return t.to(Device::CUDA); }
Tensor host_f32(const Tensor& t) { return t.to(Device::CPU).to(DType::F32); }

Tensor poisoned_gpu(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::CUDA);
  t.fill(NAN);
  return t;
}

// f32 values rounded to dtype (held in F32): the CPU reference's input.
Tensor rounded(const Tensor& f32, DType dtype) {
  return dtype == DType::F32 ? f32.clone() : f32.to(dtype).to(DType::F32);
}

void expect_close(const Tensor& gpu, const Tensor& ref, DType dtype, const char* what) {
  SCOPED_TRACE(what);
  const Tensor got = host_f32(gpu);
  if (dtype == DType::BF16) {
    EXPECT_LE(rel_error(got, ref), kBf16Rel);
    EXPECT_TRUE(allclose(got, ref, kBf16Atol, kBf16Rtol));
  } else if (dtype == DType::F16) {
    EXPECT_LE(rel_error(got, ref), kF16Rel);
    EXPECT_TRUE(allclose(got, ref, kF16Atol, kF16Rtol));
  } else {
    EXPECT_LE(rel_error(got, ref), kF32Rel);
    EXPECT_TRUE(allclose(got, ref, kF32Atol, kF32Rtol));
  }
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  return x.nbytes() == y.nbytes() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

enum class Act { Swiglu, Gelu, SquaredRelu };

void forward(Act act, const Tensor& x, const Tensor& w, Tensor& y) {
  switch (act) {
    case Act::Swiglu:
      ops::weighted_swiglu_forward(x, w, y);
      break;
    case Act::Gelu:
      ops::weighted_gelu_forward(x, w, y);
      break;
    case Act::SquaredRelu:
      ops::weighted_squared_relu_forward(x, w, y);
      break;
  }
}
void backward(Act act, const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dx, Tensor& dw,
              Tensor* y) {
  switch (act) {
    case Act::Swiglu:
      ops::weighted_swiglu_backward(dy, x, w, dx, dw, y);
      break;
    case Act::Gelu:
      ops::weighted_gelu_backward(dy, x, w, dx, dw, y);
      break;
    case Act::SquaredRelu:
      ops::weighted_squared_relu_backward(dy, x, w, dx, dw, y);
      break;
  }
}

TEST_P(CudaMoeWeightedTest, WeightedActivationsMatchCpu) {
  const DType dtype = GetParam();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + std::string(dtype_name(dtype)));
  // Tiny and odd, training-like (packed), and an odd width (unpacked path).
  for (auto [rows, ffn] : {std::pair<int64_t, int64_t>{7, 33}, {512, 1024}, {300, 1001}}) {
    for (Act act : {Act::Swiglu, Act::Gelu, Act::SquaredRelu}) {
      SCOPED_TRACE(std::string(act == Act::Swiglu ? "swiglu "
                               : act == Act::Gelu ? "gelu "
                                                  : "squared_relu ") +
                   std::to_string(rows) + "x" + std::to_string(ffn));
      const int64_t in = act == Act::Swiglu ? 2 * ffn : ffn;
      const Tensor x = rounded(randn({rows, in}, seed, 2.0f), dtype);
      const Tensor dy = rounded(randn({rows, ffn}, seed + 1), dtype);
      Tensor w = randn({rows}, seed + 2);
      w.f32()[0] = 0.0f;  // a padding row
      Tensor y_ref = Tensor::empty({rows, ffn}), dx_ref = Tensor::empty({rows, in});
      Tensor dw_ref = Tensor::empty({rows});
      forward(act, x, w, y_ref);
      backward(act, dy, x, w, dx_ref, dw_ref, nullptr);

      const Tensor xg = to_gpu(x.to(dtype)), dyg = to_gpu(dy.to(dtype)), wg = to_gpu(w);
      Tensor yg = poisoned_gpu({rows, ffn}, dtype), dxg = poisoned_gpu({rows, in}, dtype);
      Tensor dwg = poisoned_gpu({rows}, DType::F32);
      forward(act, xg, wg, yg);
      backward(act, dyg, xg, wg, dxg, dwg, nullptr);
      expect_close(yg, y_ref, dtype, "y");
      expect_close(dxg, dx_ref, dtype, "dx");
      EXPECT_TRUE(allclose(host_f32(dwg), dw_ref, kSumAtol, kSumRtol)) << "dweights";
      // The backward that also writes the forward output: its bits, the same gradients.
      Tensor y2 = poisoned_gpu({rows, ffn}, dtype), dx2 = poisoned_gpu({rows, in}, dtype);
      Tensor dw2 = poisoned_gpu({rows}, DType::F32);
      backward(act, dyg, xg, wg, dx2, dw2, &y2);
      EXPECT_TRUE(bitwise_equal(y2, yg)) << "recomputed y differs from the forward's";
      EXPECT_TRUE(bitwise_equal(dx2, dxg));
      EXPECT_TRUE(bitwise_equal(dw2, dwg)) << "dweights not deterministic";
    }
  }
}

TEST_P(CudaMoeWeightedTest, WeightedBiasMatchesCpu) {
  const DType dtype = GetParam();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + std::string(dtype_name(dtype)));
  const int64_t rows = 600, cols = 96;
  const Tensor y0 = rounded(randn({rows, cols}, seed), dtype);
  const Tensor dy = rounded(randn({rows, cols}, seed + 1), dtype);
  const Tensor b = rounded(randn({cols}, seed + 2), dtype), w = randn({rows}, seed + 3);
  Tensor y_ref = y0.clone();
  ops::weighted_bias_add_(y_ref, b, w);
  Tensor db_ref = randn({cols}, seed + 4), dw_ref = randn({rows}, seed + 5);
  Tensor dbg = to_gpu(db_ref), dwg = to_gpu(dw_ref);  // accumulated onto
  ops::weighted_bias_backward(dy, b, w, db_ref, &dw_ref);

  Tensor yg = to_gpu(y0.to(dtype));
  ops::weighted_bias_add_(yg, to_gpu(b.to(dtype)), to_gpu(w));
  expect_close(yg, y_ref, dtype, "y");
  ops::weighted_bias_backward(to_gpu(dy.to(dtype)), to_gpu(b.to(dtype)), to_gpu(w), dbg, &dwg);
  EXPECT_TRUE(allclose(host_f32(dbg), db_ref, kSumAtol, kSumRtol)) << "dbias";
  EXPECT_TRUE(allclose(host_f32(dwg), dw_ref, kSumAtol, kSumRtol)) << "dweights";
}

TEST_P(CudaMoeWeightedTest, PermuteRowsMatchesCpu) {
  const DType dtype = GetParam();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t T = 257, H = 136, k = 4, E = 16;
  const Tensor x = rounded(randn({T, H}, seed), dtype);
  std::vector<int32_t> idx(T * k);
  for (int64_t i = 0; i < T * k; ++i) idx[i] = int32_t((i * 7 + i / 5 + seed) % E);
  const Tensor indices = Tensor::from_i32({T, k}, idx);
  Tensor permuted = Tensor::empty({T * k, H}), map = Tensor::empty({T * k}, DType::I32);
  Tensor counts = Tensor::empty({E}, DType::I64);
  ops::moe_permute(x, indices, int(E), permuted, map, counts);
  Tensor got = poisoned_gpu({T * k, H}, dtype);
  ops::moe_permute_rows(to_gpu(x.to(dtype)), to_gpu(map), int(k), got);
  EXPECT_TRUE(bitwise_equal(got, to_gpu(permuted.to(dtype))));
  // k = 1 over a [T k, 1] F32 view: the probabilities by permuted row.
  const Tensor probs = randn({T, k}, seed + 1);
  Tensor pp_ref = Tensor::empty({T * k, 1});
  ops::moe_permute_rows(probs.view({T * k, 1}), map, 1, pp_ref);
  Tensor pp = poisoned_gpu({T * k, 1}, DType::F32);
  ops::moe_permute_rows(to_gpu(probs).view({T * k, 1}), to_gpu(map), 1, pp);
  EXPECT_TRUE(bitwise_equal(pp, to_gpu(pp_ref)));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaMoeWeightedTest,
                         ::testing::Values(DType::F32, DType::BF16, DType::F16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
