// FP8 quantization on the GPU (ops/fp8.h): amax, the per-tensor and delayed-scaling scale
// updates, the fused per-tensor cast (+ transpose, + amax), blockwise 1x128 / 128x128
// quantization (+ its transposed copy), dequantization, and the scale-layout conversion
// that fp8_gemm.cpp hands to cuBLASLt.
//
// Bit-exactness with the CPU reference (ops/cpu/fp8.cpp, whose header states the rules):
//   - q = fp8(x * scale): x converted to fp32, one fp32 multiply (__fmul_rn: never
//     contracted), then the sm_89+ hardware conversion cvt.rn.satfinite.{e4m3,e5m2}x2.f32
//     (round to nearest even, subnormals included). The product is first clamped to
//     +-fp8_max, so +-inf and everything beyond the largest finite value saturate whatever
//     the instruction does with them (the PTX ISA says .satfinite maps |x| > MAX_NORM, inf
//     included, to sign-preserved MAX_NORM; the clamp makes us independent of that). A NaN
//     product is encoded in software, 0x7F | (sign of x) for both formats as the CPU does:
//     the GPU multiply returns a NaN without x's sign, and the instruction's own NaN
//     (0x7F, sign dropped, in cuda_fp8.hpp's host emulation) is not that.
//   - scales: fp8_max / max(amax, eps), then / 2^margin (2^margin computed on the host
//     with the libm the CPU reference uses), then inf -> FLT_MAX, then, when power_of_2,
//     the largest power of two <= s (the mantissa cleared; a subnormal s keeps its highest
//     set bit); every division is __fdiv_rn (IEEE, whatever -use_fast_math or -prec-div
//     say), and scale_inv = __fdiv_rn(1, scale).
//   - amax: a NaN anywhere gives the canonical NaN 0x7FC00000, as the CPU's NAN.
//
// Memory traffic of the fused per-tensor cast with transpose (the hot path of the FP8
// recipes; one read of x): BF16 x: 2 bytes read + 1 (out) + 1 (out_t) written = 4 bytes
// per element, F32 x: 6. At ~3 TB/s of sustained HBM bandwidth (H100 SXM; ~4 TB/s H200)
// an 8192 x 8192 BF16 tensor (268 MB moved) should take ~90 us.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/fp8_util.cuh"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/fp8.h"

namespace megaton::ops::cuda {

// Used by fp8_gemm.cpp (declared there): cuBLASLt's scale-factor layouts.
void fp8_gemm_scale_layout(const float* src, int64_t rows, int64_t blocks, bool transpose,
                           int64_t ld, float* dst);

namespace {

using detail::compute_stream;
using detail::is_aligned;

// ---- scale updates (one block) ----

__global__ void update_scale_kernel(const float* amax, ScaleRule rule, float* scale,
                                    float* scale_inv) {
  const float a = amax[0];
  if (!scale_valid(a)) return;
  const float s = scale_from_amax(a, 1.0f, rule);
  scale[0] = s;
  scale_inv[0] = __fdiv_rn(1.0f, s);
}

constexpr int kHistoryThreads = 256;
// Histories up to this length are staged in shared memory (32 KB); longer ones are read
// from a copy the host makes first.
constexpr int64_t kMaxSharedHistory = 8192;

// Delayed scaling: amax = max |h| over the history, NaN-propagating as TE's torch.max
// (max_algo), or row 0; the scale update; then the roll new[i] = old[(i + 1) % L],
// new[0] = 0. `copy` is nullptr (the old history is staged in dynamic shared memory) or a
// copy of the old history in global memory.
__global__ void __launch_bounds__(kHistoryThreads)
    delayed_scaling_kernel(float* history, const float* copy, int64_t length, bool max_algo,
                           ScaleRule rule, float* scale, float* scale_inv) {
  extern __shared__ float staged[];
  const float* old = copy;
  if (copy == nullptr) {
    for (int64_t i = threadIdx.x; i < length; i += kHistoryThreads) staged[i] = history[i];
    __syncthreads();
    old = staged;
  }
  uint32_t m = 0;
  if (max_algo)
    for (int64_t i = threadIdx.x; i < length; i += kHistoryThreads) m = max(m, abs_bits(old[i]));
  m = block_max(m);  // its barriers also order the staging above before the writes below
  if (threadIdx.x == 0) {
    const float amax = max_algo ? __uint_as_float(m) : old[0];
    if (scale_valid(amax)) {
      const float s = scale_from_amax(amax, 1.0f, rule);
      scale[0] = s;
      scale_inv[0] = __fdiv_rn(1.0f, s);
    }
  }
  for (int64_t i = threadIdx.x; i < length; i += kHistoryThreads)
    history[i] = i == 0 ? 0.0f : old[(i + 1) % length];
}

// ---- dequantization ----

template <bool kE4M3>
__device__ __forceinline__ float fp8_to_float(uint8_t q) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(q, kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));  // exact: FP8 values are FP16 values
}

// x[r, c] = q[r, c] * scale_inv[(r / block_rows) * scale_cols + c / 128] (scale_cols 0 and
// block_rows anything: the per-tensor scale_inv[0]).
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv,
                      int64_t cols, int64_t block_rows, int64_t scale_cols, T* __restrict__ x,
                      int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const int64_t r = i / cols, c = i % cols;
    const float s =
        scale_cols ? scale_inv[(r / block_rows) * scale_cols + c / kTile] : scale_inv[0];
    x[i] = detail::from_float<T>(__fmul_rn(fp8_to_float<kE4M3>(q[i]), s));
  }
}

// ---- scale layouts for cuBLASLt ----

// transpose: dst[b * ld + r] = src[r * blocks + b] (dst [blocks, ld], ld >= rows);
// else dst[r * ld + b] = src[r * blocks + b], zeros in the padding b >= blocks.
__global__ void __launch_bounds__(kThreads)
    scale_layout_kernel(const float* __restrict__ src, int64_t rows, int64_t blocks, bool transpose,
                        int64_t ld, float* __restrict__ dst) {
  const int64_t n = transpose ? blocks * rows : rows * ld;
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    if (transpose) {
      const int64_t b = i / rows, r = i % rows;
      dst[b * ld + r] = src[r * blocks + b];
    } else {
      const int64_t r = i / ld, b = i % ld;
      dst[i] = b < blocks ? src[r * blocks + b] : 0.0f;
    }
  }
}

// ---- host ----

// x viewed as [rows, cols] with cols its last dimension (numel > 0).
struct Matrix {
  int64_t rows, cols;
};
Matrix as_matrix(const Tensor& x) {
  const int64_t cols = x.ndim() ? x.dim(-1) : 1;
  return {cols ? x.numel() / cols : 0, cols};
}

float* optional_f32(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

template <TileMode kMode>
void launch_tile(const Tensor& x, DType fp8, TileArgs& args, bool transpose) {
  args.tiles_r = (args.rows + kTile - 1) / kTile;
  args.tiles_c = (args.cols + kTile - 1) / kTile;
  const int64_t tiles = args.tiles_r * args.tiles_c;
  MEGATON_CHECK(tiles <= INT32_MAX, "fp8 quantize: [{}, {}] has too many 128 x 128 tiles",
                args.rows, args.cols);
  const bool vector = args.cols % 8 == 0 && is_aligned(args.x, 16) && is_aligned(args.out, 8) &&
                      (!transpose || (args.rows % 16 == 0 && is_aligned(args.out_t, 16)));
  detail::dispatch_f32_bf16(x.dtype(), [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(fp8, [&](auto e4m3) {
      dispatch_bool(transpose, [&](auto tr) {
        dispatch_bool(vector, [&](auto vec) {
          quantize_tile_kernel<T, decltype(e4m3)::value, kMode, decltype(tr)::value,
                               decltype(vec)::value>
              <<<unsigned(tiles), kTileThreads, 0, compute_stream()>>>(args);
          MEGATON_CUDA_CHECK_LAUNCH();
        });
      });
    });
  });
}

}  // namespace

void fp8_gemm_scale_layout(const float* src, int64_t rows, int64_t blocks, bool transpose,
                           int64_t ld, float* dst) {
  const int64_t n = transpose ? blocks * rows : rows * ld;
  if (n == 0) return;
  scale_layout_kernel<<<stride_grid(n), kThreads, 0, compute_stream()>>>(src, rows, blocks,
                                                                         transpose, ld, dst);
  MEGATON_CUDA_CHECK_LAUNCH();
}

void fp8_amax(const Tensor& x, Tensor& amax) {
  cudaStream_t stream = compute_stream();
  MEGATON_CUDA_CHECK(cudaMemsetAsync(amax.f32(), 0, sizeof(float), stream));
  const int64_t n = x.numel();
  if (n == 0) return;
  detail::dispatch_f32_bf16(x.dtype(), [&](auto t) {
    using T = decltype(t);
    const T* p = static_cast<const T*>(x.raw());
    if (is_aligned(p, 16)) {
      amax_kernel<T, true><<<stride_grid(n / 8 + 1), kThreads, 0, stream>>>(p, n, amax.f32());
    } else {
      amax_kernel<T, false><<<stride_grid(n), kThreads, 0, stream>>>(p, n, amax.f32());
    }
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void fp8_update_scale(const Tensor& amax, const Fp8ScaleRule& rule, Tensor& scale,
                      Tensor& scale_inv) {
  update_scale_kernel<<<1, 1, 0, compute_stream()>>>(amax.f32(), make_rule(rule), scale.f32(),
                                                     scale_inv.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void fp8_delayed_scaling_update(Tensor& amax_history, const Fp8ScaleRule& rule, bool max_algo,
                                Tensor& scale, Tensor& scale_inv) {
  const int64_t length = amax_history.numel();
  if (length == 0) return;
  cudaStream_t stream = compute_stream();
  Tensor copy;  // the old history, for histories too long for shared memory
  size_t shared_bytes = 0;
  if (length <= kMaxSharedHistory) {
    shared_bytes = size_t(length) * sizeof(float);
  } else {
    copy = Tensor::empty({length}, DType::F32, Device::CUDA);
    MEGATON_CUDA_CHECK(cudaMemcpyAsync(copy.raw(), amax_history.raw(), amax_history.nbytes(),
                                       cudaMemcpyDeviceToDevice, stream));
  }
  delayed_scaling_kernel<<<1, kHistoryThreads, shared_bytes, stream>>>(
      amax_history.f32(), copy.defined() ? copy.f32() : nullptr, length, max_algo, make_rule(rule),
      scale.f32(), scale_inv.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

void fp8_quantize(const Tensor& x, const Tensor& scale, Tensor& out, Tensor& out_t, Tensor& amax) {
  cudaStream_t stream = compute_stream();
  float* amax_ptr = optional_f32(amax);
  if (amax_ptr != nullptr) MEGATON_CUDA_CHECK(cudaMemsetAsync(amax_ptr, 0, sizeof(float), stream));
  const int64_t n = x.numel();
  if (n == 0) return;
  const Matrix m = as_matrix(x);
  auto* out_ptr = static_cast<uint8_t*>(out.raw());
  if (!out_t.defined()) {
    const bool vector = is_aligned(x.raw(), 16) && is_aligned(out_ptr, 8);
    detail::dispatch_f32_bf16(x.dtype(), [&](auto t) {
      using T = decltype(t);
      dispatch_fp8(out.dtype(), [&](auto e4m3) {
        dispatch_bool(vector, [&](auto vec) {
          quantize_flat_kernel<T, decltype(e4m3)::value, decltype(vec)::value>
              <<<stride_grid(vector ? n / 8 + 1 : n), kThreads, 0, stream>>>(
                  static_cast<const T*>(x.raw()), scale.f32(), out_ptr, amax_ptr, n);
          MEGATON_CUDA_CHECK_LAUNCH();
        });
      });
    });
    return;
  }
  TileArgs args{};
  args.x = x.raw();
  args.rows = m.rows;
  args.cols = m.cols;
  args.out = out_ptr;
  args.out_t = static_cast<uint8_t*>(out_t.raw());
  args.scale = scale.f32();
  args.amax = amax_ptr;
  launch_tile<TileMode::PerTensor>(x, out.dtype(), args, true);
}

void fp8_quantize_blockwise(const Tensor& x, int64_t block_rows, const Fp8ScaleRule& rule,
                            Tensor& out, Tensor& scale_inv, Tensor& out_t, Tensor& scale_inv_t) {
  if (x.numel() == 0) return;
  const Matrix m = as_matrix(x);
  const bool transpose = out_t.defined();
  TileArgs args{};
  args.x = x.raw();
  args.rows = m.rows;
  args.cols = m.cols;
  args.out = static_cast<uint8_t*>(out.raw());
  args.out_t = transpose ? static_cast<uint8_t*>(out_t.raw()) : nullptr;
  args.rule = make_rule(rule);
  args.scale_inv = scale_inv.f32();
  args.scale_inv_t = transpose ? scale_inv_t.f32() : nullptr;
  if (block_rows == 1)
    launch_tile<TileMode::Rows1x128>(x, out.dtype(), args, transpose);
  else
    launch_tile<TileMode::Block128x128>(x, out.dtype(), args, transpose);
}

void fp8_dequantize(const Tensor& q, const Tensor& scale_inv, Tensor& x) {
  const int64_t n = q.numel();
  if (n == 0) return;
  const Matrix m = as_matrix(q);
  // Per tensor: one scale (a blockwise [1, 1] is the same thing). Blockwise: 1x128 when
  // there is a scale row per row of q, else 128x128.
  const bool per_tensor = scale_inv.numel() == 1;
  const int64_t scale_cols = per_tensor ? 0 : scale_inv.dim(-1);
  const int64_t block_rows = per_tensor || scale_inv.dim(0) == m.rows ? 1 : kTile;
  detail::dispatch_f32_bf16(x.dtype(), [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(q.dtype(), [&](auto e4m3) {
      dequantize_kernel<T, decltype(e4m3)::value>
          <<<stride_grid(n), kThreads, 0, compute_stream()>>>(
              static_cast<const uint8_t*>(q.raw()), scale_inv.f32(), m.cols, block_rows, scale_cols,
              static_cast<T*>(x.raw()), n);
      MEGATON_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace megaton::ops::cuda
