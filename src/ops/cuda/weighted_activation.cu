// Row-weighted SwiGLU, exact GeLU and squared ReLU, forward and backward, on the GPU: the MoE
// experts' activation with the routing probabilities applied (semantics: ops.h; CPU twin:
// ops/cpu/activation.cpp; Megatron's weighted_swiglu / weighted_swiglu_back in
// fusions/fused_bias_swiglu.py, weighted_squared_relu / weighted_squared_relu_back in
// fusions/fused_weighted_squared_relu.py). One warp per row: the backward sums each row's
// dweights = <dy, act(x)> in lane-strided fp32 partials and the warp's butterfly, a fixed
// order (the same bits on every run). x, y, dy, dx share one dtype (F32, BF16 or F16),
// weights and dweights are F32; the math is fp32.
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
using detail::kPackElems;
using detail::load_pack;
using detail::Pack;
using detail::pack_aligned;
using detail::store_pack;
using detail::to_float;

constexpr int kThreads = 256, kRowsPerBlock = kThreads / 32;

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }
// The activations as the forward computes them, so backward's recomputed y has its bits.
__device__ __forceinline__ float swiglu_of(float g, float u) { return g * sigmoid(g) * u; }

// Row r of x ([R, 2F] for SwiGLU: gate then up; [R, F] for GeLU and squared ReLU) ->
// y[r, :] = act * w[r]. N divides F; F = cols.
template <typename T, int N, Activation A>
__global__ void weighted_act_forward_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                            T* __restrict__ y, int64_t rows, int64_t cols) {
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const float wr = w[r];
  constexpr bool kGated = A == Activation::Swiglu;
  const T* xr = x + r * (kGated ? 2 * cols : cols);
  for (int64_t j = int64_t(lane) * N; j < cols; j += 32 * N) {
    Pack<T, N> a = load_pack<N>(xr + j), yp;
    Pack<T, N> b;
    if constexpr (kGated) b = load_pack<N>(xr + cols + j);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float act;
      if constexpr (kGated)
        act = swiglu_of(to_float(a.v[k]), to_float(b.v[k]));
      else
        act = activation_of<A>(to_float(a.v[k]));
      yp.v[k] = from_float<T>(act * wr);
    }
    store_pack<N>(y + r * cols + j, yp);
  }
}

// dx = act'(x) (dy w[r]); dw[r] = sum_f dy act(x) (overwritten); y (may be null) = act w[r].
template <typename T, int N, Activation A>
__global__ void weighted_act_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                             const float* __restrict__ w, T* __restrict__ dx,
                                             float* __restrict__ dw, T* __restrict__ y,
                                             int64_t rows, int64_t cols) {
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const float wr = w[r];
  constexpr bool kGated = A == Activation::Swiglu;
  const int64_t x_row = r * (kGated ? 2 * cols : cols);
  float dot = 0.0f;
  for (int64_t j = int64_t(lane) * N; j < cols; j += 32 * N) {
    Pack<T, N> a = load_pack<N>(x + x_row + j), dyp = load_pack<N>(dy + r * cols + j);
    Pack<T, N> b, da, db, yp;
    if constexpr (kGated) b = load_pack<N>(x + x_row + cols + j);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float g = to_float(dyp.v[k]), d = g * wr;
      float act;
      if constexpr (kGated) {
        const float v = to_float(a.v[k]), u = to_float(b.v[k]), s = sigmoid(v);
        act = swiglu_of(v, u);
        da.v[k] = from_float<T>(d * u * s * (1.0f + v * (1.0f - s)));
        db.v[k] = from_float<T>(d * v * s);
      } else {
        const float v = to_float(a.v[k]);
        act = activation_of<A>(v);
        da.v[k] = from_float<T>(d * activation_grad_of<A>(v));
      }
      dot += g * act;
      yp.v[k] = from_float<T>(act * wr);
    }
    store_pack<N>(dx + x_row + j, da);
    if constexpr (kGated) store_pack<N>(dx + x_row + cols + j, db);
    if (y != nullptr) store_pack<N>(y + r * cols + j, yp);
  }
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (lane == 0) dw[r] = dot;
}

template <typename T>
bool packs_aligned(std::initializer_list<const T*> ptrs) {
  for (const T* p : ptrs)
    if (p != nullptr && !pack_aligned<kPackElems<T>>(p)) return false;
  return true;
}

// Door checks: x [R, 2F] (SwiGLU) or [R, F], out (y or dy) [R, F] of x's dtype, weights F32
// with R elements. Returns {R, F}.
std::pair<int64_t, int64_t> weighted_shape(const Tensor& x, const Tensor& out,
                                           const Tensor& weights, bool swiglu, const char* op,
                                           const char* out_name) {
  detail::check_float(x, op, "x");
  detail::check_float(out, op, out_name);
  detail::check_same_dtype(out, x, op, out_name, "x");
  MEGATON_CHECK(x.ndim() >= 1 && (!swiglu || x.dim(-1) % 2 == 0), "{}: x must be [R, {}], got {}",
                op, swiglu ? "2F" : "F", shape_str(x.shape()));
  Shape want = x.shape();
  if (swiglu) want.back() /= 2;
  MEGATON_CHECK(out.shape() == want, "{}: {} {} must be {} for x {}", op, out_name,
                shape_str(out.shape()), shape_str(want), shape_str(x.shape()));
  const int64_t cols = want.back(), rows = cols ? out.numel() / cols : 0;
  detail::check_dtype(weights, DType::F32, op, "weights");
  MEGATON_CHECK(weights.numel() == rows, "{}: weights {} must have {} elements, one per row", op,
                shape_str(weights.shape()), rows);
  return {rows, cols};
}

template <Activation A>
void weighted_forward(const Tensor& x, const Tensor& weights, Tensor& y, const char* op) {
  auto [rows, cols] = weighted_shape(x, y, weights, A == Activation::Swiglu, op, "y");
  if (rows * cols == 0) return;
  const unsigned blocks = unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  detail::dispatch_float(x.dtype(), [&, rows = rows, cols = cols](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* xp = static_cast<const T*>(x.raw());
    T* yp = static_cast<T*>(y.raw());
    if (cols % kN == 0 && packs_aligned<T>({xp, yp}))
      weighted_act_forward_kernel<T, kN, A>
          <<<blocks, kThreads, 0, compute_stream()>>>(xp, weights.f32(), yp, rows, cols);
    else
      weighted_act_forward_kernel<T, 1, A>
          <<<blocks, kThreads, 0, compute_stream()>>>(xp, weights.f32(), yp, rows, cols);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

template <Activation A>
void weighted_backward(const Tensor& dy, const Tensor& x, const Tensor& weights, Tensor& dx,
                       Tensor& dweights, Tensor* y, const char* op) {
  auto [rows, cols] = weighted_shape(x, dy, weights, A == Activation::Swiglu, op, "dy");
  detail::check_float(dx, op, "dx");
  detail::check_same_dtype(dx, x, op, "dx", "x");
  detail::check_same_shape(dx, x, op, "dx", "x");
  detail::check_dtype(dweights, DType::F32, op, "dweights");
  MEGATON_CHECK(dweights.numel() == rows, "{}: dweights {} must have {} elements", op,
                shape_str(dweights.shape()), rows);
  if (y) {
    detail::check_float(*y, op, "y");
    detail::check_same_dtype(*y, x, op, "y", "x");
    detail::check_same_shape(*y, dy, op, "y", "dy");
  }
  if (rows == 0) return;
  if (cols == 0) {  // empty rows: dweights are empty sums
    dweights.zero();
    return;
  }
  const unsigned blocks = unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  detail::dispatch_float(x.dtype(), [&, rows = rows, cols = cols](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* dyp = static_cast<const T*>(dy.raw());
    const T* xp = static_cast<const T*>(x.raw());
    T* dxp = static_cast<T*>(dx.raw());
    T* yp = y ? static_cast<T*>(y->raw()) : nullptr;
    if (cols % kN == 0 && packs_aligned<T>({dyp, xp, dxp, yp}))
      weighted_act_backward_kernel<T, kN, A><<<blocks, kThreads, 0, compute_stream()>>>(
          dyp, xp, weights.f32(), dxp, dweights.f32(), yp, rows, cols);
    else
      weighted_act_backward_kernel<T, 1, A><<<blocks, kThreads, 0, compute_stream()>>>(
          dyp, xp, weights.f32(), dxp, dweights.f32(), yp, rows, cols);
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void weighted_swiglu_forward(const Tensor& x, const Tensor& weights, Tensor& y) {
  weighted_forward<Activation::Swiglu>(x, weights, y, "weighted_swiglu_forward");
}

void weighted_swiglu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights, Tensor& dx,
                              Tensor& dweights, Tensor* y) {
  weighted_backward<Activation::Swiglu>(dy, x, weights, dx, dweights, y,
                                        "weighted_swiglu_backward");
}

void weighted_gelu_forward(const Tensor& x, const Tensor& weights, Tensor& y) {
  weighted_forward<Activation::Gelu>(x, weights, y, "weighted_gelu_forward");
}

void weighted_gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights, Tensor& dx,
                            Tensor& dweights, Tensor* y) {
  weighted_backward<Activation::Gelu>(dy, x, weights, dx, dweights, y, "weighted_gelu_backward");
}

void weighted_squared_relu_forward(const Tensor& x, const Tensor& weights, Tensor& y) {
  weighted_forward<Activation::SquaredRelu>(x, weights, y, "weighted_squared_relu_forward");
}

void weighted_squared_relu_backward(const Tensor& dy, const Tensor& x, const Tensor& weights,
                                    Tensor& dx, Tensor& dweights, Tensor* y) {
  weighted_backward<Activation::SquaredRelu>(dy, x, weights, dx, dweights, y,
                                             "weighted_squared_relu_backward");
}

}  // namespace megaton::ops::cuda
