// GPU block attention (ops/attention_block.h on cuDNN) against the CPU reference: every
// mask shape context parallelism runs (causal top-left, causal bottom-right with fewer
// queries than keys, unmasked rectangles, a block no query sees), in BF16 on bf16-rounded
// inputs, and the one-query-one-key block cuDNN refuses; the backward adds into F32 and BF16
// accumulators; many pieces in one ragged call (ops::attention_pieces_*); the log-sum-exp merge
// (with rows of -inf) against the CPU merge; and a mask cuDNN cannot run is refused.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.h"
#include "ops/attention_block.h"
#include "ops/ops.h"

#ifdef MEGATON_WITH_CUDA
#include "common/gpu_testing.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randn;
using testing::rel_error;
using testing::round_to_bf16;
using testing::to_device;
using testing::to_host_f32;

struct BlockCase {
  int64_t Sq, Skv, Hq, Hkv, D, Dv, q_offset, kv_offset;
  bool causal;
};

std::string case_name(const ::testing::TestParamInfo<BlockCase>& info) {
  const BlockCase& c = info.param;
  return "Sq" + std::to_string(c.Sq) + "_Skv" + std::to_string(c.Skv) + "_Hq" +
         std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) + "_D" + std::to_string(c.D) +
         "_Dv" + std::to_string(c.Dv) + "_q" + std::to_string(c.q_offset) + "_kv" +
         std::to_string(c.kv_offset) + (c.causal ? "_causal" : "_full");
}

class AttentionBlockGpuTest : public ::testing::TestWithParam<BlockCase> {};

// Tolerances as test_cuda_attention_gpu.cpp (bf16 probabilities and outputs): out 1e-2
// normwise, lse 1e-3 elementwise, gradients 2e-2 normwise.
TEST_P(AttentionBlockGpuTest, MatchesCpu) {
  const BlockCase c = GetParam();
  const uint64_t seed = testing::test_seed();
  const Tensor q = round_to_bf16(randn({c.Sq, c.Hq, c.D}, seed)),
               k = round_to_bf16(randn({c.Skv, c.Hkv, c.D}, seed + 1)),
               v = round_to_bf16(randn({c.Skv, c.Hkv, c.Dv}, seed + 2)),
               dout = round_to_bf16(randn({c.Sq, c.Hq, c.Dv}, seed + 3));
  Tensor out = Tensor::empty({c.Sq, c.Hq, c.Dv}), lse = Tensor::empty({c.Sq, c.Hq});
  ops::attention_block_forward(q, k, v, c.q_offset, c.kv_offset, c.causal, out, lse, 0.3f);
  // Accumulators that already hold values: the op adds.
  const Tensor dq0 = randn(q.shape(), seed + 4), dk0 = randn(k.shape(), seed + 5),
               dv0 = randn(v.shape(), seed + 6);
  Tensor dq = dq0.clone(), dk = dk0.clone(), dv = dv0.clone();
  // The backward takes the query's MERGED out and lse (over every block of its keys), not
  // this block's: a stand-in for those, so that the block's probabilities are not its own
  // softmax (p < 1 even for a block of one key).
  Tensor lse_m = lse.clone();
  for (int64_t i = 0; i < lse_m.numel(); ++i) lse_m.f32()[i] += 0.4f + 0.1f * float(i % 3);
  const Tensor out_m = round_to_bf16(randn(out.shape(), seed + 7, 0.5f));
  ops::attention_block_backward(dout, q, k, v, out_m, lse_m, c.q_offset, c.kv_offset, c.causal, dq,
                                dk, dv, 0.3f);

  const Tensor gq = to_device(q, DType::BF16), gk = to_device(k, DType::BF16),
               gv = to_device(v, DType::BF16), gdout = to_device(dout, DType::BF16);
  Tensor gout = Tensor::empty(out.shape(), DType::BF16, Device::CUDA),
         glse = Tensor::empty(lse.shape(), DType::F32, Device::CUDA);
  ops::attention_block_forward(gq, gk, gv, c.q_offset, c.kv_offset, c.causal, gout, glse, 0.3f);
  const Tensor hout = to_host_f32(gout), hlse = to_host_f32(glse);
  const bool empty = c.causal && c.kv_offset > c.q_offset + c.Sq - 1;
  if (empty) {
    EXPECT_EQ(ops::sum_of_squares(hout), 0.0);
    for (int64_t i = 0; i < hlse.numel(); ++i)
      EXPECT_EQ(hlse.f32()[i], -std::numeric_limits<float>::infinity());
  } else {
    EXPECT_LT(rel_error(hout, out), 1e-2);
    EXPECT_TRUE(allclose(hlse, lse, 1e-3, 1e-3));
  }
  for (DType acc : {DType::F32, DType::BF16}) {
    Tensor gdq = to_device(dq0, acc), gdk = to_device(dk0, acc), gdv = to_device(dv0, acc);
    ops::attention_block_backward(gdout, gq, gk, gv, to_device(out_m, DType::BF16),
                                  to_device(lse_m, DType::F32), c.q_offset, c.kv_offset, c.causal,
                                  gdq, gdk, gdv, 0.3f);
    // Normwise on the added part (the accumulator's start values taken off).
    const double tol = acc == DType::F32 ? 2e-2 : 5e-2;
    for (auto [got, want, start, name] :
         {std::tuple{&gdq, &dq, &dq0, "dq"}, {&gdk, &dk, &dk0, "dk"}, {&gdv, &dv, &dv0, "dv"}}) {
      Tensor g = to_host_f32(*got), w = want->clone();
      const Tensor s = acc == DType::F32 ? *start : round_to_bf16(*start);
      ops::add_(g, s, -1.0f);
      ops::add_(w, *start, -1.0f);
      if (empty) {
        EXPECT_EQ(ops::sum_of_squares(g), 0.0) << name;
        continue;
      }
      EXPECT_LT(rel_error(g, w), tol) << name << " accumulating in " << dtype_name(acc);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    ContextParallelTiles, AttentionBlockGpuTest,
    ::testing::Values(
        // p2p: own chunks (causal, top-left), an earlier rank's first chunk, a later rank's
        // block for the second half of the queries.
        BlockCase{64, 64, 4, 2, 64, 64, 0, 0, true}, BlockCase{64, 32, 4, 2, 64, 64, 0, 0, false},
        BlockCase{32, 64, 8, 2, 128, 128, 0, 0, false},
        // all_gather: chunk m's queries against keys [0, (m + 1) c), bottom-right.
        BlockCase{32, 96, 4, 2, 64, 64, 64, 0, true}, BlockCase{32, 32, 4, 4, 64, 64, 0, 0, true},
        // MLA's head dims; a block entirely in the past (unmasked); one in the future (empty).
        BlockCase{48, 96, 4, 4, 192, 128, 48, 0, true},
        BlockCase{32, 32, 4, 2, 64, 64, 64, 0, true}, BlockCase{32, 32, 4, 2, 64, 64, 0, 64, true},
        // One query and one key (a one-token document; cuDNN refuses s_q = s_kv = 1).
        BlockCase{1, 1, 4, 2, 64, 64, 5, 5, true}, BlockCase{1, 1, 4, 4, 64, 32, 9, 3, true}),
    case_name);

// Many pieces in one ragged cuDNN call against the CPU loop of blocks: pieces of one and
// of many rows, causal (keys ending with the queries) and not, rows in no piece untouched.
TEST(AttentionBlockGpu, PiecesMatchCpu) {
  const uint64_t seed = testing::test_seed();
  const int64_t Tq = 96, Tkv = 160, Hq = 4, Hkv = 2, D = 64;
  const Tensor q = round_to_bf16(randn({Tq, Hq, D}, seed)),
               k = round_to_bf16(randn({Tkv, Hkv, D}, seed + 1)),
               v = round_to_bf16(randn({Tkv, Hkv, D}, seed + 2)),
               dout = round_to_bf16(randn({Tq, Hq, D}, seed + 3));
  for (bool causal : {true, false}) {
    const std::vector<ops::AttentionPiece> pieces =
        causal ? std::vector<ops::AttentionPiece>{{0, 1, 0, 1},
                                                  {1, 30, 1, 70},
                                                  {40, 1, 100, 5},
                                                  {41, 55, 105, 55}}
               : std::vector<ops::AttentionPiece>{{0, 1, 10, 1}, {1, 30, 11, 3}, {40, 56, 20, 140}};
    Tensor out = Tensor::zeros({Tq, Hq, D}), lse = Tensor::zeros({Tq, Hq});
    ops::attention_pieces_forward(q, k, v, pieces, causal, out, lse, 0.3f);
    Tensor gout = Tensor::zeros({Tq, Hq, D}, DType::BF16, Device::CUDA),
           glse = Tensor::zeros({Tq, Hq}, DType::F32, Device::CUDA);
    ops::attention_pieces_forward(to_device(q, DType::BF16), to_device(k, DType::BF16),
                                  to_device(v, DType::BF16), pieces, causal, gout, glse, 0.3f);
    EXPECT_LT(rel_error(to_host_f32(gout), out), 1e-2) << causal;
    EXPECT_TRUE(allclose(to_host_f32(glse), lse, 1e-3, 1e-3)) << causal;
    // Rows 31..39 are in no piece: untouched (zero).
    EXPECT_EQ(ops::sum_of_squares(to_host_f32(gout).rows(31, 9)), 0.0);
    Tensor dq = Tensor::zeros(q.shape()), dk = Tensor::zeros(k.shape()),
           dv = Tensor::zeros(v.shape());
    ops::attention_pieces_backward(dout, q, k, v, round_to_bf16(out), lse, pieces, causal, dq, dk,
                                   dv, 0.3f);
    Tensor gdq = Tensor::zeros(q.shape(), DType::F32, Device::CUDA),
           gdk = Tensor::zeros(k.shape(), DType::F32, Device::CUDA),
           gdv = Tensor::zeros(v.shape(), DType::F32, Device::CUDA);
    ops::attention_pieces_backward(to_device(dout, DType::BF16), to_device(q, DType::BF16),
                                   to_device(k, DType::BF16), to_device(v, DType::BF16),
                                   to_device(out, DType::BF16), to_device(lse, DType::F32), pieces,
                                   causal, gdq, gdk, gdv, 0.3f);
    EXPECT_LT(rel_error(to_host_f32(gdq), dq), 2e-2) << causal;
    EXPECT_LT(rel_error(to_host_f32(gdk), dk), 2e-2) << causal;
    EXPECT_LT(rel_error(to_host_f32(gdv), dv), 2e-2) << causal;
  }
}

TEST(AttentionBlockGpu, RefusesAMaskCudnnCannotRun) {
  // 32 queries at 10 against 64 keys at 0: the diagonal is neither top-left nor bottom-right.
  const Tensor q = to_device(randn({32, 2, 64}, 1), DType::BF16),
               k = to_device(randn({64, 2, 64}, 2), DType::BF16), v = k;
  Tensor out = Tensor::empty({32, 2, 64}, DType::BF16, Device::CUDA),
         lse = Tensor::empty({32, 2}, DType::F32, Device::CUDA);
  EXPECT_THROW(ops::attention_block_forward(q, k, v, 10, 0, true, out, lse), InternalError);
}

TEST(AttentionBlockGpu, MergeMatchesCpu) {
  const int64_t S = 40, H = 3, Dv = 72;
  const uint64_t seed = testing::test_seed();
  Tensor out = randn({S, H, Dv}, seed), lse = randn({S, H}, seed + 1);
  const Tensor out_b = round_to_bf16(randn({S, H, Dv}, seed + 2)), lse_b0 = randn({S, H}, seed + 3);
  Tensor lse_b = lse_b0.clone();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < S * H; r += 7) lse.f32()[r] = -inf;     // only b's values
  for (int64_t r = 3; r < S * H; r += 11) lse_b.f32()[r] = -inf;  // b adds nothing
  lse.f32()[3] = lse_b.f32()[3] = -inf;                           // neither
  Tensor gout = to_device(out, DType::F32), glse = to_device(lse, DType::F32);
  ops::attention_lse_merge(gout, glse, to_device(out_b, DType::BF16), to_device(lse_b, DType::F32));
  ops::attention_lse_merge(out, lse, out_b, lse_b);
  EXPECT_TRUE(allclose(to_host_f32(gout), out, 1e-6, 1e-5));
  // -inf (row 3, which neither saw) compared as a finite stand-in.
  auto finite = [&](Tensor t) {
    for (int64_t i = 0; i < t.numel(); ++i)
      if (t.f32()[i] == -inf) t.f32()[i] = -1e30f;
    return t;
  };
  EXPECT_EQ(to_host_f32(glse).f32()[3], -inf);
  EXPECT_TRUE(allclose(finite(to_host_f32(glse)), finite(lse.clone()), 1e-6, 1e-6));
}

}  // namespace
}  // namespace megaton
#endif  // MEGATON_WITH_CUDA
