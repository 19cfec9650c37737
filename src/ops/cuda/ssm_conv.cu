// Mamba-2's causal depthwise conv1d on the GPU (ops/ssm.h; mamba_ssm's causal_conv1d_fn;
// CPU twin and argument checks: ops/cpu/ssm.cpp). x, y, dy, dx one dtype (F32, BF16, F16);
// weight and bias any of those, read as fp32; conv_state any of those; fp32 arithmetic.
//
// Forward and backward: each thread walks one channel down a run of kConvRun rows of one
// sample, holding the last K inputs in registers (the width K is a template argument,
// 1..kMaxConvWidth), so every input is read once plus a K - 1 row halo; a warp covers 32
// consecutive channels of a row (coalesced). Block (kConvChannels, kConvRuns) = 256 threads;
// grid (channel tiles, runs / kConvRuns).
//   forward: y[s] = act(bias + sum_m w[K-1-m] x[s-m]) over the taps m <= position(s).
//   backward: the run recomputes du[o] = dy[o] act'(u[o]) for rows o in [s0, s1 + K - 1)
//     (the K - 1 rows past its end feed its last dx rows) and scatters w du into a K-row
//     window of dx partials, writing each dx row once complete. The weight and bias
//     gradients of the run's own rows are summed in registers, then over the block's runs in
//     shared memory, into F32 partials [row blocks, C, K + 1]; a second kernel adds them in
//     row-block order into the accumulators (deterministic, no float atomics).
// Step and final state: one thread per (sample, channel) and per state element.
#include <algorithm>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/ssm.h"
#include "ops/cuda/ssm_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::compute_stream;
using detail::from_float;
using detail::to_float;
using ssm::param_at;
using ssm::ParamVector;

constexpr int kConvChannels = 64;
constexpr int kConvRuns = 4;
constexpr int kConvRun = 64;
constexpr int kMaxConvWidth = 8;  // the widths dispatch_width instantiates

struct ConvShape {
  int64_t seq, channels, runs_per_sample, runs;
};

ConvShape conv_shape(int64_t rows, int64_t batch, int64_t channels) {
  ConvShape s{};
  s.seq = batch > 0 ? rows / batch : 0;
  s.channels = channels;
  s.runs_per_sample = (s.seq + kConvRun - 1) / kConvRun;
  s.runs = batch * s.runs_per_sample;
  return s;
}

__device__ __forceinline__ float activate(float u, bool silu) {
  return silu ? u * ssm::sigmoid(u) : u;
}

template <typename T, int K>
__global__ void __launch_bounds__(kConvChannels* kConvRuns)
    causal_conv1d_forward_kernel(const T* __restrict__ x, ParamVector weight, ParamVector bias,
                                 const int32_t* __restrict__ position_ids, T* __restrict__ y,
                                 ConvShape sh, bool silu) {
  const int64_t ch = int64_t(blockIdx.x) * kConvChannels + threadIdx.x;
  const int64_t run = int64_t(blockIdx.y) * kConvRuns + threadIdx.y;
  if (ch >= sh.channels || run >= sh.runs) return;
  const int64_t b = run / sh.runs_per_sample, s0 = (run % sh.runs_per_sample) * kConvRun;
  const int64_t s1 = std::min(sh.seq, s0 + kConvRun), C = sh.channels;
  float w[K];                          // w[m] = weight[ch, K - 1 - m]: the tap m rows back
  float prev[K > 1 ? K - 1 : 1] = {};  // prev[m] = x[s - 1 - m]
#pragma unroll
  for (int m = 0; m < K; ++m) w[m] = param_at(weight, ch * K + K - 1 - m);
#pragma unroll
  for (int m = 0; m + 1 < K; ++m)
    if (s0 - 1 - m >= 0) prev[m] = to_float(x[(b * sh.seq + s0 - 1 - m) * C + ch]);
  const float bv = param_at(bias, ch);
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t row = b * sh.seq + s;
    const int64_t pos = position_ids ? position_ids[row] : s;
    const float cur = to_float(x[row * C + ch]);
    float u = bv + w[0] * cur;
#pragma unroll
    for (int m = 1; m < K; ++m)
      if (m <= pos) u += w[m] * prev[m - 1];
    y[row * C + ch] = from_float<T>(activate(u, silu));
#pragma unroll
    for (int m = K - 2; m > 0; --m) prev[m] = prev[m - 1];
    if (K > 1) prev[0] = cur;
  }
}

template <typename T, int K>
__global__ void __launch_bounds__(kConvChannels* kConvRuns)
    causal_conv1d_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                  ParamVector weight, ParamVector bias,
                                  const int32_t* __restrict__ position_ids, T* __restrict__ dx,
                                  float* __restrict__ partials, ConvShape sh, bool silu) {
  __shared__ float sums[kConvRuns][kConvChannels][K + 1];
  const int64_t ch = int64_t(blockIdx.x) * kConvChannels + threadIdx.x;
  const int64_t run = int64_t(blockIdx.y) * kConvRuns + threadIdx.y;
  const bool active = ch < sh.channels && run < sh.runs;
  float dw[K] = {};  // dw[m]: the gradient of w[m] (weight[ch, K - 1 - m])
  float db = 0.0f;
  if (active) {
    const int64_t b = run / sh.runs_per_sample, s0 = (run % sh.runs_per_sample) * kConvRun;
    const int64_t s1 = std::min(sh.seq, s0 + kConvRun), C = sh.channels;
    float w[K];
    float prev[K > 1 ? K - 1 : 1] = {};
    float dx_window[K] = {};  // dx_window[q]: the partial dx of row o - q
#pragma unroll
    for (int m = 0; m < K; ++m) w[m] = param_at(weight, ch * K + K - 1 - m);
#pragma unroll
    for (int m = 0; m + 1 < K; ++m)
      if (s0 - 1 - m >= 0) prev[m] = to_float(x[(b * sh.seq + s0 - 1 - m) * C + ch]);
    const float bv = param_at(bias, ch);
    for (int64_t o = s0; o < s1 + K - 1; ++o) {
#pragma unroll
      for (int q = K - 1; q > 0; --q) dx_window[q] = dx_window[q - 1];
      dx_window[0] = 0.0f;
      if (o < sh.seq) {
        const int64_t row = b * sh.seq + o;
        const int64_t pos = position_ids ? position_ids[row] : o;
        const float cur = to_float(x[row * C + ch]);
        float u = bv + w[0] * cur;
#pragma unroll
        for (int m = 1; m < K; ++m)
          if (m <= pos) u += w[m] * prev[m - 1];
        float du = to_float(dy[row * C + ch]);
        if (silu) {
          const float sg = ssm::sigmoid(u);
          du *= sg * (1.0f + u * (1.0f - sg));
        }
        dx_window[0] = w[0] * du;
#pragma unroll
        for (int m = 1; m < K; ++m)
          if (m <= pos) dx_window[m] += w[m] * du;
        if (o < s1) {
          dw[0] += du * cur;
#pragma unroll
          for (int m = 1; m < K; ++m)
            if (m <= pos) dw[m] += du * prev[m - 1];
          db += du;
        }
#pragma unroll
        for (int m = K - 2; m > 0; --m) prev[m] = prev[m - 1];
        if (K > 1) prev[0] = cur;
      }
      const int64_t done = o - (K - 1);  // this row has all its dx terms now
      if (done >= s0) dx[(b * sh.seq + done) * C + ch] = from_float<T>(dx_window[K - 1]);
    }
  }
#pragma unroll
  for (int m = 0; m < K; ++m) sums[threadIdx.y][threadIdx.x][K - 1 - m] = dw[m];
  sums[threadIdx.y][threadIdx.x][K] = db;
  __syncthreads();
  if (threadIdx.y == 0 && ch < sh.channels) {
    float* out = partials + (int64_t(blockIdx.y) * sh.channels + ch) * (K + 1);
#pragma unroll
    for (int q = 0; q <= K; ++q) {
      float s = 0.0f;
#pragma unroll
      for (int r = 0; r < kConvRuns; ++r) s += sums[r][threadIdx.x][q];
      out[q] = s;
    }
  }
}

// dweight[c, k] += sum over row blocks of partials[rb, c, k]; dbias[c] likewise with k = K.
__global__ void causal_conv1d_weight_grad_kernel(const float* __restrict__ partials,
                                                 int64_t row_blocks, int64_t channels, int K,
                                                 float* __restrict__ dweight,
                                                 float* __restrict__ dbias) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t width = K + 1;
  if (e >= channels * width) return;
  float s = 0.0f;
  for (int64_t rb = 0; rb < row_blocks; ++rb) s += partials[rb * channels * width + e];
  const int64_t ch = e / width, q = e % width;
  if (q < K)
    dweight[ch * K + q] += s;
  else if (dbias)
    dbias[ch] += s;
}

// x and y may share memory (each thread reads its x before writing its y): no __restrict__.
template <typename T, typename U>
__global__ void causal_conv1d_step_kernel(const T* x, ParamVector weight, ParamVector bias,
                                          U* __restrict__ state, T* y, int64_t batch,
                                          int64_t channels, int K, bool silu) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= batch * channels) return;
  const int64_t b = idx / channels, ch = idx % channels;
  U* st = state + b * (K - 1) * channels + ch;
  float u = param_at(bias, ch);
  for (int k = 0; k + 1 < K; ++k) {
    const U v = st[k * channels];
    u += param_at(weight, ch * K + k) * to_float(v);
    if (k > 0) st[(k - 1) * channels] = v;
  }
  const float xv = to_float(x[idx]);
  u += param_at(weight, ch * K + K - 1) * xv;
  if (K > 1) st[(K - 2) * channels] = from_float<U>(xv);
  y[idx] = from_float<T>(activate(u, silu));
}

template <typename T, typename U>
__global__ void causal_conv1d_final_state_kernel(const T* __restrict__ x, U* __restrict__ state,
                                                 int64_t batch, int64_t seq, int64_t channels,
                                                 int taps) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= batch * taps * channels) return;
  const int64_t ch = idx % channels, k = (idx / channels) % taps, b = idx / (channels * taps);
  const int64_t s = seq - taps + k;
  state[idx] = from_float<U>(s >= 0 ? to_float(x[(b * seq + s) * channels + ch]) : 0.0f);
}

// Calls f(std::integral_constant<int, K>{}) for the width K in 1..kMaxConvWidth.
template <typename F>
void dispatch_width(int64_t K, F&& f) {
  switch (K) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    case 8:
      return f(std::integral_constant<int, 8>{});
    default:
      MEGATON_CHECK(false, "causal_conv1d: kernel width {} (the CUDA kernels take 1 to {})", K,
                    kMaxConvWidth);
  }
}

dim3 conv_grid(const ConvShape& sh) {
  return dim3(unsigned((sh.channels + kConvChannels - 1) / kConvChannels),
              unsigned((sh.runs + kConvRuns - 1) / kConvRuns));
}

void check_conv_grid(const ConvShape& sh, const char* op) {
  MEGATON_CHECK((sh.runs + kConvRuns - 1) / kConvRuns < 65536,
                "{}: {} rows in runs of {} exceed the CUDA grid", op, sh.runs * kConvRun, kConvRun);
}

}  // namespace

void causal_conv1d_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t batch,
                           bool silu, Tensor& y, const Tensor& position_ids) {
  const ConvShape sh = conv_shape(x.dim(0), batch, x.dim(1));
  if (x.numel() == 0) return;
  check_conv_grid(sh, "causal_conv1d_forward");
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_width(weight.dim(-1), [&](auto width) {
      constexpr int K = decltype(width)::value;
      causal_conv1d_forward_kernel<T, K>
          <<<conv_grid(sh), dim3(kConvChannels, kConvRuns), 0, compute_stream()>>>(
              static_cast<const T*>(x.raw()), ssm::param_vector(weight), ssm::param_vector(bias),
              positions, static_cast<T*>(y.raw()), sh, silu);
    });
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                            const Tensor& bias, int64_t batch, bool silu, Tensor& dx,
                            Tensor& dweight_acc, Tensor& dbias_acc, const Tensor& position_ids) {
  const ConvShape sh = conv_shape(x.dim(0), batch, x.dim(1));
  if (x.numel() == 0) return;
  check_conv_grid(sh, "causal_conv1d_backward");
  const int64_t K = weight.dim(-1);
  const int64_t row_blocks = (sh.runs + kConvRuns - 1) / kConvRuns;
  Tensor partials = Tensor::empty({row_blocks, sh.channels, K + 1}, DType::F32, Device::CUDA);
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_width(K, [&](auto width) {
      constexpr int kWidth = decltype(width)::value;
      causal_conv1d_backward_kernel<T, kWidth>
          <<<conv_grid(sh), dim3(kConvChannels, kConvRuns), 0, compute_stream()>>>(
              static_cast<const T*>(dy.raw()), static_cast<const T*>(x.raw()),
              ssm::param_vector(weight), ssm::param_vector(bias), positions,
              static_cast<T*>(dx.raw()), partials.f32(), sh, silu);
    });
  });
  MEGATON_CUDA_CHECK_LAUNCH();
  constexpr int kThreads = 256;
  const int64_t items = sh.channels * (K + 1);
  causal_conv1d_weight_grad_kernel<<<unsigned((items + kThreads - 1) / kThreads), kThreads, 0,
                                     compute_stream()>>>(
      partials.f32(), row_blocks, sh.channels, int(K), dweight_acc.f32(),
      dbias_acc.defined() && dbias_acc.numel() > 0 ? dbias_acc.f32() : nullptr);
  MEGATON_CUDA_CHECK_LAUNCH();
}

void causal_conv1d_step(const Tensor& x, const Tensor& weight, const Tensor& bias, bool silu,
                        Tensor& conv_state, Tensor& y) {
  const int64_t batch = x.dim(0), channels = x.dim(1), K = weight.dim(-1);
  if (x.numel() == 0) return;
  constexpr int kThreads = 256;
  detail::dispatch_float(x.dtype(), [&](auto x_tag) {
    detail::dispatch_float(conv_state.dtype(), [&](auto s_tag) {
      using T = decltype(x_tag);
      using U = decltype(s_tag);
      causal_conv1d_step_kernel<T, U>
          <<<unsigned((batch * channels + kThreads - 1) / kThreads), kThreads, 0,
             compute_stream()>>>(static_cast<const T*>(x.raw()), ssm::param_vector(weight),
                                 ssm::param_vector(bias), static_cast<U*>(conv_state.raw()),
                                 static_cast<T*>(y.raw()), batch, channels, int(K), silu);
    });
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

void causal_conv1d_final_state(const Tensor& x, int64_t batch, Tensor& conv_state) {
  const int64_t channels = x.dim(1), taps = conv_state.dim(1);
  const int64_t seq = batch > 0 ? x.dim(0) / batch : 0;
  if (conv_state.numel() == 0) return;
  constexpr int kThreads = 256;
  detail::dispatch_float(x.dtype(), [&](auto x_tag) {
    detail::dispatch_float(conv_state.dtype(), [&](auto s_tag) {
      using T = decltype(x_tag);
      using U = decltype(s_tag);
      const int64_t items = batch * taps * channels;
      causal_conv1d_final_state_kernel<T, U>
          <<<unsigned((items + kThreads - 1) / kThreads), kThreads, 0, compute_stream()>>>(
              static_cast<const T*>(x.raw()), static_cast<U*>(conv_state.raw()), batch, seq,
              channels, int(taps));
    });
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
