// SwiGLU, exact (erf) GeLU, squared ReLU and the sigmoid row gate, forward and backward, on
// the GPU (semantics: ops.h, CPU twin: ops/cpu/activation.cpp). Inputs and outputs share one
// dtype (F32, BF16 or F16); the math is fp32. Grid-stride loops over 16-byte packs when the rows
// allow it, else over single elements.
#include <initializer_list>
#include <utility>

#include "ops/cuda/activation_math.cuh"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::Activation;
using detail::activation_grad_of;
using detail::activation_of;
using detail::compute_stream;
using detail::from_float;
using detail::grid_for;
using detail::kPackElems;
using detail::load_pack;
using detail::Pack;
using detail::pack_aligned;
using detail::store_pack;
using detail::to_float;

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// Same dtype and, unless said otherwise, shape.
void check_pair(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name,
                const char* op) {
  detail::check_float(t, op, name);
  detail::check_same_dtype(t, ref, op, name, ref_name);
}

// x [T, 2F] and y [T, F] (any leading dimensions, equal in both). Returns {T, F}.
std::pair<int64_t, int64_t> swiglu_shape(const Tensor& x, const Tensor& y, const char* op,
                                         const char* y_name) {
  MEGATON_CHECK(x.ndim() >= 1 && x.dim(-1) % 2 == 0,
                "{}: x must be [T, 2F] with an even last dim, got {}", op, shape_str(x.shape()));
  Shape want = x.shape();
  want.back() /= 2;
  MEGATON_CHECK(y.shape() == want, "{}: {} {} must be {} for x {}", op, y_name,
                shape_str(y.shape()), shape_str(want), shape_str(x.shape()));
  int64_t ffn = want.back();
  return {ffn ? y.numel() / ffn : 0, ffn};
}

// ---- kernels ----

// y[t, j] = silu(gate) * up, gate = x[t, j], up = x[t, F + j]; N divides F.
template <typename T, int N>
__global__ void swiglu_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                                      int64_t ffn) {
  const int64_t packs_per_row = ffn / N, packs = rows * packs_per_row;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = p / packs_per_row, j = (p - t * packs_per_row) * N;
    const T* gate = x + t * 2 * ffn + j;
    Pack<T, N> gp = load_pack<N>(gate), up = load_pack<N>(gate + ffn), yp;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float g = to_float(gp.v[k]);
      yp.v[k] = from_float<T>(g * sigmoid(g) * to_float(up.v[k]));
    }
    store_pack<N>(y + t * ffn + j, yp);
  }
}

// d silu(g)/dg = s (1 + g (1 - s)), s = sigmoid(g). y (may be null): the forward output,
// computed as swiglu_forward_kernel does, for the same bits.
template <typename T, int N>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                       T* __restrict__ dx, T* __restrict__ y, int64_t rows,
                                       int64_t ffn) {
  const int64_t packs_per_row = ffn / N, packs = rows * packs_per_row;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = p / packs_per_row, j = (p - t * packs_per_row) * N;
    const int64_t gate_at = t * 2 * ffn + j;
    Pack<T, N> gp = load_pack<N>(x + gate_at), up = load_pack<N>(x + gate_at + ffn);
    Pack<T, N> dyp = load_pack<N>(dy + t * ffn + j), dgp, dup, yp;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float g = to_float(gp.v[k]), u = to_float(up.v[k]), d = to_float(dyp.v[k]);
      float s = sigmoid(g);
      dgp.v[k] = from_float<T>(d * u * s * (1.0f + g * (1.0f - s)));
      dup.v[k] = from_float<T>(d * g * s);
      yp.v[k] = from_float<T>(g * s * u);
    }
    store_pack<N>(dx + gate_at, dgp);
    store_pack<N>(dx + gate_at + ffn, dup);
    if (y != nullptr) store_pack<N>(y + t * ffn + j, yp);
  }
}

// y = act(x), act exact GeLU or squared ReLU (activation_math.cuh); N divides n.
template <typename T, int N, Activation A>
__global__ void pointwise_activation_forward_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                    int64_t n) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N; i < n;
       i += int64_t(gridDim.x) * blockDim.x * N) {
    Pack<T, N> xp = load_pack<N>(x + i), yp;
#pragma unroll
    for (int k = 0; k < N; ++k) yp.v[k] = from_float<T>(activation_of<A>(to_float(xp.v[k])));
    store_pack<N>(y + i, yp);
  }
}

// dx = dy act'(x). y (may be null): the forward output, computed as the forward kernel does.
template <typename T, int N, Activation A>
__global__ void pointwise_activation_backward_kernel(const T* __restrict__ dy,
                                                     const T* __restrict__ x, T* __restrict__ dx,
                                                     T* __restrict__ y, int64_t n) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N; i < n;
       i += int64_t(gridDim.x) * blockDim.x * N) {
    Pack<T, N> xp = load_pack<N>(x + i), dyp = load_pack<N>(dy + i), dxp, yp;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float v = to_float(xp.v[k]);
      dxp.v[k] = from_float<T>(to_float(dyp.v[k]) * activation_grad_of<A>(v));
      yp.v[k] = from_float<T>(activation_of<A>(v));
    }
    store_pack<N>(dx + i, dxp);
    if (y != nullptr) store_pack<N>(y + i, yp);
  }
}

// y[t, h] = x[t, h] * sigmoid(logits[t]); N divides hidden.
template <typename T, int N>
__global__ void sigmoid_gate_forward_kernel(const T* __restrict__ x, const float* __restrict__ logits,
                                            T* __restrict__ y, int64_t rows, int64_t hidden) {
  const int64_t packs_per_row = hidden / N, packs = rows * packs_per_row;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = p / packs_per_row, at = t * hidden + (p - t * packs_per_row) * N;
    const float s = sigmoid(logits[t]);
    Pack<T, N> xp = load_pack<N>(x + at), yp;
#pragma unroll
    for (int k = 0; k < N; ++k) yp.v[k] = from_float<T>(to_float(xp.v[k]) * s);
    store_pack<N>(y + at, yp);
  }
}

// One warp per row: dx = dy s, dlogits[t] = s (1 - s) <dy[t], x[t]> (fixed summation
// order: lane-strided partials, then the warp's butterfly).
template <typename T, int N>
__global__ void sigmoid_gate_backward_kernel(const T* dy, const T* __restrict__ x,
                                             const float* __restrict__ logits, T* dx,
                                             float* __restrict__ dlogits, int64_t rows,
                                             int64_t hidden) {
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= rows) return;
  const int lane = threadIdx.x & 31;
  const float s = sigmoid(logits[t]);
  float dot = 0.0f;
  for (int64_t h = int64_t(lane) * N; h < hidden; h += 32 * N) {
    const int64_t at = t * hidden + h;
    Pack<T, N> dyp = load_pack<N>(dy + at), xp = load_pack<N>(x + at), dxp;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float d = to_float(dyp.v[k]);
      dot += d * to_float(xp.v[k]);
      dxp.v[k] = from_float<T>(d * s);
    }
    store_pack<N>(dx + at, dxp);
  }
  dot = detail::warp_sum(dot);
  if (lane == 0) dlogits[t] = s * (1.0f - s) * dot;
}

// Whether every pointer may be read or written in 16-byte packs.
template <typename T>
bool packs_aligned(std::initializer_list<const T*> ptrs) {
  for (const T* p : ptrs)
    if (!pack_aligned<kPackElems<T>>(p)) return false;
  return true;
}

}  // namespace

void swiglu_forward(const Tensor& x, Tensor& y) {
  const char* op = "swiglu_forward";
  detail::check_float(x, op, "x");
  check_pair(y, "y", x, "x", op);
  auto [rows, ffn] = swiglu_shape(x, y, op, "y");
  if (rows * ffn == 0) return;
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* xp = static_cast<const T*>(x.raw());
    T* yp = static_cast<T*>(y.raw());
    if (ffn % kN == 0 && packs_aligned<T>({xp, yp})) {
      swiglu_forward_kernel<T, kN>
          <<<grid_for(rows * ffn / kN, kThreads), kThreads, 0, compute_stream()>>>(xp, yp, rows,
                                                                                   ffn);
    } else {
      swiglu_forward_kernel<T, 1>
          <<<grid_for(rows * ffn, kThreads), kThreads, 0, compute_stream()>>>(xp, yp, rows, ffn);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y) {
  const char* op = "swiglu_backward";
  detail::check_float(x, op, "x");
  check_pair(dy, "dy", x, "x", op);
  check_pair(dx, "dx", x, "x", op);
  auto [rows, ffn] = swiglu_shape(x, dy, op, "dy");
  detail::check_same_shape(dx, x, op, "dx", "x");
  if (y) {
    check_pair(*y, "y", x, "x", op);
    detail::check_same_shape(*y, dy, op, "y", "dy");
  }
  if (rows * ffn == 0) return;
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* dyp = static_cast<const T*>(dy.raw());
    const T* xp = static_cast<const T*>(x.raw());
    T* dxp = static_cast<T*>(dx.raw());
    T* yp = y ? static_cast<T*>(y->raw()) : nullptr;
    if (ffn % kN == 0 && packs_aligned<T>({dyp, xp, dxp}) && (!yp || packs_aligned<T>({yp}))) {
      swiglu_backward_kernel<T, kN>
          <<<grid_for(rows * ffn / kN, kThreads), kThreads, 0, compute_stream()>>>(
              dyp, xp, dxp, yp, rows, ffn);
    } else {
      swiglu_backward_kernel<T, 1>
          <<<grid_for(rows * ffn, kThreads), kThreads, 0, compute_stream()>>>(dyp, xp, dxp, yp,
                                                                              rows, ffn);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

namespace {

template <Activation A>
void pointwise_activation_forward(const Tensor& x, Tensor& y, const char* op) {
  detail::check_float(x, op, "x");
  check_pair(y, "y", x, "x", op);
  detail::check_same_shape(y, x, op, "y", "x");
  const int64_t n = x.numel();
  if (n == 0) return;
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* xp = static_cast<const T*>(x.raw());
    T* yp = static_cast<T*>(y.raw());
    if (n % kN == 0 && packs_aligned<T>({xp, yp})) {
      pointwise_activation_forward_kernel<T, kN, A>
          <<<grid_for(n / kN, kThreads), kThreads, 0, compute_stream()>>>(xp, yp, n);
    } else {
      pointwise_activation_forward_kernel<T, 1, A>
          <<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(xp, yp, n);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

template <Activation A>
void pointwise_activation_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y,
                                   const char* op) {
  detail::check_float(x, op, "x");
  check_pair(dy, "dy", x, "x", op);
  check_pair(dx, "dx", x, "x", op);
  detail::check_same_shape(dy, x, op, "dy", "x");
  detail::check_same_shape(dx, x, op, "dx", "x");
  if (y) {
    check_pair(*y, "y", x, "x", op);
    detail::check_same_shape(*y, x, op, "y", "x");
  }
  const int64_t n = x.numel();
  if (n == 0) return;
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* dyp = static_cast<const T*>(dy.raw());
    const T* xp = static_cast<const T*>(x.raw());
    T* dxp = static_cast<T*>(dx.raw());
    T* yp = y ? static_cast<T*>(y->raw()) : nullptr;
    if (n % kN == 0 && packs_aligned<T>({dyp, xp, dxp}) && (!yp || packs_aligned<T>({yp}))) {
      pointwise_activation_backward_kernel<T, kN, A>
          <<<grid_for(n / kN, kThreads), kThreads, 0, compute_stream()>>>(dyp, xp, dxp, yp, n);
    } else {
      pointwise_activation_backward_kernel<T, 1, A>
          <<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(dyp, xp, dxp, yp, n);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void gelu_forward(const Tensor& x, Tensor& y) {
  pointwise_activation_forward<Activation::Gelu>(x, y, "gelu_forward");
}

void gelu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y) {
  pointwise_activation_backward<Activation::Gelu>(dy, x, dx, y, "gelu_backward");
}

void squared_relu_forward(const Tensor& x, Tensor& y) {
  pointwise_activation_forward<Activation::SquaredRelu>(x, y, "squared_relu_forward");
}

void squared_relu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, Tensor* y) {
  pointwise_activation_backward<Activation::SquaredRelu>(dy, x, dx, y, "squared_relu_backward");
}

// x [T, H] and logits (fp32, T elements). Returns {T, H}.
static std::pair<int64_t, int64_t> gate_shape(const Tensor& x, const Tensor& logits,
                                              const char* op) {
  MEGATON_CHECK(x.ndim() == 2, "{}: x must be [T, H], got {}", op, shape_str(x.shape()));
  detail::check_dtype(logits, DType::F32, op, "logits");
  MEGATON_CHECK(logits.numel() == x.dim(0), "{}: logits {} must have {} elements (x {})", op,
                shape_str(logits.shape()), x.dim(0), shape_str(x.shape()));
  return {x.dim(0), x.dim(1)};
}

void sigmoid_gate_forward(const Tensor& x, const Tensor& logits, Tensor& y) {
  const char* op = "sigmoid_gate_forward";
  detail::check_float(x, op, "x");
  check_pair(y, "y", x, "x", op);
  detail::check_same_shape(y, x, op, "y", "x");
  auto [rows, hidden] = gate_shape(x, logits, op);
  if (rows * hidden == 0) return;
  detail::dispatch_float(x.dtype(), [&, rows = rows, hidden = hidden](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* xp = static_cast<const T*>(x.raw());
    const float* lp = logits.f32();
    T* yp = static_cast<T*>(y.raw());
    if (hidden % kN == 0 && packs_aligned<T>({xp, yp})) {
      sigmoid_gate_forward_kernel<T, kN><<<grid_for(rows * hidden / kN, kThreads), kThreads, 0,
                                           compute_stream()>>>(xp, lp, yp, rows, hidden);
    } else {
      sigmoid_gate_forward_kernel<T, 1><<<grid_for(rows * hidden, kThreads), kThreads, 0,
                                          compute_stream()>>>(xp, lp, yp, rows, hidden);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void sigmoid_gate_backward(const Tensor& dy, const Tensor& x, const Tensor& logits, Tensor& dx,
                           Tensor& dlogits) {
  const char* op = "sigmoid_gate_backward";
  detail::check_float(x, op, "x");
  check_pair(dy, "dy", x, "x", op);
  check_pair(dx, "dx", x, "x", op);
  detail::check_same_shape(dy, x, op, "dy", "x");
  detail::check_same_shape(dx, x, op, "dx", "x");
  auto [rows, hidden] = gate_shape(x, logits, op);
  detail::check_dtype(dlogits, DType::F32, op, "dlogits");
  MEGATON_CHECK(dlogits.numel() == rows, "{}: dlogits {} must have {} elements", op,
                shape_str(dlogits.shape()), rows);
  if (rows == 0) return;
  constexpr int kWarps = kThreads / 32;
  const unsigned blocks = unsigned((rows + kWarps - 1) / kWarps);
  detail::dispatch_float(x.dtype(), [&, rows = rows, hidden = hidden](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* dyp = static_cast<const T*>(dy.raw());
    const T* xp = static_cast<const T*>(x.raw());
    T* dxp = static_cast<T*>(dx.raw());
    const float* lp = logits.f32();
    float* dlp = dlogits.f32();
    if (hidden % kN == 0 && packs_aligned<T>({dyp, xp, dxp})) {
      sigmoid_gate_backward_kernel<T, kN>
          <<<blocks, kThreads, 0, compute_stream()>>>(dyp, xp, lp, dxp, dlp, rows, hidden);
    } else {
      sigmoid_gate_backward_kernel<T, 1>
          <<<blocks, kThreads, 0, compute_stream()>>>(dyp, xp, lp, dxp, dlp, rows, hidden);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace megaton::ops::cuda
