// One instantiation of the CUTLASS grouped GEMM (grouped_gemm_cutlass.cuh): dgrad.
#include "ops/cuda/grouped_gemm_cutlass.cuh"

namespace megaton::ops::cuda::grouped_cutlass {

bool run_dgrad(const std::vector<GroupedProblem>& problems, float beta) {
  return GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t>::run(problems, beta);
}

}  // namespace megaton::ops::cuda::grouped_cutlass
