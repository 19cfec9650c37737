// GroupedProblem and GroupedRowsProblem: the GEMMs of one grouped call, with the group
// sizes on the host or in device memory, shared by the grouped GEMM kernels.
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

// A grouped call whose per-group row counts stay in device memory: group g owns rows
// [r_g, r_g + n_g) of the row-segmented operands, r_g the sum of the earlier counts, with
// the counts read by the kernels only (n_g cut at total_rows - r_g, negative as 0;
// group_rows_of below). Two forms, by trans_a:
//  - trans_a false (fprop, dgrad): a [R, k] and c [R, n] are cut into row segments and
//    c[rows_g] = a[rows_g] @ op(b[g]) + beta * c[rows_g]; m = n_g (the `m` field is unused);
//    `a` and `c` point at row 0, b_groups holds b[g].
//  - trans_a true (wgrad): a [R, m] and b [R, n] are cut and
//    c[g] = a[rows_g]^T @ b[rows_g] + beta * c[g], k = n_g (the `k` field is unused); `a`
//    and `b` point at row 0, c_groups holds c[g]. An empty group is a problem with m = 0
//    (no output tile: c[g] is left as it is, whatever beta).
// Row strides lda, ldb, ldc in elements as in GroupedProblem; n > 0, wgrad's m > 0, and
// fprop's k > 0 for CUTLASS (the fallback takes k == 0: c[rows_g] = beta * c[rows_g]).
struct GroupedRowsProblem {
  const int64_t* group_rows;  // [groups] int64, device memory
  int64_t groups;
  int64_t total_rows;  // R: the rows of the row-segmented operands
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
  const void* a;
  const void* b;                      // trans_a only
  void* c;                            // !trans_a only
  std::vector<const void*> b_groups;  // !trans_a only: [groups]
  std::vector<void*> c_groups;        // trans_a only: [groups]
};

// Runs the problems as one CUTLASS Hopper grouped GEMM (TMA + WGMMA, warp-specialized
// cooperative kernel; grouped_gemm_cutlass.cuh) when the case has a kernel: BF16 a and b,
// c BF16 for (trans_a, trans_b) = (no, yes) and (no, no), c F32 for (yes, no); every
// pointer 16-byte aligned and every row stride a multiple of 16 bytes (TMA's rule).
// Returns false, having launched nothing, otherwise. Stream: megaton::cuda::stream().
bool cutlass_grouped_gemm(const std::vector<GroupedProblem>& problems, DType ab, DType c,
                          float beta);
// The same for device counts: one launch of a setup kernel that writes the problem shapes
// and row-segment pointers from the counts, then the CUTLASS kernel over a persistent grid
// of one CTA per SM (the tile count is not known on the host). Also false, having launched
// nothing, when R or a fixed dim exceeds INT_MAX.
bool cutlass_grouped_gemm(const GroupedRowsProblem& problem, DType ab, DType c, float beta);

// The fallback for every other case (F32 or F16 operands, unaligned rows): one launch of a
// tiled CUDA-core kernel over all groups, fp32 accumulation; a and b F32, BF16 or F16, c
// F32 or a's dtype (F16 x F16 -> F32: the weight gradient into main_grad). Slow, but exact
// enough for the ops tests and never a per-group loop of launches.
void simt_grouped_gemm(const std::vector<GroupedProblem>& problems, DType ab, DType c,
                       float beta);
// The same for device counts: a setup kernel fills the groups' descriptors, and the grid
// covers each group's worst case (R rows for fprop/dgrad); tiles past a group's rows return
// at once. Also correct for k == 0 (fprop/dgrad: c[rows_g] = beta * c[rows_g]).
void simt_grouped_gemm(const GroupedRowsProblem& problem, DType ab, DType c, float beta);

#if defined(__CUDACC__)
// Calls row_range(g, r_g, n_g) once for every group g of a device-count call, from the
// threads of one block of kThreads threads (all of which must call it): each thread takes
// a contiguous run of groups, and a block-wide scan of the runs' sums gives each run's first
// row. Counts are taken as clamp(count, 0, total_rows), so the sums stay below
// groups * total_rows, and the range is cut at total_rows: r_g = min(R, sum of the earlier
// counts), n_g = min(count, R - r_g).
template <int kThreads, class RowRange>
__device__ void group_rows_of(const int64_t* group_rows, int64_t groups, int64_t total_rows,
                              RowRange&& row_range) {
  __shared__ int64_t run_sums[kThreads];
  auto clamped = [&](int64_t g) {
    const int64_t count = group_rows[g];
    return count < 0 ? int64_t(0) : (count > total_rows ? total_rows : count);
  };
  const int t = threadIdx.x;
  const int64_t per_thread = (groups + kThreads - 1) / kThreads;
  const int64_t first = t * per_thread;
  const int64_t last = first + per_thread < groups ? first + per_thread : groups;
  int64_t run_sum = 0;
  for (int64_t g = first; g < last; ++g) run_sum += clamped(g);
  run_sums[t] = run_sum;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset *= 2) {  // inclusive scan (Hillis-Steele)
    const int64_t left = t >= offset ? run_sums[t - offset] : 0;
    __syncthreads();
    run_sums[t] += left;
    __syncthreads();
  }
  int64_t start = run_sums[t] - run_sum;
  for (int64_t g = first; g < last; ++g) {
    const int64_t count = clamped(g);
    const int64_t row = start < total_rows ? start : total_rows;
    row_range(g, row, count < total_rows - row ? count : total_rows - row);
    start += count;
  }
}
#endif

}  // namespace megaton::ops::cuda
