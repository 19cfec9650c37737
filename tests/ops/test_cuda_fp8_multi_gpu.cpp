// The CUDA multi-tensor FP8 ops (ops/cuda/fp8_multi.cu) against the CPU, which ops/fp8.h
// makes the definition (entry i = the single-tensor op on entry i): bit for bit, for
// lists shaped like a MoE layer's experts (8 entries of [R_g, 1536] and [R_g, 4096], R_g
// in {0, 16, 48, 1024, 2048}), BF16 and F32 inputs, E4M3 and E5M2, with and without out_t
// and amax (all entries, none, and mixed within one launch), inputs spanning ~24 binades
// with NaN / inf / -0 specials, entries that take the scalar paths (odd widths, rows not
// a multiple of 16, an unaligned view) in the same launch as vectorized ones, and lists
// longer than one launch's kMaxEntries (64). Delayed scaling with L = 1, 4 and 9000, max
// and most_recent, over two steps. Outputs are poisoned first (NaN; 0x7F for FP8), so an
// element a kernel skips fails the comparison.
#ifdef MEGATON_WITH_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_testing.h"
#include "common/gpu_testing.h"
#include "ops/fp8.h"

namespace megaton {
namespace {

using ops::Fp8ScaleRule;
using testing::insert_specials;
using testing::kScaleRuleAmaxes;
using testing::poisoned_device;
using testing::rule_name;
using testing::same_bits;
using testing::scale_rules;
using testing::wide_values;

#define SEED_TRACE(seed) SCOPED_TRACE("seed " + std::to_string(seed))

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const DType kInputs[] = {DType::F32, DType::BF16};
const DType kFormats[] = {DType::F8E4M3, DType::F8E5M2};
// Lists longer than this take more than one launch.
constexpr int kEntriesPerLaunch = 64;

std::vector<Tensor> to_cuda(const std::vector<Tensor>& list) {
  std::vector<Tensor> out;
  for (const Tensor& t : list) out.push_back(t.defined() ? t.to(Device::CUDA) : Tensor());
  return out;
}

// ------------------------------------------------------------------ per-tensor cast

// One quantize_multi case: inputs on both sides, CPU outputs from the single op per entry,
// GPU outputs poisoned and filled by one multi call, then compared entry by entry.
struct Entry {
  Tensor x_cpu, x_gpu;  // the same values (x_gpu may be a view of a larger tensor)
  bool with_t, with_amax;
};

void expect_quantize_multi_matches_cpu(const std::vector<Entry>& entries, DType fp8,
                                       uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> exponent(-14, 4);
  std::vector<Tensor> x, scale, out, out_t, amax;  // GPU
  std::vector<Tensor> want_out, want_out_t, want_amax;
  for (const Entry& e : entries) {
    const int64_t cols = e.x_cpu.dim(-1), rows = cols ? e.x_cpu.numel() / cols : 0;
    // Each entry its own scale: a power of two (frequent round-to-even ties with BF16) or
    // not.
    const float scale_value = std::ldexp(gen() % 2 ? 1.0f : 1.37f, exponent(gen));
    Tensor s = Tensor::from({1}, {scale_value});
    Tensor o = Tensor::empty(e.x_cpu.shape(), fp8);
    Tensor o_t = e.with_t ? Tensor::empty({cols, rows}, fp8) : Tensor();
    Tensor a = e.with_amax ? Tensor::empty({1}) : Tensor();
    ops::fp8_quantize(e.x_cpu, s, o, o_t, a);
    want_out.push_back(o);
    want_out_t.push_back(o_t);
    want_amax.push_back(a);
    x.push_back(e.x_gpu);
    scale.push_back(s.to(Device::CUDA));
    out.push_back(poisoned_device(e.x_cpu.shape(), fp8));
    out_t.push_back(e.with_t ? poisoned_device({cols, rows}, fp8) : Tensor());
    amax.push_back(e.with_amax ? poisoned_device({1}, DType::F32) : Tensor());
  }
  ops::fp8_quantize_multi(x, scale, out, out_t, amax);
  for (size_t i = 0; i < entries.size(); ++i) {
    SCOPED_TRACE("entry " + std::to_string(i) + " " + shape_str(entries[i].x_cpu.shape()) +
                 (entries[i].with_t ? " out_t" : "") + (entries[i].with_amax ? " amax" : ""));
    EXPECT_TRUE(same_bits(out[i], want_out[i], "out"));
    EXPECT_TRUE(same_bits(out_t[i], want_out_t[i], "out_t"));
    EXPECT_TRUE(same_bits(amax[i], want_amax[i], "amax"));
  }
}

// Experts' slices [R_g, cols] of one dtype, with specials in every non-empty entry.
std::vector<Tensor> expert_inputs(const std::vector<int64_t>& rows, int64_t cols, DType dtype,
                                  uint64_t seed) {
  std::vector<Tensor> x;
  for (size_t g = 0; g < rows.size(); ++g) {
    Tensor values = wide_values({rows[g], cols}, seed + 31 * g);
    insert_specials(values);
    x.push_back(values.to(dtype));
  }
  return x;
}

const std::vector<int64_t> kExpertRows = {16, 0, 48, 1024, 2048, 16, 0, 48};

TEST(CudaFp8Multi, QuantizeExpertsMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const size_t n = kExpertRows.size();
  for (int64_t cols : {1536, 4096}) {
    for (DType dtype : kInputs) {
      for (DType fp8 : kFormats) {
        // [R_g, 4096]: two of the four dtype pairs (the CPU reference is slow).
        if (cols == 4096 && !((dtype == DType::BF16 && fp8 == DType::F8E4M3) ||
                              (dtype == DType::F32 && fp8 == DType::F8E5M2)))
          continue;
        const std::vector<Tensor> x = expert_inputs(kExpertRows, cols, dtype, seed + cols);
        const std::vector<Tensor> x_gpu = to_cuda(x);
        // Outputs: out only; all; mixed (out_t on even entries, amax on two of three).
        for (int outputs = 0; outputs < 3; ++outputs) {
          SCOPED_TRACE("[R_g, " + std::to_string(cols) + "] " + std::string(dtype_name(dtype)) +
                       " -> " + std::string(dtype_name(fp8)) + " outputs " +
                       std::to_string(outputs));
          std::vector<Entry> entries;
          for (size_t g = 0; g < n; ++g) {
            const bool with_t = outputs == 1 || (outputs == 2 && g % 2 == 0);
            const bool with_amax = outputs == 1 || (outputs == 2 && g % 3 != 1);
            entries.push_back({x[g], x_gpu[g], with_t, with_amax});
          }
          expect_quantize_multi_matches_cpu(entries, fp8, seed + outputs);
        }
      }
    }
  }
}

// Vectorized and scalar entries in one launch: odd widths, rows off the 16-row runs of
// out_t, a single column, higher rank, and an unaligned view (rows 1.. of a BF16 tensor
// start 2000 bytes in).
TEST(CudaFp8Multi, QuantizeMixedPathsMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  const std::vector<Shape> shapes = {{5, 1000},  {127, 129},  {3, 1},     {1, 4096},
                                     {144, 200}, {2, 64, 96}, {256, 384}, {129, 4096}};
  for (DType dtype : kInputs) {
    for (DType fp8 : kFormats) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " -> " + std::string(dtype_name(fp8)));
      for (int outputs = 0; outputs < 3; ++outputs) {
        SCOPED_TRACE("outputs " + std::to_string(outputs));
        std::vector<Entry> entries;
        for (size_t g = 0; g < shapes.size(); ++g) {
          Tensor values = wide_values(shapes[g], seed + 7 * g);
          insert_specials(values);
          Tensor x = values.to(dtype);
          const bool with_t = outputs == 1 || (outputs == 2 && g % 2 == 1);
          const bool with_amax = outputs != 0 && g % 4 != 3;
          entries.push_back({x, x.to(Device::CUDA), with_t, with_amax});
        }
        Tensor all = wide_values({257, 1000}, seed + 3);
        insert_specials(all);
        Tensor all_x = all.to(dtype);
        entries.push_back(
            {all_x.rows(1, 256), all_x.to(Device::CUDA).rows(1, 256), outputs != 0, outputs != 0});
        expect_quantize_multi_matches_cpu(entries, fp8, seed + 100 + outputs);
      }
    }
  }
}

// More entries than one launch holds: the chunks, and an amax scratch reused across them.
TEST(CudaFp8Multi, QuantizeManyEntriesMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  std::mt19937_64 gen(seed + 5);
  std::uniform_int_distribution<int64_t> rows(0, 300);
  for (int outputs = 0; outputs < 2; ++outputs) {
    SCOPED_TRACE(outputs ? "out_t on some" : "no out_t");
    std::vector<Entry> entries;
    for (int g = 0; g < 2 * kEntriesPerLaunch + 5; ++g) {
      Tensor values = wide_values({rows(gen), 256}, seed + 13 * g);
      insert_specials(values);
      Tensor x = values.to(DType::BF16);
      entries.push_back({x, x.to(Device::CUDA), outputs == 1 && g % 3 == 0, g % 5 != 2});
    }
    expect_quantize_multi_matches_cpu(entries, DType::F8E4M3, seed + 200 + outputs);
  }
}

// ------------------------------------------------------------------------------ amax

TEST(CudaFp8Multi, AmaxMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  for (int list = 0; list < 3; ++list) {  // experts BF16, experts F32, many mixed entries
    SCOPED_TRACE("list " + std::to_string(list));
    std::vector<Tensor> x;
    if (list < 2) {
      x = expert_inputs(kExpertRows, 1536, list == 0 ? DType::BF16 : DType::F32, seed + list);
      // Finite only in two entries (the others hold NaN from the specials), -inf in one.
      x[0] = wide_values({16, 1536}, seed + 50).to(x[0].dtype());
      Tensor finite = wide_values({1024, 1536}, seed + 51);
      finite.f32()[777] = -INFINITY;
      x[3] = finite.to(x[3].dtype());
      x[4] = wide_values({2048, 1536}, seed + 52).to(x[4].dtype());
    } else {
      std::mt19937_64 gen(seed + 6);
      std::uniform_int_distribution<int64_t> numel(0, 5000);
      for (int g = 0; g < 2 * kEntriesPerLaunch + 3; ++g)
        x.push_back(wide_values({numel(gen)}, seed + g).to(g % 2 ? DType::BF16 : DType::F32));
    }
    std::vector<Tensor> x_gpu = to_cuda(x);
    // An unaligned view (scalar path) in the same launch.
    Tensor big = wide_values({257, 1000}, seed + 9).to(DType::BF16);
    x.push_back(big.rows(1, 256));
    x_gpu.push_back(big.to(Device::CUDA).rows(1, 256));
    std::vector<Tensor> amax, want;
    for (size_t i = 0; i < x.size(); ++i) {
      want.push_back(Tensor::empty({1}));
      ops::fp8_amax(x[i], want.back());
      amax.push_back(poisoned_device({1}, DType::F32));
    }
    ops::fp8_amax_multi(x_gpu, amax);
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_TRUE(same_bits(amax[i], want[i],
                            "amax[" + std::to_string(i) + "] " + shape_str(x[i].shape())));
    // Twice in a row: the scratch was left clean by the first call.
    for (Tensor& a : amax) a.fill(NAN);
    ops::fp8_amax_multi(x_gpu, amax);
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_TRUE(same_bits(amax[i], want[i], "again amax[" + std::to_string(i) + "]"));
  }
}

// -------------------------------------------------------------------- scale updates

TEST(CudaFp8Multi, UpdateScaleMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  // Every kScaleRuleAmaxes value, rescaled on each pass; more entries than one launch.
  const int kAmaxCount = int(std::size(kScaleRuleAmaxes));
  const int count = 2 * kEntriesPerLaunch + 7;
  for (const Fp8ScaleRule& rule : scale_rules({0.0f, 2.0f})) {
    SCOPED_TRACE(rule_name(rule));
    std::vector<Tensor> amax, scale, scale_inv, want_scale, want_scale_inv;
    for (int i = 0; i < count; ++i) {
      Tensor a = Tensor::from(
          {1}, {kScaleRuleAmaxes[i % kAmaxCount] * (1.0f + float(i / kAmaxCount) / 8)});
      Tensor s = Tensor::from({1}, {0.75f + float(i)}), s_inv = Tensor::from({1}, {5.0f});
      amax.push_back(a.to(Device::CUDA));
      scale.push_back(s.to(Device::CUDA));
      scale_inv.push_back(s_inv.to(Device::CUDA));
      ops::fp8_update_scale(a, rule, s, s_inv);
      want_scale.push_back(s);
      want_scale_inv.push_back(s_inv);
    }
    ops::fp8_update_scale_multi(amax, rule, scale, scale_inv);
    for (int i = 0; i < count; ++i) {
      SCOPED_TRACE("entry " + std::to_string(i));
      EXPECT_TRUE(same_bits(scale[i], want_scale[i], "scale"));
      EXPECT_TRUE(same_bits(scale_inv[i], want_scale_inv[i], "scale_inv"));
    }
  }
}

TEST(CudaFp8Multi, DelayedScalingUpdateMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed();
  SEED_TRACE(seed);
  // L = 9000: longer than fp8_delayed_scaling_update's shared-memory staging.
  for (int64_t length : {1, 4, 1024, 9000}) {
    const int count = length <= 4 ? 2 * kEntriesPerLaunch + 3 : 8;
    for (bool max_algo : {false, true}) {
      SCOPED_TRACE("L " + std::to_string(length) + (max_algo ? " max" : " most_recent"));
      const Fp8ScaleRule rule{DType::F8E4M3, 1.0f, 0.0f, max_algo};
      std::vector<Tensor> history, scale, scale_inv;              // CPU
      std::vector<Tensor> history_gpu, scale_gpu, scale_inv_gpu;  // GPU
      for (int g = 0; g < count; ++g) {
        Tensor h = wide_values({length, 1}, seed + 17 * g + length);
        for (int64_t i = 0; i < length; ++i) h.f32()[i] = std::fabs(h.f32()[i]);
        if (g % 7 == 1) h.f32()[length / 2] = kNaN;  // NaN in the window
        if (g % 7 == 2) h.zero();                    // all zero: the scale stays
        if (g % 7 == 3) h.f32()[0] = INFINITY;       // most_recent inf: the scale stays
        history.push_back(h);
        scale.push_back(Tensor::from({1}, {0.75f}));
        scale_inv.push_back(Tensor::from({1}, {4.0f / 3.0f}));
        history_gpu.push_back(h.to(Device::CUDA));
        scale_gpu.push_back(scale.back().to(Device::CUDA));
        scale_inv_gpu.push_back(scale_inv.back().to(Device::CUDA));
      }
      for (int step = 0; step < 2; ++step) {  // the roll composes over steps
        SCOPED_TRACE("step " + std::to_string(step));
        if (step == 1) {  // the next step's amaxes land in row 0
          for (int g = 0; g < count; ++g) {
            Tensor row0 = Tensor::from({1, 1}, {2.5f + float(g)});
            history[g].rows(0, 1).copy_from(row0);
            Tensor row0_gpu = history_gpu[g].rows(0, 1);
            row0_gpu.copy_from(row0);
          }
        }
        for (int g = 0; g < count; ++g)
          ops::fp8_delayed_scaling_update(history[g], rule, max_algo, scale[g], scale_inv[g]);
        ops::fp8_delayed_scaling_update_multi(history_gpu, rule, max_algo, scale_gpu,
                                              scale_inv_gpu);
        for (int g = 0; g < count; ++g) {
          SCOPED_TRACE("entry " + std::to_string(g));
          EXPECT_TRUE(same_bits(history_gpu[g], history[g], "amax_history"));
          EXPECT_TRUE(same_bits(scale_gpu[g], scale[g], "scale"));
          EXPECT_TRUE(same_bits(scale_inv_gpu[g], scale_inv[g], "scale_inv"));
        }
      }
    }
  }
}

// ------------------------------------------------------------------------ the doors

TEST(CudaFp8Multi, DoorsRejectMixedDevices) {
  MEGATON_SKIP_WITHOUT_GPU();
  Tensor x = Tensor::empty({4, 8}, DType::BF16, Device::CUDA);
  Tensor s = Tensor::from({1}, {1.0f}).to(Device::CUDA), none;
  Tensor q = Tensor::empty({4, 8}, DType::F8E4M3, Device::CUDA);
  Tensor q_cpu = Tensor::empty({4, 8}, DType::F8E4M3);
  EXPECT_THROW(ops::fp8_quantize_multi({x, x}, {s, s}, {q, q_cpu}, {none, none}, {none, none}),
               InternalError);
  EXPECT_THROW(ops::fp8_amax_multi(
                   {x, x}, {Tensor::empty({1}, DType::F32, Device::CUDA), Tensor::empty({1})}),
               InternalError);
  EXPECT_THROW(ops::fp8_update_scale_multi({s}, {}, {s}, {Tensor::empty({1})}), InternalError);
}

// ----------------------------------------------------------------- timing (not a test)

// The MoE case this op exists for: 8 experts' [2048, 4096] BF16 operands to E4M3 with
// out_t and amax, one multi call vs 8 single calls. Prints CUDA-event medians; run with
// --gtest_also_run_disabled_tests (benchmarks proper live in bench/).
TEST(CudaFp8Multi, DISABLED_TimeQuantizeMultiVsSingle) {
  MEGATON_SKIP_WITHOUT_GPU();
  const int experts = 8;
  std::vector<Tensor> x, scale, out, out_t, amax;
  for (int g = 0; g < experts; ++g) {
    x.push_back(testing::randn({2048, 4096}, g).to(DType::BF16).to(Device::CUDA));
    scale.push_back(Tensor::from({1}, {8.0f}).to(Device::CUDA));
    out.push_back(Tensor::empty({2048, 4096}, DType::F8E4M3, Device::CUDA));
    out_t.push_back(Tensor::empty({4096, 2048}, DType::F8E4M3, Device::CUDA));
    amax.push_back(Tensor::empty({1}, DType::F32, Device::CUDA));
  }
  cudaStream_t stream = ::megaton::cuda::stream();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  auto median_ms = [&](auto&& body) {
    for (int i = 0; i < 5; ++i) body();
    std::vector<float> times;
    for (int i = 0; i < 50; ++i) {
      cudaEventRecord(start, stream);
      body();
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  for (bool with_t : {true, false}) {
    std::vector<Tensor> t_list = with_t ? out_t : std::vector<Tensor>(experts);
    const float multi = median_ms([&] { ops::fp8_quantize_multi(x, scale, out, t_list, amax); });
    const float single = median_ms([&] {
      for (int g = 0; g < experts; ++g)
        ops::fp8_quantize(x[g], scale[g], out[g], t_list[g], amax[g]);
    });
    const double bytes = double(experts) * 2048 * 4096 * (with_t ? 4 : 3);
    std::printf(
        "quantize 8 x [2048, 4096] BF16 -> E4M3%s + amax: multi %.3f ms (%.0f GB/s), "
        "8 singles %.3f ms (%.0f GB/s)\n",
        with_t ? " + out_t" : "", multi, bytes / multi / 1e6, single, bytes / single / 1e6);
  }
  // Small experts (launch-bound): 32 x [64, 1536].
  std::vector<Tensor> xs, ss, os, ots, as;
  for (int g = 0; g < 32; ++g) {
    xs.push_back(testing::randn({64, 1536}, g).to(DType::BF16).to(Device::CUDA));
    ss.push_back(Tensor::from({1}, {8.0f}).to(Device::CUDA));
    os.push_back(Tensor::empty({64, 1536}, DType::F8E4M3, Device::CUDA));
    ots.push_back(Tensor::empty({1536, 64}, DType::F8E4M3, Device::CUDA));
    as.push_back(Tensor::empty({1}, DType::F32, Device::CUDA));
  }
  const float multi = median_ms([&] { ops::fp8_quantize_multi(xs, ss, os, ots, as); });
  const float single = median_ms([&] {
    for (int g = 0; g < 32; ++g) ops::fp8_quantize(xs[g], ss[g], os[g], ots[g], as[g]);
  });
  std::printf(
      "quantize 32 x [64, 1536] BF16 -> E4M3 + out_t + amax: multi %.3f ms, 32 singles "
      "%.3f ms\n",
      multi, single);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
