// Dropout on the GPU with the CPU's Philox mask, bit for bit (semantics: ops.h, CPU twin:
// ops/cpu/dropout.cpp). x and y share one dtype (F32, BF16 or F16); y may alias x.
//
// keep[i] = Philox(seed).uniform(stream, i) >= p, the same counter-based draw as the CPU
// (core/rng.h is __host__ __device__), so a mask regenerated on either device is the
// same. The scale is the fp32 reciprocal 1 / (1 - p) computed on the host exactly as the
// CPU computes it and applied as one fp32 multiply, so F32 outputs equal the CPU's.
#include <cstdint>

#include "core/rng.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

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

void check_args(const Tensor& in, const char* in_name, const Tensor& out, const char* out_name,
                float p, const char* op) {
  detail::check_float(in, op, in_name);
  detail::check_float(out, op, out_name);
  detail::check_same_dtype(out, in, op, out_name, in_name);
  detail::check_same_shape(out, in, op, out_name, in_name);
  MEGATON_CHECK(p >= 0.0f && p < 1.0f, "{}: dropout probability {} is not in [0, 1)", op, p);
}

// out[i] = keep[i] ? in[i] * scale : 0 for i in [0, n); N divides n. Each element draws
// its own Philox block, as on the CPU (only the first of its four outputs is used).
template <typename T, int N>
__global__ void dropout_kernel(const T* in, T* out, int64_t n, float p, float scale, uint64_t seed,
                               uint64_t stream) {
  const Philox rng(seed);
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N; i < n;
       i += int64_t(gridDim.x) * blockDim.x * N) {
    Pack<T, N> in_pack = load_pack<N>(in + i), out_pack;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      bool keep = rng.uniform(stream, uint64_t(i + k)) >= p;
      out_pack.v[k] = from_float<T>(keep ? __fmul_rn(to_float(in_pack.v[k]), scale) : 0.0f);
    }
    store_pack<N>(out + i, out_pack);
  }
}

void apply_mask(const Tensor& in, Tensor& out, float p, uint64_t seed, uint64_t stream) {
  const int64_t n = in.numel();
  if (n == 0) return;
  if (p == 0.0f) {
    if (out.raw() != in.raw())
      MEGATON_CUDA_CHECK(cudaMemcpyAsync(out.raw(), in.raw(), in.nbytes(), cudaMemcpyDeviceToDevice,
                                         compute_stream()));
    return;
  }
  const float scale = 1.0f / (1.0f - p);  // as ops/cpu/dropout.cpp
  detail::dispatch_float(in.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kN = kPackElems<T>;
    const T* ip = static_cast<const T*>(in.raw());
    T* outp = static_cast<T*>(out.raw());
    if (n % kN == 0 && pack_aligned<kN>(ip) && pack_aligned<kN>(outp)) {
      dropout_kernel<T, kN><<<grid_for(n / kN, kThreads), kThreads, 0, compute_stream()>>>(
          ip, outp, n, p, scale, seed, stream);
    } else {
      dropout_kernel<T, 1><<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(
          ip, outp, n, p, scale, seed, stream);
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

// out = residual + mask(x + bias) (ops.h bias_dropout_add), rounded to T after each step
// as bias_add_, dropout_forward and add_ round. B: the bias's type (unused when bias is
// null); N divides n.
template <typename T, typename B, int N>
__global__ void bias_dropout_add_kernel(const T* x, const B* bias, int64_t cols, const T* residual,
                                        T* out, int64_t n, float p, float scale, uint64_t seed,
                                        uint64_t stream) {
  const Philox rng(seed);
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N; i < n;
       i += int64_t(gridDim.x) * blockDim.x * N) {
    Pack<T, N> x_pack = load_pack<N>(x + i), r_pack = load_pack<N>(residual + i), out_pack;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float v = to_float(x_pack.v[k]);
      if (bias != nullptr) v = to_float(from_float<T>(__fadd_rn(v, to_float(bias[(i + k) % cols]))));
      if (p > 0.0f) {
        const bool keep = rng.uniform(stream, uint64_t(i + k)) >= p;
        v = to_float(from_float<T>(keep ? __fmul_rn(v, scale) : 0.0f));
      }
      out_pack.v[k] = from_float<T>(__fadd_rn(v, to_float(r_pack.v[k])));
    }
    store_pack<N>(out + i, out_pack);
  }
}

}  // namespace

void bias_dropout_add(const Tensor& x, const Tensor& bias, const Tensor& residual, Tensor& out,
                      float p, uint64_t seed, uint64_t stream) {
  constexpr const char* kOp = "bias_dropout_add";
  check_args(x, "x", out, "out", p, kOp);
  check_args(residual, "residual", out, "out", p, kOp);
  MEGATON_CHECK(x.ndim() >= 1, "{}: x must have a last dimension", kOp);
  if (bias.defined()) {
    detail::check_float(bias, kOp, "bias");
    MEGATON_CHECK(bias.ndim() == 1 && bias.dim(0) == x.dim(-1), "{}: bias {} must be [{}]", kOp,
                  shape_str(bias.shape()), x.dim(-1));
  }
  const int64_t n = x.numel(), cols = x.dim(-1);
  if (n == 0) return;
  const float scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;  // as ops/cpu/dropout.cpp
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto bias_tag) {
      using B = decltype(bias_tag);
      constexpr int kN = kPackElems<T>;
      const T* xp = static_cast<const T*>(x.raw());
      const T* rp = static_cast<const T*>(residual.raw());
      T* op = static_cast<T*>(out.raw());
      const B* bp = bias.defined() ? static_cast<const B*>(bias.raw()) : nullptr;
      if (n % kN == 0 && pack_aligned<kN>(xp) && pack_aligned<kN>(rp) && pack_aligned<kN>(op)) {
        bias_dropout_add_kernel<T, B, kN><<<grid_for(n / kN, kThreads), kThreads, 0,
                                            compute_stream()>>>(xp, bp, cols, rp, op, n, p, scale,
                                                                seed, stream);
      } else {
        bias_dropout_add_kernel<T, B, 1><<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(
            xp, bp, cols, rp, op, n, p, scale, seed, stream);
      }
      MEGATON_CUDA_CHECK_LAUNCH();
    };
    if (bias.defined()) detail::dispatch_float(bias.dtype(), launch);
    else launch(T{});
  });
}

void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t stream) {
  check_args(x, "x", y, "y", p, "dropout_forward");
  apply_mask(x, y, p, seed, stream);
}

void dropout_backward(const Tensor& dy, Tensor& dx, float p, uint64_t seed, uint64_t stream) {
  check_args(dy, "dy", dx, "dx", p, "dropout_backward");
  apply_mask(dy, dx, p, seed, stream);
}

}  // namespace megaton::ops::cuda
