// Comm::pull_rows over NCCL with peer memory, on the GPUs of one node:
//   mpirun -np 2 test_pull_rows_gpu   (skips unless launched on 2 or more ranks)
// Every rank checks every element it pulled against values it computes for any member,
// over consecutive pulls (the two slots alternate), a pull that grows the buffers, rows of
// 16-byte multiples (word copies) and of 12 bytes (byte copies), inputs staged and inputs
// written in place (pull_input), and untouched rows.
#include <gtest/gtest.h>

#include "common/mpi_testing.h"
#include "common/testing.h"
#include "dist/comm.h"
#include "dist/runtime.h"

namespace megaton::dist {
namespace {

int32_t value(int member, int round, int64_t row, int64_t col) {
  return member * 10000000 + round * 1000000 + int32_t(row) * 100 + int32_t(col % 100);
}

TEST(PullRowsGpu, PeerMemoryPullsTheNamedRunsAcrossSlotsAndGrowth) {
  if (world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) on the GPUs of one node";
  const int me = world_rank();
  std::unique_ptr<Comm> comm = make_comm(Device::CUDA);
  const Grid grid(ParallelSizes{}, world_size(), me);  // data parallel over the world
  const Group& g = grid.world();
  const int n = g.size();
  ASSERT_TRUE(comm->peer_memory(g)) << "the GPUs of this node cannot map each other's memory";
  for (int64_t width : {int64_t(2048), int64_t(3)}) {
    for (int round = 0; round < 5; ++round) {
      SCOPED_TRACE(::testing::Message() << "width " << width << ", round " << round);
      // Member m holds base + 7 m rows; round 3 holds many more (the slots grow).
      const int64_t base = round == 3 ? 3000 : 40;
      auto rows_of = [&](int m) { return base + 7 * m; };
      Tensor host_in = Tensor::empty({rows_of(me), width}, DType::I32);
      for (int64_t r = 0; r < host_in.dim(0); ++r)
        for (int64_t c = 0; c < width; ++c) host_in.i32()[r * width + c] = value(me, round, r, c);
      // From every member, last first: rows [m + round, +5 + m), an empty run, and its
      // last row; one untouched row after each run.
      std::vector<PullRun> runs;
      int64_t out_rows = 0;
      for (int m = n - 1; m >= 0; --m) {
        runs.push_back({m, m + round, out_rows, 5 + m});
        out_rows += 6 + m;
        runs.push_back({m, 0, out_rows, 0});
        runs.push_back({m, rows_of(m) - 1, out_rows, 1});
        out_rows += 2;
      }
      Tensor out = Tensor::empty({out_rows, width}, DType::I32, Device::CUDA);
      Tensor poison = Tensor::empty({out_rows, width}, DType::I32);
      poison.fill(-1);
      out.copy_from(poison);
      if (round % 2 == 1) {  // filled in place: pull_input's slot, its first rows handed over
        Tensor in = comm->pull_input({rows_of(me) + 3, width}, DType::I32, g);
        Tensor first = in.rows(0, rows_of(me));
        first.copy_from(host_in);
        comm->pull_rows(first, runs, out, g);
      } else {  // staged into the slot
        comm->pull_rows(host_in.to(Device::CUDA), runs, out, g);
      }
      const Tensor got = out.to(Device::CPU);
      std::vector<bool> written(size_t(out_rows), false);
      int64_t bad = 0;
      for (const PullRun& r : runs)
        for (int64_t k = 0; k < r.count; ++k) {
          written[size_t(r.dst_first + k)] = true;
          for (int64_t c = 0; c < width; ++c)
            bad += got.i32()[(r.dst_first + k) * width + c] !=
                   value(r.member, round, r.src_first + k, c);
        }
      for (int64_t row = 0; row < out_rows; ++row) {
        if (written[size_t(row)]) continue;
        for (int64_t c = 0; c < width; ++c) bad += got.i32()[row * width + c] != -1;
      }
      EXPECT_EQ(bad, 0) << "elements differ at rank " << me;
    }
  }
}

}  // namespace
}  // namespace megaton::dist

int main(int argc, char** argv) { return megaton::testing::run_mpi_tests(argc, argv); }
