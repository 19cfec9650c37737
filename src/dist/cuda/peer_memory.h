// PeerMemory: buffers that the GPUs of one group on one node map into each other's address
// space (CUDA IPC), read by Comm::pull_rows over NCCL with ops/cuda/copy_chunks.h.
//
// Each member owns one allocation of two equal slots; every member maps every other's.
// A pull writes the caller's input into its slot s, waits for every member to have done
// the same (a collective), then copies the rows it needs straight out of the members'
// slot s. Consecutive pulls alternate the slots, so the next pull may overwrite slot 1 - s
// at once: the collective of this pull already proves that every member finished the
// copies of the pull before, which read slot 1 - s. (The same idea as DeepEP's intranode
// buffers; here the synchronisation is an NCCL collective on the compute stream, or for
// Comm::pull_rows_async on the group's communication stream, whose pull the compute stream
// waits for before the next pull_input or pull_rows: the argument above holds either way.)
#pragma once
#include <cuda_runtime.h>
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace megaton::dist::detail {

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
