// --tp-comm-overlap's row-block GEMMs around asynchronous sequence-parallel collectives
// (model/tp_comm_overlap.h) on 4 CPU ranks (`mpirun -np 4`), for TP 2 (two groups) and
// TP 4: gemm_all_gathered_rows equals the all-gather followed by one GEMM (every rank's
// position in the group: first, middle, last), and gemm_reduce_scattered_rows equals one
// GEMM followed by the reduce-scatter for every chunk count (including counts that do not
// divide the rows and are lowered).
// MEGATON_TEST_DEVICE=cuda (ctest's test_tp_comm_overlap_mpi_cuda, label gpu): the same
// on 4 GPUs in bf16 over NCCL's asynchronous communicators.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "common/mpi_testing.h"
#include "common/testing.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "dist/runtime.h"
#include "model/tensor_parallel.h"
#include "model/tp_comm_overlap.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using testing::allclose;
using testing::randn;

Device test_device() {
  const char* d = std::getenv("MEGATON_TEST_DEVICE");
  return d && std::string(d) == "cuda" ? Device::CUDA : Device::CPU;
}

dist::Comm& comm() {
  static std::unique_ptr<dist::Comm> c = dist::make_comm(test_device());
  return *c;
}

class TpCommOverlap : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (dist::world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
    dist::ParallelSizes sizes;
    sizes.tp = GetParam();
    grid_ = std::make_unique<dist::Grid>(sizes, dist::world_size(), dist::world_rank());
    mp_.grid = grid_.get();
    mp_.comm = &comm();
    mp_.sequence_parallel = true;
    mp_.tp_comm_overlap = true;
  }
  // A tensor on the test's device (bf16 on the GPU) and an fp32 host copy of one.
  Tensor on_device(const Tensor& x) const {
    return test_device() == Device::CUDA ? x.to(DType::BF16).to(Device::CUDA) : x;
  }
  static Tensor host(const Tensor& x) {
    return x.device() == Device::CUDA ? x.to(Device::CPU).to(DType::F32) : x;
  }
  // Tolerances: the same products and sums, cut into other GEMM calls.
  double tol() const { return test_device() == Device::CUDA ? 1e-2 : 1e-6; }

  std::unique_ptr<dist::Grid> grid_;
  ModelParallel mp_;
};

TEST_P(TpCommOverlap, AllGatheredRowsEqualGatherThenGemm) {
  const int64_t rows = 6, k = 16, n = 24;  // this rank's rows; T = rows x tp
  const uint64_t seed = testing::test_seed() + 10 * uint64_t(dist::world_rank());
  const Tensor x = on_device(randn({rows, k}, seed));
  const Tensor w = on_device(randn({n, k}, testing::test_seed() + 99));  // same on every rank
  const RowGemm gemm = [&](const Tensor& in, Tensor out) { ops::gemm(in, false, w, true, out); };
  const Tensor gathered = gather_sequence(x, mp_);
  Tensor want = Tensor::empty({gathered.dim(0), n}, x.dtype(), x.device());
  gemm(gathered, want);
  Tensor x_full = Tensor::empty(gathered.shape(), x.dtype(), x.device());
  Tensor got = Tensor::empty(want.shape(), x.dtype(), x.device());
  gemm_all_gathered_rows(x, x_full, got, gemm, mp_);
  EXPECT_TRUE(allclose(host(x_full), host(gathered), 0, 0)) << "the gathered input";
  EXPECT_TRUE(allclose(host(got), host(want), tol(), tol()));
}

TEST_P(TpCommOverlap, ReduceScatteredRowsEqualGemmThenReduceScatter) {
  const int tp = GetParam();
  const int64_t total = 24 * tp, k = 16, n = 20;
  const uint64_t seed = testing::test_seed() + 10 * uint64_t(dist::world_rank());
  const Tensor x = on_device(randn({total, k}, seed));  // a partial sum's input per rank
  const Tensor w = on_device(randn({n, k}, seed + 1));
  const RowGemm gemm = [&](const Tensor& in, Tensor out) { ops::gemm(in, false, w, true, out); };
  Tensor y = Tensor::empty({total, n}, x.dtype(), x.device());
  gemm(x, y);
  const Tensor want = reduce_scatter_sequence(y, mp_);
  for (int splits : {1, 2, 3, 4, 5, 24}) {  // 5 is lowered to 4; 24: one row per chunk
    const Tensor got = gemm_reduce_scattered_rows(x, n, gemm, mp_, splits);
    ASSERT_EQ(got.shape(), want.shape()) << splits << " splits";
    EXPECT_TRUE(allclose(host(got), host(want), tol(), tol())) << splits << " splits";
  }
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, TpCommOverlap, ::testing::Values(2, 4));

}  // namespace
}  // namespace megaton

int main(int argc, char** argv) { return megaton::testing::run_mpi_tests(argc, argv); }
