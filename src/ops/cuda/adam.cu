// AdamW optimizer step on the GPU: fp32 main params, grads and moments, fp32 arithmetic,
// 16-byte loads and stores when every buffer allows them.
#include <algorithm>
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {
namespace {

constexpr int kThreads = 256;

// Per-step constants, computed on the host in fp64 (ops.h's formula, rearranged):
//   p = p * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps),
//   decay = 1 - lr * wd, step_size = lr / (1 - b1^step), inv_sqrt_bc2 = 1 / sqrt(1 - b2^step).
struct AdamWConstants {
  float beta1, beta2, eps, decay, step_size, inv_sqrt_bc2;
};

__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v,
                                             const AdamWConstants& c) {
  m = c.beta1 * m + (1.0f - c.beta1) * g;
  v = c.beta2 * v + (1.0f - c.beta2) * g * g;
  p = p * c.decay - c.step_size * m / (sqrtf(v) * c.inv_sqrt_bc2 + c.eps);
}

// Elements [begin, end), one per thread per grid-stride step.
__global__ void adamw_scalar(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                             int64_t begin, int64_t end, AdamWConstants c) {
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update(p, grad[i], m, v, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

// Elements [0, 4 * quads) as float4 (all four buffers 16-byte aligned).
__global__ void adamw_vec4(float4* param, const float4* grad, float4* exp_avg, float4* exp_avg_sq,
                           int64_t quads, AdamWConstants c) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < quads;
       i += int64_t(gridDim.x) * blockDim.x) {
    float4 p = param[i], g = grad[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update(p.x, g.x, m.x, v.x, c);
    adamw_update(p.y, g.y, m.y, v.y, c);
    adamw_update(p.z, g.z, m.z, v.z, c);
    adamw_update(p.w, g.w, m.w, v.w, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

unsigned blocks_for(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, int64_t(1) << 20));
}

void check_f32(const Tensor& t, int64_t numel, const char* name) {
  MEGATON_CHECK(t.defined(), "adamw_step: {} is undefined", name);
  MEGATON_CHECK(t.device() == Device::CUDA, "adamw_step: {} must be on the GPU, it is on the CPU",
                name);
  MEGATON_CHECK(t.dtype() == DType::F32, "adamw_step: {} must be F32, got {}", name,
                dtype_name(t.dtype()));
  MEGATON_CHECK(t.numel() == numel, "adamw_step: {} {} has {} elements, param has {}", name,
                shape_str(t.shape()), t.numel(), numel);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, float lr,
                float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  const int64_t n = param.numel();
  check_f32(param, n, "param");
  check_f32(grad, n, "grad");
  check_f32(exp_avg, n, "exp_avg");
  check_f32(exp_avg_sq, n, "exp_avg_sq");
  MEGATON_CHECK(step >= 1, "adamw_step: step {} must be >= 1 (1-based)", step);
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "adamw_step: betas ({}, {}) must be in [0, 1)", beta1, beta2);
  if (n == 0) return;
  const double bias_correction1 = 1.0 - std::pow(double(beta1), double(step));
  const double bias_correction2 = 1.0 - std::pow(double(beta2), double(step));
  const AdamWConstants constants{beta1,
                                 beta2,
                                 eps,
                                 float(1.0 - double(lr) * weight_decay),
                                 float(lr / bias_correction1),
                                 float(1.0 / std::sqrt(bias_correction2))};
  cudaStream_t stream = ::megaton::cuda::stream();
  float *p = param.f32(), *m = exp_avg.f32(), *v = exp_avg_sq.f32();
  const float* g = grad.f32();
  int64_t vector_end = 0;
  if (aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v)) {
    const int64_t quads = n / 4;
    if (quads > 0) {
      adamw_vec4<<<blocks_for(quads), kThreads, 0, stream>>>(
          reinterpret_cast<float4*>(p), reinterpret_cast<const float4*>(g),
          reinterpret_cast<float4*>(m), reinterpret_cast<float4*>(v), quads, constants);
      MEGATON_CUDA_CHECK_LAUNCH();
    }
    vector_end = quads * 4;
  }
  if (vector_end < n) {
    adamw_scalar<<<blocks_for(n - vector_end), kThreads, 0, stream>>>(p, g, m, v, vector_end, n,
                                                                      constants);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace megaton::ops::cuda
