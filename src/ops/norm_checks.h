// Buffer-sharing rules of the fused residual-add norms (ops.h: add_rmsnorm_forward,
// add_layernorm_forward, the norms' backward with dresidual), checked alike by the CPU
// reference (ops/cpu/norm.cpp) and the CUDA kernels (ops/cuda/norm.cu). A buffer may be
// exactly another (each element is read before the same thread writes it) or apart from
// it; a partial overlap would let one row's write land on a row not yet read.
#pragma once
#include <initializer_list>

#include "core/error.h"
#include "core/tensor.h"

namespace megaton::ops::detail {

// Whether the byte ranges of a and b overlap.
inline bool overlaps(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.raw());
  const char* pb = static_cast<const char*>(b.raw());
  return a.nbytes() > 0 && b.nbytes() > 0 && pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

// The forward's buffers: sum may be exactly x or residual, no other overlap; y shares
// memory with none of them. InternalError naming `op` otherwise.
inline void check_fused_add_aliasing(const Tensor& x, const Tensor& residual, const Tensor& sum,
                                     const Tensor& y, const char* op) {
  for (const Tensor* t : {&x, &residual})
    MEGATON_CHECK(sum.raw() == t->raw() || !overlaps(sum, *t),
                  "{}: sum must be x's or residual's buffer or apart from both", op);
  for (const Tensor* t : {&x, &residual, &sum})
    MEGATON_CHECK(!overlaps(y, *t), "{}: y must not share memory with x, residual or sum", op);
}

// The backward's: dx may be exactly dresidual or apart from it.
inline void check_residual_grad_aliasing(const Tensor& dx, const Tensor& dresidual,
                                         const char* op) {
  MEGATON_CHECK(dx.raw() == dresidual.raw() || !overlaps(dx, dresidual),
                "{}: dx must be dresidual's buffer or apart from it", op);
}

}  // namespace megaton::ops::detail
