// Rotary position embedding (RoPE) on the GPU, non-interleaved "rotate half", F32, BF16
// and F16.
//
// Same numbers as ops/cpu/rope.cpp: inv_freq_i = 1 / base^(float(2i) / R) (R the rotary
// dim: D, or the first R channels with partial RoPE) is computed on
// the host with the CPU's own expression (std::pow in fp32) and passed to the kernel, so
// both backends start from identical fp32 frequencies; angle = float(s + offset) *
// inv_freq_i is one fp32 multiply on either side; cos and sin of that fp32 angle are
// evaluated in double and rounded once, as the CPU does (at position 4096 one fp32 ulp of
// the angle is ~5e-4, so the angle's rounding, not the trig, dominates; matching it keeps
// the GPU within a few fp32 ulps of the CPU at long positions).

#include <cmath>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/cuda/rope_table.cuh"
#include "ops/rope_dim.h"

namespace megaton::ops::cuda {
namespace {

constexpr int kMaxHalfDim = detail::kRopeMaxHalfDim;
constexpr int kThreads = 256;
using InvFreq = detail::RopeInvFreq;

// 16-bit values round to nearest even, as the CPU's float_to_bf16 and float_to_fp16.
template <typename T>
__device__ inline float load_float(const T* p) {
  return detail::to_float(*p);
}
template <typename T>
__device__ inline void store_float(T* p, float v) {
  *p = detail::from_float<T>(v);
}

// One block per token row (b, s): the block first fills cos/sin of its position for the
// half = R/2 frequencies in shared memory (the trig is paid once per row, not once per
// head), then walks the row's (head, item) items: item i < half rotates the pair
// (i, i + half) of the head's first R = 2 half channels, item half + j copies channel
// R + j of the tail [R, D) (partial RoPE; none when R = D). y may alias x: each thread
// reads both halves of its pair before writing them, and items are disjoint across threads.
template <typename T>
__global__ void rope_kernel(const T* x, T* y, int64_t S, int heads, int head_dim, int half,
                            int64_t position_offset, float sign, InvFreq inv_freq) {
  extern __shared__ float table[];  // cos[half], then sin[half]
  const int64_t row = blockIdx.x;   // b * S + s
  const int64_t s = row % S;
  detail::fill_rope_table(table, float(s + position_offset), half, inv_freq);
  __syncthreads();
  const int64_t row_start = row * int64_t(heads) * head_dim;
  const int items = head_dim - half;  // half pairs, then head_dim - 2 half tail values
  for (int item = threadIdx.x; item < heads * items; item += blockDim.x) {
    const int h = item / items, i = item % items;
    const int64_t head = row_start + int64_t(h) * head_dim;
    if (i >= half) {
      const int64_t at = head + half + i;  // channel 2 half + (i - half)
      y[at] = x[at];
      continue;
    }
    const int64_t first = head + i;
    const float x1 = load_float(x + first), x2 = load_float(x + first + half);
    const float c = table[i], sn = sign * table[half + i];
    store_float(y + first, x1 * c - x2 * sn);
    store_float(y + first + half, x2 * c + x1 * sn);
  }
}

// Returns the rotary dim (rotary_dim, or the whole head for 0).
int64_t check_rope_args(const Tensor& x, const Tensor& y, const char* x_name, const char* y_name,
                        float base, int64_t position_offset, int64_t rotary_dim) {
  MEGATON_CHECK(x.defined() && y.defined(), "cuda rope: {} and {} must be allocated", x_name,
                y_name);
  MEGATON_CHECK(x.device() == Device::CUDA && y.device() == Device::CUDA,
                "cuda rope: {} and {} must both be CUDA tensors", x_name, y_name);
  MEGATON_CHECK(x.dtype() == y.dtype() && detail::is_cuda_float(x.dtype()),
                "cuda rope: {} {} and {} {} must share one dtype, F32, BF16 or F16", x_name,
                dtype_name(x.dtype()), y_name, dtype_name(y.dtype()));
  MEGATON_CHECK(x.ndim() == 4, "cuda rope: {} must be [B, S, heads, D], got {}", x_name,
                shape_str(x.shape()));
  MEGATON_CHECK(y.shape() == x.shape(), "cuda rope: {} {} must match {} {}", y_name,
                shape_str(y.shape()), x_name, shape_str(x.shape()));
  const int64_t r = checked_rotary_dim("cuda rope", rotary_dim, x.dim(3));
  MEGATON_CHECK(r / 2 <= kMaxHalfDim, "cuda rope: rotary dim {} exceeds the supported {}", r,
                2 * kMaxHalfDim);
  MEGATON_CHECK(x.dim(2) * x.dim(3) <= INT32_MAX, "cuda rope: heads * D {} exceeds int32",
                x.dim(2) * x.dim(3));
  MEGATON_CHECK(x.dim(0) * x.dim(1) <= INT32_MAX, "cuda rope: B * S {} exceeds the grid limit",
                x.dim(0) * x.dim(1));
  MEGATON_CHECK(base > 0.0f, "cuda rope: base {} must be positive", base);
  MEGATON_CHECK(position_offset >= 0, "cuda rope: position_offset {} must be >= 0",
                position_offset);
  return r;
}

void rope_apply(const Tensor& x, Tensor& y, float base, int64_t position_offset, float sign,
                int64_t rotary_dim) {
  const int64_t B = x.dim(0), S = x.dim(1), heads = x.dim(2), D = x.dim(3);
  const int half = int(rotary_dim / 2);
  if (x.numel() == 0) return;
  InvFreq inv_freq{};
  for (int i = 0; i < half; ++i) {
    // Exactly ops/cpu/rope_tables.h's rope_inv_freq over the rotary dim.
    float exponent = float(2 * i) / float(rotary_dim);
    inv_freq.value[i] = 1.0f / std::pow(base, exponent);
  }
  const unsigned blocks = unsigned(B * S);
  const size_t shared_bytes = 2 * size_t(half) * sizeof(float);
  cudaStream_t stream = ::megaton::cuda::stream();
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<blocks, kThreads, shared_bytes, stream>>>(
        static_cast<const T*>(x.raw()), static_cast<T*>(y.raw()), S, int(heads), int(D), half,
        position_offset, sign, inv_freq);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_forward(const Tensor& x, Tensor& y, float base, int64_t position_offset,
                  int64_t rotary_dim) {
  const int64_t r = check_rope_args(x, y, "x", "y", base, position_offset, rotary_dim);
  rope_apply(x, y, base, position_offset, 1.0f, r);
}

void rope_backward(const Tensor& dy, Tensor& dx, float base, int64_t position_offset,
                   int64_t rotary_dim) {
  const int64_t r = check_rope_args(dy, dx, "dy", "dx", base, position_offset, rotary_dim);
  rope_apply(dy, dx, base, position_offset, -1.0f, r);
}

}  // namespace megaton::ops::cuda
