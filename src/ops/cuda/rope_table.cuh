// What the RoPE kernels share (rope.cu, rope_interleaved.cu): the frequencies passed by
// value and the per-position cos/sin table in shared memory.
#pragma once
#include <cstdint>

namespace megaton::ops::cuda::detail {

// Up to D = 512: the frequencies travel as a kernel argument (1 KiB), no device buffer.
constexpr int kRopeMaxHalfDim = 256;

struct RopeInvFreq {
  float value[kRopeMaxHalfDim];
};

// table[0, half) = cos, table[half, 2 half) = sin of angle = float(pos) * inv_freq (one fp32
// multiply, no contraction, as on the CPU), evaluated in double and rounded once. Called by
// all threads of a block, followed by __syncthreads() before the table is read.
__device__ inline void fill_rope_table(float* table, float pos, int half,
                                       const RopeInvFreq& inv_freq) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = __fmul_rn(pos, inv_freq.value[i]);
    table[i] = float(cos(double(angle)));
    table[half + i] = float(sin(double(angle)));
  }
}

}  // namespace megaton::ops::cuda::detail
