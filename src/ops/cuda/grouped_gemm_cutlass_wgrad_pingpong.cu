// One instantiation of the CUTLASS grouped GEMM (grouped_gemm_cutlass.cuh): wgrad with the
// ping-pong schedule.
#include "ops/cuda/grouped_gemm_cutlass.cuh"

namespace megaton::ops::cuda::grouped_cutlass {

bool run_wgrad_pingpong(const std::vector<GroupedProblem>& problems, float beta) {
  return GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float,
                     Pingpong128x128>::run(problems, beta);
}

}  // namespace megaton::ops::cuda::grouped_cutlass
