// CUDA softmax cross-entropy, MoE permutation and padding per group against their CPU
// twins (the router: test_cuda_moe_router_gpu.cpp): the same (rounded to BF16 or F16 where
// those are used) inputs on both devices, outputs poisoned before each CUDA op runs.
#include <gtest/gtest.h>

#ifdef MEGATON_WITH_CUDA
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
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

// CUDA fp32 tolerances of CONVENTIONS.md (fp32 math on identical inputs, different
// summation order and exp implementation), bf16's and fp16's.
constexpr double kF32Atol = 1e-5, kF32Rtol = 1e-4;
constexpr double kBf16Atol = 1e-5, kBf16Rtol = 1e-2, kBf16Rel = 1e-2;
constexpr double kF16Atol = 1e-5, kF16Rtol = 1e-3, kF16Rel = 1e-3;

std::string seed_trace(uint64_t seed) { return "seed " + std::to_string(seed); }

class CudaOpsMoeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

Tensor to_gpu(const Tensor& t) { return t.to(Device::CUDA); }
Tensor to_cpu(const Tensor& t) { return t.to(Device::CPU); }

// A GPU output filled with NaN (float) or -1 (integer), so an unwritten element shows.
Tensor poisoned_gpu(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::CUDA);
  t.fill(dtype == DType::I32 || dtype == DType::I64 ? -1.0f : NAN);
  return t;
}

// The fp32 values a BF16 or F16 tensor holds (the CPU reference's input), and that tensor.
struct Rounded {
  Tensor ref;     // F32 on the CPU
  Tensor device;  // `dtype` on the GPU, the same values
};
Rounded as_dtype(const Tensor& f32, DType dtype) {
  Tensor ref = dtype == DType::F32 ? f32.clone() : f32.to(dtype).to(DType::F32);
  return {ref, to_gpu(ref.to(dtype))};
}

// Every element identical (bit patterns compared for floats: NaN never equals).
::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  const Tensor x = to_cpu(a), y = to_cpu(b);
  if (x.nbytes() != y.nbytes() || x.dtype() != y.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  const size_t es = dtype_size(x.dtype());
  const char *p = static_cast<const char*>(x.raw()), *q = static_cast<const char*>(y.raw());
  for (int64_t i = 0; i < x.numel(); ++i)
    if (std::memcmp(p + i * es, q + i * es, es) != 0 || std::isnan(x.item(i)))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << x.item(i) << " vs " << y.item(i);
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------
// Softmax cross-entropy

struct CrossEntropyCase {
  int64_t T, V;
  DType dtype;
};

// Forward, backward out of place, and backward in place (dlogits aliasing logits), each
// against the CPU on the same values; in place must equal out of place bit for bit.
void check_cross_entropy(const CrossEntropyCase& c, uint64_t seed) {
  SCOPED_TRACE("T " + std::to_string(c.T) + " V " + std::to_string(c.V) + " " +
               std::string(dtype_name(c.dtype)));
  const bool bf16 = c.dtype == DType::BF16;
  const Rounded logits = as_dtype(randn({c.T, c.V}, seed, 2.0f), c.dtype);
  const Tensor labels = testing::randint({c.T}, int32_t(c.V), seed + 1);
  const Tensor dlosses = randn({c.T}, seed + 2);
  const Tensor labels_gpu = to_gpu(labels), dlosses_gpu = to_gpu(dlosses);

  Tensor ref_losses = Tensor::empty({c.T}), ref_lse = Tensor::empty({c.T});
  ops::cross_entropy_forward(logits.ref, labels, ref_losses, ref_lse);
  Tensor ref_dlogits = Tensor::empty({c.T, c.V});
  ops::cross_entropy_backward(dlosses, logits.ref, labels, ref_lse, ref_dlogits);

  Tensor losses = poisoned_gpu({c.T}, DType::F32), lse = poisoned_gpu({c.T}, DType::F32);
  ops::cross_entropy_forward(logits.device, labels_gpu, losses, lse);
  // fp32 math on identical inputs: the CUDA fp32 tolerance whatever the logits' dtype.
  EXPECT_TRUE(allclose(to_cpu(losses), ref_losses, kF32Atol, kF32Rtol)) << "losses";
  EXPECT_TRUE(allclose(to_cpu(lse), ref_lse, kF32Atol, kF32Rtol)) << "lse";

  Tensor dlogits = poisoned_gpu({c.T, c.V}, c.dtype);
  ops::cross_entropy_backward(dlosses_gpu, logits.device, labels_gpu, lse, dlogits);
  const Tensor dlogits_f32 = to_cpu(dlogits).to(DType::F32);
  if (bf16) {
    EXPECT_LE(rel_error(dlogits_f32, ref_dlogits), kBf16Rel) << "dlogits";
  } else if (c.dtype == DType::F16) {  // one rounding of the fp32 gradient
    EXPECT_TRUE(allclose(dlogits_f32, ref_dlogits, kF16Atol, kF16Rtol)) << "dlogits";
    EXPECT_LE(rel_error(dlogits_f32, ref_dlogits), kF16Rel) << "dlogits";
  } else {
    EXPECT_TRUE(allclose(dlogits_f32, ref_dlogits, kF32Atol, kF32Rtol)) << "dlogits";
    EXPECT_LE(rel_error(dlogits_f32, ref_dlogits), 1e-5) << "dlogits";
  }

  Tensor in_place = logits.device.clone();
  ops::cross_entropy_backward(dlosses_gpu, in_place, labels_gpu, lse, in_place);
  EXPECT_TRUE(bitwise_equal(in_place, dlogits)) << "in-place dlogits";
}

TEST_F(CudaOpsMoeTest, CrossEntropyMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 600;
  SCOPED_TRACE(seed_trace(seed));
  // V = 97: rows not a multiple of a 16-byte pack (the element-wise kernels).
  const std::vector<CrossEntropyCase> cases = {
      {1, 96, DType::F32},     {37, 96, DType::F32},      {4096, 96, DType::F32},
      {37, 97, DType::F32},    {1, 50304, DType::F32},    {37, 50304, DType::F32},
      {1, 96, DType::BF16},    {37, 97, DType::BF16},     {4096, 96, DType::BF16},
      {1, 50304, DType::BF16}, {37, 50304, DType::BF16},  {4096, 50304, DType::BF16},
      {1, 96, DType::F16},     {37, 97, DType::F16},      {4096, 96, DType::F16},
      {37, 50304, DType::F16}, {4096, 50304, DType::F16},
  };
  for (size_t i = 0; i < cases.size(); ++i) check_cross_entropy(cases[i], seed + 10 * i);
}

// ---------------------------------------------------------------------------------------
// Token permutation

struct PermuteCase {
  int64_t T, E;
  int k;
  int64_t H;
  int starved;  // an expert no token routes to, or -1
};

// Each token's k experts: distinct, uniformly drawn from [0, E) without `starved`.
Tensor random_routing(int64_t T, int64_t E, int k, int starved, uint64_t seed) {
  Tensor indices = Tensor::empty({T, k}, DType::I32);
  std::mt19937_64 gen(seed);
  std::vector<int32_t> experts;
  for (int32_t e = 0; e < E; ++e)
    if (e != starved) experts.push_back(e);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), gen);
    std::copy(experts.begin(), experts.begin() + k, indices.i32() + t * k);
  }
  return indices;
}

// Token probabilities in (0, 1).
Tensor random_probs(int64_t T, int k, uint64_t seed) {
  Tensor p = Tensor::empty({T, k});
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int64_t i = 0; i < p.numel(); ++i) p.f32()[i] = u(gen);
  return p;
}

// A sum of k values: the CPU and GPU add in the same j order in fp32, so F32 agrees to
// rounding (a fused multiply-add may differ by an ulp); BF16 and F16 add the output's
// rounding.
::testing::AssertionResult close_sum(const Tensor& gpu, const Tensor& ref, DType dtype) {
  const Tensor got = to_cpu(gpu).to(DType::F32);
  if (dtype == DType::BF16) return allclose(got, ref, kBf16Atol, kBf16Rtol);
  if (dtype == DType::F16) return allclose(got, ref, kF16Atol, kF16Rtol);
  return allclose(got, ref, 1e-6, 1e-6);
}

void check_permute(const PermuteCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE("T " + std::to_string(c.T) + " E " + std::to_string(c.E) + " k " +
               std::to_string(c.k) + " H " + std::to_string(c.H) + " starved " +
               std::to_string(c.starved) + " " + std::string(dtype_name(dtype)));
  const int64_t copies = c.T * c.k;
  const Tensor indices = random_routing(c.T, c.E, c.k, c.starved, seed);
  const Tensor indices_gpu = to_gpu(indices);
  const Rounded x = as_dtype(randn({c.T, c.H}, seed + 1), dtype);

  // Forward permutation: a stable counting sort, so the map and counts match exactly and
  // the rows are exact copies.
  Tensor ref_permuted = Tensor::empty({copies, c.H});
  Tensor ref_map = Tensor::empty({copies}, DType::I32);
  Tensor ref_tokens = Tensor::empty({c.E}, DType::I64);
  ops::moe_permute(x.ref, indices, int(c.E), ref_permuted, ref_map, ref_tokens);
  Tensor permuted = poisoned_gpu({copies, c.H}, dtype);
  Tensor row_id_map = poisoned_gpu({copies}, DType::I32);
  Tensor tokens = poisoned_gpu({c.E}, DType::I64);
  ops::moe_permute(x.device, indices_gpu, int(c.E), permuted, row_id_map, tokens);
  EXPECT_TRUE(bitwise_equal(row_id_map, ref_map)) << "row_id_map";
  EXPECT_TRUE(bitwise_equal(tokens, ref_tokens)) << "tokens_per_expert";
  EXPECT_TRUE(bitwise_equal(permuted, ref_permuted.to(dtype))) << "permuted";
  if (c.starved >= 0) {
    EXPECT_EQ(to_cpu(tokens).i64()[c.starved], 0);
  }

  // Backward of the permutation: each token sums its k rows.
  const Rounded dpermuted = as_dtype(randn({copies, c.H}, seed + 2), dtype);
  Tensor ref_dx = Tensor::empty({c.T, c.H});
  ops::moe_permute_backward(dpermuted.ref, ref_map, c.k, ref_dx);
  Tensor dx = poisoned_gpu({c.T, c.H}, dtype);
  ops::moe_permute_backward(dpermuted.device, row_id_map, c.k, dx);
  EXPECT_TRUE(close_sum(dx, ref_dx, dtype)) << "permute backward dx";

  // Unpermute: out[t] = sum_j probs[t, j] expert_out[r(t, j)].
  const Rounded expert_out = as_dtype(randn({copies, c.H}, seed + 3), dtype);
  const Tensor probs = random_probs(c.T, c.k, seed + 4);
  const Tensor probs_gpu = to_gpu(probs);
  Tensor ref_out = Tensor::empty({c.T, c.H});
  ops::moe_unpermute(expert_out.ref, ref_map, probs, ref_out);
  Tensor out = poisoned_gpu({c.T, c.H}, dtype);
  ops::moe_unpermute(expert_out.device, row_id_map, probs_gpu, out);
  EXPECT_TRUE(close_sum(out, ref_out, dtype)) << "unpermute out";

  // Unpermute backward: dexpert_out rows are one product each (exact in F32, one bf16
  // rounding in BF16 or F16); dprobs are H-term dot products.
  const Rounded dout = as_dtype(randn({c.T, c.H}, seed + 5), dtype);
  Tensor ref_dexpert = Tensor::empty({copies, c.H}), ref_dprobs = Tensor::empty({c.T, c.k});
  ops::moe_unpermute_backward(dout.ref, expert_out.ref, ref_map, probs, ref_dexpert, ref_dprobs);
  Tensor dexpert = poisoned_gpu({copies, c.H}, dtype);
  Tensor dprobs = poisoned_gpu({c.T, c.k}, DType::F32);
  ops::moe_unpermute_backward(dout.device, expert_out.device, row_id_map, probs_gpu, dexpert,
                              dprobs);
  if (dtype == DType::BF16) {
    EXPECT_TRUE(allclose(to_cpu(dexpert).to(DType::F32), ref_dexpert, kBf16Atol, kBf16Rtol))
        << "dexpert_out";
  } else if (dtype == DType::F16) {
    EXPECT_TRUE(allclose(to_cpu(dexpert).to(DType::F32), ref_dexpert, kF16Atol, kF16Rtol))
        << "dexpert_out";
  } else {
    EXPECT_TRUE(bitwise_equal(dexpert, ref_dexpert)) << "dexpert_out";
  }
  // An fp32 dot product of H terms in another order differs by a few ulp of the sum of
  // |terms| (the CPU adds in fp64): 1e-6 of that sum is ~8 ulp, plus the fp32 rtol.
  const Tensor got_dprobs = to_cpu(dprobs);
  const Tensor g = dout.ref, eo = expert_out.ref;
  std::vector<int64_t> row_of_copy(copies);
  for (int64_t r = 0; r < copies; ++r) row_of_copy[ref_map.i32()[r]] = r;
  for (int64_t t = 0; t < c.T; ++t) {
    for (int j = 0; j < c.k; ++j) {
      const int64_t copy = t * c.k + j, row = row_of_copy[copy];
      double magnitude = 0;
      for (int64_t h = 0; h < c.H; ++h)
        magnitude += std::fabs(double(g.f32()[t * c.H + h]) * eo.f32()[row * c.H + h]);
      const float want = ref_dprobs.f32()[copy], got = got_dprobs.f32()[copy];
      ASSERT_NEAR(got, want, 1e-6 * magnitude + kF32Rtol * std::fabs(want))
          << "dprobs token " << t << " slot " << j;
    }
  }
}

TEST_F(CudaOpsMoeTest, PermuteAndUnpermuteMatchCpu) {
  const uint64_t seed = testing::test_seed() + 630;
  SCOPED_TRACE(seed_trace(seed));
  // H = 97: rows not a multiple of a 16-byte pack (the element-wise kernels). k = E routes
  // every token everywhere; E = 64 with k = 2 and 37 tokens leaves experts empty by itself.
  const std::vector<PermuteCase> cases = {
      {1, 4, 1, 64, -1},     {37, 8, 2, 97, -1},    {37, 8, 8, 128, -1}, {37, 64, 2, 96, -1},
      {4096, 64, 8, 256, 7}, {4096, 8, 2, 1024, 0}, {4096, 4, 1, 96, 3},
  };
  for (DType dtype : {DType::F32, DType::BF16, DType::F16})
    for (size_t i = 0; i < cases.size(); ++i) check_permute(cases[i], dtype, seed + 10 * i);
}

// ---------------------------------------------------------------------------------------
// Padding per group (--moe-pad-expert-input-to-capacity; FP8 GEMM tiles)

struct PadCase {
  int64_t groups, max_rows, H;
  int64_t tile;  // 0: every group padded to max_rows (a capacity); else rows rounded up to it
};

// Pad and unpad on both devices: pure copies and zeros, so bitwise equal.
void check_pad_rows(const PadCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE("groups " + std::to_string(c.groups) + " max_rows " + std::to_string(c.max_rows) +
               " H " + std::to_string(c.H) + " tile " + std::to_string(c.tile) + " " +
               std::string(dtype_name(dtype)));
  // Group sizes in [0, max_rows], with a full and an empty group and, rounded to a tile, a
  // group that is an exact multiple of it (no padding); empty groups then have no padded rows.
  std::vector<int64_t> group_rows(c.groups), padded_rows(c.groups);
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> count(0, c.max_rows);
  for (int64_t& n : group_rows) n = count(gen);
  group_rows[0] = c.max_rows;
  if (c.groups > 1) group_rows[1] = 0;
  if (c.groups > 2 && c.tile > 0) group_rows[2] = c.tile * (c.max_rows / c.tile);
  for (int64_t g = 0; g < c.groups; ++g)
    padded_rows[g] = c.tile == 0 ? c.max_rows : (group_rows[g] + c.tile - 1) / c.tile * c.tile;
  const int64_t R = std::accumulate(group_rows.begin(), group_rows.end(), int64_t(0));
  const int64_t P = std::accumulate(padded_rows.begin(), padded_rows.end(), int64_t(0));

  const Rounded rows = as_dtype(randn({R, c.H}, seed + 1), dtype);
  Tensor ref_padded = Tensor::empty({P, c.H});
  ops::moe_pad_rows(rows.ref, group_rows, padded_rows, ref_padded);
  Tensor padded = poisoned_gpu({P, c.H}, dtype);
  ops::moe_pad_rows(rows.device, group_rows, padded_rows, padded);
  EXPECT_TRUE(bitwise_equal(padded, ref_padded.to(dtype))) << "padded";

  const Rounded grad = as_dtype(randn({P, c.H}, seed + 2), dtype);
  Tensor ref_rows = Tensor::empty({R, c.H});
  ops::moe_unpad_rows(grad.ref, group_rows, padded_rows, ref_rows);
  Tensor unpadded = poisoned_gpu({R, c.H}, dtype);
  ops::moe_unpad_rows(grad.device, group_rows, padded_rows, unpadded);
  EXPECT_TRUE(bitwise_equal(unpadded, ref_rows.to(dtype))) << "unpadded";
}

TEST_F(CudaOpsMoeTest, PadRowsToCapacityMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 660;
  SCOPED_TRACE(seed_trace(seed));
  // H = 97: rows not a multiple of a 16-byte pack; 2000 groups: more than one launch's
  // (480) groups; 256 x 40: DeepSeek-V3's experts on one rank.
  const std::vector<PadCase> cases = {
      {1, 1, 64, 0}, {4, 37, 97, 0}, {8, 512, 256, 0}, {2000, 3, 96, 0}, {256, 40, 1024, 0},
  };
  for (DType dtype : {DType::F32, DType::BF16, DType::F16})
    for (size_t i = 0; i < cases.size(); ++i) check_pad_rows(cases[i], dtype, seed + 10 * i);
}

TEST_F(CudaOpsMoeTest, PadRowsToTileMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 665;
  SCOPED_TRACE(seed_trace(seed));
  // Each group's rows rounded up to the FP8 GEMMs' 16 or 128 rows: unequal padding, empty
  // groups with no padded rows, groups without padding; 1000 groups: more than one launch;
  // 256 x 40: DeepSeek-V3's experts on one rank.
  const std::vector<PadCase> cases = {
      {3, 20, 97, 16},
      {64, 300, 256, 128},
      {1000, 40, 96, 16},
      {256, 40, 1024, 16},
  };
  for (DType dtype : {DType::F32, DType::BF16, DType::F16})
    for (size_t i = 0; i < cases.size(); ++i) check_pad_rows(cases[i], dtype, seed + 10 * i);
}

TEST_F(CudaOpsMoeTest, PadRowsRejectsBadInputs) {
  const Tensor rows = to_gpu(randn({5, 2}, 3));
  Tensor padded = poisoned_gpu({9, 2}, DType::F32);
  const std::vector<int64_t> groups = {2, 0, 3}, capacity = {3, 3, 3};
  EXPECT_NO_THROW(ops::moe_pad_rows(rows, groups, capacity, padded));
  EXPECT_NO_THROW(ops::moe_pad_rows(rows, groups, {4, 2, 3}, padded));
  Tensor short_padded = poisoned_gpu({8, 2}, DType::F32);
  Tensor bf16_padded = poisoned_gpu({9, 2}, DType::BF16);
  EXPECT_THROW(ops::moe_pad_rows(rows, {2, 0, 2}, capacity, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, {4, 0, 1}, capacity, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, {3, 4, 2}, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, {3, 3}, padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, capacity, short_padded), InternalError);
  EXPECT_THROW(ops::moe_pad_rows(rows, groups, capacity, bf16_padded), InternalError);
  Tensor host_rows = Tensor::empty({5, 2});
  EXPECT_THROW(ops::moe_unpad_rows(padded, groups, capacity, host_rows), InternalError);
}

TEST_F(CudaOpsMoeTest, SortChunksMatchesCpu) {
  const uint64_t seed = testing::test_seed() + 670;
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937_64 gen(seed);
  // 64 chunks of 0-300 rows (an EP8 regrouping: 8 ranks x 8 local experts) and 300 chunks
  // (more than one launch's 128); H = 2048 bf16 rows take the 16-byte path, H = 97 fp32
  // rows (388 bytes) the byte path.
  for (int64_t chunks : {int64_t(64), int64_t(300)})
    for (auto [H, dtype] : {std::pair{int64_t(2048), DType::BF16}, std::pair{int64_t(97), DType::F32}}) {
      std::uniform_int_distribution<int64_t> count(0, 300);
      std::vector<int64_t> chunk_rows(static_cast<size_t>(chunks)), order(chunk_rows.size());
      for (int64_t& n : chunk_rows) n = count(gen) % 5 == 0 ? 0 : count(gen);
      std::iota(order.begin(), order.end(), int64_t(0));
      std::shuffle(order.begin(), order.end(), gen);
      const int64_t R = std::accumulate(chunk_rows.begin(), chunk_rows.end(), int64_t(0));
      const Rounded src = as_dtype(randn({R, H}, seed + uint64_t(chunks + H)), dtype);
      Tensor ref = Tensor::empty({R, H});
      ops::moe_sort_chunks(src.ref, chunk_rows, order, ref);
      Tensor got = poisoned_gpu({R, H}, dtype);
      ops::moe_sort_chunks(src.device, chunk_rows, order, got);
      EXPECT_TRUE(bitwise_equal(got, ref.to(dtype))) << chunks << " chunks, H " << H;
    }
}

}  // namespace
}  // namespace megaton

#else  // !MEGATON_WITH_CUDA

TEST(CudaOpsMoeTest, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif
