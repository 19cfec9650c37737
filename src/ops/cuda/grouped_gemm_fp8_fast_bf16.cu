// Instantiations of the FP8 grouped GEMM (grouped_gemm_fp8.cuh): fast accumulation,
// BF16 output (the forward and input-gradient GEMMs).
#include "ops/cuda/grouped_gemm_fp8.cuh"

namespace megaton::ops::cuda::grouped_fp8 {

void run_fast_bf16(const std::vector<Fp8GroupedProblem>& problems, bool a_e5m2, float alpha,
                   float beta) {
  run_case<cutlass::bfloat16_t, FastAccumulation>(problems, a_e5m2, alpha, beta);
}

}  // namespace megaton::ops::cuda::grouped_fp8
