// Context-parallel attention on 4 CPU ranks (`mpirun -np 4`): for CP 2 (two groups) and
// CP 4, and each comm type (p2p, all_gather, a2a), every rank's output, log-sum-exp and
// gradients for its two chunks equal the rows of ops::attention_forward/backward on the
// whole sequence; and the dual-chunk split itself.
// MEGATON_TEST_DEVICE=cuda (ctest's test_context_parallel_mpi_cuda, label gpu, CUDA builds;
// 4 ranks on 4 GPUs, or 2 on 2 for the CP 2 cases): every comm type on the GPU (cuDNN
// attention per block or whole, NCCL exchanges) in bf16 against the same CPU reference on
// the bf16-rounded inputs (normwise) and against the one-GPU attention of the whole
// sequence (elementwise).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "common/mpi_testing.h"
#include "common/testing.h"
#include "dist/comm.h"
#include "dist/runtime.h"
#include "model/context_parallel.h"
#include "ops/attention_varlen.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randn;

constexpr double kAtol = 2e-6, kRtol = 2e-5;

Device test_device() {
  const char* d = std::getenv("MEGATON_TEST_DEVICE");
  return d && std::string(d) == "cuda" ? Device::CUDA : Device::CPU;
}

TEST(CpSplit, DualChunkPositions) {
  // Megatron's example: S = 8 over 2 ranks: rank 0 chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(cp_local_positions(8, 2, 0), (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(cp_local_positions(8, 2, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(cp_local_positions(16, 4, 1), (std::vector<int64_t>{2, 3, 12, 13}));
  Tensor x = Tensor::from_i32({2, 8}, {0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17});
  Tensor local = cp_split_sequence(x, 2, 1);
  ASSERT_EQ(local.shape(), (Shape{2, 4}));
  EXPECT_EQ(std::vector<int32_t>(local.i32(), local.i32() + 8),
            (std::vector<int32_t>{2, 3, 4, 5, 12, 13, 14, 15}));
  EXPECT_THROW(cp_local_positions(12, 4, 0), InternalError);  // 12 % 8 != 0
}

struct CpCase {
  int cp;
  CpCommType type;
  int64_t B, S, Hq, Hkv, D, Dv;
  bool documents = false;  // packed documents (--reset-attention-mask)
};

// Document boundaries over B samples of S rows: per sample a few documents of uneven
// lengths (some inside one chunk, some across chunks and ranks), different per sample.
std::vector<int32_t> test_documents(int64_t B, int64_t S) {
  std::vector<int32_t> cu{0};
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t cut : {S / 8 + 1 + b, S / 3 + 2 * b, S / 3 + 3 + 2 * b, (3 * S) / 4 - b})
      if (cut > 0 && cut < S && b * S + cut > cu.back()) cu.push_back(int32_t(b * S + cut));
    cu.push_back(int32_t((b + 1) * S));
  }
  return cu;
}

class CpAttentionTest : public ::testing::TestWithParam<CpCase> {
 protected:
  void SetUp() override {
    // 4 ranks (ctest); 2 run the CP 2 cases (a machine of two GPUs).
    const int world = dist::world_size();
    if ((world != 2 && world != 4) || world % GetParam().cp != 0)
      GTEST_SKIP() << "CP " << GetParam().cp << " needs 4 ranks (or 2 for CP 2)";
    if (test_device() == Device::CUDA && (GetParam().D % 8 != 0 || GetParam().Dv % 8 != 0))
      GTEST_SKIP() << "cuDNN takes head sizes that are multiples of 8";
  }
  static dist::Comm& comm() {
    static std::unique_ptr<dist::Comm> c = dist::make_comm(test_device());
    return *c;
  }
};

TEST_P(CpAttentionTest, ChunksEqualTheWholeSequence) {
  const CpCase c = GetParam();
  dist::ParallelSizes sizes;
  sizes.cp = c.cp;
  const dist::Grid grid(sizes, dist::world_size(), dist::world_rank());
  const dist::Group& g = grid.cp();
  // The same whole-sequence inputs on every rank of a CP group (seeded by the group).
  const uint64_t seed = testing::test_seed() + 100 * uint64_t(grid.dp().rank);
  Tensor q = randn({c.B, c.S, c.Hq, c.D}, seed), k = randn({c.B, c.S, c.Hkv, c.D}, seed + 1),
         v = randn({c.B, c.S, c.Hkv, c.Dv}, seed + 2),
         dout = randn({c.B, c.S, c.Hq, c.Dv}, seed + 3);
  const Device device = test_device();
  const bool gpu = device == Device::CUDA;
  // On the GPU the inputs are bf16: the reference takes the same rounded values.
  if (gpu)
    for (Tensor* t : {&q, &k, &v, &dout}) *t = t->to(DType::BF16).to(DType::F32);
  Tensor out = Tensor::empty({c.B, c.S, c.Hq, c.Dv}), lse = Tensor::empty({c.B, c.Hq, c.S});
  Tensor dq = Tensor::empty(q.shape()), dk = Tensor::empty(k.shape()),
         dv = Tensor::empty(v.shape());
  // With documents the reference is the packed-sequence op over the whole micro-batch.
  const std::vector<int32_t> cu = test_documents(c.B, c.S);
  const Tensor cu_seqlens = Tensor::from_i32({int64_t(cu.size())}, cu);
  auto tokens = [&](const Tensor& x) { return x.view({c.B * c.S, x.dim(2), x.dim(3)}); };
  Tensor vlse = Tensor::empty({c.B * c.S, c.Hq});
  if (c.documents) {
    Tensor o = tokens(out), dqr = tokens(dq), dkr = tokens(dk), dvr = tokens(dv);
    ops::attention_varlen_forward(tokens(q), tokens(k), tokens(v), o, vlse, cu_seqlens, c.S, 0.0f,
                                  0, 0, 0.3f);
    ops::attention_varlen_backward(tokens(dout), tokens(q), tokens(k), tokens(v), o, vlse,
                                   cu_seqlens, c.S, dqr, dkr, dvr, 0.0f, 0, 0, 0.3f);
  } else {
    ops::attention_forward(q, k, v, out, lse, 0.0f, 0, 0, 0.3f);
    ops::attention_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0f, 0, 0, 0.3f);
  }

  auto local = [&](const Tensor& x) { return cp_split_sequence(x, g.size(), g.rank); };
  // This rank's rows on the test's device (bf16 on the GPU), and back as fp32 host rows.
  auto on_device = [&](const Tensor& x) {
    return gpu ? local(x).to(DType::BF16).to(Device::CUDA) : local(x);
  };
  auto host = [&](const Tensor& x) { return gpu ? x.to(Device::CPU).to(DType::F32) : x; };
  const DType dtype = gpu ? DType::BF16 : DType::F32;
  // On the GPU also the one-GPU attention of the whole sequence (the same cuDNN kernels on
  // the same bf16 inputs): out, dq, dk, dv as fp32 host tensors.
  std::vector<Tensor> dense;
  if (gpu) {
    auto dev = [](const Tensor& x) { return x.to(DType::BF16).to(Device::CUDA); };
    Tensor gq = dev(q), gk = dev(k), gv = dev(v), gdout = dev(dout);
    Tensor gout = Tensor::empty(out.shape(), dtype, device),
           glse = Tensor::empty(c.documents ? vlse.shape() : lse.shape(), DType::F32, device);
    Tensor gdq = Tensor::empty(q.shape(), dtype, device),
           gdk = Tensor::empty(k.shape(), dtype, device),
           gdv = Tensor::empty(v.shape(), dtype, device);
    if (c.documents) {
      const Tensor gcu = cu_seqlens.to(device);
      Tensor o = tokens(gout), dqr = tokens(gdq), dkr = tokens(gdk), dvr = tokens(gdv);
      ops::attention_varlen_forward(tokens(gq), tokens(gk), tokens(gv), o, glse, gcu, c.S, 0.0f, 0,
                                    0, 0.3f);
      ops::attention_varlen_backward(tokens(gdout), tokens(gq), tokens(gk), tokens(gv), o, glse,
                                     gcu, c.S, dqr, dkr, dvr, 0.0f, 0, 0, 0.3f);
    } else {
      ops::attention_forward(gq, gk, gv, gout, glse, 0.0f, 0, 0, 0.3f);
      ops::attention_backward(gdout, gq, gk, gv, gout, glse, gdq, gdk, gdv, 0.0f, 0, 0, 0.3f);
    }
    for (const Tensor* t : {&gout, &gdq, &gdk, &gdv}) dense.push_back(host(*t));
  }
  // x (this rank's result) against the CPU reference `ref` (whole sequence): elementwise on
  // the CPU. On the GPU, normwise: within bf16 noise of it (2%) and no further from it than
  // the one-GPU attention of the whole sequence (dense[i]) is, give or take a quarter (p2p and
  // all_gather round per block, so their bf16 results are not the dense kernel's bits); a2a
  // runs the dense kernel on the same rows, so there also elementwise equal to it up to bf16
  // rounding.
  auto matches = [&](const Tensor& x, const Tensor& ref, size_t i) -> ::testing::AssertionResult {
    // (The larger cases sum more fp32 terms with more cancellation: dk, dq lose ~1e-4.)
    if (!gpu)
      return allclose(x, local(ref), (c.S * c.D > 1024 || c.D >= 64) ? 2e-5 : kAtol,
                      (c.S * c.D > 1024 || c.D >= 64) ? 2e-4 : kRtol);
    const Tensor got = host(x);
    const double rel = testing::rel_error(got, local(ref));
    const double dense_rel = testing::rel_error(local(dense[i]), local(ref));
    if (rel > 2e-2 || rel > 1.25 * dense_rel + 1e-3)
      return ::testing::AssertionFailure()
             << "relative L2 error " << rel
             << " to the CPU reference (the one-GPU attention's: " << dense_rel << ")";
    if (c.type != CpCommType::A2A) return ::testing::AssertionSuccess();
    return allclose(got, local(dense[i]), 4e-3, 1e-2);
  };
  CpAttention cp{&comm(), &g, c.type, nullptr};
  if (c.documents)
    cp.document_starts =
        std::make_shared<const std::vector<int32_t>>(cp_document_starts(cu, c.B, c.S));
  const int64_t L = c.S / c.cp;
  Tensor lq = on_device(q), lk = on_device(k), lv = on_device(v), ldout = on_device(dout);
  Tensor lout = Tensor::empty({c.B, L, c.Hq, c.Dv}, dtype, device),
         llse = Tensor::empty({c.B * L, c.Hq}, DType::F32, device);
  cp_attention_forward(lq, lk, lv, lout, llse, cp, 0.3f);
  EXPECT_TRUE(matches(lout, out, 0)) << cp_comm_type_name(c.type);
  if (c.type != CpCommType::A2A) {  // (a2a keeps its head group's whole-sequence lse)
    // The reference lse [B, Hq, S] as [B, S, Hq] rows (the packed op's already are), then
    // this rank's.
    Tensor rows = Tensor::empty({c.B, c.S, c.Hq});
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int64_t s = 0; s < c.S; ++s)
          rows.f32()[(b * c.S + s) * c.Hq + h] = c.documents ? vlse.f32()[(b * c.S + s) * c.Hq + h]
                                                             : lse.f32()[(b * c.Hq + h) * c.S + s];
    // (On the GPU fp32 statistics of the same bf16 products, summed in another order.)
    EXPECT_TRUE(allclose(host(llse).view({c.B, L, c.Hq}), local(rows), gpu ? 1e-3 : kAtol,
                         gpu ? 1e-3 : kRtol));
  }
  Tensor ldq = Tensor::empty(lq.shape(), dtype, device),
         ldk = Tensor::empty(lk.shape(), dtype, device),
         ldv = Tensor::empty(lv.shape(), dtype, device);
  cp_attention_backward(ldout, lq, lk, lv, lout, llse, ldq, ldk, ldv, cp, 0.3f);
  EXPECT_TRUE(matches(ldq, dq, 1)) << cp_comm_type_name(c.type);
  EXPECT_TRUE(matches(ldk, dk, 2)) << cp_comm_type_name(c.type);
  EXPECT_TRUE(matches(ldv, dv, 3)) << cp_comm_type_name(c.type);
}

INSTANTIATE_TEST_SUITE_P(
    CommTypes, CpAttentionTest,
    ::testing::Values(CpCase{2, CpCommType::P2P, 2, 8, 4, 2, 8, 6},
                      CpCase{4, CpCommType::P2P, 1, 16, 4, 2, 8, 8},
                      CpCase{4, CpCommType::P2P, 2, 24, 2, 1, 4, 4},
                      CpCase{2, CpCommType::AllGather, 2, 8, 4, 2, 8, 6},
                      CpCase{4, CpCommType::AllGather, 1, 16, 4, 2, 8, 8},
                      CpCase{2, CpCommType::A2A, 2, 8, 4, 2, 8, 6},
                      CpCase{4, CpCommType::A2A, 1, 16, 8, 4, 8, 8},
                      // cuDNN's head sizes (the GPU run's cases).
                      CpCase{2, CpCommType::P2P, 2, 64, 4, 2, 64, 64},
                      CpCase{4, CpCommType::P2P, 1, 128, 8, 4, 64, 64},
                      CpCase{2, CpCommType::AllGather, 2, 64, 4, 2, 64, 64},
                      CpCase{4, CpCommType::AllGather, 1, 128, 8, 2, 128, 128},
                      // One token per chunk: all_gather's 1 x 1 block.
                      CpCase{2, CpCommType::AllGather, 1, 4, 4, 2, 64, 64},
                      // Packed documents.
                      CpCase{2, CpCommType::P2P, 2, 16, 4, 2, 8, 8, true},
                      CpCase{4, CpCommType::P2P, 2, 32, 4, 2, 8, 6, true},
                      CpCase{2, CpCommType::AllGather, 2, 16, 4, 2, 8, 8, true},
                      CpCase{4, CpCommType::AllGather, 1, 32, 4, 2, 8, 8, true},
                      CpCase{2, CpCommType::A2A, 2, 16, 4, 2, 8, 8, true},
                      CpCase{4, CpCommType::A2A, 1, 32, 8, 4, 8, 8, true},
                      CpCase{2, CpCommType::P2P, 2, 128, 4, 2, 64, 64, true},
                      CpCase{2, CpCommType::AllGather, 1, 128, 4, 2, 64, 64, true},
                      CpCase{2, CpCommType::A2A, 1, 128, 4, 2, 64, 64, true},
                      CpCase{2, CpCommType::A2A, 2, 64, 4, 2, 64, 64},
                      CpCase{4, CpCommType::A2A, 1, 128, 8, 4, 64, 64}));

}  // namespace
}  // namespace megaton

int main(int argc, char** argv) { return megaton::testing::run_mpi_tests(argc, argv); }
