// Fused split of Megatron's grouped QKV projection into q, k, v with RoPE, and its
// gradient (pack); CPU fp32 reference.
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/dispatch.h"
#include "ops/ops.h"
#include "ops/qkv_checks.h"
#include "ops/cpu/rope_tables.h"

namespace megaton::ops {
namespace {

// Below this many elements the loop runs on the calling thread (as in rope.cpp).
constexpr int64_t kParallelMin = int64_t(1) << 15;

// Door checks shared by both directions. `grad` prefixes the names in messages ("" for
// the forward's qkv, q, k, v; "d" for the backward's).
QkvShape check_qkv_args(const char* op, const char* grad, const Tensor& packed, const Tensor& q,
                        const Tensor& k, const Tensor& v, int64_t num_query_groups, bool apply_rope,
                        float rotary_base, int64_t rotary_dim) {
  MEGATON_CHECK(packed.defined() && q.defined() && k.defined() && v.defined(),
                "{}: {}qkv, {}q, {}k and {}v must be allocated", op, grad, grad, grad, grad);
  for (const Tensor* t : {&packed, &q, &k, &v}) {
    MEGATON_CHECK(t->device() == Device::CPU, "{}: only the CPU backend is built", op);
    MEGATON_CHECK(t->dtype() == DType::F32, "{}: {}qkv, {}q, {}k, {}v must be F32, got {}", op,
                  grad, grad, grad, grad, dtype_name(t->dtype()));
  }
  return check_qkv_shapes(op, grad, packed, q, k, v, num_query_groups, apply_rope, rotary_base,
                          rotary_dim);
}

// Walks the grouped layout: for every token and every head of its packed row, calls
// move(packed_offset, part, part_offset, cos_s, sin_s), where part is 0, 1, 2 for q, k, v,
// offsets are in elements, and cos_s, sin_s are the token's RoPE tables for a q or k head
// under RoPE (at position s, or position_ids[t] when given; sh.rotary_dim / 2 frequencies
// over the rotary dim), null otherwise. Tokens run in parallel; heads never overlap.
template <typename Move>
void for_each_head(const QkvShape& sh, bool apply_rope, float rotary_base,
                   const Tensor& position_ids, Move&& move) {
  const int64_t D = sh.head_dim, qpg = sh.heads_per_group();
  cpu::RopeRows rope;
  if (apply_rope)
    rope = cpu::rope_rows(cpu::rope_inv_freq(sh.rotary_dim, rotary_base), sh.seq, sh.tokens(),
                          position_ids.defined() ? position_ids.i32() : nullptr);
#pragma omp parallel for schedule(static) if (sh.tokens() * sh.row() >= kParallelMin)
  for (int64_t t = 0; t < sh.tokens(); ++t) {
    const float* cos_s = apply_rope ? rope.cos_at(t) : nullptr;
    const float* sin_s = apply_rope ? rope.sin_at(t) : nullptr;
    for (int64_t g = 0; g < sh.groups; ++g) {
      const int64_t group = t * sh.row() + g * (qpg + 2) * D;
      for (int64_t j = 0; j < qpg; ++j)
        move(group + j * D, 0, (t * sh.heads + g * qpg + j) * D, cos_s, sin_s);
      move(group + qpg * D, 1, (t * sh.groups + g) * D, cos_s, sin_s);
      move(group + (qpg + 1) * D, 2, (t * sh.groups + g) * D, nullptr, nullptr);
    }
  }
}

}  // namespace

void qkv_split_rope(const Tensor& qkv, int64_t batch, int64_t num_query_groups, Tensor& q,
                    Tensor& k, Tensor& v, bool apply_rope, float rotary_base,
                    const Tensor& position_ids, int64_t rotary_dim) {
  MEGATON_CUDA_DISPATCH(qkv, cuda::qkv_split_rope(qkv, batch, num_query_groups, q, k, v, apply_rope,
                                                  rotary_base, position_ids, rotary_dim));
  const QkvShape sh = check_qkv_args("qkv_split_rope", "", qkv, q, k, v, num_query_groups,
                                     apply_rope, rotary_base, rotary_dim);
  check_position_ids("qkv_split_rope", position_ids, sh.tokens(), Device::CPU);
  MEGATON_CHECK(batch == sh.batch, "qkv_split_rope: batch {} does not match q {}", batch,
                shape_str(q.shape()));
  const float* src = qkv.f32();
  float* dst[3] = {q.f32(), k.f32(), v.f32()};
  const int64_t D = sh.head_dim;
  for_each_head(
      sh, apply_rope, rotary_base, position_ids,
      [&](int64_t packed, int part, int64_t separate, const float* cos_s, const float* sin_s) {
        cpu::rope_move_head(src + packed, dst[part] + separate, D, cos_s, sin_s, 1.0f,
                            sh.rotary_dim);
      });
}

void qkv_pack_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            int64_t num_query_groups, bool apply_rope, float rotary_base,
                            Tensor& dqkv, const Tensor& position_ids, int64_t rotary_dim) {
  MEGATON_CUDA_DISPATCH(dq, cuda::qkv_pack_rope_backward(dq, dk, dv, num_query_groups, apply_rope,
                                                         rotary_base, dqkv, position_ids,
                                                         rotary_dim));
  const QkvShape sh = check_qkv_args("qkv_pack_rope_backward", "d", dqkv, dq, dk, dv,
                                     num_query_groups, apply_rope, rotary_base, rotary_dim);
  check_position_ids("qkv_pack_rope_backward", position_ids, sh.tokens(), Device::CPU);
  const float* src[3] = {dq.f32(), dk.f32(), dv.f32()};
  float* dst = dqkv.f32();
  const int64_t D = sh.head_dim;
  for_each_head(
      sh, apply_rope, rotary_base, position_ids,
      [&](int64_t packed, int part, int64_t separate, const float* cos_s, const float* sin_s) {
        cpu::rope_move_head(src[part] + separate, dst + packed, D, cos_s, sin_s, -1.0f,
                            sh.rotary_dim);
      });
}

}  // namespace megaton::ops
