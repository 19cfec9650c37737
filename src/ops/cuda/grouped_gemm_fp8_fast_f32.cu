// Instantiations of the FP8 grouped GEMM (grouped_gemm_fp8.cuh): fast accumulation,
// F32 output (the weight gradient, accumulated into main_grad).
#include "ops/cuda/grouped_gemm_fp8.cuh"

namespace megaton::ops::cuda::grouped_fp8 {

void run_fast_f32(const std::vector<Fp8GroupedProblem>& problems, bool a_e5m2, float alpha,
                  float beta) {
  run_case<float, FastAccumulation>(problems, a_e5m2, alpha, beta);
}

}  // namespace megaton::ops::cuda::grouped_fp8
