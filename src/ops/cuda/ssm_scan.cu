// The SSD scan's forward and one-token step on the GPU (ops/ssm.h; CPU twin and argument
// checks: ops/cpu/ssm.cpp). Activations F32, BF16 or F16; A_log, D, dt_bias any of those,
// read as fp32; every sum in fp32. The chunk products run on fp32 FMA for F32 and F16, on
// tensor cores (WMMA, bf16 operands, fp32 accumulation) for BF16 (ssm_scan_chunk.cuh).
//
// Algorithm: the chunked SSD of the Mamba-2 paper (arXiv:2405.21060, section 6 and its
// Listing 1), in chunks of kChunk = 64 tokens (notation: ssm_scan_chunk.cuh):
//   1. ssd_chunk_cb_kernel       cb[c][i][j] = C_i . B_j per chunk and group
//        grid (nchunks, ngroups, B), 256 threads; K = N staged 32 at a time.
//   2. ssd_chunk_state_kernel    S_c[p][n] = sum_j w_j x_j[p] B_j[n] and g_c per chunk, head
//        grid (p tiles x n tiles, nchunks, B * nheads), 256 threads, one 64 x 64 tile each.
//   3. ssd_state_passing_kernel  H_0 = 0, H_{c+1} = g_c H_c + S_c, in place, sequential over
//        chunks; grid (head_dim * N / 1024, nheads, B), four state elements a thread.
//   4. ssd_chunk_scan_kernel     y_i = sum_j cb[i][j] L[i][j] delta_j x_j
//                                      + e_i H_c C_i + D x_i
//        grid (p tiles, nchunks, B * nheads), 256 threads: the inter-chunk product over N
//        in 64-deep stages (C's rows scaled by e_i as they are staged), then the
//        intra-chunk [64 x 64] x [64 x 64] product into the same accumulator tile.
// Each block's output tile is 64 x 64 (a 4 x 4 register tile per thread, or WMMA
// fragments); operands are staged with 16-byte loads where the sizes allow. Shared memory
// stays under the default 48 KB (35 KB). Scratch: cb (B * nchunks * ngroups * 16 KB) and
// the states (B * nchunks * nheads * head_dim * N * 4 bytes; 67 MB for one 4096-token
// sample of 64 heads x 64 x 128), released at return in stream order.
//
// ssd_step: one block per (sample, head), a warp per state row p (lanes over N).
#include <algorithm>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/ssm.h"
#include "ops/cuda/ssm_scan_chunk.cuh"

namespace megaton::ops::cuda {
namespace ssd {
namespace {

using detail::compute_stream;

__host__ __device__ inline int64_t tiles(int64_t n) { return (n + kTile - 1) / kTile; }

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ssd_chunk_cb_kernel(const T* __restrict__ Bm, const T* __restrict__ Cm, float* __restrict__ cb,
                        Dims d) {
  using S = StageOf<T>;
  __shared__ alignas(128) float smem[kSmemFloats];
  S* c_stage = stage_at<S>(smem, 0);
  S* b_stage = stage_at<S>(smem, kStageFloats<S, kDepth>);
  float* scratch = smem + 2 * kStageFloats<S, kDepth>;
  const int64_t c = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int64_t N = d.state_dim, ld = d.ngroups * N;
  const int len = int(std::min<int64_t>(kChunk, d.seq - c * kChunk));
  const T* cp = Cm + (b * d.seq + c * kChunk) * ld + g * N;
  const T* bp = Bm + (b * d.seq + c * kChunk) * ld + g * N;
  const bool vec = vector_rows(cp, ld, N) && vector_rows(bp, ld, N);
  TileAcc<S> tile;
  for (int64_t n0 = 0; n0 < N; n0 += kDepth) {
    stage_cols<kDepth>(c_stage, cp + n0, ld, len, N - n0, vec, NoScale{});
    stage_cols<kDepth>(b_stage, bp + n0, ld, len, N - n0, vec, NoScale{});
    __syncthreads();
    tile.template mma<kDepth>(c_stage, b_stage);
    __syncthreads();
  }
  float acc[4][4];
  tile.fetch(scratch, acc);
  float* out = cb + ((b * d.nchunks + c) * d.ngroups + g) * (kChunk * kChunk);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    *reinterpret_cast<float4*>(out + (4 * ty + i) * kChunk + 4 * tx) =
        make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
}

// kGrad false: states = S_c (u = x, v = B, weights w_j) and decay = g_c; true: the outputs'
// gradient to H_c (u = dy, v = C, weights e_i).
template <typename T, bool kGrad>
__global__ void __launch_bounds__(kThreads)
    ssd_chunk_state_kernel(const T* __restrict__ u, const T* __restrict__ v,
                           const T* __restrict__ dt, ParamVector A_log, ParamVector dt_bias,
                           const int32_t* __restrict__ position_ids, float* __restrict__ states,
                           float* __restrict__ decay, Dims d) {
  __shared__ ChunkDecay cd;
  __shared__ float weight[kChunk];
  using S = StageOf<T>;
  __shared__ alignas(128) float smem[kSmemFloats];
  S* u_stage = stage_at<S>(smem, 0);
  S* v_stage = stage_at<S>(smem, kStageFloats<S, kChunk>);
  float* scratch = smem + 2 * kStageFloats<S, kChunk>;
  const int64_t P = d.head_dim, N = d.state_dim, H = d.nheads;
  const int64_t p_tiles = tiles(P);
  const int64_t p0 = (blockIdx.x % p_tiles) * kTile, n0 = (blockIdx.x / p_tiles) * kTile;
  const int64_t c = blockIdx.y, b = blockIdx.z / H, h = blockIdx.z % H;
  const int64_t g = h / d.heads_per_group;
  const float A = -expf(param_at(A_log, h));
  const int len = int(std::min<int64_t>(kChunk, d.seq - c * kChunk));
  const int64_t row0 = b * d.seq + c * kChunk;
  const T* up = u + (row0 * H + h) * P + p0;
  const T* vp = v + row0 * d.ngroups * N + g * N + n0;
  const int64_t u_ld = H * P, v_ld = d.ngroups * N;
  // v does not depend on the decay: its loads overlap warp 0's scan.
  stage_rows<kChunk>(v_stage, vp, v_ld, len, N - n0, vector_rows(vp, v_ld, N), NoScale{});
  load_chunk_decay(cd, dt, d, b, c, h, A, param_at(dt_bias, h), position_ids);
  if (threadIdx.x < kChunk) {
    const int j = threadIdx.x;
    weight[j] = kGrad ? chunk_entry_decay(cd, j) : chunk_exit_decay(cd, j) * cd.delta[j];
  }
  __syncthreads();
  stage_rows<kChunk>(u_stage, up, u_ld, len, P - p0, vector_rows(up, u_ld, P),
                     [&](int j) { return weight[j]; });
  __syncthreads();
  TileAcc<S> tile;
  tile.template mma<kChunk>(u_stage, v_stage);
  float acc[4][4];
  tile.fetch(scratch, acc);
  float* out = states + ((b * d.nchunks + c) * H + h) * P * N;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t p = p0 + 4 * ty + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + 4 * tx + j;
      if (p < P && n < N) out[p * N + n] = acc[i][j];
    }
  }
  if (!kGrad && blockIdx.x == 0 && threadIdx.x == 0)
    decay[(b * H + h) * d.nchunks + c] = chunk_total_decay(cd);
}

constexpr int kPassingThreads = 256;
constexpr int kPassingBatch = 16;  // chunks whose loads are issued before their stores

// Float vector of V lanes (V = 4: float4 loads and stores).
template <int V>
struct Lanes {
  float v[V];
};
template <int V>
__device__ __forceinline__ Lanes<V> load_lanes(const float* p) {
  Lanes<V> r;
  if constexpr (V == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    r.v[0] = q.x, r.v[1] = q.y, r.v[2] = q.z, r.v[3] = q.w;
  } else {
    r.v[0] = *p;
  }
  return r;
}
template <int V>
__device__ __forceinline__ void store_lanes(float* p, const Lanes<V>& r) {
  if constexpr (V == 4)
    *reinterpret_cast<float4*>(p) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
  else
    *p = r.v[0];
}

// Forward (kBackward false): S_c -> H_c in place, H_0 = 0, H_{c+1} = g_c H_c + S_c, and the
// final state. Backward: the outputs' gradient G_c -> dS_c = dH_{c+1} in place, chunks in
// reverse, dH_c = G_c + g_c dH_{c+1}. A thread owns V consecutive elements of one (sample,
// head)'s [head_dim, N] state and walks the chunks, issuing kPassingBatch chunks' loads
// before their stores (the walk is latency-bound, not bandwidth-bound).
template <bool kBackward, int V>
__global__ void __launch_bounds__(kPassingThreads)
    ssd_state_passing_kernel(float* __restrict__ states, const float* __restrict__ decay,
                             float* __restrict__ final_state, Dims d) {
  const int64_t PN = d.head_dim * d.state_dim, H = d.nheads, nc = d.nchunks;
  const int64_t e = (int64_t(blockIdx.x) * kPassingThreads + threadIdx.x) * V;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  if (e >= PN) return;
  const float* g = decay + (b * H + h) * nc;
  float* base = states + (b * nc * H + h) * PN + e;
  const int64_t stride = H * PN;  // between chunks
  Lanes<V> carry{};
  for (int64_t i0 = 0; i0 < nc; i0 += kPassingBatch) {
    Lanes<V> in[kPassingBatch];
#pragma unroll
    for (int u = 0; u < kPassingBatch; ++u) {
      const int64_t c = kBackward ? nc - 1 - (i0 + u) : i0 + u;
      if (i0 + u < nc) in[u] = load_lanes<V>(base + c * stride);
    }
#pragma unroll
    for (int u = 0; u < kPassingBatch; ++u) {
      const int64_t c = kBackward ? nc - 1 - (i0 + u) : i0 + u;
      if (i0 + u < nc) {
        store_lanes<V>(base + c * stride, carry);
        const float gc = g[c];
#pragma unroll
        for (int k = 0; k < V; ++k) carry.v[k] = fmaf(gc, carry.v[k], in[u].v[k]);
      }
    }
  }
  if (!kBackward && final_state) store_lanes<V>(final_state + (b * H + h) * PN + e, carry);
}

template <bool kBackward>
void launch_passing(float* states, const float* decay, const Dims& d, float* final_state) {
  const int64_t PN = d.head_dim * d.state_dim;
  const bool aligned = final_state == nullptr || detail::is_aligned(final_state, 16);
  const int V = PN % 4 == 0 && aligned ? 4 : 1;
  const int64_t threads = (PN + V - 1) / V;
  dim3 grid(unsigned((threads + kPassingThreads - 1) / kPassingThreads), unsigned(d.nheads),
            unsigned(d.batch));
  if (V == 4)
    ssd_state_passing_kernel<kBackward, 4>
        <<<grid, kPassingThreads, 0, compute_stream()>>>(states, decay, final_state, d);
  else
    ssd_state_passing_kernel<kBackward, 1>
        <<<grid, kPassingThreads, 0, compute_stream()>>>(states, decay, final_state, d);
  MEGATON_CUDA_CHECK_LAUNCH();
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ssd_chunk_scan_kernel(const T* __restrict__ x, const T* __restrict__ Cm,
                          const T* __restrict__ dt, const float* __restrict__ cb,
                          const float* __restrict__ states, ParamVector A_log, ParamVector D,
                          ParamVector dt_bias, const int32_t* __restrict__ position_ids,
                          T* __restrict__ y, Dims d) {
  using S = StageOf<T>;
  __shared__ ChunkDecay cd;
  __shared__ alignas(128) float smem[kSmemFloats];
  S* a_stage = stage_at<S>(smem, 0);
  S* b_stage = stage_at<S>(smem, kStageFloats<S, kChunk>);
  float* scratch = smem + 2 * kStageFloats<S, kChunk>;
  const int64_t P = d.head_dim, N = d.state_dim, H = d.nheads;
  const int64_t p0 = int64_t(blockIdx.x) * kTile;
  const int64_t c = blockIdx.y, b = blockIdx.z / H, h = blockIdx.z % H;
  const int64_t g = h / d.heads_per_group;
  const float A = -expf(param_at(A_log, h));
  load_chunk_decay(cd, dt, d, b, c, h, A, param_at(dt_bias, h), position_ids);
  const int len = cd.len;
  const int64_t row0 = b * d.seq + c * kChunk;
  const int64_t x_ld = H * P, c_ld = d.ngroups * N;
  const T* xp = x + (row0 * H + h) * P + p0;
  const T* cp = Cm + row0 * c_ld + g * N;

  // Inter-chunk: y[i][p] = sum_n (e_i C_i[n]) H_c[p][n] (H_0 = 0), C staged as [n][i], H as
  // [n][p].
  TileAcc<S> tile;
  if (c > 0) {
    const float* hp = states + ((b * d.nchunks + c) * H + h) * P * N + p0 * N;
    const bool c_vec = vector_rows(cp, c_ld, N), h_vec = vector_rows(hp, N, N);
    for (int64_t n0 = 0; n0 < N; n0 += kChunk) {
      stage_cols<kChunk>(a_stage, cp + n0, c_ld, len, N - n0, c_vec,
                         [&](int i) { return chunk_entry_decay(cd, i); });
      stage_cols<kChunk>(b_stage, hp + n0, N, int(std::min<int64_t>(kTile, P - p0)), N - n0, h_vec,
                         NoScale{});
      __syncthreads();
      tile.template mma<kChunk>(a_stage, b_stage);
      __syncthreads();
    }
  }

  // Intra-chunk: y[i][p] += sum_j M[i][j] x_j[p], M^T staged as [j][i], x as [j][p].
  const float* cbp = cb + ((b * d.nchunks + c) * d.ngroups + g) * (kChunk * kChunk);
  stage_decayed_cb<true>(a_stage, cbp, cd);
  stage_rows<kChunk>(b_stage, xp, x_ld, len, P - p0, vector_rows(xp, x_ld, P), NoScale{});
  __syncthreads();
  tile.template mma<kChunk>(a_stage, b_stage);
  float out[4][4];
  tile.fetch(scratch, out);

  const float skip = param_at(D, h);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int ii = 0; ii < 4; ++ii) {
    const int i = 4 * ty + ii;
    if (i >= len) continue;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int p = 4 * tx + jj;
      if (p0 + p >= P) continue;
      const float xv = to_float(b_stage[i * kStageLd<S> + p]);
      const float v = out[ii][jj] + skip * xv;
      y[((row0 + i) * H + h) * P + p0 + p] = from_float<T>(v);
    }
  }
}

// One block per (sample, head); warp w takes state rows p = w, w + 8, ...
constexpr int kStepThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kStepThreads)
    ssd_step_kernel(const T* __restrict__ x, const T* __restrict__ dt, ParamVector A_log,
                    const T* __restrict__ Bm, const T* __restrict__ Cm, ParamVector D,
                    ParamVector dt_bias, float* __restrict__ state, T* __restrict__ y, Dims d) {
  const int64_t H = d.nheads, P = d.head_dim, N = d.state_dim;
  const int64_t b = blockIdx.x / H, h = blockIdx.x % H, g = h / d.heads_per_group;
  const float A = -expf(param_at(A_log, h));
  const float delta = ssm::softplus(to_float(dt[b * H + h]) + param_at(dt_bias, h));
  const float decay = expf(delta * A);
  const float skip = param_at(D, h);
  const T* bp = Bm + (b * d.ngroups + g) * N;
  const T* cp = Cm + (b * d.ngroups + g) * N;
  float* st = state + (b * H + h) * P * N;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t p = warp; p < P; p += kStepThreads / 32) {
    const float xv = to_float(x[(b * H + h) * P + p]);
    float acc = 0.0f;
    for (int64_t n = lane; n < N; n += 32) {
      const float s = decay * st[p * N + n] + delta * xv * to_float(bp[n]);
      st[p * N + n] = s;
      acc += s * to_float(cp[n]);
    }
    acc = detail::warp_sum(acc);
    if (lane == 0) y[(b * H + h) * P + p] = from_float<T>(acc + skip * xv);
  }
}

}  // namespace

void launch_chunk_cb(const Tensor& B, const Tensor& C, const Dims& d, float* cb) {
  detail::dispatch_float(B.dtype(), [&](auto tag) {
    using T = decltype(tag);
    dim3 grid(unsigned(d.nchunks), unsigned(d.ngroups), unsigned(d.batch));
    ssd_chunk_cb_kernel<T><<<grid, kThreads, 0, compute_stream()>>>(
        static_cast<const T*>(B.raw()), static_cast<const T*>(C.raw()), cb, d);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

void launch_chunk_states(bool grad, const Tensor& u, const Tensor& v, const Tensor& dt,
                         const Tensor& A_log, const Tensor& dt_bias, const int32_t* position_ids,
                         const Dims& d, float* states, float* decay) {
  detail::dispatch_float(u.dtype(), [&](auto tag) {
    using T = decltype(tag);
    dim3 grid(unsigned(tiles(d.head_dim) * tiles(d.state_dim)), unsigned(d.nchunks),
              unsigned(d.batch * d.nheads));
    auto args = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, compute_stream()>>>(
          static_cast<const T*>(u.raw()), static_cast<const T*>(v.raw()),
          static_cast<const T*>(dt.raw()), ssm::param_vector(A_log), ssm::param_vector(dt_bias),
          position_ids, states, decay, d);
    };
    if (grad)
      args(ssd_chunk_state_kernel<T, true>);
    else
      args(ssd_chunk_state_kernel<T, false>);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

void launch_state_passing(float* states, const float* decay, const Dims& d, float* final_state) {
  launch_passing<false>(states, decay, d, final_state);
}

void launch_state_passing_backward(float* dstates, const float* decay, const Dims& d) {
  launch_passing<true>(dstates, decay, d, nullptr);
}

}  // namespace ssd

// The grid's y and z dimensions (chunks, samples x heads) must stay under 65536.
static void check_grid(const ssd::Dims& d, const char* op) {
  MEGATON_CHECK(d.nchunks < 65536 && d.batch * d.nheads < 65536 && d.batch * d.ngroups < 65536,
                "{}: {} chunks of {} tokens, {} samples x {} heads exceed the CUDA grid", op,
                d.nchunks, ssd::kChunk, d.batch, d.nheads);
}

void ssd_forward(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
                 const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& dims,
                 Tensor& y, const Tensor& position_ids, Tensor* final_state) {
  const ssd::Dims d = ssd::make_dims(dims);
  float* final_ptr = final_state && final_state->defined() ? final_state->f32() : nullptr;
  if (d.batch == 0 || d.nheads == 0 || d.head_dim == 0) return;
  if (d.seq == 0 || d.state_dim == 0) {
    // No tokens: the final state is the zero state; no state: y = D x.
    if (final_ptr) final_state->zero();
    if (d.seq == 0) return;
  }
  check_grid(d, "ssd_forward");
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  const int64_t N = std::max<int64_t>(d.state_dim, 1);
  Tensor cb = Tensor::empty({d.batch, d.nchunks, d.ngroups, ssd::kChunk, ssd::kChunk}, DType::F32,
                            Device::CUDA);
  Tensor states =
      Tensor::empty({d.batch, d.nchunks, d.nheads, d.head_dim, N}, DType::F32, Device::CUDA);
  Tensor decay = Tensor::empty({d.batch, d.nheads, d.nchunks}, DType::F32, Device::CUDA);
  if (d.state_dim > 0) {
    ssd::launch_chunk_cb(B, C, d, cb.f32());
    ssd::launch_chunk_states(false, x, B, dt, A_log, dt_bias, positions, d, states.f32(),
                             decay.f32());
    ssd::launch_state_passing(states.f32(), decay.f32(), d, final_ptr);
  } else {
    cb.zero();
    states.zero();
  }
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    dim3 grid(unsigned(ssd::tiles(d.head_dim)), unsigned(d.nchunks), unsigned(d.batch * d.nheads));
    ssd::ssd_chunk_scan_kernel<T><<<grid, ssd::kThreads, 0, detail::compute_stream()>>>(
        static_cast<const T*>(x.raw()), static_cast<const T*>(C.raw()),
        static_cast<const T*>(dt.raw()), cb.f32(), states.f32(), ssm::param_vector(A_log),
        ssm::param_vector(D), ssm::param_vector(dt_bias), positions, static_cast<T*>(y.raw()), d);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

void ssd_step(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& B,
              const Tensor& C, const Tensor& D, const Tensor& dt_bias, const SsdDims& dims,
              Tensor& state, Tensor& y) {
  ssd::Dims d = ssd::make_dims(dims);
  d.seq = 1;
  if (d.batch == 0 || d.nheads == 0 || d.head_dim == 0) return;
  MEGATON_CHECK(d.batch * d.nheads < (int64_t(1) << 31), "ssd_step: {} x {} blocks", d.batch,
                d.nheads);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    ssd::ssd_step_kernel<T>
        <<<unsigned(d.batch * d.nheads), ssd::kStepThreads, 0, detail::compute_stream()>>>(
            static_cast<const T*>(x.raw()), static_cast<const T*>(dt.raw()),
            ssm::param_vector(A_log), static_cast<const T*>(B.raw()),
            static_cast<const T*>(C.raw()), ssm::param_vector(D), ssm::param_vector(dt_bias),
            state.f32(), static_cast<T*>(y.raw()), d);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
