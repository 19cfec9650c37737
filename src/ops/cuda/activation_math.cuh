// The non-gated MLP activations' math on the device (exact GeLU, squared ReLU), shared by the
// plain kernels (activation.cu) and the row-weighted ones (weighted_activation.cu), so that
// both compute the same bits. fp32 in and out.
#pragma once
#include <cuda_runtime.h>

namespace megaton::ops::cuda::detail {

// The MLP activation a kernel computes (SwiGLU is gated: its math stays with its kernels).
enum class Activation { Swiglu, Gelu, SquaredRelu };

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// act(v): gelu(v) = v Phi(v) = 0.5 v (1 + erf(v / sqrt 2)); squared_relu(v) = relu(v)^2
// (Megatron's activations.squared_relu).
template <Activation A>
__device__ __forceinline__ float activation_of(float v) {
  static_assert(A != Activation::Swiglu, "SwiGLU is gated: two inputs");
  if constexpr (A == Activation::Gelu) {
    return 0.5f * v * (1.0f + erff(v * kInvSqrt2));
  } else {
    const float r = v > 0.0f ? v : 0.0f;
    return r * r;
  }
}

// act'(v): gelu'(v) = Phi(v) + v phi(v), phi the standard normal density;
// squared_relu'(v) = 2 relu(v) (Megatron's _squared_relu_back).
template <Activation A>
__device__ __forceinline__ float activation_grad_of(float v) {
  static_assert(A != Activation::Swiglu, "SwiGLU is gated: two inputs");
  if constexpr (A == Activation::Gelu) {
    const float cdf = 0.5f * (1.0f + erff(v * kInvSqrt2));
    const float pdf = kInvSqrt2Pi * expf(-0.5f * v * v);
    return cdf + v * pdf;
  } else {
    return v > 0.0f ? 2.0f * v : 0.0f;
  }
}

}  // namespace megaton::ops::cuda::detail
