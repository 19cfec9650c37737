// CUDA kernels of fp16 main params (ops/adam_f16_main_param.h): per tensor, the absmax
// pass (the update's own bits of the new main param, max of |x|'s bits by atomicMax: the
// same in any order), the update (adam_state_chunk.cuh's adamw_state_chunk over an fp16
// main param with its compute copy) and the commit of the new scales. The element math is
// ops/adam_f16_main_param_math.h, the CPU twin's. One launch per tensor and pass: simple
// and exact; batching tensors per launch as multi_tensor_adamw.cu does is left for later.
#include "ops/cuda/adam_f16_main_param.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/cuda/cuda_check.h"
#include "ops/adam_f16_main_param_math.h"
#include "ops/cuda/adam_state_chunk.cuh"

namespace megaton::ops::cuda {
namespace {

// One tensor's pointers and constants for a launch.
struct F16MainParamTensor {
  uint16_t* stored;
  void* copy;          // BF16 or F16 compute weight (update only)
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  const float* moment_scale;   // F32 [2] or null
  const float* moment_absmax;  // F32 [2] or null
  float* scale;                // F32 [1]
  float* absmax;               // F32 [1]
  int64_t numel;
  float weight_decay;
  MomentRoundingKey rounding_key;
  uint8_t exp_avg_kind, exp_avg_sq_kind;
  bool grad_bf16, copy_f16;
};

// The fp16 main param and its compute copy in a kernel (the CPU's ScaledF16MainParam).
struct DeviceF16MainParam {
  uint16_t* stored;
  void* copy;
  bool copy_f16;
  float scale, new_rscale;
  __device__ float load(int64_t j) const { return load_scaled_fp16(stored[j], scale); }
  __device__ void store(int64_t j, float p) const {
    if (copy_f16)
      static_cast<uint16_t*>(copy)[j] = fp16_round_nearest(p);
    else
      static_cast<__nv_bfloat16*>(copy)[j] = __float2bfloat16_rn(p);
    stored[j] = store_scaled_fp16_nearest(p, new_rscale);
  }
};

// The step's constants: the host's, or control's (adamw_step_control) when given.
struct StepScalars {
  AdamPrecisionConstants c;
  float lr;
  uint64_t step;
};
__device__ __forceinline__ StepScalars step_scalars(const AdamPrecisionConstants& host, float lr,
                                                    uint64_t step, const float* control) {
  StepScalars s{host, lr, step};
  if (control != nullptr) {
    s.c.step_size = control[kAdamStepSize];
    s.c.inv_sqrt_bc2 = control[kAdamInvSqrtBc2];
    s.c.grad_scale = control[kAdamGradScale];
    s.lr = control[kAdamLr];
    s.step = uint64_t(int64_t(control[kAdamStep]));
  }
  return s;
}

__device__ __forceinline__ AdamStateRef moment_ref(const F16MainParamTensor& t, int column) {
  return device_state_ref(column == 0 ? t.exp_avg : t.exp_avg_sq,
                          column == 0 ? t.exp_avg_kind : t.exp_avg_sq_kind, t.moment_scale,
                          t.moment_absmax, column);
}

__global__ void __launch_bounds__(kThreads)
    f16_main_param_absmax_kernel(const F16MainParamTensor t, const AdamPrecisionConstants host,
                                 const float host_lr, const float* control) {
  const StepScalars s = step_scalars(host, host_lr, 1, control);
  const int64_t begin = int64_t(blockIdx.x) * kElementwiseChunk;
  const int64_t end = std::min(t.numel, begin + kElementwiseChunk);
  const AdamStateRef m = moment_ref(t, 0), v = moment_ref(t, 1);
  const float scale = *t.scale;
  const float decay = adam_precision_decay(s.lr, t.weight_decay);
  uint32_t bits = 0;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
    float p = load_scaled_fp16(t.stored[j], scale), mj = m.load(j), vj = v.load(j);
    adamw_precision_update(p, detail::load_main_grad(t.grad, t.grad_bf16, j), mj, vj, decay, s.c);
    bits = max(bits, absmax_bits(p));
  }
  for (int offset = 16; offset > 0; offset /= 2)
    bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, offset));
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<unsigned int*>(t.absmax), bits);
}

__global__ void __launch_bounds__(kThreads)
    f16_main_param_update_kernel(const F16MainParamTensor t, const AdamPrecisionConstants host,
                                 const float host_lr, const uint64_t host_step,
                                 const float* control) {
  if (control != nullptr && control[kAdamSkip] != 0.0f) return;
  const StepScalars s = step_scalars(host, host_lr, host_step, control);
  const int64_t begin = int64_t(blockIdx.x) * kElementwiseChunk;
  const int64_t end = std::min(t.numel, begin + kElementwiseChunk);
  const DeviceF16MainParam main{t.stored, t.copy, t.copy_f16, *t.scale,
                                state_rscale(main_param_scale_from_absmax(*t.absmax))};
  MomentRoundingStream random(t.rounding_key, s.step);
  adamw_state_chunk(main, t.grad, t.grad_bf16, moment_ref(t, 0), moment_ref(t, 1), begin, end,
                    adam_precision_decay(s.lr, t.weight_decay), s.c, random);
}

// After the tensor's update (same stream): its new scales, unless control skips.
__global__ void f16_main_param_commit_kernel(const F16MainParamTensor t, const float* control) {
  if (control != nullptr && control[kAdamSkip] != 0.0f) return;
  *t.scale = main_param_scale_from_absmax(*t.absmax);
  float* moment_scale = const_cast<float*>(t.moment_scale);
  if (state_kind_scaled(t.exp_avg_kind))
    moment_scale[0] = state_scale_from_absmax(t.moment_absmax[0], t.exp_avg_kind);
  if (state_kind_scaled(t.exp_avg_sq_kind))
    moment_scale[1] = state_scale_from_absmax(t.moment_absmax[1], t.exp_avg_sq_kind);
}

F16MainParamTensor tensor_of(size_t i, const std::vector<Tensor>& masters,
                             const std::vector<Tensor>* copies, const std::vector<Tensor>& grads,
                             const std::vector<Tensor>& exp_avg,
                             const std::vector<Tensor>& exp_avg_sq,
                             const std::vector<float>& weight_decays,
                             const std::vector<MomentRoundingKey>* keys,
                             const AdamMomentScales& moment_scales,
                             const AdamMainParamScales& main_scales) {
  F16MainParamTensor t{};
  t.stored = static_cast<uint16_t*>(const_cast<void*>(masters[i].raw()));
  t.copy = copies ? const_cast<void*>((*copies)[i].raw()) : nullptr;
  t.copy_f16 = copies && (*copies)[i].dtype() == DType::F16;
  t.grad = grads[i].raw();
  t.grad_bf16 = grads[i].dtype() == DType::BF16;
  t.exp_avg = const_cast<void*>(exp_avg[i].raw());
  t.exp_avg_sq = const_cast<void*>(exp_avg_sq[i].raw());
  t.exp_avg_kind = adam_state_kind(exp_avg[i].dtype(), "multi_tensor_adamw_f16_main_param");
  t.exp_avg_sq_kind = adam_state_kind(exp_avg_sq[i].dtype(), "multi_tensor_adamw_f16_main_param");
  t.moment_scale = moment_scales.empty() ? nullptr : moment_scales.scale[i].f32();
  t.moment_absmax = moment_scales.empty() ? nullptr : moment_scales.absmax[i].f32();
  t.scale = const_cast<float*>(main_scales.scale[i].f32());
  t.absmax = const_cast<float*>(main_scales.absmax[i].f32());
  t.numel = masters[i].numel();
  t.weight_decay = weight_decays[i];
  if (keys) t.rounding_key = (*keys)[i];
  return t;
}

unsigned blocks_of(int64_t numel) {
  return unsigned((numel + kElementwiseChunk - 1) / kElementwiseChunk);
}

}  // namespace

void multi_tensor_adamw_f16_main_param_absmax(
    const std::vector<Tensor>& masters, const std::vector<Tensor>& grads,
    const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
    const AdamMomentScales& moment_scales, const AdamMainParamScales& main_scales,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const Tensor& control) {
  // (Host constants for a skipped first step under control are unused: the device's are.)
  const AdamPrecisionConstants host = adam_precision_constants(
      lr, beta1, beta2, eps, std::max<int64_t>(step, 1), control.defined() ? 1.0f : grad_scale);
  const float* c = control.defined() ? control.f32() : nullptr;
  for (size_t i = 0; i < masters.size(); ++i) {
    if (masters[i].numel() == 0) continue;
    const F16MainParamTensor t = tensor_of(i, masters, nullptr, grads, exp_avg, exp_avg_sq,
                                           weight_decays, nullptr, moment_scales, main_scales);
    f16_main_param_absmax_kernel<<<blocks_of(t.numel), kThreads, 0, compute_stream()>>>(t, host,
                                                                                       lr, c);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}

void multi_tensor_adamw_f16_main_param(
    std::vector<Tensor>& masters, std::vector<Tensor>& copies, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const Tensor& control,
    const std::vector<MomentRoundingKey>& rounding_keys, const AdamMomentScales& moment_scales,
    const AdamMainParamScales& main_scales) {
  const AdamPrecisionConstants host = adam_precision_constants(
      lr, beta1, beta2, eps, std::max<int64_t>(step, 1), control.defined() ? 1.0f : grad_scale);
  const float* c = control.defined() ? control.f32() : nullptr;
  for (size_t i = 0; i < masters.size(); ++i) {
    const F16MainParamTensor t = tensor_of(i, masters, &copies, grads, exp_avg, exp_avg_sq,
                                           weight_decays, &rounding_keys, moment_scales,
                                           main_scales);
    if (t.numel > 0) {
      f16_main_param_update_kernel<<<blocks_of(t.numel), kThreads, 0, compute_stream()>>>(
          t, host, lr, uint64_t(std::max<int64_t>(step, 1)), c);
      MEGATON_CUDA_CHECK_LAUNCH();
    }
    f16_main_param_commit_kernel<<<1, 1, 0, compute_stream()>>>(t, c);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace megaton::ops::cuda
