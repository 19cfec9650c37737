// PeerMemory (CUDA IPC mappings between the GPUs of one node) and the chunk copy kernel.
#include <algorithm>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "dist/cuda/peer_memory.h"
#include "dist/mpi_util.h"

namespace megaton::dist::detail {

namespace {

// Copies per launch: the batch travels as a kernel parameter (24 bytes a copy, under the
// 4 KiB parameter limit).
constexpr int kMaxCopies = 128;
constexpr int kThreads = 512;

struct CopyBatch {
  PeerCopy copy[kMaxCopies];
  int count = 0;
  bool wide = false;  // every pointer and size a multiple of 16 bytes
};

// Block (x, y) copies part of batch.copy[y], grid-striding over its words. Four loads are
// issued before their stores so that each thread keeps several NVLink reads in flight.
template <typename Word>
__device__ void copy_words(const PeerCopy& c) {
  const Word* src = static_cast<const Word*>(c.src);
  Word* dst = static_cast<Word*>(c.dst);
  const int64_t n = c.bytes / int64_t(sizeof(Word));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const Word a = src[i], b = src[i + stride], d = src[i + 2 * stride], e = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = d;
    dst[i + 3 * stride] = e;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

__global__ void copy_chunks_kernel(const __grid_constant__ CopyBatch batch) {
  const PeerCopy& c = batch.copy[blockIdx.y];
  if (batch.wide)
    copy_words<int4>(c);
  else
    copy_words<unsigned char>(c);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void launch(const CopyBatch& batch, int64_t largest_bytes, int blocks_per_sm, cudaStream_t stream) {
  if (batch.count == 0) return;
  // blocks_per_sm over the whole batch, but no more than the largest copy needs.
  const int64_t word = batch.wide ? 16 : 1;
  const int64_t needed =
      (largest_bytes / word + int64_t(kThreads) * 4 - 1) / (int64_t(kThreads) * 4);
  const int64_t share =
      (int64_t(blocks_per_sm) * ::megaton::cuda::multiprocessor_count() + batch.count - 1) /
      batch.count;
  const dim3 grid(unsigned(std::max<int64_t>(1, std::min(needed, share))), unsigned(batch.count));
  copy_chunks_kernel<<<grid, kThreads, 0, stream>>>(batch);
  MEGATON_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void copy_chunks(std::span<const PeerCopy> copies, cudaStream_t stream, int blocks_per_sm) {
  CopyBatch batch;
  int64_t largest = 0;
  batch.wide = true;
  for (const PeerCopy& c : copies)
    if (c.bytes > 0 && !(aligned16(c.src) && aligned16(c.dst) && c.bytes % 16 == 0))
      batch.wide = false;
  for (const PeerCopy& c : copies) {
    if (c.bytes <= 0) continue;
    batch.copy[batch.count++] = c;
    largest = std::max(largest, c.bytes);
    if (batch.count == kMaxCopies) {
      launch(batch, largest, blocks_per_sm, stream);
      batch.count = 0;
      largest = 0;
    }
  }
  launch(batch, largest, blocks_per_sm, stream);
}

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
