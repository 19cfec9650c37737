// fp32 main params as bf16 weights plus int16 remainders on the GPU (ops/param_remainder.h):
// split and join (one elementwise kernel each) and the AdamW update over (weight,
// remainder) pairs in multi-tensor launches (multi_tensor_launch.cuh), each element by
// adamw_param_remainder_update (ops/param_remainder_math.h), the CPU twin's function.
// The doors (ops/cpu/param_remainder.cpp) check everything before these run.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "ops/adam_precision_math.h"
#include "ops/cuda/adam_grad_load.cuh"
#include "ops/cuda/adam_state_chunk.cuh"
#include "ops/cuda/multi_tensor_adamw.h"
#include "ops/cuda/multi_tensor_launch.cuh"
#include "ops/param_remainder_math.h"

namespace megaton::ops::cuda {
namespace {

// ---- split and join ----

__global__ void split_kernel(const float* master, uint16_t* weight, uint16_t* remainder,
                             int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t bits = __float_as_uint(master[i]);
    weight[i] = param_remainder_weight(bits);
    if (remainder != nullptr) remainder[i] = param_remainder_low(bits);
  }
}

__global__ void join_kernel(const uint16_t* weight, const uint16_t* remainder, float* master,
                            int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    master[i] = __uint_as_float(param_remainder_join(weight[i], remainder[i]));
}

// ---- AdamW over (weight, remainder) pairs ----

// The packed chunks' dispatch on two unscaled moments: bit 0 set, exp_avg is BF16; bit 1
// set, exp_avg_sq is BF16. Tensors with an F16 or F8E4M3 moment take adamw_state_chunk.
enum RemainderMoments : uint8_t { kMomentsF32 = 0, kExpAvgBF16 = 1, kExpAvgSqBF16 = 2 };

// Tensors per launch: 116 bytes each (the rounding keys take 40). The fields from grad on
// are fill_state_slot's (adam_state_chunk.cuh).
constexpr int kRemainderTensors = 32;
struct AdamWRemainderLaunch {
  uint16_t* weight[kRemainderTensors];     // BF16 bits
  uint16_t* remainder[kRemainderTensors];  // I16
  const void* grad[kRemainderTensors];     // float*, or __nv_bfloat16* (grad_bf16)
  void* exp_avg[kRemainderTensors];        // as exp_avg_kind says (AdamStateKind)
  void* exp_avg_sq[kRemainderTensors];     // as exp_avg_sq_kind says
  int64_t numel[kRemainderTensors];
  MomentRoundingKey rounding_key[kRemainderTensors];
  uint32_t first_chunk[kRemainderTensors + 1];
  float weight_decay[kRemainderTensors];
  float* scale[kRemainderTensors];         // F32 [2] or null (AdamMomentScales)
  const float* absmax[kRemainderTensors];  // F32 [2] or null
  uint8_t exp_avg_kind[kRemainderTensors];
  uint8_t exp_avg_sq_kind[kRemainderTensors];
  uint8_t grad_bf16[kRemainderTensors];
  // weight and remainder 8-byte aligned, grad 16 (F32) or 8 (BF16), the moments 16 (F32) or 8 (BF16): the
  // update runs on packs of four, otherwise element by element (the same bits).
  uint8_t vectorized[kRemainderTensors];
  int32_t num_tensors;
};
static_assert(sizeof(AdamWRemainderLaunch) + sizeof(AdamPrecisionConstants) + sizeof(float) +
                  sizeof(uint64_t) + sizeof(float*) <=
              kMaxKernelParamBytes);

// A moment widened to fp32: F32 as it is, BF16 (its bits) shifted into an fp32's high half.
__device__ __forceinline__ float load_moment(float x) { return x; }
__device__ __forceinline__ float load_moment(uint16_t x) { return __uint_as_float(uint32_t(x) << 16); }

// A moment stored: F32 as it is, BF16 stochastically rounded with 16 random bits.
template <typename T>
__device__ __forceinline__ T store_moment(float x, uint32_t random16) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return bf16_round_stochastic(x, random16);
  }
}

// Elements [begin, end) of one tensor whose moments are stored as M and V (float or
// uint16_t = BF16 bits); element j draws its random bits from `random` whatever thread or
// pack handles it.
template <typename M, typename V>
__device__ void remainder_chunk(uint16_t* weight, uint16_t* remainder, const void* grad,
                                bool grad_bf16, void* exp_avg_raw, void* exp_avg_sq_raw, int64_t begin,
                                int64_t end, bool vectorized, float decay,
                                const AdamPrecisionConstants& c, MomentRoundingStream& random) {
  M* exp_avg = static_cast<M*>(exp_avg_raw);
  V* exp_avg_sq = static_cast<V*>(exp_avg_sq_raw);
  for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kThreads) {
    if (vectorized && i + 4 <= end) {
      Pack<uint16_t, 4> w = load_pack<4>(weight + i);
      Pack<uint16_t, 4> r = load_pack<4>(remainder + i);
      const Pack<float, 4> g = detail::load_main_grad_pack(grad, grad_bf16, i);
      Pack<M, 4> m_pack = load_pack<4>(exp_avg + i);
      Pack<V, 4> v_pack = load_pack<4>(exp_avg_sq + i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float m = load_moment(m_pack.v[j]), v = load_moment(v_pack.v[j]);
        adamw_param_remainder_update(w.v[j], r.v[j], g.v[j], m, v, decay, c);
        const uint32_t bits = random.bits(i + j);
        m_pack.v[j] = store_moment<M>(m, bits & 0xFFFFu);
        v_pack.v[j] = store_moment<V>(v, bits >> 16);
      }
      store_pack<4>(weight + i, w);
      store_pack<4>(remainder + i, r);
      store_pack<4>(exp_avg + i, m_pack);
      store_pack<4>(exp_avg_sq + i, v_pack);
    } else {
      for (int64_t j = i; j < end && j < i + 4; ++j) {
        uint16_t w = weight[j], r = remainder[j];
        float m = load_moment(exp_avg[j]), v = load_moment(exp_avg_sq[j]);
        adamw_param_remainder_update(w, r, detail::load_main_grad(grad, grad_bf16, j), m, v, decay,
                                     c);
        const uint32_t bits = random.bits(j);
        weight[j] = w;
        remainder[j] = r;
        exp_avg[j] = store_moment<M>(m, bits & 0xFFFFu);
        exp_avg_sq[j] = store_moment<V>(v, bits >> 16);
      }
    }
  }
}

// host_lr and host_step: the host path's learning rate and step count; with a control
// tensor (adamw_step_control's) the device's, as the precision-aware launches read them.
__global__ void __launch_bounds__(kThreads)
    adamw_param_remainder_chunks(const __grid_constant__ AdamWRemainderLaunch launch,
                                 const AdamPrecisionConstants host_constants, const float host_lr,
                                 const uint64_t host_step, const float* control) {
  AdamPrecisionConstants c = host_constants;
  float lr = host_lr;
  uint64_t step = host_step;
  if (control != nullptr) {
    if (control[kAdamSkip] != 0.0f) return;
    c.step_size = control[kAdamStepSize];
    c.inv_sqrt_bc2 = control[kAdamInvSqrtBc2];
    c.grad_scale = control[kAdamGradScale];
    lr = control[kAdamLr];
    step = uint64_t(int64_t(control[kAdamStep]));
  }
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kElementwiseChunk;
  const int64_t end = std::min(launch.numel[t], begin + kElementwiseChunk);
  const bool vectorized = launch.vectorized[t];
  const float decay = adam_precision_decay(lr, launch.weight_decay[t]);
  MomentRoundingStream random(launch.rounding_key[t], step);
  uint16_t* w = launch.weight[t];
  uint16_t* r = launch.remainder[t];
  const void* g = launch.grad[t];
  const bool g_bf16 = launch.grad_bf16[t];
  void* m = launch.exp_avg[t];
  void* v = launch.exp_avg_sq[t];
  const uint8_t m_kind = launch.exp_avg_kind[t], v_kind = launch.exp_avg_sq_kind[t];
  if (state_kind_scaled(m_kind) || state_kind_scaled(v_kind)) {
    adamw_state_chunk(RemainderMainParam{w, r}, g, g_bf16,
                      device_state_ref(m, m_kind, launch.scale[t], launch.absmax[t], 0),
                      device_state_ref(v, v_kind, launch.scale[t], launch.absmax[t], 1), begin,
                      end, decay, c, random);
    return;
  }
  switch (uint8_t((m_kind == kStateBF16 ? kExpAvgBF16 : 0) |
                  (v_kind == kStateBF16 ? kExpAvgSqBF16 : 0))) {
    case kMomentsF32:
      remainder_chunk<float, float>(w, r, g, g_bf16, m, v, begin, end, vectorized, decay, c, random);
      break;
    case kExpAvgBF16:
      remainder_chunk<uint16_t, float>(w, r, g, g_bf16, m, v, begin, end, vectorized, decay, c, random);
      break;
    case kExpAvgSqBF16:
      remainder_chunk<float, uint16_t>(w, r, g, g_bf16, m, v, begin, end, vectorized, decay, c, random);
      break;
    default:
      remainder_chunk<uint16_t, uint16_t>(w, r, g, g_bf16, m, v, begin, end, vectorized, decay, c,
                                          random);
  }
}

}  // namespace

void split_param_remainders(const Tensor& master, Tensor& weight, Tensor& remainder) {
  const int64_t n = master.numel();
  if (n == 0) return;
  split_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(
      master.f32(), static_cast<uint16_t*>(weight.raw()),
      remainder.defined() ? static_cast<uint16_t*>(remainder.raw()) : nullptr, n);
  MEGATON_CUDA_CHECK_LAUNCH();
}

void join_param_remainders(const Tensor& weight, const Tensor& remainder, Tensor& master) {
  const int64_t n = weight.numel();
  if (n == 0) return;
  join_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(
      static_cast<const uint16_t*>(weight.raw()), static_cast<const uint16_t*>(remainder.raw()),
      master.f32(), n);
  MEGATON_CUDA_CHECK_LAUNCH();
}

void multi_tensor_adamw_param_remainder(
    std::vector<Tensor>& params, std::vector<Tensor>& remainders, const std::vector<Tensor>& grads,
    std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
    const std::vector<float>& weight_decays, float lr, float beta1, float beta2, float eps,
    int64_t step, float grad_scale, const float* control,
    const std::vector<MomentRoundingKey>& rounding_keys, const AdamMomentScales& scales) {
  constexpr const char* kOp = "multi_tensor_adamw_param_remainder";
  std::vector<int64_t> numels(params.size());
  for (size_t i = 0; i < params.size(); ++i) numels[i] = params[i].numel();
  const AdamPrecisionConstants constants =
      adam_precision_constants(lr, beta1, beta2, eps, step, grad_scale);
  for (const LaunchBatch& batch :
       plan_launches(numels, kElementwiseChunk, kRemainderTensors, kOp)) {
    AdamWRemainderLaunch meta{};
    meta.num_tensors = int32_t(batch.tensors.size());
    for (size_t k = 0; k < batch.tensors.size(); ++k) {
      const size_t i = batch.tensors[k];
      const bool m_bf16 = exp_avg[i].dtype() == DType::BF16;
      const bool v_bf16 = exp_avg_sq[i].dtype() == DType::BF16;
      meta.weight[k] = static_cast<uint16_t*>(params[i].raw());
      meta.remainder[k] = static_cast<uint16_t*>(remainders[i].raw());
      fill_state_slot(meta, k, i, batch, grads, exp_avg, exp_avg_sq, weight_decays, rounding_keys,
                      scales, numels[i]);
      meta.vectorized[k] = is_aligned(meta.weight[k], 8) && is_aligned(meta.remainder[k], 8) &&
                           detail::main_grad_pack_aligned(meta.grad[k], meta.grad_bf16[k]) &&
                           is_aligned(meta.exp_avg[k], m_bf16 ? 8 : 16) &&
                           is_aligned(meta.exp_avg_sq[k], v_bf16 ? 8 : 16);
    }
    meta.first_chunk[batch.tensors.size()] = batch.first_chunk.back();
    adamw_param_remainder_chunks<<<batch.first_chunk.back(), kThreads, 0, compute_stream()>>>(
        meta, constants, lr, uint64_t(step), control);
    MEGATON_CUDA_CHECK_LAUNCH();
    commit_scales(meta, control);
  }
}

}  // namespace megaton::ops::cuda
