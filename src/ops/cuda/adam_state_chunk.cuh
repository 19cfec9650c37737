// The parts of the precision-aware AdamW kernels (multi_tensor_adamw.cu, param_remainder.cu)
// that do not depend on how the main param is stored: the update of a chunk with F16 or
// F8E4M3 (scaled) moments over any main-param storage (F32 with its compute copy, or a
// (bf16 weight, int16 remainder) pair), the state-slot fields every launch fills the same
// way, and the launch that writes the new scales after an update. The element math is
// ops/adam_scaled_state_math.h, the CPU twin's (ops/cpu/adam_state_ref.h).
// Internal to those files (an unnamed namespace per translation unit).
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops/adam_precision.h"
#include "ops/adam_precision_math.h"
#include "ops/adam_scaled_state_math.h"
#include "ops/cuda/adam_grad_load.cuh"
#include "ops/cuda/multi_tensor_launch.cuh"
#include "ops/param_remainder_math.h"

namespace megaton::ops::cuda {
namespace {

struct NoCopy {};

// An fp32 main param and its compute copy (Copy = float, __nv_bfloat16, __half or NoCopy),
// rounded to nearest even from the updated value.
template <typename Copy>
struct F32MainParam {
  float* param;
  void* copy;
  __device__ float load(int64_t j) const { return param[j]; }
  __device__ void store(int64_t j, float p) const {
    param[j] = p;
    if constexpr (!std::is_same_v<Copy, NoCopy>) static_cast<Copy*>(copy)[j] = from_float<Copy>(p);
  }
};

// A main param kept as a (bf16 weight, int16 remainder) pair (ops/param_remainder_math.h).
struct RemainderMainParam {
  uint16_t* weight;
  uint16_t* remainder;
  __device__ float load(int64_t j) const { return param_remainder_value(weight[j], remainder[j]); }
  __device__ void store(int64_t j, float p) const {
    uint16_t w, r;
    param_remainder_store(p, w, r);
    weight[j] = w;
    remainder[j] = r;
  }
};

// A moment's AdamStateRef in a kernel: the old scale from scale[column], the new one's
// reciprocal from the (reduced) absmax[column]; unscaled kinds ignore both (null there).
__device__ __forceinline__ AdamStateRef device_state_ref(void* data, uint8_t kind,
                                                         const float* scale, const float* absmax,
                                                         int column) {
  AdamStateRef ref;
  ref.data = data;
  ref.kind = kind;
  if (state_kind_scaled(kind)) {
    ref.scale = scale[column];
    ref.new_rscale = state_rscale(state_scale_from_absmax(absmax[column], kind));
  }
  return ref;
}

// Elements [begin, end) of one tensor with at least one scaled moment: element by element
// (a moment of one or two bytes has no useful pack here), the same element function and
// random bits as the CPU's adamw_state_loop, whatever thread handles an element.
template <typename MainParam>
__device__ void adamw_state_chunk(const MainParam& main, const void* grad, bool grad_bf16,
                                  const AdamStateRef& m, const AdamStateRef& v, int64_t begin,
                                  int64_t end, float decay, const AdamPrecisionConstants& c,
                                  MomentRoundingStream& random) {
  for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kThreads) {
    for (int64_t j = i; j < end && j < i + 4; ++j) {
      float p = main.load(j), mj = m.load(j), vj = v.load(j);
      adamw_precision_update(p, detail::load_main_grad(grad, grad_bf16, j), mj, vj, decay, c);
      const uint32_t bits = random.bits(j);
      main.store(j, p);
      m.store(j, mj, bits & 0xFFFFu);
      v.store(j, vj, bits >> 16);
    }
  }
}

// The state fields of launch slot k for list tensor i, shared by the precision-aware and
// the remainder launches: gradient and its dtype, moments and their kinds, size, first
// chunk, weight decay, rounding key, and the scale and absmax slots (null without scales).
template <typename Launch>
void fill_state_slot(Launch& meta, size_t k, size_t i, const LaunchBatch& batch,
                     const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avg,
                     const std::vector<Tensor>& exp_avg_sq, const std::vector<float>& weight_decays,
                     const std::vector<MomentRoundingKey>& rounding_keys,
                     const AdamMomentScales& scales, int64_t numel) {
  meta.grad[k] = grads[i].raw();
  meta.grad_bf16[k] = grads[i].dtype() == DType::BF16;
  meta.exp_avg[k] = exp_avg[i].raw();
  meta.exp_avg_sq[k] = exp_avg_sq[i].raw();
  meta.exp_avg_kind[k] = adam_state_kind(exp_avg[i].dtype(), "multi_tensor_adamw");
  meta.exp_avg_sq_kind[k] = adam_state_kind(exp_avg_sq[i].dtype(), "multi_tensor_adamw");
  meta.numel[k] = numel;
  meta.first_chunk[k] = batch.first_chunk[k];
  meta.weight_decay[k] = weight_decays[i];
  meta.rounding_key[k] = rounding_keys[i];
  meta.scale[k] = scales.empty() ? nullptr : scales.scale[i].f32();
  meta.absmax[k] = scales.empty() ? nullptr : scales.absmax[i].f32();
}

// Whether slot k of a filled launch has a scaled moment.
template <typename Launch>
bool slot_scaled(const Launch& meta, size_t k) {
  return state_kind_scaled(meta.exp_avg_kind[k]) || state_kind_scaled(meta.exp_avg_sq_kind[k]);
}

// ---- the new scales, after a launch's update ----

constexpr int kScaleCommitTensors = 64;
struct ScaleCommitLaunch {
  float* scale[kScaleCommitTensors];
  const float* absmax[kScaleCommitTensors];
  uint8_t kind[kScaleCommitTensors][2];
  int32_t num_tensors;
};

// scale[t][c] = absmax[t][c] / range for the scaled moments, unless control skips.
__global__ void commit_scales_kernel(const __grid_constant__ ScaleCommitLaunch launch,
                                     const float* control) {
  if (control != nullptr && control[kAdamSkip] != 0.0f) return;
  const int t = int(threadIdx.x);
  if (t >= launch.num_tensors) return;
  for (int c = 0; c < 2; ++c)
    if (state_kind_scaled(launch.kind[t][c]))
      launch.scale[t][c] = state_scale_from_absmax(launch.absmax[t][c], launch.kind[t][c]);
}

// Queues the commit of the scaled slots of a filled launch (after its update kernel, on
// the same stream: the update reads the old scales).
template <typename Launch>
void commit_scales(const Launch& meta, const float* control) {
  ScaleCommitLaunch commit{};
  for (int k = 0; k < meta.num_tensors; ++k) {
    if (!slot_scaled(meta, size_t(k))) continue;
    if (commit.num_tensors == kScaleCommitTensors) {
      commit_scales_kernel<<<1, kScaleCommitTensors, 0, compute_stream()>>>(commit, control);
      MEGATON_CUDA_CHECK_LAUNCH();
      commit = ScaleCommitLaunch{};
    }
    const int n = commit.num_tensors++;
    commit.scale[n] = meta.scale[k];
    commit.absmax[n] = meta.absmax[k];
    commit.kind[n][0] = meta.exp_avg_kind[k];
    commit.kind[n][1] = meta.exp_avg_sq_kind[k];
  }
  if (commit.num_tensors == 0) return;
  commit_scales_kernel<<<1, kScaleCommitTensors, 0, compute_stream()>>>(commit, control);
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace megaton::ops::cuda
