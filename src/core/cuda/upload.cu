// cuda::upload: small host-to-device copies as kernel parameters (cuda_check.h).
#include <algorithm>
#include <cstring>

#include "core/cuda/cuda_check.h"

namespace megaton::cuda {

namespace {
struct UploadChunk {
  unsigned char bytes[kUploadChunk];
};
// Kernel parameters above 4 KB need CUDA 12.1 and a Volta or later GPU (Megaton: sm_90a).
static_assert(sizeof(UploadChunk) <= 32764, "kernel parameters are limited to 32,764 bytes");

__global__ void upload_kernel(const UploadChunk chunk, unsigned char* dst, size_t bytes) {
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = chunk.bytes[i];
}
}  // namespace

void upload(void* device_dst, const void* host_src, size_t bytes) {
  auto* dst = static_cast<unsigned char*>(device_dst);
  const auto* src = static_cast<const unsigned char*>(host_src);
  for (size_t at = 0; at < bytes; at += kUploadChunk) {
    const size_t n = std::min(kUploadChunk, bytes - at);
    UploadChunk chunk;
    std::memcpy(chunk.bytes, src + at, n);
    upload_kernel<<<1, 512, 0, stream()>>>(chunk, dst + at, n);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace megaton::cuda
