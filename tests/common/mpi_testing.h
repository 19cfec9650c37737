// main() for GoogleTest binaries run under mpirun (tests/*/test_*_mpi.cpp): every rank
// runs every test; only rank 0 prints the usual report, other ranks print their failures
// tagged with the rank. Each such binary's main is `return run_mpi_tests(argc, argv);`.
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "common/testing.h"
#include "dist/runtime.h"

namespace megaton::testing {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name(), r.line_number(),
                   r.message());
  }

 private:
  int rank_;
};

// Starts MPI, runs the tests, ends MPI; returns RUN_ALL_TESTS's status.
inline int run_mpi_tests(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // A rank left waiting by a failed assertion elsewhere gives up after 60 s, not 300.
  setenv("MEGATON_COMM_TIMEOUT_S", "60", 0);
  megaton::dist::init(&argc, &argv);
  const int rank = megaton::dist::world_rank();
  if (rank == 0)
    std::printf("inputs seeded with %llu (MEGATON_TEST_SEED)\n",
                static_cast<unsigned long long>(test_seed()));
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int status = RUN_ALL_TESTS();
  megaton::dist::finalize();
  return status;
}

}  // namespace megaton::testing
