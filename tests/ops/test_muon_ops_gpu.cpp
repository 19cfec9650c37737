// Muon's ops (ops/muon.h) and the SGD and Lion rules (ops/sgd_lion.h) on the GPU against
// the CPU reference: Newton-Schulz in F32 and BF16 on tall, wide, square and batched
// matrices (the tall ones exercise the transposed GEMM flags), in place, with TF32 GEMMs,
// a forced transpose and the distributed mode; the momentum EMA (with and without a control
// tensor), muon_apply, multi_tensor_sgd and multi_tensor_lion (the same bits as the CPU),
// the QKV split and copy_columns.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "common/testing.h"
#include "ops/muon.h"
#include "ops/ops.h"
#include "ops/sgd_lion.h"

namespace megaton {
namespace {

using ops::NsCoefficients;
using testing::randn;
using testing::to_host_f32;

// The CPU op iterates in fp64; the GPU in fp32 GEMMs (rounding each product, as EO does in
// fp32: test_muon_golden holds EO within 2e-5 of the CPU op on random inputs) or in bf16
// (Megatron's default --muon-fp32-matmul-prec medium: every iterate rounded to bf16). On an
// H200 (2026-11-28) the cases below measured ||gpu - cpu|| / ||cpu|| <= 3.3e-6 in F32 and
// <= 1.9e-2 in BF16 (cans at 6 steps; quintic 5 steps 5e-3 to 9e-3).
constexpr double kF32RelTol = 2e-5, kBf16RelTol = 3e-2;

struct NsCase {
  Shape shape;
  NsCoefficients set;
  int steps;
};
const NsCase kCases[] = {
    {{96, 40}, NsCoefficients::Quintic, 5},   {{40, 96}, NsCoefficients::Quintic, 5},
    {{64, 64}, NsCoefficients::Quintic, 5},   {{96, 40}, NsCoefficients::PolarExpress, 8},
    {{40, 96}, NsCoefficients::Aol, 4},       {{3, 24, 40}, NsCoefficients::Quintic, 5},
    {{2, 40, 24}, NsCoefficients::Cans, 6},   {{256, 1024}, NsCoefficients::Quintic, 5},
    {{1024, 256}, NsCoefficients::Simple, 5},
};

std::string describe(const NsCase& c) {
  return shape_str(c.shape) + " " + ops::ns_coefficients_name(c.set) + " " +
         std::to_string(c.steps) + " steps";
}

TEST(MuonOpsGpu, NewtonSchulzMatchesTheCpuReference) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE(testing::seed_trace(seed));
  for (const NsCase& c : kCases)
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(describe(c) + " " + std::string(dtype_name(dtype)));
      // The CPU sees exactly the values the GPU gets.
      const Tensor g = randn(c.shape, seed + uint64_t(c.steps)).to(dtype).to(DType::F32);
      Tensor want = Tensor::empty(c.shape);
      ops::newton_schulz(g, want, c.set, c.steps);
      const Tensor g_dev = testing::to_device(g, dtype);
      Tensor out = testing::poisoned_device(c.shape, dtype);
      ops::newton_schulz(g_dev, out, c.set, c.steps);
      const Tensor got = to_host_f32(out);
      ASSERT_TRUE(testing::all_finite(got, "out"));
      const double rel = testing::rel_error(got, want);
      std::printf("  %-36s %-4s ||gpu - cpu|| / ||cpu|| = %.2e\n", describe(c).c_str(),
                  std::string(dtype_name(dtype)).c_str(), rel);
      EXPECT_LE(rel, dtype == DType::F32 ? kF32RelTol : kBf16RelTol);
      // In place: the same bits.
      Tensor in_place = testing::to_device(g, dtype);
      ops::newton_schulz(in_place, in_place, c.set, c.steps);
      EXPECT_TRUE(testing::bitwise_equal(to_host_f32(in_place), got));
    }
}

TEST(MuonOpsGpu, NewtonSchulzZeroAndErrors) {
  MEGATON_SKIP_WITHOUT_GPU();
  Tensor zero = Tensor::zeros({8, 12}).to(Device::CUDA);
  Tensor out = testing::poisoned_device({8, 12}, DType::F32);
  ops::newton_schulz(zero, out, NsCoefficients::Quintic, 5);
  EXPECT_TRUE(testing::allclose(to_host_f32(out), Tensor::zeros({8, 12}), 0, 0));
  Tensor f16 = testing::to_device(randn({8, 12}, 1), DType::F16);
  Tensor f16_out = testing::poisoned_device({8, 12}, DType::F16);
  EXPECT_THROW(ops::newton_schulz(f16, f16_out, NsCoefficients::Quintic, 5), InternalError);
  Tensor bf16_out = testing::poisoned_device({8, 12}, DType::BF16);
  EXPECT_THROW(ops::newton_schulz(zero, bf16_out, NsCoefficients::Quintic, 5), InternalError);
}

TEST(MuonOpsGpu, MomentumMatchesTheCpuReference) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 1;
  SCOPED_TRACE(testing::seed_trace(seed));
  for (bool nesterov : {false, true}) {
    Tensor m = randn({33, 65}, seed), g = randn({33, 65}, seed + 1);
    Tensor m_dev = m.to(Device::CUDA), g_dev = g.to(Device::CUDA);
    Tensor u = Tensor::empty(m.shape()), u_dev = testing::poisoned_device(m.shape(), DType::F32);
    for (int step = 0; step < 3; ++step) {
      ops::muon_momentum_update(m, g, 0.9f, nesterov, u);
      ops::muon_momentum_update(m_dev, g_dev, 0.9f, nesterov, u_dev);
    }
    // fp32 torch-style lerp on the GPU, fp64 on the CPU: a few fp32 ulps apart.
    EXPECT_TRUE(testing::allclose(to_host_f32(m_dev), m, 1e-6, 1e-5));
    EXPECT_TRUE(testing::allclose(to_host_f32(u_dev), u, 1e-6, 1e-5));
  }
}

TEST(MuonOpsGpu, QkvSplitAndJoin) {
  MEGATON_SKIP_WITHOUT_GPU();
  const std::vector<int64_t> shapes = ops::qkv_split_shapes(8, 2, 4, true);
  const Tensor u = randn({2 * 40, 6}, testing::test_seed() + 2);
  const std::vector<Tensor> want = ops::split_qkv_update(u, shapes);
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor u_dev = testing::to_device(u, dtype);
    const std::vector<Tensor> pieces = ops::split_qkv_update(u_dev, shapes);
    ASSERT_EQ(pieces.size(), want.size());
    for (size_t i = 0; i < pieces.size(); ++i)
      EXPECT_TRUE(testing::bitwise_equal(to_host_f32(pieces[i]), want[i].to(dtype).to(DType::F32)));
    Tensor joined = testing::poisoned_device(u.shape(), dtype);
    ops::join_qkv_update(pieces, shapes, joined);
    EXPECT_TRUE(testing::bitwise_equal(to_host_f32(joined), u.to(dtype).to(DType::F32)));
  }
}

// ---- Newton-Schulz options ----

// TF32 GEMMs (--muon-fp32-matmul-prec high): inputs rounded to 10 mantissa bits, fp32
// accumulation and iterates. Measured on an H200 (2026-11-28): 7e-4 to 2.8e-3 on most cases,
// 2.9e-2 on cans at 6 steps on [2, 40, 24] (its first step's slope 8.47 amplifies the
// rounding along the small singular directions; BF16 gives 1.9e-2 there), hence 5e-2.
TEST(MuonOpsGpu, NewtonSchulzTf32IsWithinItsBound) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 3;
  SCOPED_TRACE(testing::seed_trace(seed));
  ops::NsOptions tf32;
  tf32.tf32 = true;
  for (const NsCase& c : kCases) {
    SCOPED_TRACE(describe(c));
    const Tensor g = randn(c.shape, seed + uint64_t(c.steps));
    Tensor want = Tensor::empty(c.shape);
    ops::newton_schulz(g, want, c.set, c.steps);
    const Tensor g_dev = g.to(Device::CUDA);
    Tensor out = testing::poisoned_device(c.shape, DType::F32);
    ops::newton_schulz(g_dev, out, c.set, c.steps, tf32);
    Tensor exact = testing::poisoned_device(c.shape, DType::F32);
    ops::newton_schulz(g_dev, exact, c.set, c.steps);
    const Tensor got = to_host_f32(out);
    ASSERT_TRUE(testing::all_finite(got, "out"));
    const double rel = testing::rel_error(got, want);
    std::printf("  %-36s TF32 ||gpu - cpu|| / ||cpu|| = %.2e (F32 GEMMs: %.2e)\n",
                describe(c).c_str(), rel, testing::rel_error(to_host_f32(exact), want));
    EXPECT_LE(rel, 5e-2);
  }
}

TEST(MuonOpsGpu, NewtonSchulzForcedTransposeMatchesTheCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 4;
  SCOPED_TRACE(testing::seed_trace(seed));
  for (const Shape& shape : {Shape{40, 96}, Shape{96, 40}, Shape{2, 24, 40}})
    for (int transpose : {0, 1})
      for (DType dtype : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(shape_str(shape) + " transpose " + std::to_string(transpose) + " " +
                     std::string(dtype_name(dtype)));
        ops::NsOptions options;
        options.transpose = transpose;
        const Tensor g = randn(shape, seed).to(dtype).to(DType::F32);
        Tensor want = Tensor::empty(shape);
        ops::newton_schulz(g, want, NsCoefficients::Quintic, 5, options);
        Tensor out = testing::poisoned_device(shape, dtype);
        ops::newton_schulz(testing::to_device(g, dtype), out, NsCoefficients::Quintic, 5, options);
        const Tensor got = to_host_f32(out);
        ASSERT_TRUE(testing::all_finite(got, "out"));
        EXPECT_LE(testing::rel_error(got, want), dtype == DType::F32 ? kF32RelTol : kBf16RelTol);
      }
}

// Each step's GEMMs run as one strided-batched call over the batch (muon_batched_gemm.cpp)
// with one matrix's algorithm where it takes the batched layouts, else the batched
// heuristic's. On H200s (2026-11-28) BF16 gave each matrix the bits it gets alone; F32 and
// TF32 did not (which one kept the lone algorithm differed between two machines): the same
// GEMMs summed in another order, compared norm-wise. Measured, two runs alike: F32 at most
// 8.3e-7, TF32 1.45e-3 (its rounding grown by the iteration), hence 1e-5 and 1e-2. The matrices'
// sizes (and the Gram matrices') are multiples of 256 bytes, so that every matrix of the batch has
// a lone matrix's alignment, and the plans differ by the batch only. Wide ([32, 48]: iterated as
// stored) and tall ([96, 64]: on g^T).
TEST(MuonOpsGpu, NewtonSchulzBatchEqualsSingleMatrices) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 9;
  SCOPED_TRACE(testing::seed_trace(seed));
  constexpr int64_t kBatch = 5;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{32, 48}, {96, 64}})
    for (const char* mode : {"F32", "BF16", "TF32"}) {
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " " + mode);
      const DType dtype = std::string(mode) == "BF16" ? DType::BF16 : DType::F32;
      ops::NsOptions options;
      options.tf32 = std::string(mode) == "TF32";
      const Tensor g = randn({kBatch, rows, cols}, seed + uint64_t(rows));
      Tensor batched = testing::poisoned_device({kBatch, rows, cols}, dtype);
      ops::newton_schulz(testing::to_device(g, dtype), batched, NsCoefficients::Quintic, 5,
                         options);
      const Tensor got = to_host_f32(batched);
      ASSERT_TRUE(testing::all_finite(got, "batched"));
      for (int64_t b = 0; b < kBatch; ++b) {
        Tensor single = testing::poisoned_device({rows, cols}, dtype);
        ops::newton_schulz(testing::to_device(g.rows(b, 1).view({rows, cols}).clone(), dtype),
                           single, NsCoefficients::Quintic, 5, options);
        const Tensor want = to_host_f32(single);
        ASSERT_TRUE(testing::all_finite(want, "single"));
        const Tensor mine = got.rows(b, 1).view({rows, cols}).clone();
        const double rel = testing::rel_error(mine, want);
        std::printf("  %lldx%lld %-4s matrix %lld: batched vs alone %.2e\n", (long long)rows,
                    (long long)cols, mode, (long long)b, rel);
        if (std::string(mode) == "BF16")
          EXPECT_TRUE(testing::bitwise_equal(mine, want)) << "matrix " << b;
        else
          EXPECT_LE(rel, std::string(mode) == "F32" ? 1e-5 : 1e-2) << "matrix " << b;
      }
    }
}

// The distributed mode's all-reduce over "ranks" that are the batch's matrices: each
// matrix's slot of the tensor gets the sum over the batch (fp32 on the host, rounded to the
// tensor's dtype), as an all-reduce over two ranks holding one matrix each would give.
void sum_over_batch(Tensor& t) {
  const Tensor host = to_host_f32(t);
  const int64_t batch = t.dim(0), per = t.numel() / batch;
  Tensor sum = Tensor::empty(t.shape());
  for (int64_t i = 0; i < per; ++i) {
    float total = 0.0f;
    for (int64_t b = 0; b < batch; ++b) total += host.f32()[b * per + i];
    for (int64_t b = 0; b < batch; ++b) sum.f32()[b * per + i] = total;
  }
  t = sum.to(t.dtype()).to(Device::CUDA);
}

// EO's distributed mode with two ranks simulated by a batch of two column blocks: the
// blocks' results, side by side, are the whole NS (the CPU's, without the mode).
TEST(MuonOpsGpu, DistributedNewtonSchulzOverTheBatchIsTheWholeNs) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 5;
  SCOPED_TRACE(testing::seed_trace(seed));
  const int64_t rows = 48, cols = 80;
  for (int transpose : {0, 1})
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE("transpose " + std::to_string(transpose) + " " + std::string(dtype_name(dtype)));
      const Tensor g = randn({rows, cols}, seed + uint64_t(transpose)).to(dtype).to(DType::F32);
      ops::NsOptions whole_options;
      whole_options.transpose = transpose;
      Tensor want = Tensor::empty({rows, cols});
      ops::newton_schulz(g, want, NsCoefficients::Quintic, 5, whole_options);
      // transpose 0 iterates on g: split its columns; 1 on g^T: split g's rows.
      const bool by_rows = transpose == 1;
      const int64_t br = by_rows ? rows / 2 : rows, bc = by_rows ? cols : cols / 2;
      Tensor blocks = Tensor::empty({2, br, bc});
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t r = 0; r < br; ++r)
          for (int64_t c = 0; c < bc; ++c)
            blocks.f32()[(b * br + r) * bc + c] =
                g.f32()[(by_rows ? b * br + r : r) * cols + (by_rows ? c : b * bc + c)];
      ops::NsOptions options;
      options.transpose = transpose;
      int calls = 0;
      options.all_reduce = [&calls](Tensor& t) {
        ++calls;
        sum_over_batch(t);
      };
      Tensor out = testing::poisoned_device({2, br, bc}, dtype);
      ops::newton_schulz(testing::to_device(blocks, dtype), out, NsCoefficients::Quintic, 5,
                         options);
      EXPECT_EQ(calls, 6);
      const Tensor got_blocks = to_host_f32(out);
      ASSERT_TRUE(testing::all_finite(got_blocks, "out"));
      Tensor got = Tensor::empty({rows, cols});
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t r = 0; r < br; ++r)
          for (int64_t c = 0; c < bc; ++c)
            got.f32()[(by_rows ? b * br + r : r) * cols + (by_rows ? c : b * bc + c)] =
                got_blocks.f32()[(b * br + r) * bc + c];
      const double rel = testing::rel_error(got, want);
      std::printf("  distributed transpose %d %-4s ||gpu - cpu|| / ||cpu|| = %.2e\n", transpose,
                  std::string(dtype_name(dtype)).c_str(), rel);
      EXPECT_LE(rel, dtype == DType::F32 ? kF32RelTol : kBf16RelTol);
    }
}

// ---- the optimizer step's elementwise ops ----

TEST(MuonOpsGpu, MomentumWithControlMatchesTheCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 6;
  SCOPED_TRACE(testing::seed_trace(seed));
  for (bool nesterov : {false, true})
    for (DType grad_dtype : {DType::F32, DType::BF16})
      for (DType update_dtype : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(std::string(dtype_name(grad_dtype)) + " grad, " +
                     std::string(dtype_name(update_dtype)) + " update");
        Tensor m = randn({33, 65}, seed);
        const Tensor g = randn({33 * 65}, seed + 1).to(grad_dtype);  // a flat piece
        Tensor m_dev = m.to(Device::CUDA);
        const Tensor g_dev = g.to(Device::CUDA);
        Tensor u = Tensor::empty({33, 65}, update_dtype);
        Tensor u_dev = testing::poisoned_device({33, 65}, update_dtype);
        for (int step = 0; step < 3; ++step) {
          const bool skip = step == 1;
          ops::muon_momentum_update(m, g, 0.9f, nesterov, u,
                                    testing::step_control(0.1f, 0.3f, skip, Device::CPU));
          ops::muon_momentum_update(m_dev, g_dev, 0.9f, nesterov, u_dev,
                                    testing::step_control(0.1f, 0.3f, skip, Device::CUDA));
          if (skip) {
            EXPECT_TRUE(testing::bitwise_equal(to_host_f32(u_dev), Tensor::zeros({33, 65})));
          }
        }
        EXPECT_TRUE(testing::allclose(to_host_f32(m_dev), m, 1e-6, 1e-5));
        if (update_dtype == DType::F32) {
          EXPECT_TRUE(testing::allclose(to_host_f32(u_dev), u, 1e-6, 1e-5));
        } else {
          EXPECT_TRUE(testing::allclose(to_host_f32(u_dev), u.to(DType::F32), 1e-5, 1e-2));
        }
      }
  // A unit control is the plain op, bit for bit.
  const Tensor m0 = randn({17, 9}, seed + 2).to(Device::CUDA), g = randn({17, 9}, seed + 3);
  Tensor m_plain = m0.clone(), u_plain = testing::poisoned_device({17, 9}, DType::F32);
  Tensor m_control = m0.clone(), u_control = testing::poisoned_device({17, 9}, DType::F32);
  const Tensor g_dev = g.to(Device::CUDA);
  ops::muon_momentum_update(m_plain, g_dev, 0.95f, true, u_plain);
  ops::muon_momentum_update(m_control, g_dev, 0.95f, true, u_control,
                            testing::step_control(0.1f, 1.0f, false, Device::CUDA));
  EXPECT_TRUE(testing::bitwise_equal(to_host_f32(m_control), to_host_f32(m_plain)));
  EXPECT_TRUE(testing::bitwise_equal(to_host_f32(u_control), to_host_f32(u_plain)));
}

// A list over several launches and chunks: 70 entries (the launches take 64), one of them
// longer than a block's chunk; F32 and BF16 inputs, every copy kind.
struct GpuLists {
  std::vector<Tensor> mains, inputs, state, copies;
  std::vector<float> weight_decays, scales;
  GpuLists(uint64_t seed) {
    for (int i = 0; i < 70; ++i) {
      const int64_t n = i == 3 ? 40000 : 17 + 5 * i;
      mains.push_back(randn({n}, seed + uint64_t(i)));
      inputs.push_back(randn({n}, seed + 100 + uint64_t(i)).to(i % 2 ? DType::BF16 : DType::F32));
      state.push_back(randn({n}, seed + 200 + uint64_t(i), 0.1f));
      const DType kinds[] = {DType::F32, DType::BF16, DType::F16};
      copies.push_back(i % 4 == 3 ? Tensor() : Tensor::zeros({n}, kinds[i % 4]));
      weight_decays.push_back(i % 3 == 0 ? 0.0f : 0.01f * float(i % 7));
      scales.push_back(0.2f + 0.1f * float(i % 5));
    }
  }
  GpuLists to_device() const {
    GpuLists d = *this;
    for (auto* list : {&d.mains, &d.inputs, &d.state, &d.copies})
      for (Tensor& t : *list)
        if (t.defined()) {
          t = t.to(Device::CUDA);
          if (list == &d.copies) testing::poison(t);
        }
    return d;
  }
  // Every tensor of the device lists equals the host's bit for bit.
  void expect_equal(const GpuLists& dev) const {
    for (auto [host, device] :
         {std::pair{&mains, &dev.mains}, {&state, &dev.state}, {&copies, &dev.copies}})
      for (size_t i = 0; i < host->size(); ++i)
        if ((*host)[i].defined()) {
          EXPECT_TRUE(testing::bitwise_equal(to_host_f32((*device)[i]), (*host)[i].to(DType::F32)))
              << "entry " << i;
        }
  }
};

TEST(MuonOpsGpu, ApplySgdAndLionMatchTheCpuBitwise) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 7;
  SCOPED_TRACE(testing::seed_trace(seed));
  for (const char* op : {"muon_apply", "sgd", "lion"}) {
    SCOPED_TRACE(op);
    GpuLists host(seed);
    GpuLists dev = host.to_device();
    const float lrs[] = {0.02f, 0.01f, 0.03f};
    for (int step = 0; step < 3; ++step) {
      const bool skip = step == 1;
      for (bool on_gpu : {false, true}) {
        GpuLists& l = on_gpu ? dev : host;
        const Tensor c =
            testing::step_control(lrs[step], 0.7f, skip, on_gpu ? Device::CUDA : Device::CPU);
        if (std::string(op) == "muon_apply")
          ops::muon_apply(l.mains, l.inputs, l.copies, l.weight_decays, l.scales, c);
        else if (std::string(op) == "sgd")
          ops::multi_tensor_sgd(l.mains, l.inputs, l.state, l.copies, l.weight_decays, 0.9f, c);
        else
          ops::multi_tensor_lion(l.mains, l.inputs, l.state, l.copies, l.weight_decays, 0.95f,
                                 0.98f, c);
      }
      if (step == 0) {  // the copies were written; later they must match the host's
        for (size_t i = 0; i < dev.copies.size(); ++i)
          if (dev.copies[i].defined()) {
            ASSERT_TRUE(testing::all_finite(to_host_f32(dev.copies[i]), "copy"));
          }
      }
    }
    host.expect_equal(dev);
    // The params moved.
    GpuLists fresh(seed);
    EXPECT_FALSE(testing::bitwise_equal(host.mains[0], fresh.mains[0]));
  }
}

TEST(MuonOpsGpu, CopyColumnsMatchesTheCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const Tensor src = randn({7, 30}, testing::test_seed() + 8);
  for (DType dtype : {DType::F32, DType::BF16}) {
    Tensor want = Tensor::zeros({7, 12}, dtype);
    ops::copy_columns(src.to(dtype), 9, want, 3, 8);
    Tensor got = Tensor::zeros({7, 12}, dtype).to(Device::CUDA);
    ops::copy_columns(testing::to_device(src, dtype), 9, got, 3, 8);
    EXPECT_TRUE(testing::bitwise_equal(to_host_f32(got), want.to(DType::F32)));
    EXPECT_FALSE(testing::bitwise_equal(want.to(DType::F32), Tensor::zeros({7, 12})));
  }
}

}  // namespace
}  // namespace megaton
#endif  // MEGATON_WITH_CUDA
