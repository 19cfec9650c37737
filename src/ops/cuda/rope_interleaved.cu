// MLA's interleaved rotary embedding on the GPU (ops/rope_interleaved.h), F32, BF16, F16.
// The numbers of the CPU op: the host's fp32 frequencies travel as a kernel argument, the
// angle is one fp32 multiply, cos and sin of it are evaluated in double and rounded once.
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/cuda/rope_table.cuh"
#include "ops/cuda/rope_interleaved.h"

namespace megaton::ops::cuda {
namespace {

constexpr int kMaxHalfDim = detail::kRopeMaxHalfDim;
constexpr int kThreads = 256;
using InvFreq = detail::RopeInvFreq;

// One block per token row (b, s): cos/sin of its position in shared memory, then every
// (head, pair) of the row. y never aliases x, so pairs may move freely.
template <typename T>
__global__ void rope_interleaved_kernel(const T* x, T* y, int64_t S, int heads, int half,
                                        int64_t position_offset, float scale, bool forward,
                                        InvFreq inv_freq) {
  extern __shared__ float table[];  // cos[half], then sin[half]
  const int64_t row = blockIdx.x;   // b * S + s
  detail::fill_rope_table(table, float(row % S + position_offset), half, inv_freq);
  __syncthreads();
  const int64_t row_start = row * int64_t(heads) * 2 * half;
  for (int pair = threadIdx.x; pair < heads * half; pair += blockDim.x) {
    const int h = pair / half, j = pair % half;
    const T* in = x + row_start + int64_t(h) * 2 * half;
    T* out = y + row_start + int64_t(h) * 2 * half;
    const float c = table[j], sn = table[half + j];
    if (forward) {
      const float a = detail::to_float(in[2 * j]), e = detail::to_float(in[2 * j + 1]);
      out[j] = detail::from_float<T>(scale * (a * c - e * sn));
      out[j + half] = detail::from_float<T>(scale * (e * c + a * sn));
    } else {
      const float g1 = detail::to_float(in[j]), g2 = detail::to_float(in[j + half]);
      out[2 * j] = detail::from_float<T>(scale * (g1 * c + g2 * sn));
      out[2 * j + 1] = detail::from_float<T>(scale * (g2 * c - g1 * sn));
    }
  }
}

void apply(const Tensor& x, Tensor& y, const std::vector<float>& inv_freq, float scale,
           int64_t position_offset, bool forward) {
  MEGATON_CHECK(x.defined() && y.defined(), "cuda rope_interleaved: tensors must be allocated");
  MEGATON_CHECK(x.device() == Device::CUDA && y.device() == Device::CUDA,
                "cuda rope_interleaved: tensors must be CUDA tensors");
  MEGATON_CHECK(x.dtype() == y.dtype() && detail::is_cuda_float(x.dtype()),
                "cuda rope_interleaved: tensors must share one dtype, F32, BF16 or F16");
  MEGATON_CHECK(x.ndim() == 4 && y.shape() == x.shape(),
                "cuda rope_interleaved: x {} and y {} must be the same [B, S, heads, D]",
                shape_str(x.shape()), shape_str(y.shape()));
  const int64_t B = x.dim(0), S = x.dim(1), heads = x.dim(2), D = x.dim(3);
  MEGATON_CHECK(D % 2 == 0 && int64_t(inv_freq.size()) == D / 2 && D / 2 <= kMaxHalfDim,
                "cuda rope_interleaved: head dim {} must be even, at most {}, with {} frequencies",
                D, 2 * kMaxHalfDim, inv_freq.size());
  MEGATON_CHECK(x.raw() != y.raw() || x.numel() == 0, "cuda rope_interleaved: y must not alias x");
  MEGATON_CHECK(position_offset >= 0 && B * S <= INT32_MAX && heads * D <= INT32_MAX,
                "cuda rope_interleaved: position_offset {} or the shape {} is out of range",
                position_offset, shape_str(x.shape()));
  if (x.numel() == 0) return;
  InvFreq freq{};
  for (size_t j = 0; j < inv_freq.size(); ++j) freq.value[j] = inv_freq[j];
  const int half = int(D / 2);
  const size_t shared_bytes = 2 * size_t(half) * sizeof(float);
  cudaStream_t stream = ::megaton::cuda::stream();
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    rope_interleaved_kernel<T><<<unsigned(B * S), kThreads, shared_bytes, stream>>>(
        static_cast<const T*>(x.raw()), static_cast<T*>(y.raw()), S, int(heads), half,
        position_offset, scale, forward, freq);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope_interleaved_forward(const Tensor& x, Tensor& y, const std::vector<float>& inv_freq,
                              float scale, int64_t position_offset) {
  apply(x, y, inv_freq, scale, position_offset, true);
}

void rope_interleaved_backward(const Tensor& dy, Tensor& dx, const std::vector<float>& inv_freq,
                               float scale, int64_t position_offset) {
  apply(dy, dx, inv_freq, scale, position_offset, false);
}

}  // namespace megaton::ops::cuda
