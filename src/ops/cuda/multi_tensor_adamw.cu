// multi_tensor_adamw on the GPU: the AdamW update of a list of tensors in a few launches
// (multi_tensor_launch.cuh), fp32 moments (adamw_update, adamw_chunks) or, for the
// precision-aware optimizer, BF16 moments updated in fp32 and stored stochastically
// rounded (ops/adam_precision_math.h, adamw_precision_chunks: its own launches, whose
// per-tensor rounding keys would not fit the fp32 kernel's parameter space). The param
// copy the layers compute with (param_copies) may be F32, BF16 (--bf16) or F16 (--fp16),
// rounded to nearest even from the updated fp32 param. The main grads may be F32 or BF16
// (--main-grads-dtype bf16: widened as they are read, adam_grad_load.cuh). Tensors with an
// F16 or F8E4M3 moment (scaled: ops/adam_scaled_state_math.h) take adamw_state_chunk
// (adam_state_chunk.cuh) inside the precision-aware launches, then the new scales are
// committed; their absmax pass is adam_moment_absmax.cu.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "ops/adam_control_math.h"
#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"
#include "ops/cuda/adam_grad_load.cuh"
#include "ops/cuda/adam_state_chunk.cuh"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/multi_tensor_adamw.h"
#include "ops/cuda/multi_tensor_launch.cuh"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

// ---- AdamW ----

// Per-step constants shared by every tensor, computed on the host in fp64 (or on the
// device by adamw_step_control: the control tensor):
//   g = grad * grad_scale,
//   p = p * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps),
//   step_size = lr / (1 - b1^step), inv_sqrt_bc2 = 1 / sqrt(1 - b2^step),
//   decay = 1 - lr * wd (per tensor, weight_decay in AdamWLaunch; adamw_decay).
// grad_scale is the gradient-clipping coefficient (1 without clipping).
struct AdamWConstants {
  float beta1, beta2, eps, step_size, inv_sqrt_bc2, grad_scale, lr;
};

// float(1 - lr * wd) in fp64, each operation rounded on its own (never contracted into an
// FMA), so the host-scalar and the control paths give the same factor.
__device__ __forceinline__ float adamw_decay(float lr, float weight_decay) {
  return float(__dsub_rn(1.0, __dmul_rn(double(lr), double(weight_decay))));
}

// Kinds of param copy (param_copies[i]).
enum CopyKind : uint8_t { kNoCopy = 0, kCopyF32 = 1, kCopyBF16 = 2, kCopyF16 = 3 };

// The packed kernels' dispatch on a tensor's two unscaled moments: bit 0 set: exp_avg is
// BF16, bit 1 set: exp_avg_sq is BF16 (0, both F32, never reaches the precision launches).
// Tensors with an F16 or F8E4M3 moment take adamw_state_chunk (adam_state_chunk.cuh).
enum MomentKind : uint8_t { kMomentsF32 = 0, kExpAvgBF16 = 1, kExpAvgSqBF16 = 2 };

// Tensors per launch: 60 bytes each.
constexpr int kAdamWTensors = 64;
struct AdamWLaunch {
  float* param[kAdamWTensors];
  const void* grad[kAdamWTensors];  // float*, or __nv_bfloat16* (grad_bf16)
  float* exp_avg[kAdamWTensors];
  float* exp_avg_sq[kAdamWTensors];
  void* copy[kAdamWTensors];
  int64_t numel[kAdamWTensors];
  uint32_t first_chunk[kAdamWTensors + 1];
  float weight_decay[kAdamWTensors];
  uint8_t copy_kind[kAdamWTensors];
  uint8_t grad_bf16[kAdamWTensors];
  // param, grad and both moments aligned for 4-element packs (16 bytes; 8 for a BF16
  // grad): the update runs on packs of 4, otherwise element by element.
  uint8_t vectorized[kAdamWTensors];
  // The copy is aligned for a 4-element store (16 bytes F32, 8 bytes BF16 or F16).
  uint8_t copy_vectorized[kAdamWTensors];
  int32_t num_tensors;
};
static_assert(sizeof(AdamWLaunch) + sizeof(AdamWConstants) + sizeof(float*) <=
              kMaxKernelParamBytes);

// The precision-aware launches: AdamWLaunch's fields with the moments' kinds, the
// rounding keys (ops/adam_precision_math.h) and the scale slots of scaled moments
// (ops/adam_scaled_state_math.h). Tensors per launch: 118 bytes each.
constexpr int kAdamWPrecisionTensors = 32;
struct AdamWPrecisionLaunch {
  float* param[kAdamWPrecisionTensors];
  const void* grad[kAdamWPrecisionTensors];  // float*, or __nv_bfloat16* (grad_bf16)
  void* exp_avg[kAdamWPrecisionTensors];     // as exp_avg_kind says (AdamStateKind)
  void* exp_avg_sq[kAdamWPrecisionTensors];  // as exp_avg_sq_kind says
  void* copy[kAdamWPrecisionTensors];
  int64_t numel[kAdamWPrecisionTensors];
  MomentRoundingKey rounding_key[kAdamWPrecisionTensors];
  uint32_t first_chunk[kAdamWPrecisionTensors + 1];
  float weight_decay[kAdamWPrecisionTensors];
  uint8_t copy_kind[kAdamWPrecisionTensors];
  float* scale[kAdamWPrecisionTensors];         // F32 [2] or null (AdamMomentScales)
  const float* absmax[kAdamWPrecisionTensors];  // F32 [2] or null
  uint8_t exp_avg_kind[kAdamWPrecisionTensors];
  uint8_t exp_avg_sq_kind[kAdamWPrecisionTensors];
  uint8_t grad_bf16[kAdamWPrecisionTensors];
  // param, grad and both moments aligned for 4-element packs (16 bytes F32, 8 bytes BF16).
  uint8_t vectorized[kAdamWPrecisionTensors];
  uint8_t copy_vectorized[kAdamWPrecisionTensors];
  int32_t num_tensors;
};
static_assert(sizeof(AdamWPrecisionLaunch) + sizeof(AdamPrecisionConstants) + 2 * sizeof(float) +
                  sizeof(uint64_t) + sizeof(float*) <=
              kMaxKernelParamBytes);

// One AdamW element update (ops.h adamw_step's formula) from the gradient as stored:
// adamw_precision_update (ops/adam_precision_math.h) on fp32 moments, every operation one
// correctly rounded __fmul_rn / __fmaf_rn / __fdiv_rn / __fsqrt_rn, so nvcc has nothing
// left to contract. It must not be written as plain a * b + c: ops::adamw_step on the GPU
// (adam.cu) runs this kernel's NoCopy instantiation, multi_tensor_adamw with copies its
// float / BF16 / F16 ones, and nvcc contracts the same expression into different FMAs in
// different instantiations (the BF16-grad load of adam_grad_load.cuh changed the code
// around it and the copy instantiations' params moved by 1 ulp against the NoCopy one).
// The clipping scale is its own rounded multiply, so g is bitwise the gradient that scale_
// would have written, and with grad_scale == 1 it is the stored gradient itself. The
// precision-aware kernels run the same function, so an F32 moment gives the same bits there.
__device__ __forceinline__ void adamw_update(float& p, float grad, float& m, float& v, float decay,
                                             const AdamWConstants& c) {
  const AdamPrecisionConstants pc{c.beta1,     1.0f - c.beta1, c.beta2,       1.0f - c.beta2,
                                  c.eps,       c.step_size,    c.inv_sqrt_bc2, c.grad_scale};
  adamw_precision_update(p, grad, m, v, decay, pc);
}

// Elements [begin, end) of one tensor; Copy = float, __nv_bfloat16, __half or NoCopy.
template <typename Copy>
__device__ void adamw_chunk(float* param, const void* grad, bool grad_bf16, float* exp_avg,
                            float* exp_avg_sq, void* copy_raw, int64_t begin, int64_t end,
                            bool vectorized, bool copy_vectorized, float decay,
                            const AdamWConstants& c) {
  [[maybe_unused]] Copy* copy = static_cast<Copy*>(copy_raw);
  for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kThreads) {
    if (vectorized && i + 4 <= end) {
      float4 p = *reinterpret_cast<const float4*>(param + i);
      const Pack<float, 4> g = detail::load_main_grad_pack(grad, grad_bf16, i);
      float4 m = *reinterpret_cast<const float4*>(exp_avg + i);
      float4 v = *reinterpret_cast<const float4*>(exp_avg_sq + i);
      adamw_update(p.x, g.v[0], m.x, v.x, decay, c);
      adamw_update(p.y, g.v[1], m.y, v.y, decay, c);
      adamw_update(p.z, g.v[2], m.z, v.z, decay, c);
      adamw_update(p.w, g.v[3], m.w, v.w, decay, c);
      *reinterpret_cast<float4*>(param + i) = p;
      *reinterpret_cast<float4*>(exp_avg + i) = m;
      *reinterpret_cast<float4*>(exp_avg_sq + i) = v;
      if constexpr (!std::is_same_v<Copy, NoCopy>) {
        Pack<Copy, 4> out;
        out.v[0] = from_float<Copy>(p.x);
        out.v[1] = from_float<Copy>(p.y);
        out.v[2] = from_float<Copy>(p.z);
        out.v[3] = from_float<Copy>(p.w);
        if (copy_vectorized) {
          store_pack<4>(copy + i, out);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) copy[i + j] = out.v[j];
        }
      }
    } else {
      for (int64_t j = i; j < end && j < i + 4; ++j) {
        float p = param[j], m = exp_avg[j], v = exp_avg_sq[j];
        adamw_update(p, detail::load_main_grad(grad, grad_bf16, j), m, v, decay, c);
        param[j] = p;
        exp_avg[j] = m;
        exp_avg_sq[j] = v;
        if constexpr (!std::is_same_v<Copy, NoCopy>) copy[j] = from_float<Copy>(p);
      }
    }
  }
}

// A moment's fp32 value in its storage type: fp32 as it is, bf16 stochastically rounded
// with the 16 random bits `random16` (bf16_round_stochastic).
template <typename T>
__device__ __forceinline__ T store_moment(float x, uint32_t random16) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return __ushort_as_bfloat16(bf16_round_stochastic(x, random16));
  }
}

// The precision-aware update (ops/adam_precision_math.h) of elements [begin, end) of one
// tensor whose moments are M and V (float or __nv_bfloat16, at least one BF16): each
// moment widened to fp32, updated in fp32, stored stochastically rounded with the bits of
// `random` (MomentRoundingStream: element j's, whatever thread or pack handles it); Copy
// as in adamw_chunk. The same element function on packs of 4 and on the scalar tail, so
// the alignment does not change the bits.
template <typename Copy, typename M, typename V>
__device__ void adamw_precision_chunk(float* param, const void* grad, bool grad_bf16,
                                      void* exp_avg_raw, void* exp_avg_sq_raw, void* copy_raw,
                                      int64_t begin, int64_t end, bool vectorized,
                                      bool copy_vectorized, float decay,
                                      const AdamPrecisionConstants& c,
                                      MomentRoundingStream& random) {
  M* exp_avg = static_cast<M*>(exp_avg_raw);
  V* exp_avg_sq = static_cast<V*>(exp_avg_sq_raw);
  [[maybe_unused]] Copy* copy = static_cast<Copy*>(copy_raw);
  for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kThreads) {
    if (vectorized && i + 4 <= end) {
      Pack<float, 4> p = load_pack<4>(param + i);
      const Pack<float, 4> g = detail::load_main_grad_pack(grad, grad_bf16, i);
      Pack<M, 4> m_pack = load_pack<4>(exp_avg + i);
      Pack<V, 4> v_pack = load_pack<4>(exp_avg_sq + i);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float m = to_float(m_pack.v[j]), v = to_float(v_pack.v[j]);
        adamw_precision_update(p.v[j], g.v[j], m, v, decay, c);
        const uint32_t bits = random.bits(i + j);
        m_pack.v[j] = store_moment<M>(m, bits & 0xFFFFu);
        v_pack.v[j] = store_moment<V>(v, bits >> 16);
      }
      store_pack<4>(param + i, p);
      store_pack<4>(exp_avg + i, m_pack);
      store_pack<4>(exp_avg_sq + i, v_pack);
      if constexpr (!std::is_same_v<Copy, NoCopy>) {
        Pack<Copy, 4> out;
#pragma unroll
        for (int j = 0; j < 4; ++j) out.v[j] = from_float<Copy>(p.v[j]);
        if (copy_vectorized) {
          store_pack<4>(copy + i, out);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) copy[i + j] = out.v[j];
        }
      }
    } else {
      for (int64_t j = i; j < end && j < i + 4; ++j) {
        float p = param[j], m = to_float(exp_avg[j]), v = to_float(exp_avg_sq[j]);
        adamw_precision_update(p, detail::load_main_grad(grad, grad_bf16, j), m, v, decay, c);
        const uint32_t bits = random.bits(j);
        param[j] = p;
        exp_avg[j] = store_moment<M>(m, bits & 0xFFFFu);
        exp_avg_sq[j] = store_moment<V>(v, bits >> 16);
        if constexpr (!std::is_same_v<Copy, NoCopy>) copy[j] = from_float<Copy>(p);
      }
    }
  }
}

// adamw_precision_chunk for the moment dtypes of `kind` (not kMomentsF32).
template <typename Copy>
__device__ void adamw_precision_dispatch(uint8_t kind, float* param, const void* grad,
                                         bool grad_bf16, void* exp_avg, void* exp_avg_sq, void* copy, int64_t begin,
                                         int64_t end, bool vectorized, bool copy_vectorized,
                                         float decay, const AdamPrecisionConstants& c,
                                         MomentRoundingStream& random) {
  using BF16 = __nv_bfloat16;
  switch (kind) {
    case kExpAvgBF16:
      adamw_precision_chunk<Copy, BF16, float>(param, grad, grad_bf16, exp_avg, exp_avg_sq,
                                                copy, begin, end, vectorized,
                                                copy_vectorized, decay, c, random);
      break;
    case kExpAvgSqBF16:
      adamw_precision_chunk<Copy, float, BF16>(param, grad, grad_bf16, exp_avg, exp_avg_sq,
                                               copy, begin, end, vectorized,
                                               copy_vectorized, decay, c, random);
      break;
    default:
      adamw_precision_chunk<Copy, BF16, BF16>(param, grad, grad_bf16, exp_avg, exp_avg_sq,
                                               copy, begin, end, vectorized,
                                               copy_vectorized, decay, c, random);
  }
}

__global__ void __launch_bounds__(kThreads)
    adamw_chunks(const __grid_constant__ AdamWLaunch launch, const AdamWConstants host_constants,
                 const float* control) {
  // With a control tensor (adamw_step_control's), the step's scalars come from the device.
  AdamWConstants c = host_constants;
  if (control != nullptr) {
    if (control[kAdamSkip] != 0.0f) return;
    c.step_size = control[kAdamStepSize];
    c.inv_sqrt_bc2 = control[kAdamInvSqrtBc2];
    c.grad_scale = control[kAdamGradScale];
    c.lr = control[kAdamLr];
  }
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kElementwiseChunk;
  const int64_t end = std::min(launch.numel[t], begin + kElementwiseChunk);
  const bool vectorized = launch.vectorized[t], copy_vectorized = launch.copy_vectorized[t];
  const float decay = adamw_decay(c.lr, launch.weight_decay[t]);
  float* exp_avg = launch.exp_avg[t];
  float* exp_avg_sq = launch.exp_avg_sq[t];
  switch (launch.copy_kind[t]) {
    case kCopyF32:
      adamw_chunk<float>(launch.param[t], launch.grad[t], launch.grad_bf16[t], exp_avg, exp_avg_sq, launch.copy[t],
                         begin, end, vectorized, copy_vectorized, decay, c);
      break;
    case kCopyBF16:
      adamw_chunk<__nv_bfloat16>(launch.param[t], launch.grad[t], launch.grad_bf16[t], exp_avg, exp_avg_sq,
                                 launch.copy[t], begin, end, vectorized, copy_vectorized, decay, c);
      break;
    case kCopyF16:
      adamw_chunk<__half>(launch.param[t], launch.grad[t], launch.grad_bf16[t], exp_avg, exp_avg_sq, launch.copy[t],
                          begin, end, vectorized, copy_vectorized, decay, c);
      break;
    default:
      adamw_chunk<NoCopy>(launch.param[t], launch.grad[t], launch.grad_bf16[t], exp_avg, exp_avg_sq, nullptr, begin,
                          end, vectorized, false, decay, c);
  }
}

// The precision-aware launches. host_lr and host_step: the host path's learning rate and
// step count (with a control tensor, the device's control[kAdamLr] and
// control[kAdamStep], exact below 2^24 steps, as the CPU twin reads them).
__global__ void __launch_bounds__(kThreads)
    adamw_precision_chunks(const __grid_constant__ AdamWPrecisionLaunch launch,
                           const AdamPrecisionConstants host_precision, const float host_lr,
                           const uint64_t host_step, const float* control) {
  AdamPrecisionConstants pc = host_precision;
  float lr = host_lr;
  uint64_t step = host_step;
  if (control != nullptr) {
    if (control[kAdamSkip] != 0.0f) return;
    pc.step_size = control[kAdamStepSize];
    pc.inv_sqrt_bc2 = control[kAdamInvSqrtBc2];
    pc.grad_scale = control[kAdamGradScale];
    lr = control[kAdamLr];
    step = uint64_t(int64_t(control[kAdamStep]));
  }
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kElementwiseChunk;
  const int64_t end = std::min(launch.numel[t], begin + kElementwiseChunk);
  const bool vectorized = launch.vectorized[t], copy_vectorized = launch.copy_vectorized[t];
  const float decay = adamw_decay(lr, launch.weight_decay[t]);
  const uint8_t m_kind = launch.exp_avg_kind[t], v_kind = launch.exp_avg_sq_kind[t];
  MomentRoundingStream random(launch.rounding_key[t], step);
  if (state_kind_scaled(m_kind) || state_kind_scaled(v_kind)) {
    const AdamStateRef m =
        device_state_ref(launch.exp_avg[t], m_kind, launch.scale[t], launch.absmax[t], 0);
    const AdamStateRef v =
        device_state_ref(launch.exp_avg_sq[t], v_kind, launch.scale[t], launch.absmax[t], 1);
    float* param = launch.param[t];
    void* copy = launch.copy[t];
    const void* grad = launch.grad[t];
    const bool grad_bf16 = launch.grad_bf16[t];
    switch (launch.copy_kind[t]) {
      case kCopyF32:
        adamw_state_chunk(F32MainParam<float>{param, copy}, grad, grad_bf16, m, v, begin, end,
                          decay, pc, random);
        break;
      case kCopyBF16:
        adamw_state_chunk(F32MainParam<__nv_bfloat16>{param, copy}, grad, grad_bf16, m, v, begin,
                          end, decay, pc, random);
        break;
      case kCopyF16:
        adamw_state_chunk(F32MainParam<__half>{param, copy}, grad, grad_bf16, m, v, begin, end,
                          decay, pc, random);
        break;
      default:
        adamw_state_chunk(F32MainParam<NoCopy>{param, nullptr}, grad, grad_bf16, m, v, begin, end,
                          decay, pc, random);
    }
    return;
  }
  const uint8_t moments =
      uint8_t((m_kind == kStateBF16 ? kExpAvgBF16 : 0) | (v_kind == kStateBF16 ? kExpAvgSqBF16 : 0));
  switch (launch.copy_kind[t]) {
    case kCopyF32:
      adamw_precision_dispatch<float>(moments, launch.param[t], launch.grad[t], launch.grad_bf16[t], launch.exp_avg[t],
                                      launch.exp_avg_sq[t], launch.copy[t], begin, end, vectorized,
                                      copy_vectorized, decay, pc, random);
      break;
    case kCopyBF16:
      adamw_precision_dispatch<__nv_bfloat16>(
          moments, launch.param[t], launch.grad[t], launch.grad_bf16[t], launch.exp_avg[t], launch.exp_avg_sq[t],
          launch.copy[t], begin, end, vectorized, copy_vectorized, decay, pc, random);
      break;
    case kCopyF16:
      adamw_precision_dispatch<__half>(moments, launch.param[t], launch.grad[t], launch.grad_bf16[t], launch.exp_avg[t],
                                       launch.exp_avg_sq[t], launch.copy[t], begin, end, vectorized,
                                       copy_vectorized, decay, pc, random);
      break;
    default:
      adamw_precision_dispatch<NoCopy>(moments, launch.param[t], launch.grad[t], launch.grad_bf16[t], launch.exp_avg[t],
                                       launch.exp_avg_sq[t], nullptr, begin, end, vectorized, false,
                                       decay, pc, random);
  }
}

// The param and its compute copy (kind, alignment) of list tensor i at slot k of `meta`
// (both launch kinds).
template <typename Launch>
void fill_param_slot(Launch& meta, size_t k, size_t i, std::vector<Tensor>& params,
                     const std::vector<Tensor>& param_copies) {
  meta.param[k] = params[i].f32();
  const Tensor& copy = param_copies[i];
  if (copy.defined()) {
    meta.copy[k] = copy.raw();
    meta.copy_kind[k] = copy.dtype() == DType::BF16  ? kCopyBF16
                        : copy.dtype() == DType::F16 ? kCopyF16
                                                     : kCopyF32;
    meta.copy_vectorized[k] = is_aligned(copy.raw(), 4 * dtype_size(copy.dtype()));
  }
}

// multi_tensor_adamw's checks and launches; control: null (the scalars below) or
// adamw_step_control's device tensor. Tensors whose moments are both F32 go to
// adamw_chunks, the others (with their rounding keys) to adamw_precision_chunks.
void launch_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                  std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                  float lr, float beta1, float beta2, float eps, int64_t step, float grad_scale,
                  const float* control, const std::vector<MomentRoundingKey>& rounding_keys,
                  const AdamMomentScales& scales) {
  constexpr const char* kOp = "multi_tensor_adamw";
  const size_t n = params.size();
  MEGATON_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n &&
                    param_copies.size() == n && weight_decays.size() == n,
                "{}: list lengths differ: params {}, grads {}, exp_avg {}, exp_avg_sq {}, "
                "param_copies {}, weight_decays {}",
                kOp, n, grads.size(), exp_avg.size(), exp_avg_sq.size(), param_copies.size(),
                weight_decays.size());
  check_rounding_keys(rounding_keys, n, kOp);
  MEGATON_CHECK(step >= 1, "{}: step {} must be >= 1 (1-based)", kOp, step);
  MEGATON_CHECK(beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f,
                "{}: betas ({}, {}) must be in [0, 1)", kOp, beta1, beta2);
  MEGATON_CHECK(std::isfinite(grad_scale), "{}: grad_scale {} must be finite", kOp, grad_scale);
  // numels of the fp32-state tensors and of the precision-aware ones (0: the other kind,
  // skipped by plan_launches), so each batch's indices are the caller's.
  std::vector<int64_t> numels_f32(n, 0), numels_precision(n, 0);
  for (size_t i = 0; i < n; ++i) {
    check_listed(params[i], kOp, "params", i, Listed::kF32);
    // BF16 grads: --main-grads-dtype bf16, widened as the kernels read them.
    check_listed(grads[i], kOp, "grads", i, Listed::kF32OrBF16);
    // BF16, F16 and F8E4M3 moments: the precision-aware optimizer
    // (ops/adam_precision_math.h, ops/adam_scaled_state_math.h).
    check_listed(exp_avg[i], kOp, "exp_avg", i, Listed::kAdamMoment);
    check_listed(exp_avg_sq[i], kOp, "exp_avg_sq", i, Listed::kAdamMoment);
    const int64_t numel = params[i].numel();
    const Tensor* entries[] = {&grads[i], &exp_avg[i], &exp_avg_sq[i]};
    for (const Tensor* t : entries)
      MEGATON_CHECK(t->numel() == numel, "{}: tensor {}: {} elements in a list, param has {}", kOp,
                    i, t->numel(), numel);
    if (param_copies[i].defined()) {
      check_listed(param_copies[i], kOp, "param_copies", i, Listed::kFloat);
      MEGATON_CHECK(param_copies[i].numel() == numel,
                    "{}: param_copies[{}] {} has {} elements, param has {}", kOp, i,
                    shape_str(param_copies[i].shape()), param_copies[i].numel(), numel);
    }
    const bool f32_moments =
        exp_avg[i].dtype() == DType::F32 && exp_avg_sq[i].dtype() == DType::F32;
    (f32_moments ? numels_f32 : numels_precision)[i] = numel;
  }
  check_moment_scales(scales, exp_avg, exp_avg_sq, Device::CUDA, kOp);
  // The single-tensor op (adam.cu) calls this function, so both get these bits.
  // By squaring, not pow: adamw_step_control computes the same bits on the device.
  const double bias_correction1 = 1.0 - power_by_squaring(double(beta1), step);
  const double bias_correction2 = 1.0 - power_by_squaring(double(beta2), step);
  const float step_size = float(lr / bias_correction1);
  const float inv_sqrt_bc2 = float(1.0 / std::sqrt(bias_correction2));
  const AdamWConstants constants{beta1, beta2, eps, step_size, inv_sqrt_bc2, grad_scale, lr};
  cudaStream_t stream = compute_stream();
  for (const LaunchBatch& batch :
       plan_launches(numels_f32, kElementwiseChunk, kAdamWTensors, kOp)) {
    AdamWLaunch meta{};
    meta.num_tensors = int32_t(batch.tensors.size());
    for (size_t k = 0; k < batch.tensors.size(); ++k) {
      const size_t i = batch.tensors[k];
      fill_param_slot(meta, k, i, params, param_copies);
      meta.grad[k] = grads[i].raw();
      meta.grad_bf16[k] = grads[i].dtype() == DType::BF16;
      meta.exp_avg[k] = exp_avg[i].f32();
      meta.exp_avg_sq[k] = exp_avg_sq[i].f32();
      meta.numel[k] = numels_f32[i];
      meta.first_chunk[k] = batch.first_chunk[k];
      meta.weight_decay[k] = weight_decays[i];
      meta.vectorized[k] = is_aligned(meta.param[k], 16) &&
                           detail::main_grad_pack_aligned(meta.grad[k], meta.grad_bf16[k]) &&
                           is_aligned(meta.exp_avg[k], 16) && is_aligned(meta.exp_avg_sq[k], 16);
    }
    meta.first_chunk[batch.tensors.size()] = batch.first_chunk.back();
    adamw_chunks<<<batch.first_chunk.back(), kThreads, 0, stream>>>(meta, constants, control);
    MEGATON_CUDA_CHECK_LAUNCH();
  }
  const AdamPrecisionConstants precision =
      adam_precision_constants(lr, beta1, beta2, eps, step, grad_scale);
  for (const LaunchBatch& batch :
       plan_launches(numels_precision, kElementwiseChunk, kAdamWPrecisionTensors, kOp)) {
    AdamWPrecisionLaunch meta{};
    meta.num_tensors = int32_t(batch.tensors.size());
    for (size_t k = 0; k < batch.tensors.size(); ++k) {
      const size_t i = batch.tensors[k];
      fill_param_slot(meta, k, i, params, param_copies);
      fill_state_slot(meta, k, i, batch, grads, exp_avg, exp_avg_sq, weight_decays, rounding_keys,
                      scales, numels_precision[i]);
      const bool m_bf16 = exp_avg[i].dtype() == DType::BF16;
      const bool v_bf16 = exp_avg_sq[i].dtype() == DType::BF16;
      meta.vectorized[k] = is_aligned(meta.param[k], 16) &&
                           detail::main_grad_pack_aligned(meta.grad[k], meta.grad_bf16[k]) &&
                           is_aligned(meta.exp_avg[k], m_bf16 ? 8 : 16) &&
                           is_aligned(meta.exp_avg_sq[k], v_bf16 ? 8 : 16);
    }
    meta.first_chunk[batch.tensors.size()] = batch.first_chunk.back();
    adamw_precision_chunks<<<batch.first_chunk.back(), kThreads, 0, stream>>>(
        meta, precision, lr, uint64_t(step), control);
    MEGATON_CUDA_CHECK_LAUNCH();
    commit_scales(meta, control);
  }
}

// control's checks (the device-step overloads).
void check_control(const Tensor& control) {
  MEGATON_CHECK(control.defined() && control.dtype() == DType::F32 &&
                    control.numel() == kAdamControlSize && control.device() == Device::CUDA,
                "multi_tensor_adamw: control must be F32 [{}] on the GPU", kAdamControlSize);
}
}  // namespace

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale) {
  launch_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, lr, beta1, beta2,
               eps, step, grad_scale, nullptr, list_order_rounding_keys(params.size()), {});
}

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float lr, float beta1, float beta2, float eps, int64_t step,
                        float grad_scale, const std::vector<MomentRoundingKey>& rounding_keys,
                        const AdamMomentScales& scales) {
  launch_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, lr, beta1, beta2,
               eps, step, grad_scale, nullptr, rounding_keys, scales);
}

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control) {
  check_control(control);
  // Step 1, scale 1 and lr 0 pass the host checks; the kernels take the device's values.
  launch_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, 0.0f, beta1, beta2,
               eps, 1, 1.0f, control.f32(), list_order_rounding_keys(params.size()), {});
}

void multi_tensor_adamw(std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                        std::vector<Tensor>& param_copies, const std::vector<float>& weight_decays,
                        float beta1, float beta2, float eps, const Tensor& control,
                        const std::vector<MomentRoundingKey>& rounding_keys,
                        const AdamMomentScales& scales) {
  check_control(control);
  launch_adamw(params, grads, exp_avg, exp_avg_sq, param_copies, weight_decays, 0.0f, beta1, beta2,
               eps, 1, 1.0f, control.f32(), rounding_keys, scales);
}


}  // namespace megaton::ops::cuda
