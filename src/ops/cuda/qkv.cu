// Fused split of Megatron's grouped QKV projection with RoPE, and its gradient, on the GPU:
// one kernel each way, F32, BF16 and F16.
//
// Replaces 3 * num_query_groups strided copies plus two RoPE launches per layer and
// direction. The numbers are those of ops/cuda/rope.cu (and so of ops/cpu/rope.cpp):
// inv_freq_i = 1 / base^(float(2i) / R) (R the rotary dim: the head dim, or fewer channels
// with partial RoPE) is computed on the host with the CPU's expression and passed as a
// kernel argument, angle = float(s) * inv_freq_i is one fp32 multiply without contraction,
// and cos/sin of that fp32 angle are evaluated in double and rounded once per (token,
// frequency).

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/qkv_checks.h"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using detail::from_float;
using detail::Pack;
using detail::to_float;

// Up to D = 512: the frequencies travel as a kernel argument (1 KiB), no device buffer.
constexpr int kMaxHalfDim = 256;
constexpr int kMaxThreads = 256;

struct InvFreq {
  float value[kMaxHalfDim];
};

// Sizes of one call: q [B, S, heads, head_dim], k, v [B, S, groups, head_dim], packed
// [B*S, groups * (heads_per_group + 2) * head_dim]; the tokens' RoPE positions
// (position_ids [B*S], or s = t % seq when null); rotary_dim: the channels of each q and k
// head RoPE rotates (even, <= head_dim; 0 without RoPE).
struct QkvDims {
  int64_t seq;
  int heads, groups, heads_per_group, head_dim;
  const int32_t* position_ids;
  int rotary_dim;
};

__device__ __forceinline__ int64_t position_of(int64_t t, const QkvDims& dims) {
  return dims.position_ids ? int64_t(dims.position_ids[t]) : t % dims.seq;
}

// Pointers to the three separate tensors; Elem is T (split writes them) or const T (the
// backward reads them).
template <typename Elem>
struct QkvParts {
  Elem* q;
  Elem* k;
  Elem* v;
};

// Fills table[0, half) with cos and table[half, 2 half) with sin of the token's angles at
// position s. Ends with a barrier: every thread of the block must call it.
__device__ void fill_rope_table(float* table, int64_t s, int half, const InvFreq& inv_freq) {
  const float pos = float(s);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = __fmul_rn(pos, inv_freq.value[i]);  // no contraction, as on the CPU
    table[i] = float(cos(double(angle)));
    table[half + i] = float(sin(double(angle)));
  }
  __syncthreads();
}

// Where a head of the packed row lives among q, k, v. Packed slot u = g * (qpg + 2) + r of
// token t holds query head g * qpg + r for r < qpg, key head g for r = qpg, value head g
// for r = qpg + 1.
struct HeadPlace {
  int part;        // 0 q, 1 k, 2 v
  int64_t offset;  // element offset of the head's first value in that tensor
};

__device__ __forceinline__ HeadPlace place_of(int64_t t, int slot, const QkvDims& dims) {
  const int g = slot / (dims.heads_per_group + 2), r = slot % (dims.heads_per_group + 2);
  const int64_t D = dims.head_dim;
  if (r < dims.heads_per_group)
    return {0, (t * dims.heads + int64_t(g) * dims.heads_per_group + r) * D};
  return {r == dims.heads_per_group ? 1 : 2, (t * dims.groups + g) * D};
}

template <typename Elem>
__device__ __forceinline__ Elem* part_pointer(const QkvParts<Elem>& parts, int part) {
  return part == 0 ? parts.q : part == 1 ? parts.k : parts.v;
}

// N values of each half of a head: in[0, N) and in[half, half + N), rotated by
// sign * angle (cos_i, sin_i point at the N frequencies) or copied, to out likewise. The
// expressions are rope.cu's.
template <typename T, int N>
__device__ __forceinline__ void move_pairs(const T* in, T* out, int half, const float* cos_i,
                                           const float* sin_i, bool rotate, float sign) {
  Pack<T, N> first = detail::load_pack<N>(in), second = detail::load_pack<N>(in + half);
  if (rotate) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float x1 = to_float(first.v[j]), x2 = to_float(second.v[j]);
      const float c = cos_i[j], sn = sign * sin_i[j];
      first.v[j] = from_float<T>(x1 * c - x2 * sn);
      second.v[j] = from_float<T>(x2 * c + x1 * sn);
    }
  }
  detail::store_pack<N>(out, first);
  detail::store_pack<N>(out + half, second);
}

// One block per token t = b * S + s (RoPE position s, or position_ids[t]). With RoPE, the token's
// cos/sin are computed once into shared memory. Threads stride over (packed head slot, chunk):
// the first half / N chunks of a head (half = rotary_dim / 2) each move N values of both halves
// of its rotary channels (rotated for q and k, copied for v); the remaining (head_dim -
// rotary_dim) / N chunks copy N values of the tail [rotary_dim, head_dim) (partial RoPE; all of
// the head without RoPE). The same kernel walks both directions: split reads the packed row and
// writes q, k, v (sign +1); the backward reads dq, dk, dv and writes the packed row (sign -1, the
// transpose of a rotation).
template <typename T, int N, bool kPack>
__global__ void qkv_kernel(const T* packed_in, T* packed_out, QkvParts<const T> parts_in,
                           QkvParts<T> parts_out, QkvDims dims, InvFreq inv_freq) {
  extern __shared__ float table[];  // cos[half], then sin[half]
  const int64_t t = blockIdx.x;
  const int half = dims.rotary_dim / 2;
  if (half > 0) fill_rope_table(table, position_of(t, dims), half, inv_freq);
  const int pair_chunks = half / N;
  const int chunks = pair_chunks + (dims.head_dim - dims.rotary_dim) / N;
  const int slots = dims.groups * (dims.heads_per_group + 2);
  const int64_t row_start = t * int64_t(slots) * dims.head_dim;
  const float sign = kPack ? -1.0f : 1.0f;
  for (int item = threadIdx.x; item < slots * chunks; item += blockDim.x) {
    const int slot = item / chunks, chunk = item % chunks;
    const bool pairs = chunk < pair_chunks;
    const int i = pairs ? chunk * N : dims.rotary_dim + (chunk - pair_chunks) * N;
    const HeadPlace place = place_of(t, slot, dims);
    const T* in;
    T* out;
    if constexpr (kPack) {
      in = part_pointer(parts_in, place.part) + place.offset + i;
      out = packed_out + row_start + int64_t(slot) * dims.head_dim + i;
    } else {
      in = packed_in + row_start + int64_t(slot) * dims.head_dim + i;
      out = part_pointer(parts_out, place.part) + place.offset + i;
    }
    if (pairs) {
      const bool rotate = place.part != 2;  // v is never rotated
      move_pairs<T, N>(in, out, half, table + i, table + half + i, rotate, sign);
    } else {
      detail::store_pack<N>(out, detail::load_pack<N>(in));
    }
  }
}

// Door checks shared by both directions; `grad` prefixes the names in messages ("" or "d").
QkvDims check_qkv_args(const char* op, const char* grad, const Tensor& packed, const Tensor& q,
                       const Tensor& k, const Tensor& v, int64_t num_query_groups, bool apply_rope,
                       float rotary_base, const Tensor& position_ids, int64_t rotary_dim) {
  const std::string q_name = std::string(grad) + "q", k_name = std::string(grad) + "k",
                    v_name = std::string(grad) + "v", qkv_name = std::string(grad) + "qkv";
  detail::check_float(q, op, q_name.c_str());
  detail::check_float(k, op, k_name.c_str());
  detail::check_float(v, op, v_name.c_str());
  detail::check_float(packed, op, qkv_name.c_str());
  detail::check_same_dtype(k, q, op, k_name.c_str(), q_name.c_str());
  detail::check_same_dtype(v, q, op, v_name.c_str(), q_name.c_str());
  detail::check_same_dtype(packed, q, op, qkv_name.c_str(), q_name.c_str());
  const QkvShape sh = check_qkv_shapes(op, grad, packed, q, k, v, num_query_groups, apply_rope,
                                      rotary_base, rotary_dim);
  MEGATON_CHECK(sh.row() <= INT32_MAX, "{}: {} values per token exceed int32", op, sh.row());
  MEGATON_CHECK(sh.tokens() <= INT32_MAX, "{}: B * S {} exceeds the grid limit", op, sh.tokens());
  MEGATON_CHECK(sh.rotary_dim / 2 <= kMaxHalfDim,
                "{}: rotary dim {} exceeds the {} supported with RoPE", op, sh.rotary_dim,
                2 * kMaxHalfDim);
  check_position_ids(op, position_ids, sh.tokens(), Device::CUDA);
  return QkvDims{sh.seq,
                 int(sh.heads),
                 int(sh.groups),
                 int(sh.heads_per_group()),
                 int(sh.head_dim),
                 position_ids.defined() ? position_ids.i32() : nullptr,
                 int(sh.rotary_dim)};
}

// Launches qkv_kernel<T, N, kPack> with N = 16 bytes of T when every access can be an
// aligned 16-byte pack, else one value (or pair) per item.
template <typename T, bool kPack>
void launch(const T* packed_in, T* packed_out, QkvParts<const T> parts_in, QkvParts<T> parts_out,
            const QkvDims& dims, int64_t tokens, float rotary_base) {
  const int D = dims.head_dim, R = dims.rotary_dim, half = R / 2;
  InvFreq inv_freq{};
  for (int i = 0; i < half; ++i) {
    // Exactly ops/cpu/rope_tables.h's rope_inv_freq over the rotary dim.
    float exponent = float(2 * i) / float(R);
    inv_freq.value[i] = 1.0f / std::pow(rotary_base, exponent);
  }
  constexpr int kWide = detail::kPackElems<T>;
  // Every access starts at a multiple of D (a head) plus i: a multiple of N below half,
  // i + half for a pair's second value, R + a multiple of N in the tail. Aligned bases,
  // half % N == 0 and (D - R) % N == 0 (so D % N == 0 too) make every pack aligned.
  const bool wide = half % kWide == 0 && (D - R) % kWide == 0 &&
                    detail::pack_aligned<kWide>(packed_in ? packed_in : packed_out) &&
                    detail::pack_aligned<kWide>(parts_in.q ? parts_in.q : parts_out.q) &&
                    detail::pack_aligned<kWide>(parts_in.k ? parts_in.k : parts_out.k) &&
                    detail::pack_aligned<kWide>(parts_in.v ? parts_in.v : parts_out.v);
  const int64_t slots = int64_t(dims.groups) * (dims.heads_per_group + 2);
  const int64_t items = slots * (half + D - R) / (wide ? kWide : 1);
  const int threads = int(std::min<int64_t>(kMaxThreads, (items + 31) / 32 * 32));
  const size_t shared_bytes = 2 * size_t(half) * sizeof(float);
  cudaStream_t stream = detail::compute_stream();
  if (wide) {
    qkv_kernel<T, kWide, kPack><<<unsigned(tokens), threads, shared_bytes, stream>>>(
        packed_in, packed_out, parts_in, parts_out, dims, inv_freq);
  } else {
    qkv_kernel<T, 1, kPack><<<unsigned(tokens), threads, shared_bytes, stream>>>(
        packed_in, packed_out, parts_in, parts_out, dims, inv_freq);
  }
  MEGATON_CUDA_CHECK_LAUNCH();
}

template <typename T>
T* typed(const Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.f32();
  } else {
    return reinterpret_cast<T*>(t.data<uint16_t>());
  }
}

}  // namespace

void qkv_split_rope(const Tensor& qkv, int64_t batch, int64_t num_query_groups, Tensor& q,
                    Tensor& k, Tensor& v, bool apply_rope, float rotary_base,
                    const Tensor& position_ids, int64_t rotary_dim) {
  const QkvDims dims = check_qkv_args("cuda qkv_split_rope", "", qkv, q, k, v, num_query_groups,
                                      apply_rope, rotary_base, position_ids, rotary_dim);
  MEGATON_CHECK(batch == q.dim(0), "cuda qkv_split_rope: batch {} does not match q {}", batch,
                shape_str(q.shape()));
  if (qkv.numel() == 0) return;
  detail::dispatch_float(qkv.dtype(), [&](auto zero) {
    using T = decltype(zero);
    launch<T, false>(typed<T>(qkv), nullptr, {nullptr, nullptr, nullptr},
                     {typed<T>(q), typed<T>(k), typed<T>(v)}, dims, qkv.dim(0), rotary_base);
  });
}

void qkv_pack_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            int64_t num_query_groups, bool apply_rope, float rotary_base,
                            Tensor& dqkv, const Tensor& position_ids, int64_t rotary_dim) {
  const QkvDims dims =
      check_qkv_args("cuda qkv_pack_rope_backward", "d", dqkv, dq, dk, dv, num_query_groups,
                     apply_rope, rotary_base, position_ids, rotary_dim);
  if (dqkv.numel() == 0) return;
  detail::dispatch_float(dqkv.dtype(), [&](auto zero) {
    using T = decltype(zero);
    launch<T, true>(nullptr, typed<T>(dqkv), {typed<T>(dq), typed<T>(dk), typed<T>(dv)},
                    {nullptr, nullptr, nullptr}, dims, dqkv.dim(0), rotary_base);
  });
}

}  // namespace megaton::ops::cuda
