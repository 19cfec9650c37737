// Fused QKV split + q/k norm (--qk-layernorm) + RoPE, and its gradient, on the GPU
// (semantics: ops.h; CPU twin: ops/cpu/qkv_norm.cpp). F32, BF16 or F16 activations, F32,
// BF16 or F16 norm parameters, fp32 arithmetic.
//
// Replaces, per layer and direction, the split, the two norms (and the backward's
// weight-gradient reductions) and the two RoPE launches of the unfused path: one kernel
// forward; one kernel plus a small reduction kernel backward.
//
// Work split: one warp per head (a row of d <= 512 values). Lane l holds the value pairs
// i = l + 32 m (m < K) of rope_table.cuh's head_channels: the RoPE pair (i, i + R/2) of the
// first R (rotary dim, even) channels for i < R/2, two channels of the unrotated tail
// [R, d) otherwise (R = d: the pairs (i, i + d/2); no RoPE: (i, i + ceil(d/2))), so that a
// RoPE pair sits in one lane and the row's sums are one warp reduction. The forward runs
// one block per token; the backward one block per chunk of consecutive tokens, whose warps
// keep per-lane weight-gradient sums in registers, combine them in the block in warp order
// and write one partial row per chunk; a second kernel adds the chunks in order. The
// chunks and the warps' heads depend on the shape only and nothing is atomic: repeated
// runs give the same bits.
//
// RoPE's numbers are those of ops/cuda/qkv.cu (and so of ops/cpu/rope.cpp): inv_freq over
// the rotary dim from the host with the CPU's expression, angle = float(s) * inv_freq
// without contraction (s the token's position: within its sequence, or position_ids[t] for
// packed sequences), cos/sin of it in double rounded once. The norms' are those of
// ops/cuda/norm.cu: sums in fp32, 1 / sqrtf(mean + eps), LayerNorm's variance from a second
// pass over the values.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/qkv_checks.h"
#include "ops/cuda/pointwise_util.cuh"
#include "ops/cuda/rope_table.cuh"
#include "ops/norm_checks.h"
#include "ops/ops.h"

namespace megaton::ops::cuda {
namespace {

using detail::compute_stream;
using detail::from_float;
using detail::HeadChannels;
using detail::head_channels;
using detail::to_float;
using detail::warp_sum;

constexpr int kMaxHeadDim = 512;
constexpr int kMaxWarps = 8;
// Backward: at most this many token chunks (partial rows of the weight gradients).
constexpr int64_t kMaxChunks = 1024;
// The finalize kernel's block: 32 columns x kFinalizeRows chunk strides.
constexpr int kFinalizeRows = 8;

using InvFreq = detail::RopeInvFreq;  // kMaxHeadDim / 2 frequencies

// Sizes of one call: q [B, S, heads, head_dim], k, v [B, S, groups, head_dim], packed
// [tokens, slots * head_dim], slots = groups * (heads_per_group + 2).
// position_ids [tokens]: the tokens' RoPE positions (null: s = t % seq). rotary_dim: the
// channels of each q and k head RoPE rotates (even, <= head_dim; 0 without RoPE).
struct QkvDims {
  int64_t tokens, seq;
  int heads, groups, heads_per_group, head_dim;
  const int32_t* position_ids;
  int rotary_dim;
  __host__ __device__ int slots() const { return groups * (heads_per_group + 2); }
  __device__ int64_t position(int64_t t) const {
    return position_ids ? int64_t(position_ids[t]) : t % seq;
  }
};

// The dtype of the norm parameters.
enum class ParamType : uint8_t { F32, BF16, F16 };

// The norm parameters: q_weight, k_weight, q_bias, k_bias (biases null: none), F32, BF16
// or F16 (all four one dtype).
struct NormParams {
  const void* tensor[4];
  ParamType type;
  bool has_bias;
  float eps;
};

// ---- device helpers ----

// Where a head of the packed row lives (qkv.cu's place_of): slot u = g * (qpg + 2) + r of
// token t holds query head g * qpg + r for r < qpg, key head g for r = qpg, value head g
// for r = qpg + 1. offset / head_dim is the head's norm row.
struct HeadPlace {
  int part;        // 0 q, 1 k, 2 v
  int64_t offset;  // element offset of the head's first value in q, k or v
};

__device__ __forceinline__ HeadPlace place_of(int64_t t, int slot, const QkvDims& dims) {
  const int g = slot / (dims.heads_per_group + 2), r = slot % (dims.heads_per_group + 2);
  const int64_t D = dims.head_dim;
  if (r < dims.heads_per_group)
    return {0, (t * dims.heads + int64_t(g) * dims.heads_per_group + r) * D};
  return {r == dims.heads_per_group ? 1 : 2, (t * dims.groups + g) * D};
}

// rope_table.cuh's fill_rope_table at position s: table[0, half) = cos, table[half,
// 2 half) = sin. Ends with a barrier: every thread of the block must call it.
__device__ void fill_rope_table(float* table, int64_t s, int half, const InvFreq& inv_freq) {
  detail::fill_rope_table(table, float(s), half, inv_freq);
  __syncthreads();
}

// shared[p * D + j] = parameter p's value j as float, for the first `count` parameters
// (biases: only when has_bias). No barrier.
__device__ void load_params(float* shared, const NormParams& params, int count, int D) {
  for (int j = threadIdx.x; j < count * D; j += blockDim.x) {
    const int p = j / D, i = j % D;
    const void* src = params.tensor[p];
    switch (params.type) {
      case ParamType::BF16:
        shared[j] = to_float(static_cast<const __nv_bfloat16*>(src)[i]);
        break;
      case ParamType::F16:
        shared[j] = to_float(static_cast<const __half*>(src)[i]);
        break;
      default:
        shared[j] = static_cast<const float*>(src)[i];
    }
  }
}

// ---- forward ----

template <typename T>
struct ForwardArgs {
  const T* qkv;
  T* q;
  T* k;
  T* v;
  T* q_input;
  T* k_input;
  float* q_mean;  // LayerNorm only
  float* q_rstd;
  float* k_mean;
  float* k_rstd;
};

// One block per token; warp w handles the token's packed heads w, w + warps, ...
// Query / key heads: copy to q_input / k_input, normalize, rotate the first rotary_dim
// channels (none without RoPE), store; value heads: copy.
template <typename T, int K, bool kLayerNorm>
__global__ void __launch_bounds__(kMaxWarps * 32)
    qkv_norm_forward_kernel(ForwardArgs<T> a, QkvDims dims, NormParams params, InvFreq inv_freq) {
  extern __shared__ float shared[];
  const int D = dims.head_dim, R = dims.rotary_dim, half = R / 2;
  float* param = shared;  // q_weight, k_weight, q_bias, k_bias: [4][D]
  float* table = shared + 4 * D;
  load_params(param, params, params.has_bias ? 4 : 2, D);
  const int64_t t = blockIdx.x;
  if (half > 0)
    fill_rope_table(table, dims.position(t), half, inv_freq);
  else
    __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int slots = dims.slots();
  const float inv_d = 1.0f / float(D);
  const T* row = a.qkv + t * int64_t(slots) * D;
  for (int slot = warp; slot < slots; slot += warps) {
    const HeadPlace place = place_of(t, slot, dims);
    const T* src = row + int64_t(slot) * D;
    if (place.part == 2) {
      T* dst = a.v + place.offset;
      for (int j = lane; j < D; j += 32) dst[j] = src[j];
      continue;
    }
    const bool is_q = place.part == 0;
    T* input = (is_q ? a.q_input : a.k_input) + place.offset;
    T* out = (is_q ? a.q : a.k) + place.offset;
    const float* w = param + (is_q ? 0 : D);
    const float* b = param + (is_q ? 2 : 3) * D;

    float x1[K], x2[K];
    float sum = 0.0f;
#pragma unroll
    for (int m = 0; m < K; ++m) {
      const HeadChannels ch = head_channels(lane + 32 * m, D, R);
      x1[m] = x2[m] = 0.0f;
      if (ch.has_a) {
        const T v1 = src[ch.a];
        input[ch.a] = v1;
        x1[m] = to_float(v1);
      }
      if (ch.has_b) {
        const T v2 = src[ch.b];
        input[ch.b] = v2;
        x2[m] = to_float(v2);
      }
      sum += x1[m] + x2[m];
    }
    float mu = 0.0f;
    if constexpr (kLayerNorm) mu = warp_sum(sum) * inv_d;
    float ss = 0.0f;
#pragma unroll
    for (int m = 0; m < K; ++m) {
      const HeadChannels ch = head_channels(lane + 32 * m, D, R);
      const float d1 = ch.has_a ? x1[m] - mu : 0.0f, d2 = ch.has_b ? x2[m] - mu : 0.0f;
      ss += d1 * d1 + d2 * d2;
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) * inv_d + params.eps);

#pragma unroll
    for (int m = 0; m < K; ++m) {
      const int i = lane + 32 * m;
      const HeadChannels ch = head_channels(i, D, R);
      float y1 = ch.has_a ? (x1[m] - mu) * r * w[ch.a] : 0.0f;
      float y2 = ch.has_b ? (x2[m] - mu) * r * w[ch.b] : 0.0f;
      if (params.has_bias) {
        if (ch.has_a) y1 += b[ch.a];
        if (ch.has_b) y2 += b[ch.b];
      }
      if (ch.rotated) {  // the pair (i, i + half)
        const float c = table[i], sn = table[half + i];
        const float o1 = y1 * c - y2 * sn, o2 = y2 * c + y1 * sn;
        y1 = o1;
        y2 = o2;
      }
      if (ch.has_a) out[ch.a] = from_float<T>(y1);
      if (ch.has_b) out[ch.b] = from_float<T>(y2);
    }
    if (lane == 0) {
      const int64_t norm_row = place.offset / D;
      (is_q ? a.q_rstd : a.k_rstd)[norm_row] = r;
      if constexpr (kLayerNorm) (is_q ? a.q_mean : a.k_mean)[norm_row] = mu;
    }
  }
}

// ---- backward ----

template <typename T>
struct BackwardArgs {
  const T* dq;
  const T* dk;
  const T* dv;
  const T* q_input;
  const T* k_input;
  const float* q_mean;  // LayerNorm only
  const float* q_rstd;
  const float* k_mean;
  const float* k_rstd;
  T* dqkv;
  float* partial;  // [chunks, accumulators, D]: q weight, k weight (, q bias, k bias)
  int64_t tokens_per_chunk;
  bool bias_grads;
};

// Block c handles tokens [c tpc, (c + 1) tpc) one after the other; warp w the token's
// packed heads w, w + warps, ... With u = the inverse rotation of the head's gradient,
// g = u * w, xhat = (x - mean) r (ops/cuda/norm.cu's norm_backward_dx_kernel):
//   LayerNorm dx = r (g - mean(g) - xhat mean(g xhat)), RMSNorm dx = r (g - xhat mean(g xhat)),
// written to the head's slot of dqkv; value heads copy dv. Each lane adds u * xhat (and u)
// of its columns into the q or k sums; at the end the block writes its partial rows.
template <typename T, int K, bool kLayerNorm>
__global__ void __launch_bounds__(kMaxWarps * 32)
    qkv_norm_backward_kernel(BackwardArgs<T> a, QkvDims dims, NormParams params, InvFreq inv_freq) {
  extern __shared__ float shared[];
  const int D = dims.head_dim, R = dims.rotary_dim, half = R / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  float* param = shared;  // q_weight, k_weight: [2][D]
  float* table = shared + 2 * D;
  float* reduce = table + 2 * half;  // [warps][D]
  load_params(param, params, 2, D);
  __syncthreads();

  float wq1[K] = {}, wq2[K] = {}, wk1[K] = {}, wk2[K] = {};  // weight-gradient sums
  float bq1[K] = {}, bq2[K] = {}, bk1[K] = {}, bk2[K] = {};  // bias-gradient sums
  const int slots = dims.slots();
  const float inv_d = 1.0f / float(D);
  const int64_t t_begin = int64_t(blockIdx.x) * a.tokens_per_chunk;
  const int64_t t_end = std::min(dims.tokens, t_begin + a.tokens_per_chunk);
  for (int64_t t = t_begin; t < t_end; ++t) {
    if (half > 0) fill_rope_table(table, dims.position(t), half, inv_freq);
    T* row = a.dqkv + t * int64_t(slots) * D;
    for (int slot = warp; slot < slots; slot += warps) {
      const HeadPlace place = place_of(t, slot, dims);
      T* dst = row + int64_t(slot) * D;
      if (place.part == 2) {
        const T* src = a.dv + place.offset;
        for (int j = lane; j < D; j += 32) dst[j] = src[j];
        continue;
      }
      const bool is_q = place.part == 0;
      const T* dy = (is_q ? a.dq : a.dk) + place.offset;
      const T* x = (is_q ? a.q_input : a.k_input) + place.offset;
      const float* w = param + (is_q ? 0 : D);
      const int64_t norm_row = place.offset / D;
      const float mu = kLayerNorm ? (is_q ? a.q_mean : a.k_mean)[norm_row] : 0.0f;
      const float r = (is_q ? a.q_rstd : a.k_rstd)[norm_row];

      float u1[K], u2[K], xhat1[K], xhat2[K];
      float g_sum = 0.0f, gx_sum = 0.0f;
#pragma unroll
      for (int m = 0; m < K; ++m) {
        const int i = lane + 32 * m;
        const HeadChannels ch = head_channels(i, D, R);
        float d1 = ch.has_a ? to_float(dy[ch.a]) : 0.0f, d2 = ch.has_b ? to_float(dy[ch.b]) : 0.0f;
        if (ch.rotated) {  // the inverse rotation: by -angle
          const float c = table[i], sn = -table[half + i];
          const float o1 = d1 * c - d2 * sn, o2 = d2 * c + d1 * sn;
          d1 = o1;
          d2 = o2;
        }
        u1[m] = d1;
        u2[m] = d2;
        xhat1[m] = ch.has_a ? (to_float(x[ch.a]) - mu) * r : 0.0f;
        xhat2[m] = ch.has_b ? (to_float(x[ch.b]) - mu) * r : 0.0f;
        const float g1 = ch.has_a ? d1 * w[ch.a] : 0.0f, g2 = ch.has_b ? d2 * w[ch.b] : 0.0f;
        g_sum += g1 + g2;
        gx_sum += g1 * xhat1[m] + g2 * xhat2[m];
      }
      const float g_mean = kLayerNorm ? warp_sum(g_sum) * inv_d : 0.0f;
      const float gx_mean = warp_sum(gx_sum) * inv_d;
#pragma unroll
      for (int m = 0; m < K; ++m) {
        const HeadChannels ch = head_channels(lane + 32 * m, D, R);
        if (ch.has_a)
          dst[ch.a] = from_float<T>(r * (u1[m] * w[ch.a] - g_mean - xhat1[m] * gx_mean));
        if (ch.has_b)
          dst[ch.b] = from_float<T>(r * (u2[m] * w[ch.b] - g_mean - xhat2[m] * gx_mean));
        // Lanes past the row hold u = 0: they add nothing.
        if (is_q) {
          wq1[m] += u1[m] * xhat1[m];
          wq2[m] += u2[m] * xhat2[m];
          bq1[m] += u1[m];
          bq2[m] += u2[m];
        } else {
          wk1[m] += u1[m] * xhat1[m];
          wk2[m] += u2[m] * xhat2[m];
          bk1[m] += u1[m];
          bk2[m] += u2[m];
        }
      }
    }
    __syncthreads();  // the next token's table replaces this one's
  }

  // The block's partial row of each sum: the warps' columns added in warp order.
  const int accumulators = a.bias_grads ? 4 : 2;
  auto flush = [&](const float(&c1)[K], const float(&c2)[K], int acc) {
    float* mine = reduce + warp * D;
#pragma unroll
    for (int m = 0; m < K; ++m) {
      const HeadChannels ch = head_channels(lane + 32 * m, D, R);
      if (ch.has_a) mine[ch.a] = c1[m];
      if (ch.has_b) mine[ch.b] = c2[m];
    }
    __syncthreads();
    float* out = a.partial + (int64_t(blockIdx.x) * accumulators + acc) * D;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
      float s = 0.0f;
      for (int v = 0; v < warps; ++v) s += reduce[v * D + j];
      out[j] = s;
    }
    __syncthreads();
  };
  flush(wq1, wq2, 0);
  flush(wk1, wk2, 1);
  if (a.bias_grads) {
    flush(bq1, bq2, 2);
    flush(bk1, bk2, 3);
  }
}

// grads[acc][j] += sum over chunks c (in order of c mod kFinalizeRows, then of the rows) of
// partial[c, acc, j]. Block (32, kFinalizeRows), grid (column tiles, accumulators).
struct GradTargets {
  float* dst[4];  // q weight, k weight, q bias, k bias
};

__global__ void qkv_norm_grad_finalize_kernel(const float* __restrict__ partial, int64_t chunks,
                                              int accumulators, int D, GradTargets targets) {
  __shared__ float sums[kFinalizeRows][33];
  const int col = blockIdx.x * 32 + threadIdx.x, acc = blockIdx.y;
  float s = 0.0f;
  if (col < D)
    for (int64_t c = threadIdx.y; c < chunks; c += kFinalizeRows)
      s += partial[(c * accumulators + acc) * D + col];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < D) {
    float total = sums[0][threadIdx.x];
    for (int y = 1; y < kFinalizeRows; ++y) total += sums[y][threadIdx.x];
    targets.dst[acc][col] += total;
  }
}

// ---- door checks ----

void check_f32_shape(const Tensor& t, const Shape& want, const char* op, const char* name) {
  detail::check_dtype(t, DType::F32, op, name);
  detail::check_shape(t, want, op, name);
}

void check_norm(const QkNorm& norm, int64_t D, const char* op) {
  detail::check_float(norm.q_weight, op, "q_weight");
  detail::check_shape(norm.q_weight, {D}, op, "q_weight");
  detail::check_float(norm.k_weight, op, "k_weight");
  detail::check_shape(norm.k_weight, {D}, op, "k_weight");
  detail::check_same_dtype(norm.k_weight, norm.q_weight, op, "k_weight", "q_weight");
  MEGATON_CHECK(norm.q_bias.defined() == norm.k_bias.defined(),
                "{}: q_bias and k_bias must be both defined or both undefined", op);
  if (norm.q_bias.defined()) {
    MEGATON_CHECK(norm.type == QkNormType::LayerNorm, "{}: RMSNorm takes no bias", op);
    for (auto [t, name] : {std::pair{&norm.q_bias, "q_bias"}, std::pair{&norm.k_bias, "k_bias"}}) {
      detail::check_float(*t, op, name);
      detail::check_shape(*t, {D}, op, name);
      detail::check_same_dtype(*t, norm.q_weight, op, name, "q_weight");
    }
  }
}

// Checks of both directions; `grad` prefixes the names of qkv, q, k, v ("" or "d").
QkvDims check_args(const char* op, const char* grad, const Tensor& packed, const Tensor& q,
                   const Tensor& k, const Tensor& v, const QkNormSaved& saved,
                   int64_t num_query_groups, const QkNorm& norm, bool apply_rope, float rotary_base,
                   const Tensor& position_ids, int64_t rotary_dim) {
  const std::string g(grad);
  const std::string q_name = g + "q", k_name = g + "k", v_name = g + "v", qkv_name = g + "qkv";
  detail::check_float(q, op, q_name.c_str());
  detail::check_float(k, op, k_name.c_str());
  detail::check_float(v, op, v_name.c_str());
  detail::check_float(packed, op, qkv_name.c_str());
  detail::check_same_dtype(k, q, op, k_name.c_str(), q_name.c_str());
  detail::check_same_dtype(v, q, op, v_name.c_str(), q_name.c_str());
  detail::check_same_dtype(packed, q, op, qkv_name.c_str(), q_name.c_str());
  const QkvShape sh = check_qkv_shapes(op, grad, packed, q, k, v, num_query_groups, apply_rope,
                                      rotary_base, rotary_dim);
  const int64_t B = sh.batch, S = sh.seq, heads = sh.heads, D = sh.head_dim, groups = sh.groups;
  const Shape kv_shape{B, S, groups, D};
  MEGATON_CHECK(D >= 1 && D <= kMaxHeadDim, "{}: head dim {} outside the supported 1..{}", op, D,
                kMaxHeadDim);
  MEGATON_CHECK((heads + 2 * groups) <= INT32_MAX / kMaxHeadDim, "{}: {} heads per token", op,
                heads + 2 * groups);
  MEGATON_CHECK(B * S <= INT32_MAX, "{}: B * S {} exceeds the grid limit", op, B * S);
  check_norm(norm, D, op);
  detail::check_float(saved.q_input, op, "q_input");
  detail::check_shape(saved.q_input, q.shape(), op, "q_input");
  detail::check_same_dtype(saved.q_input, q, op, "q_input", q_name.c_str());
  detail::check_float(saved.k_input, op, "k_input");
  detail::check_shape(saved.k_input, kv_shape, op, "k_input");
  detail::check_same_dtype(saved.k_input, q, op, "k_input", q_name.c_str());
  const Shape q_rows{B * S * heads}, k_rows{B * S * groups};
  check_f32_shape(saved.q_rstd, q_rows, op, "q_rstd");
  check_f32_shape(saved.k_rstd, k_rows, op, "k_rstd");
  if (norm.type == QkNormType::LayerNorm) {
    check_f32_shape(saved.q_mean, q_rows, op, "q_mean");
    check_f32_shape(saved.k_mean, k_rows, op, "k_mean");
  }
  check_position_ids(op, position_ids, B * S, Device::CUDA);
  const int32_t* positions = position_ids.defined() ? position_ids.i32() : nullptr;
  return QkvDims{B * S,  S,         int(heads),        int(groups), int(heads / groups),
                 int(D), positions, int(sh.rotary_dim)};
}

// `written` must share memory with none of `read` nor with each other.
void check_apart(const std::vector<const Tensor*>& written, const std::vector<const Tensor*>& read,
                 const char* op) {
  for (size_t w = 0; w < written.size(); ++w) {
    for (const Tensor* r : read)
      MEGATON_CHECK(!::megaton::ops::detail::overlaps(*written[w], *r),
                    "{}: an output shares memory with an input", op);
    for (size_t other = w + 1; other < written.size(); ++other)
      MEGATON_CHECK(!::megaton::ops::detail::overlaps(*written[w], *written[other]),
                    "{}: two outputs share memory", op);
  }
}

// The R / 2 frequencies over the rotary dim R (none for R = 0: no RoPE).
InvFreq inverse_frequencies(int R, float rotary_base) {
  InvFreq inv_freq{};
  for (int i = 0; i < R / 2; ++i) {
    // Exactly ops/cpu/rope_tables.h's rope_inv_freq.
    float exponent = float(2 * i) / float(R);
    inv_freq.value[i] = 1.0f / std::pow(rotary_base, exponent);
  }
  return inv_freq;
}

NormParams norm_params(const QkNorm& norm) {
  const bool bias = norm.q_bias.defined();
  return NormParams{{norm.q_weight.raw(), norm.k_weight.raw(), bias ? norm.q_bias.raw() : nullptr,
                     bias ? norm.k_bias.raw() : nullptr},
                    norm.q_weight.dtype() == DType::BF16  ? ParamType::BF16
                    : norm.q_weight.dtype() == DType::F16 ? ParamType::F16
                                                          : ParamType::F32,
                    bias,
                    norm.eps};
}

// Calls f(std::integral_constant<int, K>) with K = the lane's value pairs for head dim D:
// the smallest of 1, 2, 4, 8 with 32 K >= ceil(D / 2) (head_channels' slots, any R).
template <typename F>
void dispatch_pairs(int D, F&& f) {
  const int first = (D + 1) / 2;
  if (first <= 32)
    f(std::integral_constant<int, 1>{});
  else if (first <= 64)
    f(std::integral_constant<int, 2>{});
  else if (first <= 128)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

template <typename F>
void dispatch_layernorm(bool layernorm, F&& f) {
  if (layernorm)
    f(std::true_type{});
  else
    f(std::false_type{});
}

template <typename T>
T* typed(const Tensor& t) {
  return static_cast<T*>(t.raw());
}

int warps_for(const QkvDims& dims) { return std::min(kMaxWarps, dims.slots()); }

}  // namespace

void qkv_split_norm_rope(const Tensor& qkv, int64_t batch, int64_t num_query_groups,
                         const QkNorm& norm, bool apply_rope, float rotary_base, Tensor& q,
                         Tensor& k, Tensor& v, QkNormSaved& saved, const Tensor& position_ids,
                         int64_t rotary_dim) {
  const char* op = "cuda qkv_split_norm_rope";
  const QkvDims dims = check_args(op, "", qkv, q, k, v, saved, num_query_groups, norm, apply_rope,
                                  rotary_base, position_ids, rotary_dim);
  MEGATON_CHECK(batch == q.dim(0), "{}: batch {} does not match q {}", op, batch,
                shape_str(q.shape()));
  const bool layernorm = norm.type == QkNormType::LayerNorm;
  std::vector<const Tensor*> written{
      &q, &k, &v, &saved.q_input, &saved.k_input, &saved.q_rstd, &saved.k_rstd};
  if (layernorm) written.insert(written.end(), {&saved.q_mean, &saved.k_mean});
  check_apart(written, {&qkv}, op);
  if (dims.tokens == 0) return;

  const int D = dims.head_dim, R = dims.rotary_dim;
  const InvFreq inv_freq = inverse_frequencies(R, rotary_base);
  const NormParams params = norm_params(norm);
  const size_t shared_bytes = (4 * size_t(D) + size_t(R)) * sizeof(float);
  const int threads = 32 * warps_for(dims);
  detail::dispatch_float(qkv.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ForwardArgs<T> a{typed<T>(qkv),
                     typed<T>(q),
                     typed<T>(k),
                     typed<T>(v),
                     typed<T>(saved.q_input),
                     typed<T>(saved.k_input),
                     layernorm ? saved.q_mean.f32() : nullptr,
                     saved.q_rstd.f32(),
                     layernorm ? saved.k_mean.f32() : nullptr,
                     saved.k_rstd.f32()};
    dispatch_pairs(D, [&](auto pairs) {
      dispatch_layernorm(layernorm, [&](auto ln) {
        qkv_norm_forward_kernel<T, decltype(pairs)::value, decltype(ln)::value>
            <<<unsigned(dims.tokens), threads, shared_bytes, compute_stream()>>>(
                a, dims, params, inv_freq);
      });
    });
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void qkv_pack_norm_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                 const QkNormSaved& saved, int64_t num_query_groups,
                                 const QkNorm& norm, bool apply_rope, float rotary_base,
                                 Tensor& dqkv, QkNormGrads& grads, const Tensor& position_ids,
                                 int64_t rotary_dim) {
  const char* op = "cuda qkv_pack_norm_rope_backward";
  const QkvDims dims = check_args(op, "d", dqkv, dq, dk, dv, saved, num_query_groups, norm,
                                  apply_rope, rotary_base, position_ids, rotary_dim);
  const int D = dims.head_dim;
  check_f32_shape(grads.q_weight, {D}, op, "grads.q_weight");
  check_f32_shape(grads.k_weight, {D}, op, "grads.k_weight");
  MEGATON_CHECK(grads.q_bias.defined() == grads.k_bias.defined(),
                "{}: grads.q_bias and grads.k_bias must be both defined or both undefined", op);
  const bool bias_grads = grads.q_bias.defined();
  if (bias_grads) {
    MEGATON_CHECK(norm.q_bias.defined(), "{}: bias gradients of a norm without a bias", op);
    check_f32_shape(grads.q_bias, {D}, op, "grads.q_bias");
    check_f32_shape(grads.k_bias, {D}, op, "grads.k_bias");
  }
  check_apart({&dqkv}, {&dq, &dk, &dv, &saved.q_input, &saved.k_input}, op);
  if (dims.tokens == 0) return;

  const bool layernorm = norm.type == QkNormType::LayerNorm;
  const InvFreq inv_freq = inverse_frequencies(dims.rotary_dim, rotary_base);
  const NormParams params = norm_params(norm);
  const int warps = warps_for(dims);
  // Chunks of consecutive tokens: a function of the shape only (determinism).
  const int64_t tokens_per_chunk = (dims.tokens + kMaxChunks - 1) / kMaxChunks;
  const int64_t chunks = (dims.tokens + tokens_per_chunk - 1) / tokens_per_chunk;
  const int accumulators = bias_grads ? 4 : 2;
  Tensor partial = Tensor::empty({chunks, accumulators, D}, DType::F32, Device::CUDA);
  const size_t shared_bytes =
      (2 * size_t(D) + size_t(dims.rotary_dim) + size_t(warps) * D) * sizeof(float);
  detail::dispatch_float(dqkv.dtype(), [&](auto zero) {
    using T = decltype(zero);
    BackwardArgs<T> a{typed<T>(dq),
                      typed<T>(dk),
                      typed<T>(dv),
                      typed<T>(saved.q_input),
                      typed<T>(saved.k_input),
                      layernorm ? saved.q_mean.f32() : nullptr,
                      saved.q_rstd.f32(),
                      layernorm ? saved.k_mean.f32() : nullptr,
                      saved.k_rstd.f32(),
                      typed<T>(dqkv),
                      partial.f32(),
                      tokens_per_chunk,
                      bias_grads};
    dispatch_pairs(D, [&](auto pairs) {
      dispatch_layernorm(layernorm, [&](auto ln) {
        qkv_norm_backward_kernel<T, decltype(pairs)::value, decltype(ln)::value>
            <<<unsigned(chunks), 32 * warps, shared_bytes, compute_stream()>>>(
                a, dims, params, inv_freq);
      });
    });
    MEGATON_CUDA_CHECK_LAUNCH();
  });
  GradTargets targets{{grads.q_weight.f32(), grads.k_weight.f32(),
                       bias_grads ? grads.q_bias.f32() : nullptr,
                       bias_grads ? grads.k_bias.f32() : nullptr}};
  qkv_norm_grad_finalize_kernel<<<dim3(unsigned((D + 31) / 32), unsigned(accumulators)),
                                  dim3(32, kFinalizeRows), 0, compute_stream()>>>(
      partial.f32(), chunks, accumulators, D, targets);
  MEGATON_CUDA_CHECK_LAUNCH();
  // partial is released here; the caching allocator hands blocks out in stream order on
  // the one compute stream, so the kernels above finish with it first.
}

}  // namespace megaton::ops::cuda
