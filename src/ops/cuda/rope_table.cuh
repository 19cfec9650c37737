// What the RoPE kernels share (rope.cu, rope_interleaved.cu, qkv_norm.cu): the frequencies
// passed by value, the per-position cos/sin table in shared memory, and the pairing of a
// head's channels under partial RoPE.
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

// The channels of a head of D values that pair slot i < ceil(D / 2) holds, for a kernel that
// gives each thread (lane) whole pairs: with R = rotary_dim (even, <= D; 0 without RoPE)
// and half = R / 2, slot i < half holds the RoPE pair (i, i + half) of the first R
// channels; slot half + j holds channels R + j and R + j + ceil((D - R) / 2) of the
// unrotated tail [R, D) (the second absent, has_b false, past D). The slots cover every
// channel once: half + ceil((D - R) / 2) = ceil(D / 2). For R = 0 and R = D this is the
// plain split (i, i + ceil(D / 2)).
struct HeadChannels {
  int a, b;
  bool has_a, has_b;
  bool rotated;  // a RoPE pair: table index i
};

__device__ __forceinline__ HeadChannels head_channels(int i, int D, int rotary_dim) {
  const int half = rotary_dim / 2;
  if (i < half) return {i, i + half, true, true, true};
  const int tail = D - rotary_dim, tail_first = (tail + 1) / 2, j = i - half;
  return {rotary_dim + j, rotary_dim + j + tail_first, j < tail_first, j + tail_first < tail,
          false};
}

}  // namespace megaton::ops::cuda::detail
