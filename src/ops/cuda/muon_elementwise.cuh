// The multi-tensor launch of the elementwise optimizer rules beside AdamW: muon_apply
// (muon_apply.cu), SGD and Lion (sgd_lion.cu). A rule updates one fp32 main param element
// from one input element (an update or a grad, F32 or BF16) and at most one fp32 state
// element; the launch machinery (multi_tensor_launch.cuh) spreads a list's chunks over the
// blocks, the step's scalars are read from the control tensor on the device (a skipped step
// returns before reading anything else), and the param copy is written after the update.
// Internal to those files (an unnamed namespace per translation unit).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <vector>

#include "ops/cuda/adam_grad_load.cuh"
#include "ops/cuda/multi_tensor_launch.cuh"
#include "ops/ops.h"

namespace megaton::ops::cuda {
namespace {

// Kinds of param copy (copies[i]).
enum RuleCopyKind : uint8_t { kRuleNoCopy = 0, kRuleCopyF32, kRuleCopyBF16, kRuleCopyF16 };

// Tensors per launch: 53 bytes each.
constexpr int kRuleTensors = 64;
struct RuleLaunch {
  float* main[kRuleTensors];
  const void* input[kRuleTensors];  // float*, or __nv_bfloat16* (input_bf16)
  float* state[kRuleTensors];       // null for a rule without state
  void* copy[kRuleTensors];
  int64_t numel[kRuleTensors];
  uint32_t first_chunk[kRuleTensors + 1];
  float weight_decay[kRuleTensors];
  float scale[kRuleTensors];  // muon_apply's per-matrix scale; 1 for the others
  uint8_t input_bf16[kRuleTensors];
  uint8_t copy_kind[kRuleTensors];
  int32_t num_tensors;
};
static_assert(sizeof(RuleLaunch) + 64 <= kMaxKernelParamBytes);  // 64: the rule and control

// The updated param, rounded to nearest even into the copy's type.
__device__ __forceinline__ void store_rule_copy(void* copy, uint8_t kind, int64_t i, float p) {
  switch (kind) {
    case kRuleCopyF32:
      static_cast<float*>(copy)[i] = p;
      break;
    case kRuleCopyBF16:
      static_cast<__nv_bfloat16*>(copy)[i] = __float2bfloat16_rn(p);
      break;
    case kRuleCopyF16:
      static_cast<__half*>(copy)[i] = __float2half_rn(p);
      break;
    default:
      break;
  }
}

// Rule: a trivially copyable struct with
//   __device__ Consts consts(const float* control, float weight_decay, float scale) const;
//   __device__ void update(const Consts&, float& main, float input, float* state) const;
// (state points at the element's state, null for a rule without).
template <typename Rule>
__global__ void __launch_bounds__(kThreads)
    rule_chunks(const __grid_constant__ RuleLaunch launch, const Rule rule, const float* control) {
  if (control[kAdamSkip] != 0.0f) return;
  const int t = tensor_of_block(launch.first_chunk, launch.num_tensors);
  const int64_t begin = int64_t(blockIdx.x - launch.first_chunk[t]) * kElementwiseChunk;
  const int64_t end = std::min(launch.numel[t], begin + kElementwiseChunk);
  const auto consts = rule.consts(control, launch.weight_decay[t], launch.scale[t]);
  float* main = launch.main[t];
  float* state = launch.state[t];
  const void* input = launch.input[t];
  const bool input_bf16 = launch.input_bf16[t];
  void* copy = launch.copy[t];
  const uint8_t copy_kind = launch.copy_kind[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float p = main[i];
    rule.update(consts, p, detail::load_main_grad(input, input_bf16, i),
                state != nullptr ? state + i : nullptr);
    main[i] = p;
    store_rule_copy(copy, copy_kind, i, p);
  }
}

// Launches `rule` over the lists (checked at the ops door; here again the GPU placement and
// dtypes, which a wrong list would turn into a bad access). states, scales: null when the
// rule has none.
template <typename Rule>
void launch_rule(const char* op, const Rule& rule, std::vector<Tensor>& mains,
                 const std::vector<Tensor>& inputs, std::vector<Tensor>* states,
                 std::vector<Tensor>& copies, const std::vector<float>& weight_decays,
                 const std::vector<float>* scales, const Tensor& control) {
  check_listed(control, op, "control", 0, Listed::kF32);
  std::vector<int64_t> numels;
  for (size_t i = 0; i < mains.size(); ++i) {
    check_listed(mains[i], op, "mains", i, Listed::kF32);
    check_listed(inputs[i], op, "inputs", i, Listed::kF32OrBF16);
    if (states != nullptr) check_listed((*states)[i], op, "state", i, Listed::kF32);
    if (copies[i].defined()) check_listed(copies[i], op, "copies", i, Listed::kFloat);
    numels.push_back(mains[i].numel());
  }
  for (const LaunchBatch& batch : plan_launches(numels, kElementwiseChunk, kRuleTensors, op)) {
    RuleLaunch meta{};
    meta.num_tensors = int32_t(batch.tensors.size());
    for (size_t k = 0; k < batch.tensors.size(); ++k) {
      const size_t i = batch.tensors[k];
      meta.main[k] = mains[i].f32();
      meta.input[k] = inputs[i].raw();
      meta.input_bf16[k] = inputs[i].dtype() == DType::BF16;
      meta.state[k] = states != nullptr ? (*states)[i].f32() : nullptr;
      const Tensor& copy = copies[i];
      meta.copy[k] = copy.defined() ? copy.raw() : nullptr;
      meta.copy_kind[k] = !copy.defined()               ? kRuleNoCopy
                          : copy.dtype() == DType::F32  ? kRuleCopyF32
                          : copy.dtype() == DType::BF16 ? kRuleCopyBF16
                                                        : kRuleCopyF16;
      meta.numel[k] = numels[i];
      meta.first_chunk[k] = batch.first_chunk[k];
      meta.weight_decay[k] = weight_decays[i];
      meta.scale[k] = scales != nullptr ? (*scales)[i] : 1.0f;
    }
    meta.first_chunk[batch.tensors.size()] = batch.first_chunk.back();
    rule_chunks<Rule>
        <<<batch.first_chunk.back(), kThreads, 0, compute_stream()>>>(meta, rule, control.f32());
    MEGATON_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace
}  // namespace megaton::ops::cuda
