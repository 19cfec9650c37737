// The SSD scan's chunk machinery on the GPU, shared by ssm_scan.cu (forward, step) and
// ssm_scan_backward.cu: the chunk size, the chunk's decay (delta, cumulative log decay,
// document starts) and the 64 x 64 fp32 shared-memory tile product every chunk kernel is
// built from; and the launchers of the kernels both passes run (defined in ssm_scan.cu).
//
// Notation (ops/ssm.h; Mamba-2 paper, arXiv:2405.21060, section 6): per sample b and head h,
// chunk c holds tokens t0 = c * kChunk .. t0 + len - 1; within it token i has
//   delta_i = softplus(dt_i + dt_bias),  cum_i = sum_{k <= i} delta_k A   (A = -exp(A_log))
//   first_i = the last document start (position 0) at or before i in the chunk, -1 if none
//   mask(i, j) = first_i <= j <= i (j >= 0)          L[i][j] = exp(cum_i - cum_j) mask(i, j)
//   e_i = exp(cum_i) if first_i < 0 else 0            (how much of the entering state i sees)
//   w_j = exp(cum_last - cum_j) delta_j if j >= first_last else 0   (last = len - 1)
//   g_c = exp(cum_last) if first_last < 0 else 0      (the chunk's total decay)
// and the state entering chunk c is H_c [head_dim, N]: H_0 = 0, H_{c+1} = g_c H_c + S_c with
// S_c[p][n] = sum_j w_j x_j[p] B_j[n].
#pragma once
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "core/tensor.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/cuda/ssm_util.cuh"
#include "ops/ssm.h"

namespace megaton::ops::cuda::ssd {

using detail::from_float;
using detail::to_float;
using ssm::param_at;
using ssm::ParamVector;

// Tokens per chunk on the GPU, whatever dims.chunk_size says: the result does not depend
// on the chunk beyond rounding (ops/ssm.h), and 64 keeps every chunk product one 64 x 64
// output tile (64 tokens x 64 channels) with the operands in 35 KB of shared memory.
constexpr int kChunk = 64;
constexpr int kTile = 64;      // output tile edge: rows and columns of every tile product
constexpr int kThreads = 256;  // 16 x 16 threads, each 4 x 4 outputs of the tile
constexpr int kDepth = 32;     // reduction depth of one staged operand tile

// The scan's sizes on the device. int64 throughout: offsets like row * nheads * head_dim
// pass 2^31 at long sequences.
struct Dims {
  int64_t batch, seq, nheads, head_dim, ngroups, state_dim, nchunks, heads_per_group;
};

inline Dims make_dims(const SsdDims& s) {
  Dims d{};
  d.batch = s.batch;
  d.seq = s.seq;
  d.nheads = s.nheads;
  d.head_dim = s.head_dim;
  d.ngroups = s.ngroups;
  d.state_dim = s.state_dim;
  d.nchunks = (s.seq + kChunk - 1) / kChunk;
  d.heads_per_group = s.ngroups > 0 ? s.nheads / s.ngroups : 0;
  return d;
}

// ---- the chunk's decay (shared memory) ----

struct ChunkDecay {
  float delta[kChunk];  // 0 past the sequence's end
  float cum[kChunk];
  int first[kChunk];
  int len;
};

__device__ __forceinline__ bool chunk_mask(const ChunkDecay& cd, int i, int j) {
  return i < cd.len && j <= i && j >= cd.first[i];
}
// L[i][j] (0 where masked).
__device__ __forceinline__ float chunk_decay_between(const ChunkDecay& cd, int i, int j) {
  return chunk_mask(cd, i, j) ? expf(cd.cum[i] - cd.cum[j]) : 0.0f;
}
__device__ __forceinline__ float chunk_entry_decay(const ChunkDecay& cd, int i) {
  return i < cd.len && cd.first[i] < 0 ? expf(cd.cum[i]) : 0.0f;
}
// exp(cum_last - cum_j) for tokens the chunk's end sees, else 0 (w_j = this * delta_j).
__device__ __forceinline__ float chunk_exit_decay(const ChunkDecay& cd, int j) {
  const int last = cd.len - 1;
  return j <= last && j >= cd.first[last] ? expf(cd.cum[last] - cd.cum[j]) : 0.0f;
}
__device__ __forceinline__ float chunk_total_decay(const ChunkDecay& cd) {
  const int last = cd.len - 1;
  return cd.first[last] < 0 ? expf(cd.cum[last]) : 0.0f;
}

// Fills cd for (sample b, chunk c, head h). Every thread of the block calls it; warp 0
// computes (two tokens a lane, shuffle scans, so every kernel gets the same bits), then the
// block synchronises. A token starts a document when its position is 0 (or, without
// position_ids, when it is the sample's first).
template <typename T>
__device__ void load_chunk_decay(ChunkDecay& cd, const T* __restrict__ dt, const Dims& d, int64_t b,
                                 int64_t c, int64_t h, float A, float dt_bias,
                                 const int32_t* __restrict__ position_ids) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int64_t t0 = c * kChunk;
    const int len = int(d.seq - t0 < kChunk ? d.seq - t0 : kChunk);
    float delta[2], a[2];
    int start[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = 2 * lane + u;
      delta[u] = 0.0f;
      start[u] = -1;
      if (i < len) {
        const int64_t row = b * d.seq + t0 + i;
        delta[u] = ssm::softplus(to_float(dt[row * d.nheads + h]) + dt_bias);
        const bool reset = position_ids ? position_ids[row] == 0 : t0 + i == 0;
        start[u] = reset ? i : -1;
      }
      a[u] = delta[u] * A;
    }
    // Inclusive scans over lanes of the lane totals (sum of a, max of starts).
    float sum = a[0] + a[1];
    int top = max(start[0], start[1]);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const float s = __shfl_up_sync(0xffffffffu, sum, off);
      const int m = __shfl_up_sync(0xffffffffu, top, off);
      if (lane >= off) {
        sum += s;
        top = max(top, m);
      }
    }
    float before = __shfl_up_sync(0xffffffffu, sum, 1);
    int top_before = __shfl_up_sync(0xffffffffu, top, 1);
    if (lane == 0) {
      before = 0.0f;
      top_before = -1;
    }
    cd.delta[2 * lane] = delta[0];
    cd.delta[2 * lane + 1] = delta[1];
    cd.cum[2 * lane] = before + a[0];
    cd.cum[2 * lane + 1] = (before + a[0]) + a[1];
    cd.first[2 * lane] = max(top_before, start[0]);
    cd.first[2 * lane + 1] = max(max(top_before, start[0]), start[1]);
    if (lane == 0) cd.len = len;
  }
  __syncthreads();
}

// ---- the tile product ----
//
// Every chunk product is a 64 x 64 output tile, out[r][c] += sum_k a[k][r] b[k][c], with both
// operands staged "reduction index major" in shared memory. The stage element S is fp32 for
// F32 and F16 activations (fp32 FMA: 4 x 4 outputs a thread, rows 4 ty + i, columns
// 4 tx + j, (ty, tx) = (thread / 16, thread % 16)), and BF16 for BF16 activations (tensor
// cores, WMMA m16n16k16 with fp32 accumulation, as mamba_ssm's kernels round their operands
// to the input dtype); F16 stays on fp32 FMA, since its range cannot hold every state.
// Either way the caller sees the same 4 x 4 accumulator tile a thread.

template <typename T>
using StageOf = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat16, float>;

// Shared row stride of a stage (elements): rows of 16-byte multiples (32 bytes for WMMA's
// loads), padded against bank conflicts.
template <typename S>
constexpr int kStageLd = std::is_same_v<S, float> ? kTile + 4 : kTile + 8;
// Floats of shared memory that a stage of kRows rows takes.
template <typename S, int kRows>
constexpr int kStageFloats = kRows* kStageLd<S>* int(sizeof(S)) / 4;
// The fp32 [64][64] tile through which the tensor-core path hands its results to threads.
constexpr int kScratchFloats = kTile * kTile;
// Shared memory (floats) of every scan kernel's staging area: two 64-row fp32 stages, which
// also hold two 64-row BF16 stages and the scratch tile.
constexpr int kSmemFloats = 2 * kStageFloats<float, kChunk>;
static_assert(2 * kStageFloats<__nv_bfloat16, kChunk> + kScratchFloats <= kSmemFloats);

template <typename S>
__device__ __forceinline__ S* stage_at(float* smem, int floats) {
  return reinterpret_cast<S*>(smem + floats);
}

// A 64 x 64 fp32 accumulator tile. mma<kSteps>(a, b) adds sum_{k < kSteps} a[k][r] b[k][c]
// (stages of S); fetch(scratch, out) gives each thread out[i][j] = tile[4 ty + i][4 tx + j].
// Every thread of the block calls both.
template <typename S>
struct TileAcc;

// fp32 FMA: the thread's 4 x 4 outputs live in its registers; scratch is unused and fetch
// does not synchronise.
template <>
struct TileAcc<float> {
  float v[4][4] = {};

  template <int kSteps>
  __device__ __forceinline__ void mma(const float* a, const float* b) {
    constexpr int ld = kStageLd<float>;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const float* ap = a + 4 * ty;
    const float* bp = b + 4 * tx;
#pragma unroll 8
    for (int k = 0; k < kSteps; ++k) {
      const float4 av = *reinterpret_cast<const float4*>(ap + k * ld);
      const float4 bv = *reinterpret_cast<const float4*>(bp + k * ld);
      const float ar[4] = {av.x, av.y, av.z, av.w};
      const float br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) v[i][j] = fmaf(ar[i], br[j], v[i][j]);
    }
  }
  __device__ __forceinline__ void fetch(float* /*scratch*/, float (&out)[4][4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) out[i][j] = v[i][j];
  }
};

// Tensor cores (BF16 stages, WMMA m16n16k16, fp32 accumulation): warp w holds rows
// 16 (w % 4) .. + 15 and columns 32 (w / 4) .. + 31 in two fragments; fetch passes them
// through scratch (fp32 [64][64], 32-byte aligned) and synchronises the block twice.
template <>
struct TileAcc<__nv_bfloat16> {
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> c[2];

  __device__ __forceinline__ TileAcc() {
    nvcuda::wmma::fill_fragment(c[0], 0.0f);
    nvcuda::wmma::fill_fragment(c[1], 0.0f);
  }
  template <int kSteps>
  __device__ __forceinline__ void mma(const __nv_bfloat16* a, const __nv_bfloat16* b) {
    namespace wmma = nvcuda::wmma;
    static_assert(kSteps % 16 == 0);
    constexpr int ld = kStageLd<__nv_bfloat16>;
    const int warp = threadIdx.x >> 5;
    const int rb = warp & 3, cb = (warp >> 2) * 2;
#pragma unroll
    for (int k0 = 0; k0 < kSteps; k0 += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb0, fb1;
      wmma::load_matrix_sync(fa, a + k0 * ld + 16 * rb, ld);
      wmma::load_matrix_sync(fb0, b + k0 * ld + 16 * cb, ld);
      wmma::load_matrix_sync(fb1, b + k0 * ld + 16 * (cb + 1), ld);
      wmma::mma_sync(c[0], fa, fb0, c[0]);
      wmma::mma_sync(c[1], fa, fb1, c[1]);
    }
  }
  __device__ __forceinline__ void fetch(float* scratch, float (&out)[4][4]) const {
    namespace wmma = nvcuda::wmma;
    const int warp = threadIdx.x >> 5;
    const int rb = warp & 3, cb = (warp >> 2) * 2;
    wmma::store_matrix_sync(scratch + 16 * rb * kTile + 16 * cb, c[0], kTile, wmma::mem_row_major);
    wmma::store_matrix_sync(scratch + 16 * rb * kTile + 16 * (cb + 1), c[1], kTile,
                            wmma::mem_row_major);
    __syncthreads();
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = *reinterpret_cast<const float4*>(scratch + (4 * ty + i) * kTile + 4 * tx);
      out[i][0] = v.x;
      out[i][1] = v.y;
      out[i][2] = v.z;
      out[i][3] = v.w;
    }
    __syncthreads();
  }
};

// ---- staging ----

// s[k][r] = f(k, r) for k < kRows, r < kTile; consecutive threads take consecutive r.
template <int kRows, typename S, typename F>
__device__ __forceinline__ void fill_rows(S* s, F&& f) {
  for (int idx = threadIdx.x; idx < kRows * kTile; idx += kThreads) {
    const int k = idx / kTile, r = idx % kTile;
    s[k * kStageLd<S> + r] = from_float<S>(f(k, r));
  }
}
// The same with consecutive threads on consecutive k.
template <int kRows, typename S, typename F>
__device__ __forceinline__ void fill_cols(S* s, F&& f) {
  for (int idx = threadIdx.x; idx < kRows * kTile; idx += kThreads) {
    const int r = idx / kRows, k = idx % kRows;
    s[k * kStageLd<S> + r] = from_float<S>(f(k, r));
  }
}

// Elements of T in one 16-byte load.
template <typename T>
constexpr int kVec = int(16 / sizeof(T));

// Whether rows of src (row stride ld elements, `cols` valid columns) can be read as whole
// 16-byte vectors: src aligned, ld and cols multiples of kVec<T>.
template <typename T>
__device__ __forceinline__ bool vector_rows(const T* src, int64_t ld, int64_t cols) {
  return reinterpret_cast<uintptr_t>(src) % 16 == 0 && ld % kVec<T> == 0 && cols % kVec<T> == 0;
}

template <typename T>
__device__ __forceinline__ void load_run(const T* src, float (&v)[kVec<T>]) {
  const detail::Pack<T, kVec<T>> p = detail::load_pack<kVec<T>>(src);
#pragma unroll
  for (int u = 0; u < kVec<T>; ++u) v[u] = to_float(p.v[u]);
}

// A staged operand straight from a row-major source:
//   stage_rows: s[k][r] = scale(k) src[k * ld + r]   (k < rows, r < cols, else 0)
//   stage_cols: s[k][r] = scale(r) src[r * ld + k]   (r < rows, k < cols, else 0)
// for k < kRows, r < kTile. 16-byte loads when `vec` (vector_rows of the source: the
// columns read contiguously), element loads otherwise.
template <int kRows, typename S, typename T, typename Scale>
__device__ __forceinline__ void stage_rows(S* s, const T* __restrict__ src, int64_t ld, int rows,
                                           int64_t cols, bool vec, Scale&& scale) {
  constexpr int V = kVec<T>, ldS = kStageLd<S>;
  if (vec) {
    constexpr int kPer = kTile / V;
    for (int idx = threadIdx.x; idx < kRows * kPer; idx += kThreads) {
      const int k = idx / kPer, r = (idx % kPer) * V;
      float v[V] = {};
      if (k < rows && r < cols) {
        load_run(src + k * ld + r, v);
        const float sc = scale(k);
#pragma unroll
        for (int u = 0; u < V; ++u) v[u] *= sc;
      }
#pragma unroll
      for (int u = 0; u < V; ++u) s[k * ldS + r + u] = from_float<S>(v[u]);
    }
  } else {
    fill_rows<kRows>(s, [&](int k, int r) {
      return k < rows && r < cols ? scale(k) * to_float(src[k * ld + r]) : 0.0f;
    });
  }
}

template <int kRows, typename S, typename T, typename Scale>
__device__ __forceinline__ void stage_cols(S* s, const T* __restrict__ src, int64_t ld, int rows,
                                           int64_t cols, bool vec, Scale&& scale) {
  constexpr int V = kVec<T>, ldS = kStageLd<S>;
  static_assert(kRows % V == 0);
  if (vec) {
    constexpr int kPer = kRows / V;
    for (int idx = threadIdx.x; idx < kTile * kPer; idx += kThreads) {
      const int r = idx / kPer, k = (idx % kPer) * V;
      float v[V] = {};
      if (r < rows && k < cols) {
        load_run(src + r * ld + k, v);
        const float sc = scale(r);
#pragma unroll
        for (int u = 0; u < V; ++u) v[u] *= sc;
      }
#pragma unroll
      for (int u = 0; u < V; ++u) s[(k + u) * ldS + r] = from_float<S>(v[u]);
    }
  } else {
    fill_cols<kRows>(s, [&](int k, int r) {
      return r < rows && k < cols ? scale(r) * to_float(src[r * ld + k]) : 0.0f;
    });
  }
}

// The decayed cb of a chunk, M[i][j] = cb[i][j] L[i][j] delta_j (cbp: fp32 [64][64]),
// staged as [j][i] (kTransposed, the intra-chunk product's left operand) or [i][j].
template <bool kTransposed, typename S>
__device__ __forceinline__ void stage_decayed_cb(S* s, const float* __restrict__ cbp,
                                                 const ChunkDecay& cd) {
  constexpr int ldS = kStageLd<S>;
  for (int idx = threadIdx.x; idx < kChunk * kChunk / 4; idx += kThreads) {
    const int i = idx / (kChunk / 4), j0 = (idx % (kChunk / 4)) * 4;
    const float4 q = *reinterpret_cast<const float4*>(cbp + i * kChunk + j0);
    const float v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = j0 + u;
      const float m =
          chunk_mask(cd, i, j) ? v[u] * expf(cd.cum[i] - cd.cum[j]) * cd.delta[j] : 0.0f;
      s[kTransposed ? j * ldS + i : i * ldS + j] = from_float<S>(m);
    }
  }
}

struct NoScale {
  __device__ __forceinline__ float operator()(int) const { return 1.0f; }
};

// ---- launchers shared by the forward and the backward (ssm_scan.cu) ----

// cb [B, nchunks, ngroups, kChunk, kChunk] F32: cb[i][j] = C_i . B_j within each chunk
// (zero rows and columns past the sequence's end).
void launch_chunk_cb(const Tensor& B, const Tensor& C, const Dims& d, float* cb);
// states [B, nchunks, nheads, head_dim, N] F32. Forward (grad false): u = x, v = B,
//   states[c][p][n] = S_c = sum_j w_j x_j[p] B_j[n], and decay [B, nheads, nchunks] = g_c.
// Backward (grad true): u = dy, v = C, states[c][p][n] = sum_i e_i dy_i[p] C_i[n] (the
//   gradient that chunk c's outputs send to H_c); decay is not written (may be null).
void launch_chunk_states(bool grad, const Tensor& u, const Tensor& v, const Tensor& dt,
                         const Tensor& A_log, const Tensor& dt_bias, const int32_t* position_ids,
                         const Dims& d, float* states, float* decay);
// In place: S_c -> H_c (the state entering chunk c); final_state [B, nheads, head_dim, N]
// (may be null) receives the state after each sample's last token.
void launch_state_passing(float* states, const float* decay, const Dims& d, float* final_state);
// In place, backwards: the outputs' gradient to H_c -> dS_c = dH_{c+1} (the gradient of
// the state leaving chunk c), with dH_c = (outputs' gradient to H_c) + g_c dH_{c+1}.
void launch_state_passing_backward(float* dstates, const float* decay, const Dims& d);

}  // namespace megaton::ops::cuda::ssd
