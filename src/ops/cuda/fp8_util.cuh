// Device code shared by the FP8 quantization kernels (fp8.cu, fp8_multi.cu): the cast and
// scale-rule numerics, packed row loads, block reductions, and the amax, flat-cast and
// 128 x 128 tile-cast bodies with the single-tensor kernels built on them.
//
// The bodies (amax_bits, quantize_flat, quantize_tile) take their work item (thread range,
// tile index) as arguments so that the multi-tensor kernels of fp8_multi.cu run exactly the
// code of the single-tensor kernels on each entry's share of the grid: bit-exactness of
// the multi-tensor ops with the single-tensor ones follows from it. They return the
// thread's |x| max as bits (abs_bits), which the caller reduces.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/fp8.h"

namespace megaton::ops::cuda {

// ---- numerics (device) ----

// The scale rule of ops/fp8.h with its host-side constants.
struct ScaleRule {
  float fp8_max;
  float amax_epsilon;
  float margin_divisor;   // exp2f(margin) from the host's libm
  bool divide_by_margin;  // margin != 0
  bool power_of_2;
};

inline ScaleRule make_rule(const Fp8ScaleRule& rule) {
  ScaleRule r;
  r.fp8_max = fp8_max(rule.fp8);
  r.amax_epsilon = rule.amax_epsilon;
  r.divide_by_margin = rule.margin != 0.0f;
  r.margin_divisor = r.divide_by_margin ? ::exp2f(rule.margin) : 1.0f;
  r.power_of_2 = rule.power_of_2;
  return r;
}

// Largest power of two <= s for s > 0 finite: a normal s keeps its exponent bits (TE's
// force_pow_2_scales), a subnormal one its highest set bit.
__device__ __forceinline__ float round_down_pow2(float s) {
  const uint32_t bits = __float_as_uint(s);
  if (bits & 0x7F800000u) return __uint_as_float(bits & 0xFF800000u);
  if (bits == 0) return s;
  return __uint_as_float(1u << (31 - __clz(bits)));
}

// The new scale from amax, or `previous` when amax is 0, negative, NaN or infinite.
__device__ __forceinline__ float scale_from_amax(float amax, float previous,
                                                 const ScaleRule& rule) {
  if (!(amax > 0.0f) || isinf(amax)) return previous;
  float s = __fdiv_rn(rule.fp8_max, fmaxf(amax, rule.amax_epsilon));
  if (rule.divide_by_margin) s = __fdiv_rn(s, rule.margin_divisor);  // exp2f(0) = 1: exact
  if (isinf(s)) s = FLT_MAX;
  if (rule.power_of_2) s = round_down_pow2(s);
  return s;
}

__device__ __forceinline__ bool scale_valid(float amax) { return amax > 0.0f && !isinf(amax); }

// |v| as bits, every NaN as the canonical 0x7FC00000: for non-negative floats the unsigned
// order of the bits is the order of the values, and NaNs sort above +inf. So an unsigned
// max of these bits (and atomicMax on them) is a NaN-propagating float max whose NaN is
// the CPU's NAN, bit for bit.
__device__ __forceinline__ uint32_t abs_bits(float v) {
  const uint32_t bits = __float_as_uint(v) & 0x7FFFFFFFu;
  return bits > 0x7F800000u ? 0x7FC00000u : bits;
}

// A NaN product's code: 0x7F with x's sign, both formats.
__device__ __forceinline__ uint32_t nan_code(float x) {
  return 0x7Fu | ((__float_as_uint(x) >> 24) & 0x80u);
}

// fp8(x0 * scale), fp8(x1 * scale), the first in the low byte.
template <bool kE4M3>
__device__ __forceinline__ uint32_t fp8x2(float x0, float x1, float scale) {
  constexpr float kMax = kE4M3 ? 448.0f : 57344.0f;
  const float p0 = __fmul_rn(x0, scale), p1 = __fmul_rn(x1, scale);
  const float c0 = fminf(fmaxf(p0, -kMax), kMax), c1 = fminf(fmaxf(p1, -kMax), kMax);
  uint32_t q =
      __nv_cvt_float2_to_fp8x2(make_float2(c0, c1), __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2);
  if (isnan(p0)) q = (q & 0xFF00u) | nan_code(x0);
  if (isnan(p1)) q = (q & 0x00FFu) | (nan_code(x1) << 8);
  return q;
}

template <bool kE4M3>
__device__ __forceinline__ uint8_t fp8_of(float x, float scale) {
  return uint8_t(fp8x2<kE4M3>(x, 0.0f, scale) & 0xFFu);
}

// Eight elements times the scale, quantized, in memory order (element 0 in byte 0).
template <bool kE4M3>
__device__ __forceinline__ uint2 fp8x8(const float (&v)[8], float scale) {
  uint2 q;
  q.x = fp8x2<kE4M3>(v[0], v[1], scale) | fp8x2<kE4M3>(v[2], v[3], scale) << 16;
  q.y = fp8x2<kE4M3>(v[4], v[5], scale) | fp8x2<kE4M3>(v[6], v[7], scale) << 16;
  return q;
}

// Eight consecutive elements of one row as loaded (BF16 kept packed: half the registers).
template <typename T>
struct Row8;

template <>
struct Row8<float> {
  float v[8];
  __device__ __forceinline__ float get(int k) const { return v[k]; }
  // 16-byte aligned p.
  __device__ __forceinline__ void load(const float* p) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
  // The first `count` elements (0..8), zeros after.
  __device__ __forceinline__ void load_partial(const float* p, int64_t count) {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = k < count ? __ldg(p + k) : 0.0f;
  }
};

template <>
struct Row8<__nv_bfloat16> {
  uint32_t w[4];  // element 2i in the low half of w[i], 2i + 1 in the high half
  __device__ __forceinline__ float get(int k) const {
    return __uint_as_float(k & 1 ? (w[k >> 1] & 0xFFFF0000u) : (w[k >> 1] << 16));
  }
  __device__ __forceinline__ void load(const __nv_bfloat16* p) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = r.x, w[1] = r.y, w[2] = r.z, w[3] = r.w;
  }
  __device__ __forceinline__ void load_partial(const __nv_bfloat16* p, int64_t count) {
    const auto* bits = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = 2 * i < count ? uint32_t(__ldg(bits + 2 * i)) : 0u;
      const uint32_t hi = 2 * i + 1 < count ? uint32_t(__ldg(bits + 2 * i + 1)) : 0u;
      w[i] = lo | hi << 16;
    }
  }
};

template <typename T>
__device__ __forceinline__ void to_floats(const Row8<T>& row, float (&v)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = row.get(k);
}

template <typename T>
__device__ __forceinline__ uint32_t abs_max_bits(const Row8<T>& row) {
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) m = max(m, abs_bits(row.get(k)));
  return m;
}

// Transposes the 4 x 4 bytes of a[0..3] (row i = the bytes of a[i], low byte first) into
// b[0..3] (b[k] = column k).
__device__ __forceinline__ void transpose_4x4(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t& b0, uint32_t& b1, uint32_t& b2,
                                              uint32_t& b3) {
  const uint32_t t0 = __byte_perm(a0, a1, 0x5140), t1 = __byte_perm(a0, a1, 0x7362);
  const uint32_t t2 = __byte_perm(a2, a3, 0x5140), t3 = __byte_perm(a2, a3, 0x7362);
  b0 = __byte_perm(t0, t2, 0x5410), b1 = __byte_perm(t0, t2, 0x7632);
  b2 = __byte_perm(t1, t3, 0x5410), b3 = __byte_perm(t1, t3, 0x7632);
}

// qt[k] = column k of the 8 x 8 bytes whose row j is q[j].
__device__ __forceinline__ void transpose_8x8(const uint2 (&q)[8], uint2 (&qt)[8]) {
  transpose_4x4(q[0].x, q[1].x, q[2].x, q[3].x, qt[0].x, qt[1].x, qt[2].x, qt[3].x);
  transpose_4x4(q[4].x, q[5].x, q[6].x, q[7].x, qt[0].y, qt[1].y, qt[2].y, qt[3].y);
  transpose_4x4(q[0].y, q[1].y, q[2].y, q[3].y, qt[4].x, qt[5].x, qt[6].x, qt[7].x);
  transpose_4x4(q[4].y, q[5].y, q[6].y, q[7].y, qt[4].y, qt[5].y, qt[6].y, qt[7].y);
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Max over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ __forceinline__ uint32_t block_max(uint32_t v) {
  __shared__ uint32_t warp_partials[32];
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // an earlier call's readers are done with warp_partials
  if (lane == 0) warp_partials[warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? warp_partials[lane] : 0u;
  return warp_max(v);
}

__device__ __forceinline__ int64_t global_thread() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_threads() { return int64_t(gridDim.x) * blockDim.x; }

constexpr int kThreads = 256;

// Blocks of a grid-stride loop over `items` per-thread work items: at most 8 resident
// blocks per SM (an amax costs one atomic per block).
inline unsigned stride_grid(int64_t items) {
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  const int64_t resident = int64_t(8) * ::megaton::cuda::multiprocessor_count();
  return unsigned(std::clamp<int64_t>(wanted, 1, resident));
}

// ---- amax ----

// The |x| max (as bits) of this thread's share of x [n]: threads `thread` of `threads`
// striding over it, 8 elements per step (kVector: x 16-byte aligned), the rest one by one.
template <typename T, bool kVector>
__device__ __forceinline__ uint32_t amax_bits(const T* __restrict__ x, int64_t n, int64_t thread,
                                              int64_t threads) {
  uint32_t m = 0;
  int64_t tail = 0;
  if constexpr (kVector) {
    // Four 16-byte loads in flight per thread before any is reduced: one at a time left
    // the loop latency-bound (2.5 TB/s on an H200 in the llama-1.3B step).
    constexpr int kUnroll = 4;
    const int64_t packs = n / 8, stride = threads;
    int64_t i = thread;
    for (; i + (kUnroll - 1) * stride < packs; i += kUnroll * stride) {
      Row8<T> rows[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) rows[u].load(x + 8 * (i + u * stride));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) m = max(m, abs_max_bits(rows[u]));
    }
    for (; i < packs; i += stride) {
      Row8<T> row;
      row.load(x + 8 * i);
      m = max(m, abs_max_bits(row));
    }
    tail = packs * 8;
  }
  for (int64_t i = tail + thread; i < n; i += threads) m = max(m, abs_bits(detail::to_float(x[i])));
  return m;
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ x, int64_t n, float* amax) {
  const uint32_t m = block_max(amax_bits<T, kVector>(x, n, global_thread(), grid_threads()));
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), m);
}

// ---- per-tensor cast without transpose: flat, 8 elements per thread ----

// out = fp8(x * scale) on this thread's share of x [n] (threads `thread` of `threads`
// striding over it; kVector: x 16-byte and out 8-byte aligned); returns the share's |x|
// max as bits.
template <typename T, bool kE4M3, bool kVector>
__device__ __forceinline__ uint32_t quantize_flat(const T* __restrict__ x, float scale,
                                                  uint8_t* __restrict__ out, int64_t n,
                                                  int64_t thread, int64_t threads) {
  uint32_t m = 0;
  int64_t tail = 0;
  if constexpr (kVector) {
    const int64_t packs = n / 8;
    for (int64_t i = thread; i < packs; i += threads) {
      Row8<T> row;
      row.load(x + 8 * i);
      m = max(m, abs_max_bits(row));
      float v[8];
      to_floats(row, v);
      *reinterpret_cast<uint2*>(out + 8 * i) = fp8x8<kE4M3>(v, scale);
    }
    tail = packs * 8;
  }
  for (int64_t i = tail + thread; i < n; i += threads) {
    const float v = detail::to_float(x[i]);
    m = max(m, abs_bits(v));
    out[i] = fp8_of<kE4M3>(v, scale);
  }
  return m;
}

template <typename T, bool kE4M3, bool kVector>
__global__ void __launch_bounds__(kThreads)
    quantize_flat_kernel(const T* __restrict__ x, const float* scale_ptr, uint8_t* __restrict__ out,
                         float* amax, int64_t n) {
  uint32_t m =
      quantize_flat<T, kE4M3, kVector>(x, *scale_ptr, out, n, global_thread(), grid_threads());
  if (amax != nullptr) {  // uniform across the grid
    m = block_max(m);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), m);
  }
}
// ---- the tile kernel: per-tensor cast + transpose, blockwise 1x128 / 128x128 ----
//
// One CTA of 256 threads quantizes a 128 x 128 tile of x (which is also one 128x128
// block, 128 1x128 row blocks, and, for the transposed copy, 128 column runs of 128 rows).
// Thread (u = tid % 16, mr = tid / 16) holds the 8 x 8 micro-tile of rows 8 mr .. +8 and
// columns 8 u .. +8 of the tile in registers: each micro-row is one 16-byte load (BF16;
// two for F32), 16 threads read 128 consecutive columns of a row. It writes out's rows
// directly (16 threads: 128 contiguous bytes), and the quantized columns of its
// micro-tile (8 bytes each: rows 8 mr .. +8 of out_t's row) to a shared tile laid out as
// out_t's tile, [128 columns of x][128 rows of x] bytes; after a barrier the CTA writes
// that tile to out_t with 16-byte stores, 8 threads per 128-byte row.
//
// Shared memory banks: the tile is 16 units of 8 bytes per 128-byte row, unit m of row cc
// stored at unit m ^ ((cc / 8) % 16). A warp's writes (16 values of u, i.e. 16 rows whose
// (cc / 8) % 16 = u differ, same m) then land in 16 distinct units; its reads (4 rows, 8
// threads each reading an aligned pair of units of one row) cover each row once. Both
// are conflict-free.
//
// Bytes: x read once (2 or 4 per element), out and out_t written once (1 + 1).

constexpr int kTile = 128;
constexpr int kTileThreads = 256;
// The shared transposed tile: 128 rows of 16 units of 8 bytes (16 KB).
constexpr int kTileShared = kTile * 16;

enum class TileMode { PerTensor, Rows1x128, Block128x128 };

struct TileArgs {
  const void* x;
  int64_t rows, cols;        // x viewed as [rows, cols]
  int64_t tiles_r, tiles_c;  // ceil(rows / 128), ceil(cols / 128)
  uint8_t* out;              // [rows, cols]
  uint8_t* out_t;            // [cols, rows], with kTranspose
  const float* scale;        // PerTensor: [1]
  float* amax;               // PerTensor: [1] or nullptr
  ScaleRule rule;            // blockwise
  float* scale_inv;          // Rows1x128: [rows, tiles_c]; 128x128: [tiles_r, tiles_c]
  float* scale_inv_t;        // Rows1x128: [cols, tiles_r]; 128x128: [tiles_c, tiles_r]
};

// Tile `tile` (row-major over the tiles_r x tiles_c grid) of x, by the whole CTA of
// kTileThreads threads; tile_t: the CTA's shared tile of kTileShared units (with
// kTranspose). Per tensor with args.amax set, amax_sink(m) is called by every thread with
// the tile's |x| max (bits; abs_bits), before the tile is written.
// kVector: cols % 8 == 0, x 16-byte and out 8-byte aligned, and with out_t rows % 16 == 0
// and out_t 16-byte aligned: every micro-row and every 16-byte run of out_t is wholly
// inside or outside x, and each is one aligned vector access.
template <typename T, bool kE4M3, TileMode kMode, bool kTranspose, bool kVector, typename AmaxSink>
__device__ __forceinline__ void quantize_tile(const TileArgs& args, int64_t tile,
                                              uint2* __restrict__ tile_t, AmaxSink&& amax_sink) {
  const int tid = threadIdx.x, u = tid & 15, mr = tid >> 4;
  const int64_t br = tile / args.tiles_c, bc = tile % args.tiles_c;
  const int64_t r0 = br * kTile, c0 = bc * kTile;
  const int64_t c = c0 + 8 * u;  // the micro-tile's first column
  const int64_t rows = args.rows, cols = args.cols;
  const T* x = static_cast<const T*>(args.x);

  Row8<T> v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t r = r0 + 8 * mr + j;
    if constexpr (kVector) {
      if (r < rows && c < cols)
        v[j].load(x + r * cols + c);
      else
        v[j].load_partial(x, 0);
    } else {
      const int64_t count = r < rows ? min(max(cols - c, int64_t(0)), int64_t(8)) : 0;
      v[j].load_partial(count > 0 ? x + r * cols + c : x, count);
    }
  }

  // The scales: row j of the micro-tile is quantized with row_scale[j], column k of it
  // (for out_t) with col_scale[k].
  float row_scale[8], col_scale[8];
  if constexpr (kMode == TileMode::PerTensor) {
    const float s = *args.scale;
#pragma unroll
    for (int j = 0; j < 8; ++j) row_scale[j] = col_scale[j] = s;
    if (args.amax != nullptr) {  // uniform across the CTA
      uint32_t m = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) m = max(m, abs_max_bits(v[j]));
      amax_sink(block_max(m));
    }
  } else if constexpr (kMode == TileMode::Block128x128) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = max(m, abs_max_bits(v[j]));
    m = block_max(m);
    const float s = scale_from_amax(__uint_as_float(m), 1.0f, args.rule);
#pragma unroll
    for (int j = 0; j < 8; ++j) row_scale[j] = col_scale[j] = s;
    if (tid == 0) {
      const float s_inv = __fdiv_rn(1.0f, s);
      args.scale_inv[br * args.tiles_c + bc] = s_inv;
      if constexpr (kTranspose) args.scale_inv_t[bc * args.tiles_r + br] = s_inv;
    }
  } else {
    // Rows1x128. Row r of the tile is one 1x128 block: its amax is a max over the 16
    // threads with this thread's mr, 16 consecutive lanes.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t m = abs_max_bits(v[j]);
#pragma unroll
      for (int offset = 8; offset > 0; offset >>= 1)
        m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
      row_scale[j] = scale_from_amax(__uint_as_float(m), 1.0f, args.rule);
      const int64_t r = r0 + 8 * mr + j;
      if (u == 0 && r < rows) args.scale_inv[r * args.tiles_c + bc] = __fdiv_rn(1.0f, row_scale[j]);
    }
    if constexpr (kTranspose) {
      // Column c of the tile over its 128 rows is one 1x128 block of x^T: per-thread
      // partials over 8 rows, the two micro-rows of a warp by shuffle, the 8 warps
      // through shared memory.
      __shared__ uint32_t col_partials[kTileThreads / 32][kTile];
      __shared__ float col_scales[kTile];
      const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        uint32_t m = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) m = max(m, abs_bits(v[j].get(k)));
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 16));
        if (lane < 16) col_partials[warp][8 * u + k] = m;
      }
      __syncthreads();
      if (tid < kTile) {
        uint32_t m = 0;
#pragma unroll
        for (int w = 0; w < kTileThreads / 32; ++w) m = max(m, col_partials[w][tid]);
        const float s = scale_from_amax(__uint_as_float(m), 1.0f, args.rule);
        col_scales[tid] = s;
        if (c0 + tid < cols) args.scale_inv_t[(c0 + tid) * args.tiles_r + br] = __fdiv_rn(1.0f, s);
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < 8; ++k) col_scale[k] = col_scales[8 * u + k];
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) col_scale[k] = 1.0f;
    }
  }

  // out: the micro-tile's rows.
  uint2 q[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t r = r0 + 8 * mr + j;
    float f[8];
    to_floats(v[j], f);
    q[j] = fp8x8<kE4M3>(f, row_scale[j]);
    if constexpr (kVector) {
      if (r < rows && c < cols) *reinterpret_cast<uint2*>(args.out + r * cols + c) = q[j];
    } else if (r < rows) {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (c + k < cols)
          args.out[r * cols + c + k] = uint8_t((k < 4 ? q[j].x : q[j].y) >> (8 * (k & 3)));
    }
  }
  if constexpr (kTranspose) {
    // out_t: the micro-tile's columns, 8 rows each, into the shared tile (see above). With
    // one scale for the whole micro-tile they are the bytes of out, transposed; 1x128
    // column blocks have scales of their own, so the columns are quantized again.
    uint2 qt[8];
    if constexpr (kMode == TileMode::Rows1x128) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float f[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = v[j].get(k);
        qt[k] = fp8x8<kE4M3>(f, col_scale[k]);
      }
    } else {
      transpose_8x8(q, qt);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) tile_t[(8 * u + k) * 16 + (mr ^ u)] = qt[k];
    __syncthreads();
    const int h = tid & 7;  // the 16-byte run of tile rows 16 h .. +16
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) {
      const int cc = pass * 32 + (tid >> 3);
      const int g = (cc >> 3) & 15;
      // Logical units 2h, 2h + 1 are the aligned physical pair h ^ (g / 2), swapped when g
      // is odd.
      const uint4 pair = *reinterpret_cast<const uint4*>(&tile_t[cc * 16 + 2 * (h ^ (g >> 1))]);
      const uint4 run = (g & 1) ? make_uint4(pair.z, pair.w, pair.x, pair.y) : pair;
      const int64_t col = c0 + cc, r = r0 + 16 * h;
      if (col >= cols) continue;
      uint8_t* dst = args.out_t + col * rows + r;
      if constexpr (kVector) {
        if (r < rows) *reinterpret_cast<uint4*>(dst) = run;
      } else {
        const uint32_t words[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
        for (int b = 0; b < 16; ++b)
          if (r + b < rows) dst[b] = uint8_t(words[b >> 2] >> (8 * (b & 3)));
      }
    }
  }
}

// One CTA per tile; per tensor, the amax (when asked) by one atomic per CTA.
template <typename T, bool kE4M3, TileMode kMode, bool kTranspose, bool kVector>
__global__ void __launch_bounds__(kTileThreads)
    quantize_tile_kernel(const __grid_constant__ TileArgs args) {
  __shared__ __align__(16) uint2 tile_t[kTranspose ? kTileShared : 2];
  quantize_tile<T, kE4M3, kMode, kTranspose, kVector>(args, blockIdx.x, tile_t, [&](uint32_t m) {
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(args.amax), m);
  });
}

// ---- host ----

template <typename F>
inline void dispatch_fp8(DType fp8, F&& f) {
  if (fp8 == DType::F8E4M3)
    f(std::true_type{});
  else if (fp8 == DType::F8E5M2)
    f(std::false_type{});
  else
    MEGATON_CHECK(false, "no FP8 kernel for dtype {}", dtype_name(fp8));
}

template <typename F>
inline void dispatch_bool(bool b, F&& f) {
  if (b)
    f(std::true_type{});
  else
    f(std::false_type{});
}

}  // namespace megaton::ops::cuda
