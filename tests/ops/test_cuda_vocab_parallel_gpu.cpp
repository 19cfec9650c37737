// CUDA vocab-parallel embedding and cross entropy against their CPU twins: the same
// (rounded to BF16 or F16 where those are used) inputs on both devices, outputs poisoned with NaN
// before each CUDA op runs, at shapes that take the packed and the element-wise kernels.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/gpu_testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::all_finite;
using testing::allclose;
using testing::bitwise_equal;
using testing::poisoned_device;
using testing::randint;
using testing::randn;
using testing::rel_error;
using testing::seed_trace;
using testing::to_device;
using testing::to_host_f32;

// CONVENTIONS.md: CUDA fp32 against the CPU; bf16 outputs as whole tensors; fp16 outputs
// elementwise and as whole tensors (one rounding, 2^-12 relative).
constexpr double kF32Atol = 1e-5, kF32Rtol = 1e-4;
constexpr double kBf16Rel = 1e-2;
constexpr double kF16Atol = 1e-5, kF16Rtol = 1e-3, kF16Rel = 1e-3;
// Main grads: fp32 sums of up to ~1000 O(1) values in atomic order; as the embedding
// test of test_cuda_pointwise_gpu.cpp.
constexpr double kMainGradAtol = 1e-3, kMainGradRtol = 1e-4, kMainGradRel = 1e-4;

std::string dtype_str(DType dtype) { return std::string(dtype_name(dtype)); }

// Both devices' inputs: fp32 values (rounded to `dtype` for a BF16 or F16 run) on the CPU,
// and the same values in `dtype` on the GPU.
struct Input {
  Tensor cpu;     // F32
  Tensor device;  // dtype
};
Input input(const Tensor& f32, DType dtype) {
  Tensor cpu = dtype == DType::F32 ? f32.clone() : f32.to(dtype).to(DType::F32);
  return {cpu, to_device(cpu, dtype)};
}

// ------------------------------------------------------------------------ embedding

struct EmbeddingCase {
  int64_t tokens, hidden, vocab_local, vocab_start;
};

TEST(CudaVocabParallelEmbedding, ForwardBackwardMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 800;
  SCOPED_TRACE(seed_trace(seed));
  // Odd hidden sizes take the element-wise kernels; vocab_start 0 and an interior shard;
  // ids drawn from a vocabulary larger than the shard on both sides.
  const std::vector<EmbeddingCase> cases = {
      {7, 33, 13, 5}, {256, 1024, 50, 25}, {300, 1001, 17, 40}, {1000, 4096, 64, 0}, {5, 8, 1, 3}};
  for (const EmbeddingCase& c : cases) {
    const int32_t vocab = int32_t(c.vocab_start + c.vocab_local + 11);
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " hidden " + std::to_string(c.hidden) +
                   " shard [" + std::to_string(c.vocab_start) + ", " +
                   std::to_string(c.vocab_start + c.vocab_local) + ") " + dtype_str(dtype));
      const uint64_t s = seed + 10 * uint64_t(c.tokens + c.hidden);
      const Tensor ids = randint({c.tokens}, vocab, s);
      const Input table = input(randn({c.vocab_local, c.hidden}, s + 1), dtype);
      const Input dout = input(randn({c.tokens, c.hidden}, s + 2), dtype);
      const Tensor dtable0 = randn({c.vocab_local, c.hidden}, s + 3);  // main grads accumulate

      Tensor ref_out = Tensor::empty({c.tokens, c.hidden}), ref_dtable = dtable0.clone();
      ops::embedding_forward_vocab_range(ids, table.cpu, c.vocab_start, ref_out);
      ops::embedding_backward_vocab_range(dout.cpu, ids, c.vocab_start, ref_dtable);

      const Tensor ids_gpu = ids.to(Device::CUDA);
      Tensor out = poisoned_device({c.tokens, c.hidden}, dtype);
      ops::embedding_forward_vocab_range(ids_gpu, table.device, c.vocab_start, out);
      // Row copies and zeros: exact in either dtype.
      EXPECT_TRUE(allclose(to_host_f32(out), ref_out, 0, 0)) << "out";

      Tensor dtable = dtable0.to(Device::CUDA);
      ops::embedding_backward_vocab_range(dout.device, ids_gpu, c.vocab_start, dtable);
      const Tensor got = to_host_f32(dtable);
      EXPECT_LE(rel_error(got, ref_dtable), kMainGradRel) << "dtable";
      EXPECT_TRUE(allclose(got, ref_dtable, kMainGradAtol, kMainGradRtol)) << "dtable";
    }
  }
}

TEST(CudaVocabParallelEmbedding, DoorChecks) {
  MEGATON_SKIP_WITHOUT_GPU();
  Tensor ids = Tensor::zeros({4}, DType::I32, Device::CUDA);
  Tensor table = Tensor::zeros({10, 8}, DType::BF16, Device::CUDA);
  Tensor out_f32 = Tensor::zeros({4, 8}, DType::F32, Device::CUDA);
  Tensor out_wide = Tensor::zeros({4, 9}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::zeros({4, 8}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, table, 0, out_f32), InternalError);
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, table, 0, out_wide), InternalError);
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, table, -1, out), InternalError);
  // A table left on the CPU while the ids are on the GPU.
  EXPECT_THROW(ops::embedding_forward_vocab_range(ids, table.to(Device::CPU), 0, out),
               InternalError);
  Tensor dtable_bf16 = Tensor::zeros({10, 8}, DType::BF16, Device::CUDA);
  EXPECT_THROW(ops::embedding_backward_vocab_range(out, ids, 0, dtable_bf16), InternalError);
  Tensor dtable = Tensor::zeros({10, 8}, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::embedding_backward_vocab_range(out_wide, ids, 0, dtable), InternalError);
}

// ------------------------------------------------------------------------ cross entropy

struct CrossEntropyCase {
  int64_t T, V_local, vocab_start;
  DType dtype;
};

std::string describe(const CrossEntropyCase& c) {
  return "T " + std::to_string(c.T) + " shard [" + std::to_string(c.vocab_start) + ", " +
         std::to_string(c.vocab_start + c.V_local) + ") " + dtype_str(c.dtype);
}

// V_local = 97, 37: rows not a multiple of a 16-byte pack (the element-wise kernels);
// 25152 = 50304 / 2, one of two GPT-2 vocabulary shards.
std::vector<CrossEntropyCase> cross_entropy_cases() {
  std::vector<CrossEntropyCase> cases;
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    cases.push_back({1, 96, 0, dtype});
    cases.push_back({37, 97, 100, dtype});
    cases.push_back({4096, 96, 48, dtype});
    cases.push_back({37, 37, 0, dtype});
    cases.push_back({37, 25152, 25152, dtype});
  }
  cases.push_back({4096, 25152, 0, DType::BF16});
  return cases;
}

// Labels over a vocabulary that extends past the shard on both sides, with some on the
// shard's first and last rows.
Tensor shard_labels(const CrossEntropyCase& c, uint64_t seed) {
  const int64_t vocab = c.vocab_start + c.V_local + 50;
  Tensor labels = randint({c.T}, int32_t(vocab), seed);
  if (c.T > 2) {
    labels.i32()[0] = int32_t(c.vocab_start);
    labels.i32()[1] = int32_t(c.vocab_start + c.V_local - 1);
    labels.i32()[2] = int32_t(c.vocab_start + c.V_local);
  }
  return labels;
}

TEST(CudaVocabParallelCrossEntropy, PartialStatsMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 820;
  SCOPED_TRACE(seed_trace(seed));
  const std::vector<CrossEntropyCase> cases = cross_entropy_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    const CrossEntropyCase& c = cases[i];
    SCOPED_TRACE(describe(c));
    const uint64_t s = seed + 10 * i;
    const Input logits = input(randn({c.T, c.V_local}, s, 2.0f), c.dtype);
    const Tensor labels = shard_labels(c, s + 1);
    Tensor ref_max = Tensor::empty({c.T}), ref_sum = Tensor::empty({c.T}),
           ref_target = Tensor::empty({c.T});
    ops::cross_entropy_partial_stats(logits.cpu, labels, c.vocab_start, ref_max, ref_sum,
                                     ref_target);

    Tensor row_max = poisoned_device({c.T}, DType::F32);
    Tensor sum_exp = poisoned_device({c.T}, DType::F32);
    Tensor target = poisoned_device({c.T}, DType::F32);
    ops::cross_entropy_partial_stats(logits.device, labels.to(Device::CUDA), c.vocab_start, row_max,
                                     sum_exp, target);
    // The max and the target are values of the row: exact. The sum is fp32 math on the
    // same inputs (the CPU sums in fp64).
    EXPECT_TRUE(allclose(to_host_f32(row_max), ref_max, 0, 0)) << "row_max";
    EXPECT_TRUE(allclose(to_host_f32(target), ref_target, 0, 0)) << "target_logit";
    EXPECT_TRUE(allclose(to_host_f32(sum_exp), ref_sum, kF32Atol, kF32Rtol)) << "sum_exp";
  }
}

TEST(CudaVocabParallelCrossEntropy, RescaleAndFinishMatchCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 840;
  SCOPED_TRACE(seed_trace(seed));
  for (int64_t T : {1, 37, 1000, 70001}) {
    SCOPED_TRACE("T " + std::to_string(T));
    const uint64_t s = seed + uint64_t(T);
    // global_max >= row_max; every other row the rank holds the maximum (factor 1).
    const Tensor row_max = randn({T}, s, 3.0f);
    Tensor global_max = row_max.clone();
    const Tensor gap = randn({T}, s + 1, 2.0f);
    for (int64_t t = 0; t < T; t += 2) global_max.f32()[t] += std::fabs(gap.f32()[t]);
    Tensor sum_exp = randn({T}, s + 2);
    for (int64_t t = 0; t < T; ++t) sum_exp.f32()[t] = 1.0f + 20.0f * std::fabs(sum_exp.f32()[t]);
    const Tensor target = randn({T}, s + 3, 2.0f);

    Tensor ref_rescaled = sum_exp.clone();
    ops::cross_entropy_rescale_sum_exp(row_max, global_max, ref_rescaled);
    Tensor rescaled = sum_exp.to(Device::CUDA);
    ops::cross_entropy_rescale_sum_exp(row_max.to(Device::CUDA), global_max.to(Device::CUDA),
                                       rescaled);
    EXPECT_TRUE(allclose(to_host_f32(rescaled), ref_rescaled, kF32Atol, kF32Rtol)) << "rescale";

    Tensor ref_losses = Tensor::empty({T}), ref_lse = Tensor::empty({T});
    ops::cross_entropy_finish(global_max, sum_exp, target, ref_losses, ref_lse);
    Tensor losses = poisoned_device({T}, DType::F32), lse = poisoned_device({T}, DType::F32);
    ops::cross_entropy_finish(global_max.to(Device::CUDA), sum_exp.to(Device::CUDA),
                              target.to(Device::CUDA), losses, lse);
    EXPECT_TRUE(allclose(to_host_f32(lse), ref_lse, kF32Atol, kF32Rtol)) << "lse";
    EXPECT_TRUE(allclose(to_host_f32(losses), ref_losses, kF32Atol, kF32Rtol)) << "losses";
  }
}

TEST(CudaVocabParallelCrossEntropy, BackwardMatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 860;
  SCOPED_TRACE(seed_trace(seed));
  const std::vector<CrossEntropyCase> cases = cross_entropy_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    const CrossEntropyCase& c = cases[i];
    SCOPED_TRACE(describe(c));
    const uint64_t s = seed + 10 * i;
    const Input logits = input(randn({c.T, c.V_local}, s, 2.0f), c.dtype);
    const Tensor labels = shard_labels(c, s + 1);
    const Tensor dlosses = randn({c.T}, s + 2);
    // A global log-sum-exp above this shard's (other ranks add to the sum).
    Tensor lse = Tensor::empty({c.T});
    {
      Tensor m = Tensor::empty({c.T}), sum = Tensor::empty({c.T}), target = Tensor::empty({c.T});
      ops::cross_entropy_partial_stats(logits.cpu, labels, c.vocab_start, m, sum, target);
      for (int64_t t = 0; t < c.T; ++t) lse.f32()[t] = m.f32()[t] + std::log(sum.f32()[t]) + 0.5f;
    }
    Tensor ref = Tensor::empty({c.T, c.V_local});
    ops::cross_entropy_backward_vocab_range(dlosses, logits.cpu, labels, lse, c.vocab_start, ref);

    const Tensor dlosses_gpu = dlosses.to(Device::CUDA), labels_gpu = labels.to(Device::CUDA);
    const Tensor lse_gpu = lse.to(Device::CUDA);
    Tensor dlogits = poisoned_device({c.T, c.V_local}, c.dtype);
    ops::cross_entropy_backward_vocab_range(dlosses_gpu, logits.device, labels_gpu, lse_gpu,
                                            c.vocab_start, dlogits);
    const Tensor got = to_host_f32(dlogits);
    EXPECT_TRUE(all_finite(got, "dlogits"));
    if (c.dtype == DType::BF16) {
      EXPECT_LE(rel_error(got, ref), kBf16Rel) << "dlogits";
    } else if (c.dtype == DType::F16) {
      EXPECT_TRUE(allclose(got, ref, kF16Atol, kF16Rtol)) << "dlogits";
      EXPECT_LE(rel_error(got, ref), kF16Rel) << "dlogits";
    } else {
      EXPECT_TRUE(allclose(got, ref, kF32Atol, kF32Rtol)) << "dlogits";
      EXPECT_LE(rel_error(got, ref), 1e-5) << "dlogits";
    }
    // In place over the logits (as the model runs it): bit for bit the out-of-place result.
    Tensor in_place = logits.device.clone();
    ops::cross_entropy_backward_vocab_range(dlosses_gpu, in_place, labels_gpu, lse_gpu,
                                            c.vocab_start, in_place);
    EXPECT_TRUE(bitwise_equal(to_host_f32(in_place), got)) << "in-place dlogits";
  }
}

// The whole vocab-parallel loss on the GPU, three uneven shards combined as the TP
// reductions would (on the host here), against the full-vocabulary CPU op.
TEST(CudaVocabParallelCrossEntropy, CombinedShardsMatchFullVocabularyCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 880;
  SCOPED_TRACE(seed_trace(seed));
  const int64_t T = 53, V = 1001;
  const std::vector<std::pair<int64_t, int64_t>> shards = {{0, 333}, {333, 400}, {733, 268}};
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_str(dtype));
    const Input logits = input(randn({T, V}, seed, 2.0f), dtype);
    const Tensor labels = randint({T}, int32_t(V), seed + 1);
    Tensor ref_losses = Tensor::empty({T}), ref_lse = Tensor::empty({T});
    ops::cross_entropy_forward(logits.cpu, labels, ref_losses, ref_lse);

    const Tensor labels_gpu = labels.to(Device::CUDA);
    std::vector<Tensor> row_max, sum_exp;
    Tensor global_max = Tensor::empty({T}), total_target = Tensor::zeros({T});
    global_max.fill(-std::numeric_limits<float>::infinity());
    for (auto [start, size] : shards) {
      Tensor shard = Tensor::empty({T, size});
      for (int64_t t = 0; t < T; ++t)
        for (int64_t v = 0; v < size; ++v)
          shard.f32()[t * size + v] = logits.cpu.f32()[t * V + start + v];
      row_max.push_back(poisoned_device({T}, DType::F32));
      sum_exp.push_back(poisoned_device({T}, DType::F32));
      Tensor target = poisoned_device({T}, DType::F32);
      ops::cross_entropy_partial_stats(to_device(shard, dtype), labels_gpu, start, row_max.back(),
                                       sum_exp.back(), target);
      const Tensor m = to_host_f32(row_max.back()), tg = to_host_f32(target);
      for (int64_t t = 0; t < T; ++t) {
        global_max.f32()[t] = std::max(global_max.f32()[t], m.f32()[t]);
        total_target.f32()[t] += tg.f32()[t];
      }
    }
    const Tensor global_max_gpu = global_max.to(Device::CUDA);
    Tensor total_sum_exp = Tensor::zeros({T});
    for (size_t r = 0; r < shards.size(); ++r) {
      ops::cross_entropy_rescale_sum_exp(row_max[r], global_max_gpu, sum_exp[r]);
      const Tensor part = to_host_f32(sum_exp[r]);
      for (int64_t t = 0; t < T; ++t) total_sum_exp.f32()[t] += part.f32()[t];
    }
    Tensor losses = poisoned_device({T}, DType::F32), lse = poisoned_device({T}, DType::F32);
    ops::cross_entropy_finish(global_max_gpu, total_sum_exp.to(Device::CUDA),
                              total_target.to(Device::CUDA), losses, lse);
    EXPECT_TRUE(allclose(to_host_f32(lse), ref_lse, kF32Atol, kF32Rtol)) << "lse";
    EXPECT_TRUE(allclose(to_host_f32(losses), ref_losses, kF32Atol, kF32Rtol)) << "losses";
  }
}

TEST(CudaVocabParallelCrossEntropy, DoorChecks) {
  MEGATON_SKIP_WITHOUT_GPU();
  const int64_t T = 4;
  auto gpu = [](const Shape& shape, DType dtype = DType::F32) {
    return Tensor::zeros(shape, dtype, Device::CUDA);
  };
  Tensor logits = gpu({T, 16}, DType::BF16), labels = gpu({T}, DType::I32);
  Tensor a = gpu({T}), b = gpu({T}), c = gpu({T});
  Tensor long_f32 = gpu({T + 1}), short_bf16 = gpu({T}, DType::BF16);
  EXPECT_THROW(ops::cross_entropy_partial_stats(gpu({T, 16}, DType::I32), labels, 0, a, b, c),
               InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, gpu({T}), 0, a, b, c), InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, labels, 0, short_bf16, b, c),
               InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, labels, 0, a, long_f32, c), InternalError);
  EXPECT_THROW(ops::cross_entropy_partial_stats(logits, labels, -1, a, b, c), InternalError);
  EXPECT_THROW(ops::cross_entropy_rescale_sum_exp(a, long_f32, b), InternalError);
  EXPECT_THROW(ops::cross_entropy_rescale_sum_exp(a, b, short_bf16), InternalError);
  EXPECT_THROW(ops::cross_entropy_finish(a, b, c, long_f32, a), InternalError);
  Tensor dlogits_f32 = gpu({T, 16});
  EXPECT_THROW(ops::cross_entropy_backward_vocab_range(a, logits, labels, b, 0, dlogits_f32),
               InternalError);  // dlogits must have the logits' dtype
  Tensor big = gpu({2 * T, 16}, DType::BF16);
  Tensor overlapping = big.rows(1, T);
  Tensor start = big.rows(0, T);
  EXPECT_THROW(ops::cross_entropy_backward_vocab_range(a, start, labels, b, 0, overlapping),
               InternalError);  // partial overlap
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
