// The chunk copy kernel (copy_chunks.h) and moe_sort_chunks (ops.h) on the GPU.
#include "ops/cuda/copy_chunks.h"

#include <algorithm>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {

namespace {

// Copies per launch: the batch travels as a kernel parameter (24 bytes a copy, under the
// 4 KiB parameter limit).
constexpr int kMaxCopies = 128;
constexpr int kThreads = 512;

struct CopyBatch {
  ByteCopy copy[kMaxCopies];
  int count = 0;
  bool wide = false;  // every pointer and size a multiple of 16 bytes
};

// Block (x, y) copies part of batch.copy[y], grid-striding over its words. Four loads are
// issued before their stores so that each thread keeps several NVLink reads in flight.
template <typename Word>
__device__ void copy_words(const ByteCopy& c) {
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
  const ByteCopy& c = batch.copy[blockIdx.y];
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

void copy_chunks(std::span<const ByteCopy> copies, cudaStream_t stream, int blocks_per_sm) {
  CopyBatch batch;
  int64_t largest = 0;
  batch.wide = true;
  for (const ByteCopy& c : copies)
    if (c.bytes > 0 && !(aligned16(c.src) && aligned16(c.dst) && c.bytes % 16 == 0))
      batch.wide = false;
  for (const ByteCopy& c : copies) {
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

void moe_sort_chunks(const Tensor& src, const std::vector<int64_t>& src_first,
                     const std::vector<int64_t>& rows, Tensor& dst) {
  const size_t row_bytes = src.dim(0) > 0 ? src.nbytes() / size_t(src.dim(0)) : 0;
  std::vector<ByteCopy> copies;
  copies.reserve(rows.size());
  int64_t at = 0;
  for (size_t j = 0; j < rows.size(); ++j) {
    copies.push_back({static_cast<const char*>(src.raw()) + size_t(src_first[j]) * row_bytes,
                      static_cast<char*>(dst.raw()) + size_t(at) * row_bytes,
                      int64_t(size_t(rows[j]) * row_bytes)});
    at += rows[j];
  }
  copy_chunks(copies, ::megaton::cuda::stream());
}

}  // namespace megaton::ops::cuda
