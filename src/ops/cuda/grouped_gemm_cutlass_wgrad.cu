// One instantiation of the CUTLASS grouped GEMM (grouped_gemm_cutlass.cuh): wgrad, with the
// ping-pong schedule. Measured against the cooperative 128x256 one (bench_grouped_gemm_gpu,
// H200, 2026-11-26): moe-8x-top2 fc2 / fc1 wgrad 614 / 584 TFLOP/s against 500 / 504,
// moe-64x-top8 437 / 464 against 445 / 420 (docs/performance.md).
#include "ops/cuda/grouped_gemm_cutlass.cuh"

namespace megaton::ops::cuda::grouped_cutlass {

using Wgrad =
    GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, Pingpong128x128>;

bool run_wgrad(const std::vector<GroupedProblem>& problems, float beta) {
  return Wgrad::run(problems, beta);
}

bool run_wgrad(const GroupedRowsProblem& problem, float beta) { return Wgrad::run(problem, beta); }

}  // namespace megaton::ops::cuda::grouped_cutlass
