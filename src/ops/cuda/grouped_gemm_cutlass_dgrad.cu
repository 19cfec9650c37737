// One instantiation of the CUTLASS grouped GEMM (grouped_gemm_cutlass.cuh): dgrad.
#include "ops/cuda/grouped_gemm_cutlass.cuh"

namespace megaton::ops::cuda::grouped_cutlass {

using Dgrad = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t>;

bool run_dgrad(const std::vector<GroupedProblem>& problems, float beta) {
  return Dgrad::run(problems, beta);
}

bool run_dgrad(const GroupedRowsProblem& problem, float beta) { return Dgrad::run(problem, beta); }

}  // namespace megaton::ops::cuda::grouped_cutlass
