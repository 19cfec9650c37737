// The MoE token exchange on the GPUs of one node, at moe-64x-top8's size (8192 tokens x
// top-8 = 65536 rows of 2048 bf16 per rank, 64 experts spread evenly over the ranks):
//   mpirun -np N bench_pull_rows_gpu      (N >= 2 GPUs of one node)
// Times, with CUDA events (median of 20 after 5 warm-up runs), on every rank:
//   - Comm::all_to_allv over NCCL of the same bytes (the exchange that `regroup` follows
//     with its regrouping copies),
//   - Comm::pull_rows with a staged input and with the input written in place
//     (pull_input), synchronisation included,
//   - the peer copy kernel alone at several grid sizes (blocks per SM).
// Rank 0 prints ms and GB/s per GPU of the bytes that cross to other GPUs. Built with the
// CUDA backend only (otherwise it says so and exits).
#include <fmt/core.h>

#include <algorithm>
#include <functional>
#include <vector>

#ifdef MEGATON_WITH_CUDA
#include <cuda_runtime.h>
#include <mpi.h>

#include "core/cuda/cuda_check.h"
#include "cuda_timing.h"
#include "dist/comm.h"
#include "dist/cuda/peer_memory.h"
#include "ops/cuda/copy_chunks.h"
#include "dist/runtime.h"
#endif

#ifdef MEGATON_WITH_CUDA
namespace {

using namespace megaton;

using bench::median_ms;

int run(int argc, char** argv) {
  dist::init(&argc, &argv);
  const int n = dist::world_size(), me = dist::world_rank();
  if (n < 2) {
    fmt::print("bench_pull_rows_gpu: run it under mpirun on 2 or more GPUs of one node\n");
    return 0;
  }
  const int64_t rows = 65536, hidden = 2048, experts = 64;
  const int64_t local = experts / n, chunk = rows / experts;  // rows per (rank, expert)
  std::unique_ptr<dist::Comm> comm = dist::make_comm(Device::CUDA);
  const dist::Grid grid(dist::ParallelSizes{}, n, me);
  const dist::Group& g = grid.world();
  if (!comm->peer_memory(g)) {
    fmt::print("bench_pull_rows_gpu: these GPUs cannot map each other's memory\n");
    return 0;
  }
  Tensor input = Tensor::zeros({rows, hidden}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({rows, hidden}, DType::BF16, Device::CUDA);
  // Each rank's rows are sorted by global expert; rank r pulls, for each of its experts,
  // that expert's chunk from every rank, into expert order.
  std::vector<dist::PullRun> runs;
  for (int64_t l = 0; l < local; ++l)
    for (int m = 0; m < n; ++m)
      runs.push_back({m, (me * local + l) * chunk, (l * n + m) * chunk, chunk});
  const double remote_gb = double(rows * hidden * 2) * (n - 1) / n / 1e9;
  std::vector<std::pair<std::string, double>> results;

  std::vector<int64_t> counts(size_t(n), rows / n * hidden);
  results.push_back(
      {"NCCL all_to_allv", median_ms([&] { comm->all_to_allv(input, counts, out, counts, g); })});
  results.push_back(
      {"pull_rows, staged input", median_ms([&] { comm->pull_rows(input, runs, out, g); })});
  results.push_back({"pull_rows, input in place", median_ms([&] {
                       Tensor in = comm->pull_input({rows, hidden}, DType::BF16, g);
                       comm->pull_rows(in, runs, out, g);
                     })});
  // The copy kernel alone, on buffers of its own (no synchronisation between ranks: the
  // inputs do not change).
  dist::detail::PeerMemory peers(MPI_COMM_WORLD);
  peers.reserve(input.nbytes(), cuda::stream());
  MEGATON_CUDA_CHECK(cudaMemcpyAsync(peers.slot(me, 0), input.raw(), input.nbytes(),
                                     cudaMemcpyDeviceToDevice, cuda::stream()));
  MEGATON_CUDA_CHECK(cudaStreamSynchronize(cuda::stream()));
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<ops::cuda::ByteCopy> copies;
  const size_t row_bytes = size_t(hidden) * 2;
  for (int step = 1; step <= n; ++step) {
    const int m = (me + step) % n;
    for (const dist::PullRun& r : runs)
      if (r.member == m)
        copies.push_back({peers.slot(m, 0) + size_t(r.src_first) * row_bytes,
                          static_cast<char*>(out.raw()) + size_t(r.dst_first) * row_bytes,
                          int64_t(size_t(r.count) * row_bytes)});
  }
  for (int blocks_per_sm : {1, 2, 4, 8, 16})
    results.push_back({fmt::format("copy kernel, {} blocks per SM", blocks_per_sm), median_ms([&] {
                         ops::cuda::copy_chunks(copies, cuda::stream(), blocks_per_sm);
                       })});
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 0) {
    fmt::print(
        "{} ranks, {} rows x {} bf16 per rank, {} chunks pulled per rank, {:.1f} MB to "
        "or from other GPUs per rank\n",
        n, rows, hidden, runs.size(), remote_gb * 1e3);
    for (const auto& [name, ms] : results)
      fmt::print("{:<36} {:8.3f} ms  {:7.1f} GB/s\n", name, ms, remote_gb / (ms / 1e3));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int status = run(argc, argv);
  megaton::dist::finalize();
  return status;
}
#else
int main() {
  fmt::print("bench_pull_rows_gpu: this build has no CUDA backend\n");
  return 0;
}
#endif
