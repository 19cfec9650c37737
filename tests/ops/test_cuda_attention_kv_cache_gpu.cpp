// GPU test of ops::attention_kv_cache (generation's attention over the KV cache) against
// its CPU twin, F32, BF16 and F16, with equal and with distinct key and value head dims
// (multi-latent attention) and a given softmax scale, with poisoned outputs and poisoned
// cache rows past the last query's position (the kernel must neither skip an output nor
// read such a row).
#include <fmt/format.h>

#include <string>

#include "common/testing.h"
#include "ops/ops.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"

namespace megaton {
namespace {

using testing::all_finite;
using testing::allclose;
using testing::poison;
using testing::poisoned_device;
using testing::randn;
using testing::rel_error;
using testing::seed_trace;
using testing::to_device;
using testing::to_host_f32;

struct KvCacheCase {
  int64_t max_positions, Hq, Hkv, D;
  int64_t first, n;    // queries at positions [first, first + n)
  int64_t Dv = 0;      // value head dim (0: D)
  float scale = 0.0f;  // softmax scale (0: 1 / sqrt(D))
  int64_t v_dim() const { return Dv > 0 ? Dv : D; }
};

std::string case_name(const ::testing::TestParamInfo<KvCacheCase>& info) {
  const KvCacheCase& c = info.param;
  return fmt::format("max{}_Hq{}_Hkv{}_D{}_first{}_n{}{}{}", c.max_positions, c.Hq, c.Hkv, c.D,
                     c.first, c.n, c.Dv > 0 ? fmt::format("_Dv{}", c.Dv) : "",
                     c.scale > 0 ? "_scaled" : "");
}

class CudaAttentionKvCacheTest : public ::testing::TestWithParam<KvCacheCase> {
 protected:
  // Runs the op on the CPU (fp32, on the inputs as the GPU sees them) and on the GPU in
  // `dtype`; returns {gpu result, cpu result} as host fp32.
  std::pair<Tensor, Tensor> run(DType dtype, uint64_t seed) {
    const KvCacheCase c = GetParam();
    const Shape q_shape{c.n, c.Hq, c.D}, cache_shape{c.max_positions, c.Hkv, c.D};
    const Shape value_shape{c.max_positions, c.Hkv, c.v_dim()}, out_shape{c.n, c.Hq, c.v_dim()};
    auto input = [&](const Shape& shape, uint64_t s) {
      Tensor t = randn(shape, s);
      return dtype == DType::F32 ? t : t.to(dtype).to(DType::F32);
    };
    const Tensor q = input(q_shape, seed);
    Tensor key_cache = input(cache_shape, seed + 1), value_cache = input(value_shape, seed + 2);
    // Rows past the last query's position: NaN.
    const int64_t filled = c.first + c.n;
    if (filled < c.max_positions) {
      Tensor unused_keys = key_cache.rows(filled, c.max_positions - filled);
      Tensor unused_values = value_cache.rows(filled, c.max_positions - filled);
      poison(unused_keys);
      poison(unused_values);
    }
    Tensor want = Tensor::empty(out_shape);
    poison(want);
    ops::attention_kv_cache(q, key_cache, value_cache, c.first, want, c.scale);

    Tensor out_d = poisoned_device(out_shape, dtype);
    ops::attention_kv_cache(to_device(q, dtype), to_device(key_cache, dtype),
                            to_device(value_cache, dtype), c.first, out_d, c.scale);
    cuda::synchronize();
    return {to_host_f32(out_d), want};
  }
};

TEST_P(CudaAttentionKvCacheTest, F32MatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 600;
  SCOPED_TRACE(seed_trace(seed));
  const auto [got, want] = run(DType::F32, seed);
  ASSERT_TRUE(all_finite(got, "out"));
  // CUDA fp32 tolerances (CONVENTIONS.md): the sums run in another order.
  EXPECT_TRUE(allclose(got, want, 1e-5, 1e-4));
}

TEST_P(CudaAttentionKvCacheTest, Bf16MatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 700;
  SCOPED_TRACE(seed_trace(seed));
  const auto [got, want] = run(DType::BF16, seed);
  ASSERT_TRUE(all_finite(got, "out"));
  // Same bf16 inputs on both sides and fp32 arithmetic: the GPU rounds only its output.
  EXPECT_LE(rel_error(got, want), 1e-2);
  EXPECT_TRUE(allclose(got, want, 1e-5, 1e-2));
}

TEST_P(CudaAttentionKvCacheTest, F16MatchesCpu) {
  MEGATON_SKIP_WITHOUT_GPU();
  const uint64_t seed = testing::test_seed() + 800;
  SCOPED_TRACE(seed_trace(seed));
  const auto [got, want] = run(DType::F16, seed);
  ASSERT_TRUE(all_finite(got, "out"));
  // F16 inputs on both sides, fp32 arithmetic, one F16 rounding of the output (fp16
  // tolerances, an eighth of BF16's).
  EXPECT_LE(rel_error(got, want), 1e-3);
  EXPECT_TRUE(allclose(got, want, 1e-5, 1e-3));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionKvCacheTest,
    ::testing::Values(KvCacheCase{4, 2, 2, 8, 0, 1},          // the first token alone, D < 32
                      KvCacheCase{64, 8, 2, 128, 37, 1},      // a decode step, GQA, Llama's D
                      KvCacheCase{2048, 4, 1, 128, 1999, 1},  // a long cache, MQA
                      KvCacheCase{32, 4, 4, 64, 0, 32},       // a prefill filling the cache
                      KvCacheCase{48, 6, 3, 40, 10, 13},      // a chunk mid-cache, D not /32
                      KvCacheCase{128, 2, 1, 512, 100, 3},    // the largest D
                      KvCacheCase{16, 4, 2, 8, 5, 1},         // the test models' shape
                      // MLA (DeepSeek-V3): Dqk 192, Dv 128, YaRN's scale; decode and a chunk.
                      KvCacheCase{256, 4, 4, 192, 200, 1, 128, 0.135234f},
                      KvCacheCase{64, 4, 4, 192, 10, 17, 128, 0.135234f},
                      KvCacheCase{40, 4, 2, 24, 3, 5, 40}),  // Dv > Dqk, in other chunks
    case_name);

TEST(CudaAttentionKvCache, RejectsWhatTheKernelCannotRun) {
  MEGATON_SKIP_WITHOUT_GPU();
  Tensor q = poisoned_device({1, 2, 520}, DType::F32);
  Tensor cache = poisoned_device({4, 1, 520}, DType::F32);
  Tensor out = poisoned_device({1, 2, 520}, DType::F32);
  EXPECT_THROW(ops::attention_kv_cache(q, cache, cache, 0, out), InternalError);  // D > 512
  Tensor q8 = poisoned_device({2, 2, 8}, DType::BF16);
  Tensor cache8 = poisoned_device({4, 1, 8}, DType::BF16);
  Tensor out8 = poisoned_device({2, 2, 8}, DType::BF16);
  EXPECT_THROW(ops::attention_kv_cache(q8, cache8, cache8, 3, out8), InternalError);  // past end
  // Dv > 512.
  Tensor wide_values = poisoned_device({4, 1, 520}, DType::BF16);
  Tensor wide_out = poisoned_device({2, 2, 520}, DType::BF16);
  EXPECT_THROW(ops::attention_kv_cache(q8, cache8, wide_values, 0, wide_out), InternalError);
  Tensor cache8_f32 = poisoned_device({4, 1, 8}, DType::F32);
  EXPECT_THROW(ops::attention_kv_cache(q8, cache8_f32, cache8_f32, 0, out8), InternalError);
}

}  // namespace
}  // namespace megaton

#endif  // MEGATON_WITH_CUDA
