// The grouped QKV layout's sizes and shape checks, shared by the doors of the fused QKV
// ops (qkv_split_rope / qkv_pack_rope_backward and qkv_split_norm_rope /
// qkv_pack_norm_rope_backward), CPU and CUDA alike. Dtype and device checks stay with each
// door.
#pragma once
#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/rope_dim.h"

namespace megaton::ops {

// Sizes of one call: q [B, S, heads, D], k, v [B, S, groups, D], packed [B*S, row];
// rotary_dim: the channels of each q and k head RoPE rotates (0 without RoPE).
struct QkvShape {
  int64_t batch, seq, heads, groups, head_dim;
  int64_t rotary_dim = 0;
  int64_t tokens() const { return batch * seq; }
  int64_t heads_per_group() const { return heads / groups; }
  int64_t row() const { return (heads + 2 * groups) * head_dim; }
};

// q must be 4-d [B, S, np, d], num_query_groups ng > 0 must divide np, k and v be
// [B, S, ng, d], packed [B*S, (np + 2 ng) d]; with RoPE rotary_base > 0 and the rotary dim
// (rotary_dim, 0: d) even and in (0, d] (checked_rotary_dim). InternalError naming `op`
// otherwise; `grad` prefixes the tensors' names in messages ("" for the forward's qkv, q,
// k, v; "d" for the backward's). Returns the sizes, the resolved rotary dim with RoPE.
inline QkvShape check_qkv_shapes(const char* op, const char* grad, const Tensor& packed,
                                 const Tensor& q, const Tensor& k, const Tensor& v,
                                 int64_t num_query_groups, bool apply_rope, float rotary_base,
                                 int64_t rotary_dim = 0) {
  MEGATON_CHECK(q.ndim() == 4, "{}: {}q must be [B, S, heads, D], got {}", op, grad,
                shape_str(q.shape()));
  QkvShape sh{q.dim(0), q.dim(1), q.dim(2), num_query_groups, q.dim(3)};
  MEGATON_CHECK(sh.groups > 0 && sh.heads % sh.groups == 0,
                "{}: num_query_groups {} must divide the {} query heads", op, sh.groups, sh.heads);
  const Shape kv_shape{sh.batch, sh.seq, sh.groups, sh.head_dim};
  MEGATON_CHECK(k.shape() == kv_shape && v.shape() == kv_shape, "{}: {}k {} and {}v {} must be {}",
                op, grad, shape_str(k.shape()), grad, shape_str(v.shape()), shape_str(kv_shape));
  const Shape packed_shape{sh.tokens(), sh.row()};
  MEGATON_CHECK(packed.shape() == packed_shape, "{}: {}qkv {} must be [B*S, (np + 2 ng) d] = {}",
                op, grad, shape_str(packed.shape()), shape_str(packed_shape));
  if (apply_rope) {
    sh.rotary_dim = checked_rotary_dim(op, rotary_dim, sh.head_dim);
    MEGATON_CHECK(rotary_base > 0.0f, "{}: rotary_base {} must be positive", op, rotary_base);
  }
  return sh;
}

// The optional per-token RoPE positions of the fused QKV and MLA ops (packed sequences):
// undefined, or I32 [tokens] on `device`; on the CPU also every value >= 0 (the GPU cannot
// read them without a host synchronization). InternalError naming `op` otherwise.
inline void check_position_ids(const char* op, const Tensor& position_ids, int64_t tokens,
                               Device device) {
  if (!position_ids.defined()) return;
  MEGATON_CHECK(position_ids.dtype() == DType::I32 && position_ids.shape() == Shape{tokens},
                "{}: position_ids must be I32 [{}], got {} {}", op, tokens,
                dtype_name(position_ids.dtype()), shape_str(position_ids.shape()));
  MEGATON_CHECK(position_ids.device() == device,
                "{}: position_ids must be on the tensors' device ({})", op,
                device == Device::CPU ? "CPU" : "CUDA");
  if (device != Device::CPU) return;
  const int32_t* p = position_ids.i32();
  for (int64_t t = 0; t < tokens; ++t)
    MEGATON_CHECK(p[t] >= 0, "{}: position_ids[{}] = {} is negative", op, t, p[t]);
}

}  // namespace megaton::ops
