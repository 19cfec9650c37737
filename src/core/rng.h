// Counter-based random numbers (Philox4x32-10), keyed by seed and a stream id.
#pragma once
#include <cmath>
#include <cstdint>

// Callable from CUDA kernels too, so a GPU dropout mask equals the CPU one bit for bit.
#ifdef __CUDACC__
#define MEGATON_HD __host__ __device__
#else
#define MEGATON_HD
#endif

namespace megaton {

// Philox4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC'11). The output depends only on (key, counter), so any element of a random
// tensor can be recomputed on any rank, in any order: dropout masks are regenerated in
// backward and a resumed run draws the same numbers as an uninterrupted one.
struct Philox {
  uint32_t key[2];
  MEGATON_HD explicit Philox(uint64_t seed) : key{uint32_t(seed), uint32_t(seed >> 32)} {}

  // Four 32-bit outputs for the 128-bit counter (c0 = low 64 bits, c1 = high 64 bits).
  MEGATON_HD void generate(uint64_t c0, uint64_t c1, uint32_t out[4]) const {
    uint32_t c[4] = {uint32_t(c0), uint32_t(c0 >> 32), uint32_t(c1), uint32_t(c1 >> 32)};
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; ++round) {
      uint64_t p0 = uint64_t(0xD2511F53u) * c[0];
      uint64_t p1 = uint64_t(0xCD9E8D57u) * c[2];
      uint32_t n0 = uint32_t(p1 >> 32) ^ c[1] ^ k0;
      uint32_t n1 = uint32_t(p1);
      uint32_t n2 = uint32_t(p0 >> 32) ^ c[3] ^ k1;
      uint32_t n3 = uint32_t(p0);
      c[0] = n0; c[1] = n1; c[2] = n2; c[3] = n3;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    out[0] = c[0]; out[1] = c[1]; out[2] = c[2]; out[3] = c[3];
  }

  // Uniform in [0, 1) for element `index` of stream `stream` (24-bit resolution).
  MEGATON_HD float uniform(uint64_t stream, uint64_t index) const {
    uint32_t out[4];
    generate(index, stream, out);
    return float(out[0] >> 8) * (1.0f / 16777216.0f);
  }

  // Standard normal for element `index` of stream `stream` (Box-Muller on two outputs).
  MEGATON_HD float normal(uint64_t stream, uint64_t index) const {
    uint32_t out[4];
    generate(index, stream, out);
    double u1 = (double(out[0]) + 1.0) / 4294967297.0;  // (0, 1]
    double u2 = double(out[1]) / 4294967296.0;
    return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }
};

}  // namespace megaton
