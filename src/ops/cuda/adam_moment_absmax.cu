// multi_tensor_adamw_moment_absmax on the GPU (ops/adam_precision.h): the first pass of an
// update with fp16 or fp8 moments. Each block computes the new moments of its chunk with the
// update's own element function (adamw_precision_moments), reduces |x| over the block, and
// adds its maximum with one atomicMax per moment on the bits of the non-negative float, so
// the result does not depend on the schedule and is the CPU twin's.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"
#include "ops/adam_scaled_state_math.h"
#include "ops/cuda/adam_grad_load.cuh"
#include "ops/cuda/multi_tensor_adamw.h"
#include "ops/cuda/multi_tensor_launch.cuh"

namespace megaton::ops::cuda {
namespace {

// ---- the absmax pass of scaled moments (multi_tensor_adamw_moment_absmax) ----

constexpr int kAbsmaxTensors = 48;
struct AbsmaxLaunch {
  const void* grad[kAbsmaxTensors];
  void* exp_avg[kAbsmaxTensors];
  void* exp_avg_sq[kAbsmaxTensors];
  const float* scale[kAbsmaxTensors];
  float* absmax[kAbsmaxTensors];
  int64_t numel[kAbsmaxTensors];
  uint32_t first_chunk[kAbsmaxTensors + 1];
  uint8_t exp_avg_kind[kAbsmaxTensors];
  uint8_t exp_avg_sq_kind[kAbsmaxTensors];
  uint8_t grad_bf16[kAbsmaxTensors];
  int32_t num_tensors;
};
static_assert(sizeof(AbsmaxLaunch) + sizeof(AdamPrecisionConstants) + sizeof(float*) <=
              kMaxKernelParamBytes);

__global__ void zero_absmax_kernel(const __grid_constant__ AbsmaxLaunch launch) {
  const int t = int(threadIdx.x);
  if (t >= launch.num_tensors) return;
  if (state_kind_scaled(launch.exp_avg_kind[t])) launch.absmax[t][0] = 0.0f;
  if (state_kind_scaled(launch.exp_avg_sq_kind[t])) launch.absmax[t][1] = 0.0f;
}

// Each block: the new moments of its chunk (adamw_precision_moments, the update's bits),
// the max of |x|'s bits over the block, one atomicMax per scaled moment. Max is order
// independent, so the result is the CPU's whatever the schedule.
__global__ void __launch_bounds__(kThreads)
    moment_absmax_chunks(const __grid_constant__ AbsmaxLaunch launch,
                         const AdamPrecisionConstants host_constants, const float* control) {
  AdamPrecisionConstants c = host_constants;
  if (control != nullptr) c.grad_scale = control[kAdamGradScale];
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kElementwiseChunk;
  const int64_t end = std::min(launch.numel[t], begin + kElementwiseChunk);
  const uint8_t m_kind = launch.exp_avg_kind[t], v_kind = launch.exp_avg_sq_kind[t];
  AdamStateRef m, v;
  m.data = launch.exp_avg[t];
  m.kind = m_kind;
  if (state_kind_scaled(m_kind)) m.scale = launch.scale[t][0];
  v.data = launch.exp_avg_sq[t];
  v.kind = v_kind;
  if (state_kind_scaled(v_kind)) v.scale = launch.scale[t][1];
  const void* grad = launch.grad[t];
  const bool grad_bf16 = launch.grad_bf16[t];
  uint32_t m_max = 0, v_max = 0;
  for (int64_t j = begin + int64_t(threadIdx.x); j < end; j += kThreads) {
    float mj = m.load(j), vj = v.load(j);
    adamw_precision_moments(detail::load_main_grad(grad, grad_bf16, j), mj, vj, c);
    m_max = max(m_max, absmax_bits(mj));
    v_max = max(v_max, absmax_bits(vj));
  }
  __shared__ uint32_t warp_max[2][kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    m_max = max(m_max, __shfl_xor_sync(0xffffffffu, m_max, offset));
    v_max = max(v_max, __shfl_xor_sync(0xffffffffu, v_max, offset));
  }
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  if (lane == 0) {
    warp_max[0][warp] = m_max;
    warp_max[1][warp] = v_max;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kThreads / 32; ++w) {
    m_max = max(m_max, warp_max[0][w]);
    v_max = max(v_max, warp_max[1][w]);
  }
  // Non-negative floats order as their bits: an unsigned max on the bits is the float max.
  if (state_kind_scaled(m_kind))
    atomicMax(reinterpret_cast<unsigned int*>(launch.absmax[t]), m_max);
  if (state_kind_scaled(v_kind))
    atomicMax(reinterpret_cast<unsigned int*>(launch.absmax[t]) + 1, v_max);
}

}  // namespace

void multi_tensor_adamw_moment_absmax(const std::vector<Tensor>& grads,
                                      const std::vector<Tensor>& exp_avg,
                                      const std::vector<Tensor>& exp_avg_sq,
                                      const AdamMomentScales& scales, float beta1, float beta2,
                                      float grad_scale, const float* control) {
  constexpr const char* kOp = "multi_tensor_adamw_moment_absmax";
  const size_t n = grads.size();
  std::vector<int64_t> numels(n, 0);
  for (size_t i = 0; i < n; ++i) {
    check_listed(grads[i], kOp, "grads", i, Listed::kF32OrBF16);
    check_listed(exp_avg[i], kOp, "exp_avg", i, Listed::kAdamMoment);
    check_listed(exp_avg_sq[i], kOp, "exp_avg_sq", i, Listed::kAdamMoment);
    const bool scaled = state_kind_scaled(adam_state_kind(exp_avg[i].dtype(), kOp)) ||
                        state_kind_scaled(adam_state_kind(exp_avg_sq[i].dtype(), kOp));
    if (scaled) numels[i] = grads[i].numel();
  }
  // Step 1 and lr 0 stand in: the pass reads only the betas and the gradient scale.
  const AdamPrecisionConstants c =
      adam_precision_constants(0.0f, beta1, beta2, 1e-8f, 1, grad_scale);
  cudaStream_t stream = compute_stream();
  for (const LaunchBatch& batch : plan_launches(numels, kElementwiseChunk, kAbsmaxTensors, kOp)) {
    AbsmaxLaunch meta{};
    meta.num_tensors = int32_t(batch.tensors.size());
    for (size_t k = 0; k < batch.tensors.size(); ++k) {
      const size_t i = batch.tensors[k];
      meta.grad[k] = grads[i].raw();
      meta.grad_bf16[k] = grads[i].dtype() == DType::BF16;
      meta.exp_avg[k] = exp_avg[i].raw();
      meta.exp_avg_sq[k] = exp_avg_sq[i].raw();
      meta.exp_avg_kind[k] = adam_state_kind(exp_avg[i].dtype(), kOp);
      meta.exp_avg_sq_kind[k] = adam_state_kind(exp_avg_sq[i].dtype(), kOp);
      meta.scale[k] = scales.scale[i].f32();
      meta.absmax[k] = scales.absmax[i].f32();
      meta.numel[k] = numels[i];
      meta.first_chunk[k] = batch.first_chunk[k];
    }
    meta.first_chunk[batch.tensors.size()] = batch.first_chunk.back();
    // The slots start at 0 (|x| >= +0 as bits), then every block's atomicMax.
    zero_absmax_kernel<<<1, kAbsmaxTensors, 0, stream>>>(meta);
    MEGATON_CUDA_CHECK_LAUNCH();
    moment_absmax_chunks<<<batch.first_chunk.back(), kThreads, 0, stream>>>(meta, c, control);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace megaton::ops::cuda
