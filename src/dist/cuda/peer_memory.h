// PeerMemory: buffers that the GPUs of one group on one node map into each other's address
// space (CUDA IPC), and the copy kernel that reads them (Comm::pull_rows over NCCL).
//
// Each member owns one allocation of two equal slots; every member maps every other's.
// A pull writes the caller's input into its slot s, waits for every member to have done
// the same (a collective), then copies the rows it needs straight out of the members'
// slot s. Consecutive pulls alternate the slots, so the next pull may overwrite slot 1 - s
// at once: the collective of this pull already proves that every member finished the
// copies of the pull before, which read slot 1 - s. (The same idea as DeepEP's intranode
// buffers; here the synchronisation is an NCCL collective on the compute stream.)
#pragma once
#include <cuda_runtime.h>
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace megaton::dist::detail {

// One copy of `bytes` bytes from src (this GPU's memory or a mapped peer's) to dst.
struct PeerCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t bytes = 0;
};

// Enqueues the copies on `stream` (kernels that read and write with the SMs, 16-byte words
// when every copy's pointers and size allow, else bytes), about `blocks_per_sm` blocks of
// 512 threads per SM over all copies (bench/bench_pull_rows_gpu.cpp compares settings).
// Empty copies are skipped. The destinations must not overlap each other or the sources.
// Throws InternalError on a failed launch.
void copy_chunks(std::span<const PeerCopy> copies, cudaStream_t stream, int blocks_per_sm = 4);

class PeerMemory {
 public:
  // Collective over `comm` (the group's MPI communicator, one rank per GPU): whether every
  // member can map every other member's memory, tried with a small allocation. False for a
  // group spread over nodes or when CUDA refuses a mapping.
  static bool available(MPI_Comm comm);

  explicit PeerMemory(MPI_Comm comm);
  ~PeerMemory();
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  // Makes every slot hold at least `bytes` (the same value on every member: collective
  // over the group). Growing waits for `stream` and for every member (their copies may
  // still read the old buffers), then allocates anew with room to spare and maps again.
  void reserve(size_t bytes, cudaStream_t stream);
  size_t slot_bytes() const { return slot_bytes_; }
  // Slot `slot` (0 or 1) of member `member`: this GPU's own for member == rank(), else the
  // mapping of that member's.
  char* slot(int member, int slot) const;
  int rank() const { return rank_; }

 private:
  void release();

  MPI_Comm comm_;
  int rank_ = 0, size_ = 0;
  size_t slot_bytes_ = 0;
  char* own_ = nullptr;        // this member's allocation (2 slots)
  std::vector<char*> mapped_;  // every member's allocation as mapped here (own_ at rank_)
};

}  // namespace megaton::dist::detail
