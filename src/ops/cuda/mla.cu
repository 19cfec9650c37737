// Multi-latent attention's data movement on the GPU (ops/mla.h), F32, BF16, F16. The
// arguments were checked by the doors in ops/cpu/mla.cpp. The RoPE numbers are the CPU
// op's: fp32 angle, cos/sin in double rounded once (rope_table.cuh), fp32 arithmetic.
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/mla.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/cuda/rope_table.cuh"

namespace megaton::ops::cuda {
namespace {

constexpr int kThreads = 256;
using InvFreq = detail::RopeInvFreq;

// Columns [at, at + w) of x [R, C] <-> part [R, w]: one strided 2D copy (graph-capturable).
void copy_block(const Tensor& src, int64_t src_cols, int64_t src_at, Tensor& dst,
                int64_t dst_cols, int64_t dst_at, int64_t width, int64_t rows) {
  if (rows == 0 || width == 0) return;
  const size_t e = dtype_size(src.dtype());
  MEGATON_CUDA_CHECK(cudaMemcpy2DAsync(
      static_cast<char*>(dst.raw()) + dst_at * e, size_t(dst_cols) * e,
      static_cast<const char*>(src.raw()) + src_at * e, size_t(src_cols) * e, size_t(width) * e,
      size_t(rows), cudaMemcpyDeviceToDevice, ::megaton::cuda::stream()));
}

InvFreq pack_freq(const std::vector<float>& inv_freq) {
  InvFreq f{};
  for (size_t j = 0; j < inv_freq.size(); ++j) f.value[j] = inv_freq[j];
  return f;
}

// Row (b, s)'s position: s, or position_ids[b * S + s] (packed sequences).
__device__ __forceinline__ int64_t position_of(int64_t row, int64_t S,
                                               const int32_t* position_ids) {
  return position_ids ? int64_t(position_ids[row]) : row % S;
}

// One block per token row (b, s): the cos/sin table and the rotated key RoPE part in shared
// memory, then every head's query, key and value of the row.
template <typename T>
__global__ void mla_qkv_rope_kernel(const T* q, const T* kv, const T* k_pe, T* query, T* key,
                                    T* value, int64_t S, int n, int qk, int rope, int v,
                                    int64_t position_offset, const int32_t* position_ids,
                                    float scale, InvFreq inv_freq) {
  extern __shared__ float smem[];  // cos[half], sin[half], rotated k_pe[rope]
  const int half = rope / 2;
  float* table = smem;
  float* k_rot = smem + 2 * half;
  const int64_t row = blockIdx.x;
  detail::fill_rope_table(table, float(position_of(row, S, position_ids) + position_offset), half,
                          inv_freq);
  __syncthreads();
  const T* kp = k_pe + row * rope;
  for (int i = threadIdx.x; i < rope; i += blockDim.x) {
    const int j = i < half ? i : i - half;
    const float a = detail::to_float(kp[2 * j]), e = detail::to_float(kp[2 * j + 1]);
    const float c = table[j], sn = table[half + j];
    k_rot[i] = i < half ? scale * (a * c - e * sn) : scale * (e * c + a * sn);
  }
  __syncthreads();
  const int dq = qk + rope, dkv = qk + v;
  const int64_t head0 = row * n;
  for (int idx = threadIdx.x; idx < n * dq; idx += blockDim.x) {
    const int h = idx / dq, i = idx % dq;
    const int64_t head = head0 + h;
    const T* qh = q + head * dq;
    if (i < qk) {
      query[head * dq + i] = qh[i];
      key[head * dq + i] = kv[head * dkv + i];
    } else {
      const int r = i - qk, j = r < half ? r : r - half;
      const float a = detail::to_float(qh[qk + 2 * j]), e = detail::to_float(qh[qk + 2 * j + 1]);
      const float c = table[j], sn = table[half + j];
      query[head * dq + i] =
          detail::from_float<T>(r < half ? scale * (a * c - e * sn) : scale * (e * c + a * sn));
      key[head * dq + i] = detail::from_float<T>(k_rot[r]);
    }
  }
  for (int idx = threadIdx.x; idx < n * v; idx += blockDim.x) {
    const int h = idx / v, i = idx % v;
    value[(head0 + h) * v + i] = kv[(head0 + h) * dkv + qk + i];
  }
}

template <typename T>
__global__ void mla_qkv_rope_backward_kernel(const T* dquery, const T* dkey, const T* dvalue, T* dq,
                                             T* dkv, T* dk_pe, int64_t S, int n, int qk, int rope,
                                             int v, int64_t position_offset,
                                             const int32_t* position_ids, float scale,
                                             InvFreq inv_freq) {
  extern __shared__ float smem[];  // cos[half], sin[half], the heads' summed key grad[rope]
  const int half = rope / 2;
  float* table = smem;
  float* g_sum = smem + 2 * half;
  const int64_t row = blockIdx.x;
  detail::fill_rope_table(table, float(position_of(row, S, position_ids) + position_offset), half,
                          inv_freq);
  const int dqw = qk + rope, dkvw = qk + v;
  const int64_t head0 = row * n;
  // The shared key RoPE part's gradient: the sum over heads, in head order (the CPU's).
  for (int i = threadIdx.x; i < rope; i += blockDim.x) {
    float acc = 0.0f;
    for (int h = 0; h < n; ++h) acc += detail::to_float(dkey[(head0 + h) * dqw + qk + i]);
    g_sum[i] = acc;
  }
  __syncthreads();
  // Transpose of the rotation: dx[2j] = s (g1 c + g2 sin), dx[2j+1] = s (g2 c - g1 sin).
  for (int i = threadIdx.x; i < rope; i += blockDim.x) {
    const int j = i / 2;
    const float g1 = g_sum[j], g2 = g_sum[j + half], c = table[j], sn = table[half + j];
    dk_pe[row * rope + i] =
        detail::from_float<T>(i % 2 == 0 ? scale * (g1 * c + g2 * sn) : scale * (g2 * c - g1 * sn));
  }
  for (int idx = threadIdx.x; idx < n * dqw; idx += blockDim.x) {
    const int h = idx / dqw, i = idx % dqw;
    const int64_t head = head0 + h;
    const T* gq = dquery + head * dqw;
    if (i < qk) {
      dq[head * dqw + i] = gq[i];
      dkv[head * dkvw + i] = dkey[head * dqw + i];
    } else {
      const int r = i - qk, j = r / 2;
      const float g1 = detail::to_float(gq[qk + j]), g2 = detail::to_float(gq[qk + j + half]);
      const float c = table[j], sn = table[half + j];
      dq[head * dqw + i] = detail::from_float<T>(r % 2 == 0 ? scale * (g1 * c + g2 * sn)
                                                            : scale * (g2 * c - g1 * sn));
    }
  }
  for (int idx = threadIdx.x; idx < n * v; idx += blockDim.x) {
    const int h = idx / v, i = idx % v;
    dkv[(head0 + h) * dkvw + qk + i] = dvalue[(head0 + h) * v + i];
  }
}

void check_range(int64_t rows, int64_t n, int64_t width) {
  MEGATON_CHECK(rows <= INT32_MAX && n * width <= INT32_MAX,
                "cuda mla_qkv_rope: {} rows of {} heads x {} values are out of range", rows, n,
                width);
}

}  // namespace

void split_columns(const Tensor& x, std::vector<Tensor>& parts) {
  int64_t at = 0;
  for (Tensor& p : parts) {
    copy_block(x, x.dim(1), at, p, p.dim(1), 0, p.dim(1), x.dim(0));
    at += p.dim(1);
  }
}

void concat_columns(const std::vector<Tensor>& parts, Tensor& y) {
  int64_t at = 0;
  for (const Tensor& p : parts) {
    copy_block(p, p.dim(1), 0, y, y.dim(1), at, p.dim(1), y.dim(0));
    at += p.dim(1);
  }
}

void mla_qkv_rope(const Tensor& q, const Tensor& kv, const Tensor& k_pe, int64_t qk_head_dim,
                  const std::vector<float>& inv_freq, float rope_scale, Tensor& query, Tensor& key,
                  Tensor& value, int64_t position_offset, const Tensor& position_ids) {
  const int64_t B = q.dim(0), S = q.dim(1), n = q.dim(2), rope = k_pe.dim(2),
                qk = qk_head_dim, v = kv.dim(3) - qk;
  check_range(B * S, n, qk + rope + v);
  if (q.numel() == 0) return;
  const InvFreq freq = pack_freq(inv_freq);
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  const size_t shared_bytes = size_t(2 * rope) * sizeof(float);
  detail::dispatch_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    mla_qkv_rope_kernel<T><<<unsigned(B * S), kThreads, shared_bytes, ::megaton::cuda::stream()>>>(
        static_cast<const T*>(q.raw()), static_cast<const T*>(kv.raw()),
        static_cast<const T*>(k_pe.raw()), static_cast<T*>(query.raw()), static_cast<T*>(key.raw()),
        static_cast<T*>(value.raw()), S, int(n), int(qk), int(rope), int(v), position_offset,
        positions, rope_scale, freq);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

void mla_qkv_rope_backward(const Tensor& dquery, const Tensor& dkey, const Tensor& dvalue,
                           int64_t qk_head_dim, const std::vector<float>& inv_freq,
                           float rope_scale, Tensor& dq, Tensor& dkv, Tensor& dk_pe,
                           int64_t position_offset, const Tensor& position_ids) {
  const int64_t B = dq.dim(0), S = dq.dim(1), n = dq.dim(2), rope = dk_pe.dim(2),
                qk = qk_head_dim, v = dkv.dim(3) - qk;
  check_range(B * S, n, qk + rope + v);
  if (dq.numel() == 0) return;
  const InvFreq freq = pack_freq(inv_freq);
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  const size_t shared_bytes = size_t(2 * rope) * sizeof(float);
  detail::dispatch_float(dq.dtype(), [&](auto tag) {
    using T = decltype(tag);
    mla_qkv_rope_backward_kernel<T>
        <<<unsigned(B * S), kThreads, shared_bytes, ::megaton::cuda::stream()>>>(
            static_cast<const T*>(dquery.raw()), static_cast<const T*>(dkey.raw()),
            static_cast<const T*>(dvalue.raw()), static_cast<T*>(dq.raw()),
            static_cast<T*>(dkv.raw()), static_cast<T*>(dk_pe.raw()), S, int(n), int(qk), int(rope),
            int(v), position_offset, positions, rope_scale, freq);
  });
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
