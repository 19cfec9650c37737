// CUDA norms, activations, dropout and embedding against the CPU reference ops.
//
// Inputs are random, seeded and rounded to values BF16 and F16 both hold exactly, so the
// CPU reference (fp32 on those values) and the GPU (F32, BF16 or F16 copies of the same
// values) see identical numbers; what differs is only fp32-vs-fp64 arithmetic and, for
// BF16 and F16 runs, the rounding of outputs.
// Outputs are poisoned with NaN first, so an element a kernel skips fails the check.
#ifdef MEGATON_WITH_CUDA

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.h"
#include "core/cuda/cuda_check.h"
#include "ops/determinism.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randint;
using testing::randn;
using testing::rel_error;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))
#define SKIP_WITHOUT_GPU() \
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device"

// Tolerances (CONVENTIONS.md). BF16 outputs carry one bf16 rounding (2^-9 relative), hence
// rtol 2e-2 elementwise; F32 outputs are "CUDA fp32". Statistics and main grads are F32
// sums whose only error is fp32 vs the CPU's fp64 accumulation.
constexpr double kBf16WholeRel = 1e-2, kBf16Atol = 1e-2, kBf16Rtol = 2e-2;
// F16 outputs: one rounding, 2^-11 relative (fp16 1e-5/1e-3), far below BF16's: an F16
// output computed or stored as BF16 fails these.
constexpr double kF16WholeRel = 1e-3, kF16Atol = 1e-5, kF16Rtol = 1e-3;
constexpr double kF32WholeRel = 1e-5, kF32Atol = 1e-5, kF32Rtol = 1e-4;
constexpr double kStatRel = 1e-4;
// Main grads elementwise: sums of ~1000 O(1) products, |value| ~ 30; fp32 summation
// error is ~1e-5 there, so atol 1e-3 is a wide margin that still catches a wrong element.
constexpr double kMainGradAtol = 1e-3, kMainGradRtol = 1e-4;

constexpr float kEps = 1e-5f;

// {rows, cols}: tiny and odd, two aligned training-like widths, and an odd width that
// takes the unvectorised path.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {
    {7, 33}, {256, 1024}, {1000, 4096}, {300, 1001}};

std::string shape_trace(int64_t rows, int64_t cols, DType dtype) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "] " +
         std::string(dtype_name(dtype));
}

// N(mean, std) values rounded to BF16, then to F16 (which changes only values below F16's
// normal range, |x| < 2^-14), held in fp32: exact in both 16-bit types.
Tensor randn_bf16_values(const Shape& shape, uint64_t seed, float std = 1.0f, float mean = 0.0f) {
  Tensor t = randn(shape, seed, std);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] += mean;
  return t.to(DType::BF16).to(DType::F16).to(DType::F32);
}

// A device copy of the fp32 host tensor t in `dtype`.
Tensor on_gpu(const Tensor& t, DType dtype) { return t.to(dtype).to(Device::CUDA); }

Tensor poisoned_gpu(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::CUDA);
  t.fill(NAN);
  return t;
}

Tensor host_f32(const Tensor& gpu) { return gpu.to(Device::CPU).to(DType::F32); }

// An activation output (dtype of the run) against the fp32 CPU reference.
void expect_output_close(const Tensor& gpu, const Tensor& ref, DType dtype, const char* what) {
  SCOPED_TRACE(what);
  Tensor got = host_f32(gpu);
  if (dtype == DType::BF16) {
    EXPECT_LE(rel_error(got, ref), kBf16WholeRel);
    EXPECT_TRUE(allclose(got, ref, kBf16Atol, kBf16Rtol));
  } else if (dtype == DType::F16) {
    EXPECT_LE(rel_error(got, ref), kF16WholeRel);
    EXPECT_TRUE(allclose(got, ref, kF16Atol, kF16Rtol));
  } else {
    EXPECT_LE(rel_error(got, ref), kF32WholeRel);
    EXPECT_TRUE(allclose(got, ref, kF32Atol, kF32Rtol));
  }
}

// An F32 statistic (mean, rstd): whole-tensor rel error, and every element written.
void expect_stat_close(const Tensor& gpu, const Tensor& ref, const char* what) {
  SCOPED_TRACE(what);
  Tensor got = host_f32(gpu);
  EXPECT_LE(rel_error(got, ref), kStatRel);
  EXPECT_TRUE(allclose(got, ref, 1e-5, kStatRel));
}

void expect_main_grad_close(const Tensor& gpu, const Tensor& ref, const char* what) {
  SCOPED_TRACE(what);
  Tensor got = host_f32(gpu);
  EXPECT_LE(rel_error(got, ref), kStatRel);
  EXPECT_TRUE(allclose(got, ref, kMainGradAtol, kMainGradRtol));
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.to(Device::CPU).to_vector() == b.to(Device::CPU).to_vector();
}

// Activation dtype and weight dtype of a norm run.
struct NormDtypes {
  DType act, weight;
};
const NormDtypes kNormDtypes[] = {{DType::F32, DType::F32},
                                  {DType::BF16, DType::BF16},
                                  {DType::BF16, DType::F32},
                                  {DType::F16, DType::F16},
                                  {DType::F16, DType::F32}};

// ------------------------------------------------------------------------- RMSNorm

TEST(CudaNorm, RmsNormForwardBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (auto [rows, cols] : kShapes) {
    for (NormDtypes dt : kNormDtypes) {
      SCOPED_TRACE(shape_trace(rows, cols, dt.act) + " weight " +
                   std::string(dtype_name(dt.weight)));
      Tensor x = randn_bf16_values({rows, cols}, seed + 1);
      Tensor w = randn_bf16_values({cols}, seed + 2, 0.5f, 1.0f);
      Tensor dy = randn_bf16_values({rows, cols}, seed + 3);
      Tensor dw0 = randn({cols}, seed + 4);  // main grads start nonzero: they accumulate

      // CPU reference (fp32 on the rounded values).
      Tensor y_ref = Tensor::empty({rows, cols}), rstd_ref = Tensor::empty({rows});
      ops::rmsnorm_forward(x, w, kEps, y_ref, rstd_ref);
      Tensor dx_ref = Tensor::empty({rows, cols}), dw_ref = dw0.clone();
      ops::rmsnorm_backward(dy, x, w, rstd_ref, dx_ref, dw_ref);

      Tensor xg = on_gpu(x, dt.act), wg = on_gpu(w, dt.weight);
      Tensor yg = poisoned_gpu({rows, cols}, dt.act), rstdg = poisoned_gpu({rows}, DType::F32);
      ops::rmsnorm_forward(xg, wg, kEps, yg, rstdg);
      expect_output_close(yg, y_ref, dt.act, "y");
      expect_stat_close(rstdg, rstd_ref, "rstd");

      // Backward from the reference rstd, so it is checked on its own.
      Tensor dyg = on_gpu(dy, dt.act), rstd_in = rstd_ref.to(Device::CUDA);
      Tensor dxg = poisoned_gpu({rows, cols}, dt.act), dwg = dw0.to(Device::CUDA);
      ops::rmsnorm_backward(dyg, xg, wg, rstd_in, dxg, dwg);
      expect_output_close(dxg, dx_ref, dt.act, "dx");
      expect_main_grad_close(dwg, dw_ref, "dweight");

      // dweight is reduced without atomics: a second run gives the same bits.
      Tensor dwg_again = dw0.to(Device::CUDA);
      ops::rmsnorm_backward(dyg, xg, wg, rstd_in, dxg, dwg_again);
      EXPECT_TRUE(bitwise_equal(dwg_again, dwg)) << "dweight differs between identical runs";
    }
  }
}

TEST(CudaNorm, RmsNormMergesLeadingDimensions) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  Tensor x = randn_bf16_values({3, 5, 64}, seed + 1);
  Tensor w = randn_bf16_values({64}, seed + 2, 0.5f, 1.0f);
  Tensor y_ref = Tensor::empty({3, 5, 64}), rstd_ref = Tensor::empty({15});
  ops::rmsnorm_forward(x, w, kEps, y_ref, rstd_ref);
  Tensor yg = poisoned_gpu({3, 5, 64}, DType::BF16), rstdg = poisoned_gpu({15}, DType::F32);
  ops::rmsnorm_forward(on_gpu(x, DType::BF16), on_gpu(w, DType::BF16), kEps, yg, rstdg);
  expect_output_close(yg, y_ref, DType::BF16, "y");
  expect_stat_close(rstdg, rstd_ref, "rstd");
}

// ----------------------------------------------------------------------- LayerNorm

TEST(CudaNorm, LayerNormForwardBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (bool with_bias : {true, false}) {
    for (auto [rows, cols] : kShapes) {
      for (NormDtypes dt : kNormDtypes) {
        SCOPED_TRACE(shape_trace(rows, cols, dt.act) + " weight " +
                     std::string(dtype_name(dt.weight)) + (with_bias ? " bias" : " no bias"));
        // Rows with a nonzero mean (2) exercise the centring and the two-pass variance.
        Tensor x = randn_bf16_values({rows, cols}, seed + 1, 1.0f, 2.0f);
        Tensor w = randn_bf16_values({cols}, seed + 2, 0.5f, 1.0f);
        Tensor b = with_bias ? randn_bf16_values({cols}, seed + 3, 0.5f) : Tensor();
        Tensor dy = randn_bf16_values({rows, cols}, seed + 4);
        Tensor dw0 = randn({cols}, seed + 5), db0 = randn({cols}, seed + 6);

        Tensor y_ref = Tensor::empty({rows, cols});
        Tensor mean_ref = Tensor::empty({rows}), rstd_ref = Tensor::empty({rows});
        ops::layernorm_forward(x, w, b, kEps, y_ref, mean_ref, rstd_ref);
        Tensor dx_ref = Tensor::empty({rows, cols}), dw_ref = dw0.clone();
        Tensor db_ref = with_bias ? db0.clone() : Tensor();
        ops::layernorm_backward(dy, x, w, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref);

        Tensor xg = on_gpu(x, dt.act), wg = on_gpu(w, dt.weight);
        Tensor bg = with_bias ? on_gpu(b, dt.weight) : Tensor();
        Tensor yg = poisoned_gpu({rows, cols}, dt.act);
        Tensor meang = poisoned_gpu({rows}, DType::F32), rstdg = poisoned_gpu({rows}, DType::F32);
        ops::layernorm_forward(xg, wg, bg, kEps, yg, meang, rstdg);
        expect_output_close(yg, y_ref, dt.act, "y");
        expect_stat_close(meang, mean_ref, "mean");
        expect_stat_close(rstdg, rstd_ref, "rstd");

        Tensor dyg = on_gpu(dy, dt.act);
        Tensor mean_in = mean_ref.to(Device::CUDA), rstd_in = rstd_ref.to(Device::CUDA);
        Tensor dxg = poisoned_gpu({rows, cols}, dt.act), dwg = dw0.to(Device::CUDA);
        Tensor dbg = with_bias ? db0.to(Device::CUDA) : Tensor();
        ops::layernorm_backward(dyg, xg, wg, mean_in, rstd_in, dxg, dwg, dbg);
        expect_output_close(dxg, dx_ref, dt.act, "dx");
        expect_main_grad_close(dwg, dw_ref, "dweight");
        if (with_bias) expect_main_grad_close(dbg, db_ref, "dbias");

        Tensor dwg_again = dw0.to(Device::CUDA);
        Tensor dbg_again = with_bias ? db0.to(Device::CUDA) : Tensor();
        ops::layernorm_backward(dyg, xg, wg, mean_in, rstd_in, dxg, dwg_again, dbg_again);
        EXPECT_TRUE(bitwise_equal(dwg_again, dwg)) << "dweight differs between identical runs";
        if (with_bias) {
          EXPECT_TRUE(bitwise_equal(dbg_again, dbg)) << "dbias differs between identical runs";
        }
      }
    }
  }
}

// The residual add fused into the norm: forward (sum and y) and backward (dx with the
// residual gradient added) against the CPU's add-then-norm, and the in-place use of the
// model (sum written over x, dx over dresidual) equal to the out-of-place run bit for bit.
TEST(CudaNorm, FusedResidualAddMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (bool layernorm : {false, true}) {
    for (auto [rows, cols] : kShapes) {
      for (NormDtypes dt : kNormDtypes) {
        SCOPED_TRACE(std::string(layernorm ? "LayerNorm " : "RMSNorm ") +
                     shape_trace(rows, cols, dt.act) + " weight " +
                     std::string(dtype_name(dt.weight)));
        Tensor x = randn_bf16_values({rows, cols}, seed + 1);
        Tensor res = randn_bf16_values({rows, cols}, seed + 2, 2.0f);
        Tensor w = randn_bf16_values({cols}, seed + 3, 0.5f, 1.0f);
        Tensor b = randn_bf16_values({cols}, seed + 4);
        Tensor dy = randn_bf16_values({rows, cols}, seed + 5);
        Tensor dres = randn_bf16_values({rows, cols}, seed + 6);
        // The reference norms the sum as the GPU stores it (rounded to the run's dtype).
        Tensor sum_ref = x.clone();
        ops::add_(sum_ref, res);
        Tensor sum_in = sum_ref.to(dt.act).to(DType::F32);
        Tensor y_ref = Tensor::empty({rows, cols}), mean_ref = Tensor::empty({rows});
        Tensor rstd_ref = Tensor::empty({rows}), dx_ref = Tensor::empty({rows, cols});
        Tensor dw_ref = Tensor::zeros({cols}), db_ref = Tensor::zeros({cols});
        if (layernorm) {
          ops::layernorm_forward(sum_in, w, b, kEps, y_ref, mean_ref, rstd_ref);
          ops::layernorm_backward(dy, sum_in, w, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref, dres);
        } else {
          ops::rmsnorm_forward(sum_in, w, kEps, y_ref, rstd_ref);
          ops::rmsnorm_backward(dy, sum_in, w, rstd_ref, dx_ref, dw_ref, dres);
        }

        Tensor xg = on_gpu(x, dt.act), resg = on_gpu(res, dt.act), wg = on_gpu(w, dt.weight);
        Tensor bg = on_gpu(b, dt.weight);
        Tensor sumg = poisoned_gpu({rows, cols}, dt.act), yg = poisoned_gpu({rows, cols}, dt.act);
        Tensor meang = poisoned_gpu({rows}, DType::F32), rstdg = poisoned_gpu({rows}, DType::F32);
        if (layernorm)
          ops::add_layernorm_forward(xg, resg, wg, bg, kEps, sumg, yg, meang, rstdg);
        else
          ops::add_rmsnorm_forward(xg, resg, wg, kEps, sumg, yg, rstdg);
        expect_output_close(sumg, sum_ref, dt.act, "sum");
        expect_output_close(yg, y_ref, dt.act, "y");
        expect_stat_close(rstdg, rstd_ref, "rstd");
        if (layernorm) expect_stat_close(meang, mean_ref, "mean");

        Tensor dyg = on_gpu(dy, dt.act), dresg = on_gpu(dres, dt.act);
        Tensor dxg = poisoned_gpu({rows, cols}, dt.act);
        Tensor dwg = Tensor::zeros({cols}).to(Device::CUDA), dbg = Tensor::zeros({cols}).to(Device::CUDA);
        if (layernorm)
          ops::layernorm_backward(dyg, sumg, wg, meang, rstdg, dxg, dwg, dbg, dresg);
        else
          ops::rmsnorm_backward(dyg, sumg, wg, rstdg, dxg, dwg, dresg);
        expect_output_close(dxg, dx_ref, dt.act, "dx");
        expect_main_grad_close(dwg, dw_ref, "dweight");
        if (layernorm) expect_main_grad_close(dbg, db_ref, "dbias");

        // In place, as the model calls them: the same bits.
        Tensor sum_in_place = xg.clone(), y2 = poisoned_gpu({rows, cols}, dt.act);
        Tensor mean2 = poisoned_gpu({rows}, DType::F32), rstd2 = poisoned_gpu({rows}, DType::F32);
        if (layernorm)
          ops::add_layernorm_forward(sum_in_place, resg, wg, bg, kEps, sum_in_place, y2, mean2, rstd2);
        else
          ops::add_rmsnorm_forward(sum_in_place, resg, wg, kEps, sum_in_place, y2, rstd2);
        EXPECT_TRUE(bitwise_equal(sum_in_place, sumg)) << "in-place sum differs";
        EXPECT_TRUE(bitwise_equal(y2, yg)) << "in-place y differs";
        Tensor dx_in_place = dresg.clone();
        Tensor dw2 = Tensor::zeros({cols}).to(Device::CUDA), db2 = Tensor::zeros({cols}).to(Device::CUDA);
        if (layernorm)
          ops::layernorm_backward(dyg, sumg, wg, meang, rstdg, dx_in_place, dw2, db2, dx_in_place);
        else
          ops::rmsnorm_backward(dyg, sumg, wg, rstdg, dx_in_place, dw2, dx_in_place);
        EXPECT_TRUE(bitwise_equal(dx_in_place, dxg)) << "in-place dx differs";
      }
    }
  }
}

TEST(CudaNorm, DoorChecks) {
  SKIP_WITHOUT_GPU();
  Tensor x = Tensor::zeros({4, 8}, DType::BF16, Device::CUDA);
  Tensor w = Tensor::zeros({8}, DType::BF16, Device::CUDA);
  Tensor y = Tensor::zeros({4, 8}, DType::BF16, Device::CUDA);
  Tensor rstd = Tensor::zeros({4}, DType::F32, Device::CUDA);
  Tensor rstd_bf16 = Tensor::zeros({4}, DType::BF16, Device::CUDA);
  Tensor y_f32 = Tensor::zeros({4, 8}, DType::F32, Device::CUDA);
  Tensor w_short = Tensor::zeros({7}, DType::BF16, Device::CUDA);
  Tensor w_host = Tensor::zeros({8});
  EXPECT_THROW(ops::rmsnorm_forward(x, w, kEps, y, rstd_bf16), InternalError);  // stats are F32
  EXPECT_THROW(ops::rmsnorm_forward(x, w, kEps, y_f32, rstd), InternalError);   // y dtype of x
  EXPECT_THROW(ops::rmsnorm_forward(x, w_short, kEps, y, rstd), InternalError);
  EXPECT_THROW(ops::rmsnorm_forward(x, w_host, kEps, y, rstd), InternalError);  // device mix
  Tensor dweight_bf16 = Tensor::zeros({8}, DType::BF16, Device::CUDA);
  Tensor dx = Tensor::zeros({4, 8}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::rmsnorm_backward(y, x, w, rstd, dx, dweight_bf16), InternalError);
}

// ---------------------------------------------------------------------- activations

TEST(CudaActivation, SwigluForwardBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (auto [rows, ffn] : kShapes) {
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(shape_trace(rows, ffn, dtype) + " (F)");
      Tensor x = randn_bf16_values({rows, 2 * ffn}, seed + 1, 2.0f);
      Tensor dy = randn_bf16_values({rows, ffn}, seed + 2);
      Tensor y_ref = Tensor::empty({rows, ffn}), dx_ref = Tensor::empty({rows, 2 * ffn});
      ops::swiglu_forward(x, y_ref);
      ops::swiglu_backward(dy, x, dx_ref);

      Tensor xg = on_gpu(x, dtype), dyg = on_gpu(dy, dtype);
      Tensor yg = poisoned_gpu({rows, ffn}, dtype), dxg = poisoned_gpu({rows, 2 * ffn}, dtype);
      ops::swiglu_forward(xg, yg);
      ops::swiglu_backward(dyg, xg, dxg);
      expect_output_close(yg, y_ref, dtype, "y");
      expect_output_close(dxg, dx_ref, dtype, "dx");
      // The backward that also writes the forward output: the forward's bits, the same dx.
      Tensor y2 = poisoned_gpu({rows, ffn}, dtype), dx2 = poisoned_gpu({rows, 2 * ffn}, dtype);
      ops::swiglu_backward(dyg, xg, dx2, &y2);
      EXPECT_TRUE(bitwise_equal(y2, yg)) << "recomputed y differs from swiglu_forward's";
      EXPECT_TRUE(bitwise_equal(dx2, dxg)) << "dx differs when y is written";
    }
  }
}

// The non-gated activations: exact GeLU and squared ReLU (relu(x)^2).
TEST(CudaActivation, GeluAndSquaredReluForwardBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  struct Activation {
    const char* name;
    void (*forward)(const Tensor&, Tensor&);
    void (*backward)(const Tensor&, const Tensor&, Tensor&, Tensor*);
  };
  for (const Activation& act :
       {Activation{"gelu", ops::gelu_forward, ops::gelu_backward},
        Activation{"squared_relu", ops::squared_relu_forward, ops::squared_relu_backward}}) {
    for (auto [rows, cols] : kShapes) {
      for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
        SCOPED_TRACE(std::string(act.name) + " " + shape_trace(rows, cols, dtype));
        Tensor x = randn_bf16_values({rows, cols}, seed + 1, 2.0f);
        Tensor dy = randn_bf16_values({rows, cols}, seed + 2);
        Tensor y_ref = Tensor::empty({rows, cols}), dx_ref = Tensor::empty({rows, cols});
        act.forward(x, y_ref);
        act.backward(dy, x, dx_ref, nullptr);

        Tensor xg = on_gpu(x, dtype), dyg = on_gpu(dy, dtype);
        Tensor yg = poisoned_gpu({rows, cols}, dtype), dxg = poisoned_gpu({rows, cols}, dtype);
        act.forward(xg, yg);
        act.backward(dyg, xg, dxg, nullptr);
        expect_output_close(yg, y_ref, dtype, "y");
        expect_output_close(dxg, dx_ref, dtype, "dx");
        Tensor y2 = poisoned_gpu({rows, cols}, dtype), dx2 = poisoned_gpu({rows, cols}, dtype);
        act.backward(dyg, xg, dx2, &y2);
        EXPECT_TRUE(bitwise_equal(y2, yg)) << "recomputed y differs from the forward's";
        EXPECT_TRUE(bitwise_equal(dx2, dxg)) << "dx differs when y is written";
      }
    }
  }
}

TEST(CudaActivation, SigmoidGateForwardBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (auto [rows, cols] : kShapes) {
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(shape_trace(rows, cols, dtype));
      Tensor x = randn_bf16_values({rows, cols}, seed + 1, 2.0f);
      Tensor dy = randn_bf16_values({rows, cols}, seed + 2);
      Tensor logits = randn({rows, 1}, seed + 3, 3.0f);
      Tensor y_ref = Tensor::empty({rows, cols}), dx_ref = Tensor::empty({rows, cols});
      Tensor dlogits_ref = Tensor::empty({rows, 1});
      ops::sigmoid_gate_forward(x, logits, y_ref);
      ops::sigmoid_gate_backward(dy, x, logits, dx_ref, dlogits_ref);

      Tensor xg = on_gpu(x, dtype), dyg = on_gpu(dy, dtype), lg = on_gpu(logits, DType::F32);
      Tensor yg = poisoned_gpu({rows, cols}, dtype), dxg = poisoned_gpu({rows, cols}, dtype);
      Tensor dlg = poisoned_gpu({rows, 1}, DType::F32);
      ops::sigmoid_gate_forward(xg, lg, yg);
      ops::sigmoid_gate_backward(dyg, xg, lg, dxg, dlg);
      expect_output_close(yg, y_ref, dtype, "y");
      expect_output_close(dxg, dx_ref, dtype, "dx");
      // dlogits: an fp32 sum over the row of products of bf16-valued inputs.
      expect_main_grad_close(dlg, dlogits_ref, "dlogits");
      // In place (dx = dy), as the shared expert's backward may call it.
      ops::sigmoid_gate_backward(dyg, xg, lg, dyg, dlg);
      expect_output_close(dyg, dx_ref, dtype, "dx in place");
    }
  }
}

// -------------------------------------------------------------------------- dropout

// Elements where exactly one of a and b is zero.
int64_t zero_pattern_mismatches(const Tensor& a, const Tensor& b) {
  std::vector<float> va = a.to_vector(), vb = b.to_vector();
  int64_t n = 0;
  for (size_t i = 0; i < va.size(); ++i) n += (va[i] == 0.0f) != (vb[i] == 0.0f);
  return n;
}

TEST(CudaDropout, MaskEqualsCpuMaskBitForBit) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const uint64_t drop_seed = 0x1234abcd5678ull ^ seed, stream = 7;
  for (auto [rows, cols] : kShapes) {
    for (float p : {0.0f, 0.1f, 0.5f}) {
      for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
        SCOPED_TRACE(shape_trace(rows, cols, dtype) + " p " + std::to_string(p));
        // N(0, 1) inputs have no zeros, so a zero output marks a dropped element.
        Tensor x = randn_bf16_values({rows, cols}, seed + 1);
        Tensor dy = randn_bf16_values({rows, cols}, seed + 2);
        Tensor y_ref = Tensor::empty({rows, cols}), dx_ref = Tensor::empty({rows, cols});
        ops::dropout_forward(x, y_ref, p, drop_seed, stream);
        ops::dropout_backward(dy, dx_ref, p, drop_seed, stream);

        Tensor xg = on_gpu(x, dtype), dyg = on_gpu(dy, dtype);
        Tensor yg = poisoned_gpu({rows, cols}, dtype), dxg = poisoned_gpu({rows, cols}, dtype);
        ops::dropout_forward(xg, yg, p, drop_seed, stream);
        ops::dropout_backward(dyg, dxg, p, drop_seed, stream);
        Tensor y = host_f32(yg), dx = host_f32(dxg);
        EXPECT_EQ(zero_pattern_mismatches(y, y_ref), 0) << "forward mask differs from the CPU's";
        EXPECT_EQ(zero_pattern_mismatches(dx, dx_ref), 0) << "backward mask differs from the CPU's";
        if (dtype == DType::F32 || p == 0.0f) {
          // Same mask, same fp32 reciprocal, one fp32 multiply (p = 0: a copy): equal bits.
          EXPECT_TRUE(allclose(y, y_ref, 0, 0)) << "y";
          EXPECT_TRUE(allclose(dx, dx_ref, 0, 0)) << "dx";
        } else {
          expect_output_close(yg, y_ref, dtype, "y");
          expect_output_close(dxg, dx_ref, dtype, "dx");
        }
      }
    }
  }
}

TEST(CudaDropout, InPlaceEqualsOutOfPlace) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Tensor x = randn_bf16_values({33, 257}, seed + 1);
    Tensor xg = on_gpu(x, dtype), yg = poisoned_gpu({33, 257}, dtype);
    ops::dropout_forward(xg, yg, 0.3f, 42, 5);
    Tensor inplace = xg.clone();
    ops::dropout_forward(inplace, inplace, 0.3f, 42, 5);
    EXPECT_TRUE(bitwise_equal(inplace, yg));
  }
}

// ------------------------------------------------------------------------ embedding

TEST(CudaEmbedding, ForwardBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // A small vocabulary so ids repeat many times: backward must sum repeated rows.
  const int64_t vocab = 50;
  for (auto [tokens, hidden] : kShapes) {
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(shape_trace(tokens, hidden, dtype) + " (tokens, hidden)");
      // One case with [B, S] ids and a [B, S, H] output.
      Shape ids_shape = tokens == 256 ? Shape{4, 64} : Shape{tokens};
      Shape out_shape = ids_shape;
      out_shape.push_back(hidden);
      Tensor ids = randint(ids_shape, int32_t(vocab), seed + 1);
      Tensor table = randn_bf16_values({vocab, hidden}, seed + 2);
      Tensor dout = randn_bf16_values(out_shape, seed + 3);
      Tensor dtable0 = randn({vocab, hidden}, seed + 4);  // accumulates onto nonzero values

      Tensor out_ref = Tensor::empty(out_shape), dtable_ref = dtable0.clone();
      ops::embedding_forward(ids, table, out_ref);
      ops::embedding_backward(dout, ids, dtable_ref);

      Tensor idsg = ids.to(Device::CUDA);
      Tensor outg = poisoned_gpu(out_shape, dtype);
      ops::embedding_forward(idsg, on_gpu(table, dtype), outg);
      EXPECT_TRUE(allclose(host_f32(outg), out_ref, 0, 0)) << "out is not an exact row copy";

      Tensor dtableg = dtable0.to(Device::CUDA);
      ops::embedding_backward(on_gpu(dout, dtype), idsg, dtableg);
      expect_main_grad_close(dtableg, dtable_ref, "dtable");
    }
  }
}

// --deterministic-mode's embedding backward (ops/determinism.h): the CPU's sums, and the
// same bits on every run even though ids repeat hundreds of times (the atomic version's
// order of additions varies); the vocab-range version skips the ids of other shards.
TEST(CudaEmbedding, DeterministicBackwardRepeatsBitForBit) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  struct Restore {
    ~Restore() { ops::set_deterministic(false); }
  } restore;
  ops::set_deterministic(true);
  const int64_t vocab = 50;
  for (auto [tokens, hidden] : kShapes) {
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(shape_trace(tokens, hidden, dtype) + " (tokens, hidden)");
      Tensor ids = randint({tokens}, int32_t(vocab), seed + 1);
      Tensor dout = randn_bf16_values({tokens, hidden}, seed + 3);
      Tensor dtable0 = randn({vocab, hidden}, seed + 4);
      Tensor ref = dtable0.clone();
      ops::embedding_backward(dout, ids, ref);
      Tensor idsg = ids.to(Device::CUDA), doutg = on_gpu(dout, dtype);
      Tensor first = dtable0.to(Device::CUDA);
      ops::embedding_backward(doutg, idsg, first);
      expect_main_grad_close(first, ref, "dtable");
      if (dtype == DType::F32) {
        // The sorted path's exact bits: per id, an fp32 sum of its rows in token order from
        // zero, added to dtable once (the atomic path's order would differ).
        Tensor sums = Tensor::zeros({vocab, hidden});
        for (int64_t t = 0; t < tokens; ++t)
          for (int64_t j = 0; j < hidden; ++j)
            sums.f32()[ids.i32()[t] * hidden + j] += dout.f32()[t * hidden + j];
        Tensor exact = dtable0.clone();
        for (int64_t i = 0; i < vocab * hidden; ++i) exact.f32()[i] += sums.f32()[i];
        EXPECT_TRUE(bitwise_equal(first, exact)) << "not the in-order sums of the sorted path";
      }
      for (int rep = 0; rep < 3; ++rep) {
        Tensor again = dtable0.to(Device::CUDA);
        ops::embedding_backward(doutg, idsg, again);
        EXPECT_TRUE(bitwise_equal(again, first)) << "run " << rep + 2 << " differs";
      }
      // A shard of rows [20, 40): the other ids add nothing.
      Tensor shard0 = randn({20, hidden}, seed + 5), shard_ref = shard0.clone();
      ops::embedding_backward_vocab_range(dout, ids, 20, shard_ref);
      Tensor shard = shard0.to(Device::CUDA);
      ops::embedding_backward_vocab_range(doutg, idsg, 20, shard);
      expect_main_grad_close(shard, shard_ref, "dtable shard");
    }
  }
}

TEST(CudaEmbedding, DoorChecks) {
  SKIP_WITHOUT_GPU();
  Tensor ids = Tensor::zeros({4}, DType::I32, Device::CUDA);
  Tensor table = Tensor::zeros({10, 8}, DType::BF16, Device::CUDA);
  Tensor out_f32 = Tensor::zeros({4, 8}, DType::F32, Device::CUDA);
  Tensor out_wide = Tensor::zeros({4, 9}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::embedding_forward(ids, table, out_f32), InternalError);  // dtype of table
  EXPECT_THROW(ops::embedding_forward(ids, table, out_wide), InternalError);
  Tensor dout = Tensor::zeros({4, 8}, DType::BF16, Device::CUDA);
  Tensor dtable_bf16 = Tensor::zeros({10, 8}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::embedding_backward(dout, ids, dtable_bf16), InternalError);  // F32 main grad
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
