// GroupedProblem: one row-major GEMM of a grouped call, shared by the grouped GEMM kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace megaton::ops::cuda {

// c [m, n] = op(a) @ op(b) + beta * c, all row-major with row strides lda, ldb, ldc
// (elements). op(a) is [m, k]: a is stored [m, k], or [k, m] when trans_a. op(b) is
// [k, n]: b is stored [k, n], or [n, k] when trans_b. Every group has m, n, k > 0.
struct GroupedProblem {
  const void* a;
  const void* b;
  void* c;
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
};

// Runs the problems as one CUTLASS Hopper grouped GEMM (TMA + WGMMA, warp-specialized
// cooperative kernel; grouped_gemm_cutlass.cuh) when the case has a kernel: BF16 a and b,
// c BF16 for (trans_a, trans_b) = (no, yes) and (no, no), c F32 for (yes, no); every
// pointer 16-byte aligned and every row stride a multiple of 16 bytes (TMA's rule).
// Returns false, having launched nothing, otherwise. Stream: megaton::cuda::stream().
bool cutlass_grouped_gemm(const std::vector<GroupedProblem>& problems, DType ab, DType c,
                          float beta);

// The fallback for every other case (F32 operands, unaligned rows): one launch of a
// tiled CUDA-core kernel over all groups, fp32 accumulation. Slow, but exact enough for
// the ops tests and never a per-group loop of launches.
void simt_grouped_gemm(const std::vector<GroupedProblem>& problems, DType ab, DType c,
                       float beta);

}  // namespace megaton::ops::cuda
