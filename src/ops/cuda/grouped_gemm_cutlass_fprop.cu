// One instantiation of the CUTLASS grouped GEMM (grouped_gemm_cutlass.cuh): fprop.
#include "ops/cuda/grouped_gemm_cutlass.cuh"

namespace megaton::ops::cuda::grouped_cutlass {

using Fprop = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t>;

bool run_fprop(const std::vector<GroupedProblem>& problems, float beta) {
  return Fprop::run(problems, beta);
}

bool run_fprop(const GroupedRowsProblem& problem, float beta) { return Fprop::run(problem, beta); }

}  // namespace megaton::ops::cuda::grouped_cutlass
