// ops::cuda::fp8_grouped_gemm: the MoE experts' FP8 GEMMs (per-tensor scales), all groups
// in one CUTLASS Hopper grouped GEMM launch (grouped_gemm_fp8.cuh).
//
// Groups with a zero dimension are dropped here (their c untouched, as ops/fp8.h says);
// the rest go to the instantiation for (A's format, c's dtype, accumulation). B is E4M3 in
// every instantiation: E4M3 x E4M3 (the E4M3 recipe's three GEMMs, the hybrid forward)
// and E5M2 x E4M3 (the hybrid recipe's gradient times the weight, and the weight gradient
// as dy^T x^T); E4M3 x E5M2 has no kernel and raises InternalError. The door checks
// (dtypes, shapes, devices) are the caller's (ops/cpu/fp8_grouped.cpp).
#include <climits>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/grouped_gemm_fp8.cuh"

namespace megaton::ops::cuda {

namespace grouped_fp8 {

namespace {
__global__ void group_alpha_kernel(const float* const* a_scale_inv, const float* const* b_scale_inv,
                                   float alpha, float* group_alpha, int count) {
  for (int g = threadIdx.x; g < count; g += blockDim.x)
    group_alpha[g] = alpha * *a_scale_inv[g] * *b_scale_inv[g];
}
}  // namespace

void launch_group_alpha(const float* const* a_scale_inv, const float* const* b_scale_inv,
                        float alpha, float* group_alpha, int count) {
  group_alpha_kernel<<<1, 256, 0, ::megaton::cuda::stream()>>>(a_scale_inv, b_scale_inv, alpha,
                                                               group_alpha, count);
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace grouped_fp8

void fp8_grouped_gemm(const std::vector<Tensor>& a, const std::vector<Tensor>& a_scale_inv,
                      const std::vector<Tensor>& b, const std::vector<Tensor>& b_scale_inv,
                      const std::vector<Tensor>& c, float alpha, float beta,
                      bool fast_accumulation) {
  using grouped_fp8::Fp8GroupedProblem;
  std::vector<Fp8GroupedProblem> problems;
  problems.reserve(a.size());
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  for (size_t g = 0; g < a.size(); ++g) {
    const int64_t m = a[g].dim(0), k = a[g].dim(1), n = b[g].dim(0);
    if (m == 0 || n == 0 || k == 0) continue;
    MEGATON_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX,
                  "fp8_grouped_gemm: group {} M={} N={} K={} exceeds CUTLASS's int shapes", g, m, n,
                  k);
    // TMA reads and writes 16-byte aligned rows: the row strides are (multiples of 16
    // elements, the door's rule), the bases must be too (a view at a row offset is).
    MEGATON_CHECK(aligned(a[g].raw()) && aligned(b[g].raw()) && aligned(c[g].raw()),
                  "fp8_grouped_gemm: group {}: a {}, b {}, c {} must be 16-byte aligned (TMA)", g,
                  a[g].raw(), b[g].raw(), c[g].raw());
    problems.push_back({a[g].raw(), b[g].raw(), c[g].raw(), a_scale_inv[g].f32(),
                        b_scale_inv[g].f32(), int(m), int(n), int(k)});
  }
  if (problems.empty()) return;
  // Every group has one a dtype, one b dtype and one c dtype (the door's rule): group 0's.
  const DType a_dtype = a[0].dtype(), b_dtype = b[0].dtype(), c_dtype = c[0].dtype();
  MEGATON_CHECK(b_dtype == DType::F8E4M3,
                "fp8_grouped_gemm: no CUDA kernel for a {} x b {} (b must be F8E4M3; put the "
                "E5M2 operand in a)",
                dtype_name(a_dtype), dtype_name(b_dtype));
  const bool a_e5m2 = a_dtype == DType::F8E5M2;
  if (c_dtype == DType::BF16) {
    if (fast_accumulation)
      grouped_fp8::run_fast_bf16(problems, a_e5m2, alpha, beta);
    else
      grouped_fp8::run_split_bf16(problems, a_e5m2, alpha, beta);
  } else {
    if (fast_accumulation)
      grouped_fp8::run_fast_f32(problems, a_e5m2, alpha, beta);
    else
      grouped_fp8::run_split_f32(problems, a_e5m2, alpha, beta);
  }
}

}  // namespace megaton::ops::cuda
