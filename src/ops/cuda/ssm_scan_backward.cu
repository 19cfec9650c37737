// The SSD scan's backward on the GPU (ops/ssm.h ssd_backward; the forward and notation:
// ssm_scan.cu, ssm_scan_chunk.cuh). Nothing but the inputs is saved, so it first recomputes
// the forward's chunk states; every sum in fp32 (products on tensor cores for BF16, as in
// the forward); no float atomics, so repeated runs give the same bits.
//
// Gradients (dy_i the output gradient of token i; G[i][j] = dy_i . x_j over head_dim;
// dS_c = dH_{c+1} the gradient of the state leaving chunk c):
//   dx_j   = D dy_j + sum_i M[i][j] dy_i + w_j dS_c B_j          (M = cb L delta_j)
//   dC_i   = sum_h [ sum_j G[i][j] L[i][j] delta_j B_j + e_i dy_i^T H_c ]   (heads of the group)
//   dB_j   = sum_h [ sum_i G[i][j] L[i][j] delta_j C_i + w_j x_j^T dS_c ]
//   dH_c   = sum_i e_i dy_i C_i^T + g_c dH_{c+1}                  (reverse state passing)
//   dcum_i = rowsum_i(G cb L delta) - colsum_i(G cb L) delta_i + e_i dy_i . (H_c C_i)
//            - w_i R_i + [i = last] (sum_j w_j R_j + g_c sum(dS_c o H_c)),
//            R_j = x_j . (dS_c B_j)
//   ddelta_j = colsum_j(G cb L) + exp(cum_last - cum_j) R_j + A sum_{i >= j} dcum_i
//   ddt = ddelta sigmoid(dt + dt_bias);  dA = sum delta_k sum_{i >= k} dcum_i, dA_log = A dA
//
// Kernels, after the forward's ssd_chunk_cb, ssd_chunk_state and ssd_state_passing:
//   ssd_chunk_state<grad>          the outputs' gradient to H_c; grid as the forward's.
//   ssd_state_passing_backward     dS_c, in place, chunks in reverse; grid as the forward's.
//   ssd_chunk_scan_backward_kernel dx, ddt and per-(chunk, head) partial sums of dA_log, dD,
//        ddt_bias; grid (nchunks, B * nheads), 256 threads. Stages: G over head_dim (32 deep),
//        then per 64-column tile of head_dim: dS_c B^T and H_c C^T over N (32 deep), M^T dy
//        (64 deep); the per-token terms in warp 0 with shuffle scans.
//   ssd_chunk_dcdb_kernel          dC and dB; grid (N tiles, nchunks, B * ngroups), 256
//        threads (at most 128 registers: two blocks an SM); loops over the group's heads
//        (G, dy^T H_c, x^T dS_c over head_dim, 16 deep, the dC and dB tiles accumulating
//        across heads), summing G L delta in registers, then two 64-deep products with B
//        and C.
//   ssd_param_grad_reduce_kernel   adds the partials, in chunk order, into the accumulators;
//        grid (nheads), 256 threads.
// Shared memory: 35 KB a block at most. Scratch: cb, states, dstates (each as the forward's
// states), decay and the partials.
#include <algorithm>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/ssm.h"
#include "ops/cuda/ssm_scan_chunk.cuh"

namespace megaton::ops::cuda {
namespace ssd {
namespace {

using detail::block_sum;
using detail::compute_stream;
using detail::warp_sum;

constexpr int kParamGrads = 3;  // dA_log, dD, ddt_bias

// Sum over the 16 threads of a tile row (lanes 0-15 or 16-31 of a warp).
__device__ __forceinline__ float row_sum16(float v) {
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// ds_t[k][p] = dS[p][k], h_t[k][p] = H[p][k] for p < rows, k < cols (0 elsewhere), k < kDepth,
// p < kTile (dsp, hp: the tile's origin in [head_dim, N] row-major, row stride N); returns
// this thread's share of sum dS o H over the tile.
template <typename S>
__device__ __forceinline__ float stage_state_pair(S* ds_t, S* h_t, const float* __restrict__ dsp,
                                                  const float* __restrict__ hp, int64_t N, int rows,
                                                  int64_t cols, bool vec) {
  constexpr int ldS = kStageLd<S>;
  float dot = 0.0f;
  if (vec) {
    constexpr int kPer = kDepth / 4;
    for (int idx = threadIdx.x; idx < kTile * kPer; idx += kThreads) {
      const int p = idx / kPer, k = (idx % kPer) * 4;
      float4 sv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), hv = sv;
      if (p < rows && k < cols) {
        sv = *reinterpret_cast<const float4*>(dsp + p * N + k);
        hv = *reinterpret_cast<const float4*>(hp + p * N + k);
      }
      const float sa[4] = {sv.x, sv.y, sv.z, sv.w}, ha[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        ds_t[(k + u) * ldS + p] = from_float<S>(sa[u]);
        h_t[(k + u) * ldS + p] = from_float<S>(ha[u]);
        dot += sa[u] * ha[u];
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < kDepth * kTile; idx += kThreads) {
      const int p = idx / kDepth, k = idx % kDepth;
      float sv = 0.0f, hv = 0.0f;
      if (p < rows && k < cols) {
        sv = dsp[p * N + k];
        hv = hp[p * N + k];
      }
      ds_t[k * ldS + p] = from_float<S>(sv);
      h_t[k * ldS + p] = from_float<S>(hv);
      dot += sv * hv;
    }
  }
  return dot;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ssd_chunk_scan_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                   const T* __restrict__ dt, const T* __restrict__ Bm,
                                   const T* __restrict__ Cm, const float* __restrict__ cb,
                                   const float* __restrict__ states,
                                   const float* __restrict__ dstates, ParamVector A_log,
                                   ParamVector D, ParamVector dt_bias,
                                   const int32_t* __restrict__ position_ids, T* __restrict__ dx,
                                   T* __restrict__ ddt, float* __restrict__ partials, Dims d) {
  __shared__ ChunkDecay cd;
  __shared__ float exit_w[kChunk], entry_e[kChunk];
  __shared__ float row_z[kChunk], col_w[kChunk], r_state[kChunk], inter_dot[kChunk];
  // Four 32-deep stages, or two 64-deep ones (each with the scratch tile after them when S
  // is BF16), or the fp32 [64][65] matrix W.
  using S = StageOf<T>;
  __shared__ alignas(128) float smem[kSmemFloats];
  static_assert(4 * kStageFloats<S, kDepth> <= 2 * kStageFloats<S, kChunk> &&
                kChunk * (kChunk + 1) <= kSmemFloats);
  float* scratch = smem + 2 * kStageFloats<S, kChunk>;

  const int64_t P = d.head_dim, N = d.state_dim, H = d.nheads;
  const int64_t c = blockIdx.x, b = blockIdx.y / H, h = blockIdx.y % H;
  const int64_t g = h / d.heads_per_group;
  const float A = -expf(param_at(A_log, h)), bias = param_at(dt_bias, h);
  const int64_t row0 = b * d.seq + c * kChunk;
  const int64_t x_ld = H * P, bc_ld = d.ngroups * N;
  const T* dyp = dy + (row0 * H + h) * P;
  const T* xp = x + (row0 * H + h) * P;
  const T* bp = Bm + row0 * bc_ld + g * N;
  const T* cp = Cm + row0 * bc_ld + g * N;
  const float* cbp = cb + ((b * d.nchunks + c) * d.ngroups + g) * (kChunk * kChunk);
  const float* hp = states + ((b * d.nchunks + c) * H + h) * P * N;
  const float* dsp = dstates + ((b * d.nchunks + c) * H + h) * P * N;
  const bool x_vec = vector_rows(dyp, x_ld, P) && vector_rows(xp, x_ld, P);
  const bool bc_vec = vector_rows(bp, bc_ld, N) && vector_rows(cp, bc_ld, N);
  const bool state_vec = N % 4 == 0 && reinterpret_cast<uintptr_t>(hp) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(dsp) % 16 == 0;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int len = int(std::min<int64_t>(kChunk, d.seq - c * kChunk));

  // 1. G[i][j] = dy_i . x_j (its loads overlap warp 0's decay scan); W = G cb L (masked) in
  // shared memory; W's row sums weighted by delta and its column sums.
  {
    S* dy_t = stage_at<S>(smem, 0);
    S* x_t = stage_at<S>(smem, kStageFloats<S, kDepth>);
    TileAcc<S> tile;
    for (int64_t p0 = 0; p0 < P; p0 += kDepth) {
      stage_cols<kDepth>(dy_t, dyp + p0, x_ld, len, P - p0, x_vec, NoScale{});
      stage_cols<kDepth>(x_t, xp + p0, x_ld, len, P - p0, x_vec, NoScale{});
      __syncthreads();
      tile.template mma<kDepth>(dy_t, x_t);
      __syncthreads();
    }
    float gram[4][4];
    tile.fetch(scratch, gram);
    load_chunk_decay(cd, dt, d, b, c, h, A, bias, position_ids);
    if (threadIdx.x < kChunk) {
      const int j = threadIdx.x;
      exit_w[j] = chunk_exit_decay(cd, j) * cd.delta[j];
      entry_e[j] = chunk_entry_decay(cd, j);
    }
    float* w = smem;  // [64][65]
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) {
      const int i = 4 * ty + ii;
      const float4 q = *reinterpret_cast<const float4*>(cbp + i * kChunk + 4 * tx);
      const float cbv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * tx + jj;
        w[i * (kChunk + 1) + j] =
            chunk_mask(cd, i, j) ? gram[ii][jj] * cbv[jj] * expf(cd.cum[i] - cd.cum[j]) : 0.0f;
      }
    }
    __syncthreads();
    if (threadIdx.x < kChunk) {
      const int i = threadIdx.x;
      float s = 0.0f;
      for (int j = 0; j < kChunk; ++j) s += w[i * (kChunk + 1) + j] * cd.delta[j];
      row_z[i] = s;
    } else if (threadIdx.x < 2 * kChunk) {
      const int j = threadIdx.x - kChunk;
      float s = 0.0f;
      for (int i = 0; i < kChunk; ++i) s += w[i * (kChunk + 1) + j];
      col_w[j] = s;
    }
    __syncthreads();
  }

  // 2. Per 64-column tile of head_dim: dx, and the per-token dot products R and inter.
  const float skip = param_at(D, h);
  float r_part[4] = {}, inter_part[4] = {};
  float dD_part = 0.0f, dg_part = 0.0f;
  for (int64_t p0 = 0; p0 < P; p0 += kTile) {
    const int prows = int(std::min<int64_t>(kTile, P - p0));
    TileAcc<S> bds_tile, chs_tile;  // [j][p] = B_j . dS[p], [i][p] = C_i . H[p]
    {
      S* b_t = stage_at<S>(smem, 0);
      S* ds_t = stage_at<S>(smem, kStageFloats<S, kDepth>);
      S* c_t = stage_at<S>(smem, 2 * kStageFloats<S, kDepth>);
      S* h_t = stage_at<S>(smem, 3 * kStageFloats<S, kDepth>);
      for (int64_t n0 = 0; n0 < N; n0 += kDepth) {
        stage_cols<kDepth>(b_t, bp + n0, bc_ld, len, N - n0, bc_vec, NoScale{});
        stage_cols<kDepth>(c_t, cp + n0, bc_ld, len, N - n0, bc_vec, NoScale{});
        dg_part += stage_state_pair(ds_t, h_t, dsp + p0 * N + n0, hp + p0 * N + n0, N, prows,
                                    N - n0, state_vec);
        __syncthreads();
        bds_tile.template mma<kDepth>(b_t, ds_t);
        chs_tile.template mma<kDepth>(c_t, h_t);
        __syncthreads();
      }
    }
    float bds[4][4], chs[4][4];
    bds_tile.fetch(scratch, bds);
    chs_tile.fetch(scratch, chs);
    S* m_s = stage_at<S>(smem, 0);  // [i][j] = M[i][j]
    S* dy_s = stage_at<S>(smem, kStageFloats<S, kChunk>);
    stage_decayed_cb<false>(m_s, cbp, cd);
    stage_rows<kChunk>(dy_s, dyp + p0, x_ld, len, P - p0, x_vec, NoScale{});
    __syncthreads();
    TileAcc<S> mdy_tile;  // [j][p] = sum_i M[i][j] dy_i[p]
    mdy_tile.template mma<kChunk>(m_s, dy_s);
    float mdy[4][4];
    mdy_tile.fetch(scratch, mdy);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = 4 * ty + jj;
      if (j >= len) continue;
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) {
        const int64_t p = p0 + 4 * tx + pp;
        if (p >= P) continue;
        const float dyv = to_float(dy_s[j * kStageLd<S> + 4 * tx + pp]);
        const float xv = to_float(xp[j * x_ld + p]);
        dx[((row0 + j) * H + h) * P + p] =
            from_float<T>(skip * dyv + mdy[jj][pp] + exit_w[j] * bds[jj][pp]);
        r_part[jj] += xv * bds[jj][pp];
        inter_part[jj] += dyv * chs[jj][pp];
        dD_part += dyv * xv;
      }
    }
    __syncthreads();  // the next tile overwrites smem
  }
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const float r = row_sum16(r_part[jj]), inter = row_sum16(inter_part[jj]);
    if (tx == 0) {
      r_state[4 * ty + jj] = r;
      inter_dot[4 * ty + jj] = inter;
    }
  }
  const float dD = block_sum(dD_part);  // synchronises: r_state and inter_dot are visible
  const float dg = block_sum(dg_part);

  // 3. Per token, in warp 0 (two tokens a lane).
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, last = len - 1;
    const float total_decay = chunk_total_decay(cd);
    float ddelta[2], dcum[2], sum_wr = 0.0f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int t = 2 * lane + u;
      ddelta[u] = 0.0f;
      dcum[u] = 0.0f;
      if (t < len) {
        const float wr = exit_w[t] * r_state[t];
        ddelta[u] = col_w[t] + chunk_exit_decay(cd, t) * r_state[t];
        // Rounded product (no FMA contraction): the diagonal terms of row_z and col_w then
        // cancel exactly, as L[t][t] = 1 has no gradient (a one-token chunk's dcum is 0).
        dcum[u] = row_z[t] - __fmul_rn(cd.delta[t], col_w[t]) + entry_e[t] * inter_dot[t] - wr;
        sum_wr += wr;
      }
    }
    sum_wr = warp_sum(sum_wr);
#pragma unroll
    for (int u = 0; u < 2; ++u)
      if (2 * lane + u == last) dcum[u] += sum_wr + dg * total_decay;
    // da_t = sum_{i >= t} dcum_i: a suffix scan over lanes of the lane totals.
    float suffix = dcum[0] + dcum[1];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const float s = __shfl_down_sync(0xffffffffu, suffix, off);
      if (lane + off < 32) suffix += s;
    }
    float after = __shfl_down_sync(0xffffffffu, suffix, 1);
    if (lane == 31) after = 0.0f;
    float da[2];
    da[1] = after + dcum[1];
    da[0] = da[1] + dcum[0];
    float dA_part = 0.0f, dbias_part = 0.0f;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int t = 2 * lane + u;
      if (t >= len) continue;
      const int64_t row = row0 + t;
      const float v = to_float(dt[row * H + h]) + bias;
      const float grad = (ddelta[u] + da[u] * A) * ssm::softplus_grad(v);
      ddt[row * H + h] = from_float<T>(grad);
      dA_part += da[u] * cd.delta[t];
      dbias_part += grad;
    }
    dA_part = warp_sum(dA_part);
    dbias_part = warp_sum(dbias_part);
    if (lane == 0) {
      float* out = partials + ((b * d.nchunks + c) * H + h) * kParamGrads;
      out[0] = dA_part * A;
      out[1] = dD;
      out[2] = dbias_part;
    }
  }
}

constexpr int kHeadDepth = 16;  // head_dim depth of one stage in ssd_chunk_dcdb_kernel

// s[k][r] = src[r * ld + k] and s_scaled[k][r] = scale[r] src[r * ld + k] for r < rows,
// k < cols (0 elsewhere), k < kRows, r < kTile: the transposed stage and its row-scaled twin
// from one read of the source.
template <int kRows, typename S, typename T>
__device__ __forceinline__ void stage_cols_pair(S* s, S* s_scaled, const T* __restrict__ src,
                                                int64_t ld, int rows, int64_t cols, bool vec,
                                                const float* scale) {
  constexpr int V = kVec<T>, ldS = kStageLd<S>;
  static_assert(kRows % V == 0);
  if (vec) {
    constexpr int kPer = kRows / V;
    for (int idx = threadIdx.x; idx < kTile * kPer; idx += kThreads) {
      const int r = idx / kPer, k = (idx % kPer) * V;
      float v[V] = {};
      if (r < rows && k < cols) load_run(src + r * ld + k, v);
      const float sc = scale[r];
#pragma unroll
      for (int u = 0; u < V; ++u) {
        s[(k + u) * ldS + r] = from_float<S>(v[u]);
        s_scaled[(k + u) * ldS + r] = from_float<S>(sc * v[u]);
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < kRows * kTile; idx += kThreads) {
      const int r = idx / kRows, k = idx % kRows;
      const float v = r < rows && k < cols ? to_float(src[r * ld + k]) : 0.0f;
      s[k * ldS + r] = from_float<S>(v);
      s_scaled[k * ldS + r] = from_float<S>(scale[r] * v);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    ssd_chunk_dcdb_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                          const T* __restrict__ dt, const T* __restrict__ Bm,
                          const T* __restrict__ Cm, const float* __restrict__ states,
                          const float* __restrict__ dstates, ParamVector A_log, ParamVector dt_bias,
                          const int32_t* __restrict__ position_ids, T* __restrict__ dB,
                          T* __restrict__ dC, Dims d) {
  __shared__ ChunkDecay cd;
  __shared__ float exit_w[kChunk], entry_e[kChunk];
  // Six 16-deep stages (dy^T, e dy^T, x^T, w x^T, H, dS), then two 64-deep ones; each with
  // the scratch tile after them when S is BF16.
  using S = StageOf<T>;
  __shared__ alignas(128) float smem[kSmemFloats];
  static_assert(6 * kStageFloats<S, kHeadDepth> <= 2 * kStageFloats<S, kChunk>);
  float* scratch = smem + 2 * kStageFloats<S, kChunk>;
  constexpr int ld = kStageLd<S>;

  const int64_t P = d.head_dim, N = d.state_dim, H = d.nheads;
  const int64_t n0 = int64_t(blockIdx.x) * kTile, c = blockIdx.y;
  const int64_t b = blockIdx.z / d.ngroups, g = blockIdx.z % d.ngroups;
  const int64_t row0 = b * d.seq + c * kChunk;
  const int64_t x_ld = H * P, bc_ld = d.ngroups * N;
  const int len = int(std::min<int64_t>(kChunk, d.seq - c * kChunk));
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  TileAcc<S> dc_tile, db_tile;  // [i][n], [j][n]
  float dcb[4][4] = {};         // [i][j]: sum over the group's heads of G L delta_j

  for (int64_t hh = 0; hh < d.heads_per_group; ++hh) {
    const int64_t h = g * d.heads_per_group + hh;
    const float A = -expf(param_at(A_log, h));
    __syncthreads();  // the previous head's readers of cd, exit_w, entry_e are done
    load_chunk_decay(cd, dt, d, b, c, h, A, param_at(dt_bias, h), position_ids);
    if (threadIdx.x < kChunk) {
      const int j = threadIdx.x;
      exit_w[j] = chunk_exit_decay(cd, j) * cd.delta[j];
      entry_e[j] = chunk_entry_decay(cd, j);
    }
    __syncthreads();
    const T* dyp = dy + (row0 * H + h) * P;
    const T* xp = x + (row0 * H + h) * P;
    const float* hp = states + ((b * d.nchunks + c) * H + h) * P * N + n0;
    const float* dsp = dstates + ((b * d.nchunks + c) * H + h) * P * N + n0;
    const bool x_vec = vector_rows(dyp, x_ld, P) && vector_rows(xp, x_ld, P);
    const bool state_vec = vector_rows(hp, N, N) && vector_rows(dsp, N, N);
    S* dy_t = stage_at<S>(smem, 0);
    S* dye_t = stage_at<S>(smem, kStageFloats<S, kHeadDepth>);
    S* x_t = stage_at<S>(smem, 2 * kStageFloats<S, kHeadDepth>);
    S* xw_t = stage_at<S>(smem, 3 * kStageFloats<S, kHeadDepth>);
    S* h_s = stage_at<S>(smem, 4 * kStageFloats<S, kHeadDepth>);
    S* ds_s = stage_at<S>(smem, 5 * kStageFloats<S, kHeadDepth>);
    TileAcc<S> gram_tile;  // [i][j] = dy_i . x_j
    for (int64_t p0 = 0; p0 < P; p0 += kHeadDepth) {
      stage_cols_pair<kHeadDepth>(dy_t, dye_t, dyp + p0, x_ld, len, P - p0, x_vec, entry_e);
      stage_cols_pair<kHeadDepth>(x_t, xw_t, xp + p0, x_ld, len, P - p0, x_vec, exit_w);
      const int prows = int(std::min<int64_t>(kHeadDepth, P - p0));
      stage_rows<kHeadDepth>(h_s, hp + p0 * N, N, prows, N - n0, state_vec, NoScale{});
      stage_rows<kHeadDepth>(ds_s, dsp + p0 * N, N, prows, N - n0, state_vec, NoScale{});
      __syncthreads();
      gram_tile.template mma<kHeadDepth>(dy_t, x_t);
      dc_tile.template mma<kHeadDepth>(dye_t, h_s);
      db_tile.template mma<kHeadDepth>(xw_t, ds_s);
      __syncthreads();
    }
    float gram[4][4];
    gram_tile.fetch(scratch, gram);
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) {
      const int i = 4 * ty + ii;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * tx + jj;
        if (chunk_mask(cd, i, j))
          dcb[ii][jj] += gram[ii][jj] * expf(cd.cum[i] - cd.cum[j]) * cd.delta[j];
      }
    }
  }

  // dC[i][n] += sum_j dcb[i][j] B_j[n]; dB[j][n] += sum_i dcb[i][j] C_i[n].
  const T* bp = Bm + row0 * bc_ld + g * N + n0;
  const T* cp = Cm + row0 * bc_ld + g * N + n0;
  const bool bc_vec = vector_rows(bp, bc_ld, N) && vector_rows(cp, bc_ld, N);
  S* a_s = stage_at<S>(smem, 0);
  S* v_s = stage_at<S>(smem, kStageFloats<S, kChunk>);
  __syncthreads();
#pragma unroll
  for (int ii = 0; ii < 4; ++ii)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
      a_s[(4 * tx + jj) * ld + 4 * ty + ii] = from_float<S>(dcb[ii][jj]);
  stage_rows<kChunk>(v_s, bp, bc_ld, len, N - n0, bc_vec, NoScale{});
  __syncthreads();
  dc_tile.template mma<kChunk>(a_s, v_s);
  __syncthreads();
#pragma unroll
  for (int ii = 0; ii < 4; ++ii)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
      a_s[(4 * ty + ii) * ld + 4 * tx + jj] = from_float<S>(dcb[ii][jj]);
  stage_rows<kChunk>(v_s, cp, bc_ld, len, N - n0, bc_vec, NoScale{});
  __syncthreads();
  db_tile.template mma<kChunk>(a_s, v_s);
  float dc_out[4][4], db_out[4][4];
  dc_tile.fetch(scratch, dc_out);
  db_tile.fetch(scratch, db_out);

#pragma unroll
  for (int ii = 0; ii < 4; ++ii) {
    const int r = 4 * ty + ii;
    if (r >= len) continue;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int64_t n = n0 + 4 * tx + jj;
      if (n >= N) continue;
      dC[(row0 + r) * bc_ld + g * N + n] = from_float<T>(dc_out[ii][jj]);
      dB[(row0 + r) * bc_ld + g * N + n] = from_float<T>(db_out[ii][jj]);
    }
  }
}

constexpr int kReduceThreads = 256;

// acc[h] += sum over (sample, chunk) of the partials, in a fixed order.
__global__ void __launch_bounds__(kReduceThreads)
    ssd_param_grad_reduce_kernel(const float* __restrict__ partials, int64_t items, int64_t H,
                                 float* __restrict__ dA_log, float* __restrict__ dD,
                                 float* __restrict__ ddt_bias) {
  const int64_t h = blockIdx.x;
  float s[kParamGrads] = {};
  for (int64_t item = threadIdx.x; item < items; item += kReduceThreads)
#pragma unroll
    for (int q = 0; q < kParamGrads; ++q) s[q] += partials[(item * H + h) * kParamGrads + q];
#pragma unroll
  for (int q = 0; q < kParamGrads; ++q) s[q] = block_sum(s[q]);
  if (threadIdx.x == 0) {
    dA_log[h] += s[0];
    dD[h] += s[1];
    ddt_bias[h] += s[2];
  }
}

}  // namespace
}  // namespace ssd

void ssd_backward(const Tensor& dy, const Tensor& x, const Tensor& dt, const Tensor& A_log,
                  const Tensor& B, const Tensor& C, const Tensor& D, const Tensor& dt_bias,
                  const SsdDims& dims, Tensor& dx, Tensor& ddt, Tensor& dB, Tensor& dC,
                  Tensor& dA_log_acc, Tensor& dD_acc, Tensor& ddt_bias_acc,
                  const Tensor& position_ids) {
  const ssd::Dims d = ssd::make_dims(dims);
  if (d.batch * d.seq == 0 || d.nheads == 0) return;
  MEGATON_CHECK(d.nchunks < 65536 && d.batch * d.nheads < 65536 && d.batch * d.ngroups < 65536,
                "ssd_backward: {} chunks of {} tokens, {} samples x {} heads exceed the CUDA grid",
                d.nchunks, ssd::kChunk, d.batch, d.nheads);
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  const int64_t P = std::max<int64_t>(d.head_dim, 1), N = std::max<int64_t>(d.state_dim, 1);
  Tensor cb = Tensor::empty({d.batch, d.nchunks, d.ngroups, ssd::kChunk, ssd::kChunk}, DType::F32,
                            Device::CUDA);
  Tensor states = Tensor::empty({d.batch, d.nchunks, d.nheads, P, N}, DType::F32, Device::CUDA);
  Tensor dstates = Tensor::empty({d.batch, d.nchunks, d.nheads, P, N}, DType::F32, Device::CUDA);
  Tensor decay = Tensor::empty({d.batch, d.nheads, d.nchunks}, DType::F32, Device::CUDA);
  Tensor partials =
      Tensor::empty({d.batch * d.nchunks, d.nheads, ssd::kParamGrads}, DType::F32, Device::CUDA);
  if (d.state_dim > 0 && d.head_dim > 0) {
    ssd::launch_chunk_cb(B, C, d, cb.f32());
    ssd::launch_chunk_states(false, x, B, dt, A_log, dt_bias, positions, d, states.f32(),
                             decay.f32());
    ssd::launch_state_passing(states.f32(), decay.f32(), d, nullptr);
    ssd::launch_chunk_states(true, dy, C, dt, A_log, dt_bias, positions, d, dstates.f32(), nullptr);
    ssd::launch_state_passing_backward(dstates.f32(), decay.f32(), d);
  } else {
    cb.zero();
    states.zero();
    dstates.zero();
  }
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = static_cast<const T*>(dy.raw());
    const T* xp = static_cast<const T*>(x.raw());
    const T* dtp = static_cast<const T*>(dt.raw());
    const T* bp = static_cast<const T*>(B.raw());
    const T* cp = static_cast<const T*>(C.raw());
    const ssm::ParamVector a_log = ssm::param_vector(A_log), skip = ssm::param_vector(D),
                           bias = ssm::param_vector(dt_bias);
    ssd::ssd_chunk_scan_backward_kernel<T>
        <<<dim3(unsigned(d.nchunks), unsigned(d.batch * d.nheads)), ssd::kThreads, 0,
           detail::compute_stream()>>>(dyp, xp, dtp, bp, cp, cb.f32(), states.f32(), dstates.f32(),
                                       a_log, skip, bias, positions, static_cast<T*>(dx.raw()),
                                       static_cast<T*>(ddt.raw()), partials.f32(), d);
    MEGATON_CUDA_CHECK_LAUNCH();
    if (d.state_dim > 0) {
      dim3 grid(unsigned((d.state_dim + ssd::kTile - 1) / ssd::kTile), unsigned(d.nchunks),
                unsigned(d.batch * d.ngroups));
      ssd::ssd_chunk_dcdb_kernel<T><<<grid, ssd::kThreads, 0, detail::compute_stream()>>>(
          dyp, xp, dtp, bp, cp, states.f32(), dstates.f32(), a_log, bias, positions,
          static_cast<T*>(dB.raw()), static_cast<T*>(dC.raw()), d);
      MEGATON_CUDA_CHECK_LAUNCH();
    }
  });
  ssd::ssd_param_grad_reduce_kernel<<<unsigned(d.nheads), ssd::kReduceThreads, 0,
                                      detail::compute_stream()>>>(
      partials.f32(), d.batch * d.nchunks, d.nheads, dA_log_acc.f32(), dD_acc.f32(),
      ddt_bias_acc.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
