// PeerMemory: CUDA IPC mappings between the GPUs of one node.
#include <algorithm>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "dist/cuda/peer_memory.h"
#include "dist/mpi_util.h"

namespace megaton::dist::detail {

bool PeerMemory::available(MPI_Comm comm) {
  int size = 0, rank = 0;
  MEGATON_MPI_CHECK(MPI_Comm_size(comm, &size));
  MEGATON_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  // One node: every member shares this node's memory.
  MPI_Comm node;
  MEGATON_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int node_size = 0;
  MEGATON_MPI_CHECK(MPI_Comm_size(node, &node_size));
  MEGATON_MPI_CHECK(MPI_Comm_free(&node));
  int ok = node_size == size;
  MEGATON_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm));
  if (!ok) return false;
  // Then a real mapping of a small allocation, both ways between every pair.
  void* probe = nullptr;
  cudaIpcMemHandle_t handle{};
  ok = cudaMalloc(&probe, 256) == cudaSuccess && cudaIpcGetMemHandle(&handle, probe) == cudaSuccess;
  std::vector<cudaIpcMemHandle_t> handles(size);
  MEGATON_MPI_CHECK(MPI_Allgather(&handle, int(sizeof(handle)), MPI_BYTE, handles.data(),
                                  int(sizeof(handle)), MPI_BYTE, comm));
  for (int m = 0; m < size && ok; ++m) {
    if (m == rank) continue;
    void* mapped = nullptr;
    if (cudaIpcOpenMemHandle(&mapped, handles[m], cudaIpcMemLazyEnablePeerAccess) != cudaSuccess)
      ok = 0;
    else
      cudaIpcCloseMemHandle(mapped);
  }
  (void)cudaGetLastError();  // a refused mapping is an answer, not an error
  MEGATON_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm));
  if (probe) cudaFree(probe);  // every member has closed its mapping (the all-reduce)
  return ok != 0;
}

PeerMemory::PeerMemory(MPI_Comm comm) : comm_(comm) {
  MEGATON_MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  MEGATON_MPI_CHECK(MPI_Comm_size(comm, &size_));
}

PeerMemory::~PeerMemory() {
  // At exit: the mappings closed, the allocation freed; errors do not matter any more.
  for (int m = 0; m < int(mapped_.size()); ++m)
    if (m != rank_ && mapped_[m]) cudaIpcCloseMemHandle(mapped_[m]);
  if (own_) cudaFree(own_);
}

void PeerMemory::release() {
  for (int m = 0; m < int(mapped_.size()); ++m)
    if (m != rank_ && mapped_[m]) MEGATON_CUDA_CHECK(cudaIpcCloseMemHandle(mapped_[m]));
  mapped_.clear();
  // The exporter frees only after every member has closed its mapping.
  MEGATON_MPI_CHECK(MPI_Barrier(comm_));
  if (own_) {
    MEGATON_CUDA_CHECK(cudaFree(own_));
    ::megaton::cuda::count_external_device_memory(-int64_t(2 * slot_bytes_));
  }
  own_ = nullptr;
  slot_bytes_ = 0;
}

void PeerMemory::reserve(size_t bytes, cudaStream_t stream) {
  if (bytes <= slot_bytes_) return;
  // Every member's copies out of the old buffers have finished before any is unmapped.
  MEGATON_CUDA_CHECK(cudaStreamSynchronize(stream));
  MEGATON_MPI_CHECK(MPI_Barrier(comm_));
  release();
  // A quarter more, in 2 MiB steps, so that routing that varies a little does not
  // reallocate every step.
  constexpr size_t step = size_t(2) << 20;
  slot_bytes_ = ((bytes + bytes / 4) + step - 1) / step * step;
  void* own = nullptr;
  MEGATON_CUDA_CHECK(cudaMalloc(&own, 2 * slot_bytes_));
  own_ = static_cast<char*>(own);
  ::megaton::cuda::count_external_device_memory(int64_t(2 * slot_bytes_));
  cudaIpcMemHandle_t handle{};
  MEGATON_CUDA_CHECK(cudaIpcGetMemHandle(&handle, own_));
  std::vector<cudaIpcMemHandle_t> handles(size_);
  MEGATON_MPI_CHECK(MPI_Allgather(&handle, int(sizeof(handle)), MPI_BYTE, handles.data(),
                                  int(sizeof(handle)), MPI_BYTE, comm_));
  mapped_.assign(size_, nullptr);
  for (int m = 0; m < size_; ++m) {
    if (m == rank_) {
      mapped_[m] = own_;
      continue;
    }
    void* mapped = nullptr;
    MEGATON_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, handles[m], cudaIpcMemLazyEnablePeerAccess));
    mapped_[m] = static_cast<char*>(mapped);
  }
}

char* PeerMemory::slot(int member, int slot) const {
  MEGATON_CHECK(member >= 0 && member < int(mapped_.size()) && (slot == 0 || slot == 1),
                "PeerMemory::slot({}, {}) of {} members", member, slot, mapped_.size());
  return mapped_[member] + size_t(slot) * slot_bytes_;
}

}  // namespace megaton::dist::detail
