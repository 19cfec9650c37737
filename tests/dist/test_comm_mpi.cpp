// MpiComm on 4 CPU ranks (`mpirun -np 4`): every collective against values each rank
// computes locally from every member's seeded inputs, on several groups of a tp 2 grid,
// and the timeout path (a rank that skips a collective gets a message naming the group,
// the collective and the rank).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>

#include "common/mpi_testing.h"
#include "common/testing.h"
#include "dist/comm.h"
#include "dist/runtime.h"

namespace megaton::dist {
namespace {

using ::megaton::testing::allclose;
using ::megaton::testing::randn;

// The grid of these tests: tp 2 (groups {0,1} {2,3}), dp 2 ({0,2} {1,3}), and an expert
// grid of ep 4 (the world) with etp 1 (groups of one rank).
Grid test_grid() {
  ParallelSizes s;
  if (world_size() == 4) {  // otherwise every test skips
    s.tp = 2;
    s.ep = 4;
    s.etp = 1;
  }
  return Grid(s, world_size(), world_rank());
}

// Every rank's input for a test: seeded by (test seed, salt, world rank), so each rank
// can compute what any other rank holds.
Tensor input(int rank, int64_t n, int salt) {
  return randn({n}, ::megaton::testing::test_seed() + 1000 * salt + rank);
}

class CommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks: mpirun -np 4 test_comm_mpi";
  }
  // One Comm for all tests, its communicators created up front.
  static Comm& comm() {
    static std::unique_ptr<Comm> c = [] {
      auto made = make_comm(Device::CPU);
      made->prepare(test_grid());
      return made;
    }();
    return *c;
  }
  const Grid grid = test_grid();
  const int me = world_rank();
};

// Sum (or max) over the group's members of input(member, n, salt), in fp64.
Tensor reduce_reference(const Group& g, int64_t n, int salt, bool max = false) {
  Tensor out = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) {
    double acc = max ? -1e300 : 0;
    for (int r : g.ranks) {
      double v = input(r, n, salt).f32()[i];
      acc = max ? std::max(acc, v) : acc + v;
    }
    out.f32()[i] = float(acc);
  }
  return out;
}

TEST_F(CommTest, AllReduceSumAndMaxFp32) {
  int salt = 1;
  for (const Group* g : {&grid.world(), &grid.tp(), &grid.dp(), &grid.ep()}) {
    SCOPED_TRACE(g->describe());
    Tensor t = input(me, 37, salt);
    comm().all_reduce(t, *g);
    EXPECT_TRUE(allclose(t, reduce_reference(*g, 37, salt), 1e-6, 5e-6));
    Tensor m = input(me, 37, salt + 1);
    comm().all_reduce(m, *g, ReduceOp::Max);
    EXPECT_TRUE(allclose(m, reduce_reference(*g, 37, salt + 1, true), 0, 0));
    salt += 2;
  }
}

TEST_F(CommTest, AllReduceIntegers) {
  for (const Group* g : {&grid.world(), &grid.tp()}) {
    SCOPED_TRACE(g->describe());
    // Element i of rank r: (r + 1) * (i + 3) - 7 r.
    auto value = [](int r, int i) { return int64_t(r + 1) * (i + 3) - 7 * r; };
    Tensor a = Tensor::empty({5}, DType::I32), b = Tensor::empty({5}, DType::I64);
    for (int i = 0; i < 5; ++i) a.i32()[i] = int32_t(value(me, i)), b.i64()[i] = value(me, i) << 33;
    comm().all_reduce(a, *g);
    comm().all_reduce(b, *g, ReduceOp::Max);
    for (int i = 0; i < 5; ++i) {
      int64_t sum = 0, max = INT64_MIN;
      for (int r : g->ranks) sum += value(r, i), max = std::max(max, value(r, i) << 33);
      EXPECT_EQ(a.i32()[i], sum) << "element " << i;
      EXPECT_EQ(b.i64()[i], max) << "element " << i;
    }
  }
}

// bf16 and fp16 (--fp16's sequence-parallel reductions) alike.
TEST_F(CommTest, AllReduceBf16AndFp16SumInFp32) {
  for (DType half : {DType::BF16, DType::F16})
    for (const Group* g : {&grid.world(), &grid.dp()}) {
      SCOPED_TRACE(g->describe() + " " + std::string(dtype_name(half)));
      Tensor t = input(me, 64, 20).to(half);
      comm().all_reduce(t, *g);
      // The documented result: the fp32 sum of the 16-bit inputs, rounded once.
      Tensor sum = Tensor::zeros({64});
      for (int r : g->ranks) {
        Tensor x = input(r, 64, 20).to(half).to(DType::F32);
        for (int i = 0; i < 64; ++i) sum.f32()[i] += x.f32()[i];
      }
      EXPECT_EQ(t.dtype(), half);
      EXPECT_TRUE(allclose(t, sum.to(half), 1e-5, half == DType::F16 ? 2e-3 : 1e-2));
    }
}

TEST_F(CommTest, ReduceScatter) {
  for (const Group* g : {&grid.world(), &grid.tp()}) {
    SCOPED_TRACE(g->describe());
    const int64_t n = 11;
    const Tensor full = reduce_reference(*g, n * g->size(), 30);
    const Tensor mine = full.rows(n * g->rank, n);
    Tensor out = Tensor::empty({n});
    ::megaton::testing::poison(out);
    comm().reduce_scatter(input(me, n * g->size(), 30), out, *g);
    EXPECT_TRUE(allclose(out, mine, 1e-6, 5e-6));

    Tensor out16 = Tensor::empty({n}, DType::BF16);
    comm().reduce_scatter(input(me, n * g->size(), 30).to(DType::BF16), out16, *g);
    Tensor sum = Tensor::zeros({n});
    for (int r : g->ranks) {
      Tensor x = input(r, n * g->size(), 30).to(DType::BF16).to(DType::F32);
      for (int64_t i = 0; i < n; ++i) sum.f32()[i] += x.f32()[n * g->rank + i];
    }
    EXPECT_TRUE(allclose(out16, sum.to(DType::BF16), 1e-5, 1e-2));
  }
}

TEST_F(CommTest, AllGather) {
  for (const Group* g : {&grid.world(), &grid.dp()}) {
    SCOPED_TRACE(g->describe());
    const int64_t n = 9;
    Tensor out = Tensor::empty({g->size() * n});
    ::megaton::testing::poison(out);
    comm().all_gather(input(me, n, 40), out, *g);
    for (int i = 0; i < g->size(); ++i)
      EXPECT_TRUE(allclose(out.rows(i * n, n), input(g->ranks[i], n, 40), 0, 0)) << "chunk " << i;

    // In place: this rank's input is its own chunk of the output.
    Tensor gathered = Tensor::zeros({g->size() * n}, DType::I64);
    Tensor shard = gathered.rows(g->rank * n, n);
    for (int64_t k = 0; k < n; ++k) shard.i64()[k] = int64_t(me) * 1000 + k;
    comm().all_gather(shard, gathered, *g);
    for (int i = 0; i < g->size(); ++i)
      for (int64_t k = 0; k < n; ++k)
        EXPECT_EQ(gathered.i64()[i * n + k], int64_t(g->ranks[i]) * 1000 + k);
  }
}

TEST_F(CommTest, AllToAllvUnevenWithZeroCounts) {
  for (const Group* g : {&grid.world(), &grid.tp()}) {
    SCOPED_TRACE(g->describe());
    const int size = g->size();
    // Member i sends (i + 2 j + 1) % 3 elements to member j: 0, 1 or 2, so some pairs
    // exchange nothing. Element k from world rank s to world rank d holds s*1000+d*10+k.
    auto count = [](int from, int to) { return int64_t((from + 2 * to + 1) % 3); };
    std::vector<int64_t> send(size), recv(size);
    int64_t total_send = 0, total_recv = 0, zeros = 0;
    for (int j = 0; j < size; ++j) {
      send[j] = count(g->rank, j);
      recv[j] = count(j, g->rank);
      total_send += send[j];
      total_recv += recv[j];
      for (int i = 0; i < size; ++i) zeros += count(i, j) == 0;
    }
    EXPECT_GT(zeros, 0);  // the group has pairs that exchange nothing
    Tensor in = Tensor::empty({total_send}, DType::I32);
    Tensor out = Tensor::empty({total_recv}, DType::I32);
    out.fill(-1);
    for (int j = 0, at = 0; j < size; ++j)
      for (int64_t k = 0; k < send[j]; ++k) in.i32()[at++] = me * 1000 + g->ranks[j] * 10 + int(k);
    comm().all_to_allv(in, send, out, recv, *g);
    for (int j = 0, at = 0; j < size; ++j)
      for (int64_t k = 0; k < recv[j]; ++k, ++at)
        EXPECT_EQ(out.i32()[at], g->ranks[j] * 1000 + me * 10 + int(k))
            << "from member " << j << " element " << k;

    // Started and left running while a blocking collective on another group runs: the
    // same result once waited for.
    Tensor async_out = Tensor::empty({total_recv}, DType::I32);
    async_out.fill(-1);
    std::unique_ptr<dist::CommWork> work = comm().all_to_allv_async(in, send, async_out, recv, *g);
    Tensor beside = Tensor::from({1}, {float(me)});
    comm().all_reduce(beside, grid.dp());
    work->wait();
    EXPECT_TRUE(allclose(async_out, out, 0, 0)) << "all_to_allv_async";

    // Equal chunks, fp32.
    const int64_t n = 5;
    Tensor a = input(me, size * n, 50), b = Tensor::empty({size * n});
    comm().all_to_all(a, b, *g);
    for (int j = 0; j < size; ++j)
      EXPECT_TRUE(
          allclose(b.rows(j * n, n), input(g->ranks[j], size * n, 50).rows(g->rank * n, n), 0, 0));
  }
}

TEST_F(CommTest, AllToAllvRowsScattersRunsOnBothSides) {
  for (const Group* g : {&grid.world(), &grid.tp()}) {
    SCOPED_TRACE(g->describe());
    const int size = g->size(), runs = 3, width = 2;
    // Member s sends member j runs r = 0, 1, 2 of (s + j + r) % 3 rows (some empty). Row k
    // of run r from world rank s to world rank d holds s*10000 + d*100 + r*10 + k, then
    // its negative.
    auto length = [](int s, int d, int r) { return int64_t((s + d + r) % 3); };
    auto value = [](int s, int d, int r, int64_t k) {
      return s * 10000 + d * 100 + r * 10 + int(k);
    };
    // The sender stores its runs last member first and last run first; the receiver
    // stores run r of every member before run r + 1, with one untouched row after each.
    dist::RowRuns send(size, std::vector<dist::RowRun>(runs));
    dist::RowRuns recv(size, std::vector<dist::RowRun>(runs));
    int64_t in_rows = 0, out_rows = 0;
    for (int j = size - 1; j >= 0; --j)
      for (int r = runs - 1; r >= 0; --r) {
        send[j][r] = {in_rows, length(g->rank, j, r)};
        in_rows += send[j][r].count;
      }
    for (int r = 0; r < runs; ++r)
      for (int j = 0; j < size; ++j) {
        recv[j][r] = {out_rows, length(j, g->rank, r)};
        out_rows += recv[j][r].count + 1;
      }
    Tensor in = Tensor::empty({in_rows, width}, DType::I32);
    for (int j = 0; j < size; ++j)
      for (int r = 0; r < runs; ++r)
        for (int64_t k = 0; k < send[j][r].count; ++k) {
          const int v = value(me, g->ranks[j], r, k);
          in.i32()[(send[j][r].first + k) * width] = v;
          in.i32()[(send[j][r].first + k) * width + 1] = -v;
        }
    Tensor out = Tensor::empty({out_rows, width}, DType::I32);
    out.fill(-1);
    comm().all_to_allv_rows(in, send, out, recv, *g);
    int64_t checked = 0;
    for (int j = 0; j < size; ++j)
      for (int r = 0; r < runs; ++r) {
        const dist::RowRun run = recv[j][r];
        for (int64_t k = 0; k < run.count; ++k, ++checked) {
          const int v = value(g->ranks[j], me, r, k);
          EXPECT_EQ(out.i32()[(run.first + k) * width], v) << "member " << j << " run " << r;
          EXPECT_EQ(out.i32()[(run.first + k) * width + 1], -v);
        }
        // The row after each run is in no run: left as it was.
        EXPECT_EQ(out.i32()[(run.first + run.count) * width], -1);
      }
    EXPECT_EQ(checked + size * runs, out_rows);
  }
}

TEST_F(CommTest, PullRowsReadsTheRunsTheReceiverNames) {
  for (const Group* g : {&grid.world(), &grid.tp(), &grid.etp()}) {
    SCOPED_TRACE(g->describe());
    const int size = g->size(), width = 2;
    // World rank s holds 3 + s rows; row k is (s * 1000 + k, -(s * 1000 + k)).
    auto value = [](int s, int64_t k) { return s * 1000 + int(k); };
    Tensor in = Tensor::empty({3 + me, width}, DType::I32);
    for (int64_t k = 0; k < in.dim(0); ++k) {
      in.i32()[k * width] = value(me, k);
      in.i32()[k * width + 1] = -value(me, k);
    }
    // From each member m (last member first): rows [(me + m) % 2, +1 + (me + m) % 2), an
    // empty run, and its last row; each followed by one row no run writes.
    std::vector<dist::PullRun> runs;
    int64_t out_rows = 0;
    for (int m = size - 1; m >= 0; --m) {
      const int src = g->ranks[m], shift = (me + src) % 2;
      runs.push_back({m, shift, out_rows, 1 + shift});
      out_rows += 2 + shift;
      runs.push_back({m, 1, out_rows, 0});
      runs.push_back({m, 2 + src, out_rows, 1});
      out_rows += 2;
    }
    Tensor out = Tensor::empty({out_rows, width}, DType::I32);
    out.fill(-1);
    EXPECT_FALSE(comm().peer_memory(*g));  // CPU ranks: the run lists are exchanged
    comm().pull_rows(in, runs, out, *g);
    // Started and left running: the same rows once waited for.
    Tensor async_out = Tensor::empty({out_rows, width}, DType::I32);
    async_out.fill(-1);
    comm().pull_rows_async(in, runs, async_out, *g)->wait();
    EXPECT_TRUE(allclose(async_out, out, 0, 0)) << "pull_rows_async";
    std::vector<bool> written(size_t(out_rows), false);
    for (const dist::PullRun& r : runs)
      for (int64_t k = 0; k < r.count; ++k) {
        const int v = value(g->ranks[r.member], r.src_first + k);
        EXPECT_EQ(out.i32()[(r.dst_first + k) * width], v) << "member " << r.member;
        EXPECT_EQ(out.i32()[(r.dst_first + k) * width + 1], -v);
        written[size_t(r.dst_first + k)] = true;
      }
    for (int64_t row = 0; row < out_rows; ++row) {
      if (!written[size_t(row)]) {
        EXPECT_EQ(out.i32()[row * width], -1) << "row " << row;
      }
    }
  }
}

TEST_F(CommTest, PullRowsRejectsRunsOutsideTheTensors) {
  const Group& g = grid.world();
  Tensor in = Tensor::zeros({4, 3}), out = Tensor::zeros({4, 3}), narrow = Tensor::zeros({4, 2});
  const std::vector<dist::PullRun> none;
  const std::vector<dist::PullRun> outside_group = {{g.size(), 0, 0, 1}};
  const std::vector<dist::PullRun> outside_out = {{0, 0, 3, 2}};
  const std::vector<dist::PullRun> outside_own = {{g.rank, 3, 0, 2}};
  EXPECT_THROW(comm().pull_rows(in, none, narrow, g), InternalError);
  EXPECT_THROW(comm().pull_rows(in, outside_group, out, g), InternalError);
  EXPECT_THROW(comm().pull_rows(in, outside_out, out, g), InternalError);
  EXPECT_THROW(comm().pull_rows(in, outside_own, out, g), InternalError);
}

TEST_F(CommTest, AllToAllvRowsRejectsMismatchedRuns) {
  const Group& g = grid.world();
  Tensor in = Tensor::zeros({4, 3}), out = Tensor::zeros({4, 3}), narrow = Tensor::zeros({4, 2});
  dist::RowRuns none(g.size()), outside(g.size());
  outside[0] = {{3, 2}};  // rows 3 and 4 of a 4-row tensor
  EXPECT_THROW(comm().all_to_allv_rows(in, none, narrow, none, g), InternalError);
  EXPECT_THROW(comm().all_to_allv_rows(in, outside, out, none, g), InternalError);
  EXPECT_THROW(comm().all_to_allv_rows(in, dist::RowRuns(1), out, none, g), InternalError);
  // The runs to and from this member must pair up.
  dist::RowRuns self(g.size());
  self[g.rank] = {{0, 2}};
  EXPECT_THROW(comm().all_to_allv_rows(in, self, out, none, g), InternalError);
}

TEST_F(CommTest, SendRecvRing) {
  const Group& w = grid.world();
  const int next = (w.rank + 1) % w.size(), prev = (w.rank + w.size() - 1) % w.size();
  // Large enough that MPI cannot buffer it (rendezvous): the order below matters.
  const int64_t n = 1 << 17;
  Tensor got = Tensor::empty({n});
  if (w.rank % 2 == 0) {
    comm().send(input(me, n, 60), next, w);
    comm().recv(got, prev, w);
  } else {
    comm().recv(got, prev, w);
    comm().send(input(me, n, 60), next, w);
  }
  EXPECT_TRUE(allclose(got, input(w.ranks[prev], n, 60), 0, 0));

  // Everyone at once, the other way round.
  Tensor back = Tensor::empty({n}, DType::BF16);
  comm().send_recv(input(me, n, 61).to(DType::BF16), prev, back, next, w);
  EXPECT_TRUE(allclose(back, input(w.ranks[next], n, 61).to(DType::BF16), 0, 0));
}

TEST_F(CommTest, Broadcast) {
  Tensor t = input(me, 33, 70);
  comm().broadcast(t, 1, grid.world());
  EXPECT_TRUE(allclose(t, input(1, 33, 70), 0, 0));
  const Group& dp = grid.dp();
  Tensor b = input(me, 17, 71).to(DType::BF16);
  comm().broadcast(b, 1, dp);
  EXPECT_TRUE(allclose(b, input(dp.ranks[1], 17, 71).to(DType::BF16), 0, 0));
  for (const Group& g : grid.groups()) comm().barrier(g);
}

TEST_F(CommTest, GroupsOfOneCopyWithoutTransport) {
  const Group& etp = grid.etp();
  ASSERT_EQ(etp.size(), 1);
  Tensor t = input(me, 8, 80);
  comm().all_reduce(t, etp);
  EXPECT_TRUE(allclose(t, input(me, 8, 80), 0, 0));
  Tensor out = Tensor::empty({8});
  comm().all_gather(t, out, etp);
  EXPECT_TRUE(allclose(out, t, 0, 0));
  comm().reduce_scatter(t, out, etp);
  EXPECT_TRUE(allclose(out, t, 0, 0));
  const int64_t count[] = {8};
  comm().all_to_allv(t, count, out, count, etp);
  EXPECT_TRUE(allclose(out, t, 0, 0));
  comm().send_recv(t, 0, out, 0, etp);
  EXPECT_TRUE(allclose(out, t, 0, 0));
  // Row runs to itself: rows 0-2 to 5-7 and rows 3-7 to 0-4, an empty run in between.
  Tensor swapped = Tensor::empty({8});
  comm().all_to_allv_rows(t, {{{0, 3}, {6, 0}, {3, 5}}}, swapped, {{{5, 3}, {0, 5}}}, etp);
  EXPECT_TRUE(allclose(swapped.rows(5, 3), t.rows(0, 3), 0, 0));
  EXPECT_TRUE(allclose(swapped.rows(0, 5), t.rows(3, 5), 0, 0));
  comm().broadcast(t, 0, etp);
  comm().barrier(etp);
}

TEST_F(CommTest, ArgumentMistakesThrowBeforeSending) {
  Tensor t = Tensor::zeros({6});
  Tensor wrong = Tensor::zeros({5});
  EXPECT_THROW(comm().reduce_scatter(t, wrong, grid.tp()), InternalError);
  EXPECT_THROW(comm().all_gather(t, wrong, grid.tp()), InternalError);
  const int64_t counts[] = {3, 3};
  EXPECT_THROW(comm().all_to_allv(t, counts, wrong, counts, grid.tp()), InternalError);
  EXPECT_THROW(comm().broadcast(t, 2, grid.tp()), InternalError);
  EXPECT_THROW(comm().send(t, grid.tp().rank, grid.tp()), InternalError);
  Tensor f8 = Tensor::zeros({6}, DType::F8E4M3);
  EXPECT_THROW(comm().all_reduce(f8, grid.tp()), InternalError);
  Tensor b16 = Tensor::zeros({6}, DType::BF16);
  EXPECT_THROW(comm().all_reduce(b16, grid.tp(), ReduceOp::Max), InternalError);
  Group stranger{"other", {me == 0 ? 1 : 0}, -1};
  EXPECT_THROW(comm().barrier(stranger), InternalError);
}

// Rank 1 skips an all_reduce on the tp group {0, 1}; rank 0 must get the named error
// after the 2 s deadline. Then rank 1 joins the abandoned collective late, so that it
// completes and every rank leaves MPI cleanly.
TEST_F(CommTest, TimeoutNamesGroupCollectiveAndRank) {
  const char* previous = std::getenv("MEGATON_COMM_TIMEOUT_S");
  const std::string saved = previous ? previous : "";
  setenv("MEGATON_COMM_TIMEOUT_S", "2", 1);
  std::unique_ptr<Comm> hurried = make_comm(Device::CPU);
  if (previous)
    setenv("MEGATON_COMM_TIMEOUT_S", saved.c_str(), 1);
  else
    unsetenv("MEGATON_COMM_TIMEOUT_S");
  EXPECT_EQ(hurried->timeout_s(), 2.0);
  // Its communicators exist before anyone skips anything (creation has no deadline).
  hurried->prepare(grid);

  Tensor x = input(me, 4, 90);
  Tensor token = Tensor::zeros({1}, DType::I32);
  if (me == 0) {
    const auto start = std::chrono::steady_clock::now();
    set_comm_iteration(17);
    const int line = __LINE__ + 2;
    try {
      hurried->all_reduce(x, grid.tp());
      ADD_FAILURE() << "all_reduce finished although rank 1 never called it";
    } catch (const CommError& e) {
      // The group, the collective, the rank, the call site and the iteration.
      EXPECT_EQ(std::string(e.what()),
                fmt::format("all_reduce on group tp (ranks 0,1) timed out after 2 s at world rank "
                            "0, called from tests/dist/test_comm_mpi.cpp:{} in iteration 17",
                            line));
    }
    set_comm_iteration(-1);
    EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.9);
    // The group's communicator is not used again after a timeout.
    EXPECT_THROW(hurried->barrier(grid.tp()), CommError);
    comm().send(token, 1, grid.world());  // tell rank 1 the deadline has passed
  } else if (me == 1) {
    comm().recv(token, 0, grid.world());
    hurried->all_reduce(x, grid.tp());  // completes rank 0's abandoned all_reduce
    EXPECT_TRUE(allclose(x, reduce_reference(grid.tp(), 4, 90), 1e-6, 5e-6));
  }
  comm().barrier(grid.world());
}

}  // namespace
}  // namespace megaton::dist

int main(int argc, char** argv) { return megaton::testing::run_mpi_tests(argc, argv); }
