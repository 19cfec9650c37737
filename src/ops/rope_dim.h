// The rotary dim of partial RoPE (Megatron's --rotary-percent): the door check shared by
// the CPU and CUDA RoPE ops (rope_forward / rope_backward and the fused QKV ops).
#pragma once
#include <cstdint>

#include "core/error.h"

namespace megaton::ops {

// The channels of each head that RoPE rotates: the first R of head_dim, R = rotary_dim, or
// the whole head when rotary_dim is 0 (the ops' default). Returns R. InternalError naming
// `op` unless R is even (rotate-half pairs channel i with i + R/2) and, when given,
// 0 < R <= head_dim.
inline int64_t checked_rotary_dim(const char* op, int64_t rotary_dim, int64_t head_dim) {
  if (rotary_dim == 0) {
    MEGATON_CHECK(head_dim % 2 == 0, "{}: head dim {} must be even for RoPE", op, head_dim);
    return head_dim;
  }
  MEGATON_CHECK(rotary_dim > 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
                "{}: rotary_dim {} must be even and in [2, head dim {}] (0: the whole head)", op,
                rotary_dim, head_dim);
  return rotary_dim;
}

}  // namespace megaton::ops
