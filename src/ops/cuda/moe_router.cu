// MoE top-k routing on the GPU with all of Megatron's router options, fp32: score
// functions (softmax before or after the top-k, sigmoid, sqrt-softplus), expert bias,
// group-limited routing, sinkhorn selection, normalisation and scaling. Semantics: ops.h
// (moe_router_topk_forward); CPU twin: ops/cpu/moe_router.cpp; source: Megatron-LM
// transformer/moe/moe_utils.py (topk_routing_with_score_function, group_limited_topk).
//
// One fused kernel per direction, one warp per token row. In the forward a lane holds its
// experts' selection scores and probabilities in registers (E / 32 of each, rounded up to
// a power of two), the group scores of the group limit go through shared memory, and the
// top-k is k rounds of a warp arg-max in the CPU's total order (larger first, lower
// expert on ties), carrying the winner's probability along.
#include <cmath>
#include <cstdint>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/moe_router_util.cuh"
#include "ops/cuda/pointwise_util.cuh"

namespace megaton::ops::cuda {
namespace {

using router::Candidate;
using router::kMaxExperts;
using router::kNoExpert;
using router::kThreads;
using router::kWarpsPerBlock;
using router::offer;
using router::ranks_before;
using router::row_blocks;
using router::warp_best;

// What a row's selection score and probability are (ops.h, moe_router_topk_forward).
enum class ScoreMode : int {
  SoftmaxAfterTopk,  // select on the logits, probs = softmax over the k chosen
  PreSoftmax,        // s = softmax over E, select on s, probs = s
  Sigmoid,           // s = sigmoid(x), select on s + bias, probs = s (normalised if k > 1)
  SqrtSoftplus,      // s = sqrt(softplus(x)), as sigmoid
  Sinkhorn,          // select on sinkhorn(exp(x)), probs = sigmoid(x) (k == 1) or softmax
};

struct TopkParams {
  int64_t T = 0;
  int E = 0;
  int k = 0;
  ScoreMode mode = ScoreMode::SoftmaxAfterTopk;
  float scaling = 0.0f;  // 0: none
  int num_groups = 0;    // 0: no group limit
  int group_topk = 0;
  int group_size = 0;  // E / num_groups
  int group_pick = 0;  // k / group_topk: the scores summed into a group's score
};

ScoreMode score_mode(const RouterTopK& options) {
  if (options.sinkhorn) return ScoreMode::Sinkhorn;
  switch (options.score_function) {
    case RouterScoreFunction::Softmax:
      return options.pre_softmax ? ScoreMode::PreSoftmax : ScoreMode::SoftmaxAfterTopk;
    case RouterScoreFunction::Sigmoid:
      return ScoreMode::Sigmoid;
    case RouterScoreFunction::SqrtSoftplus:
      return ScoreMode::SqrtSoftplus;
  }
  MEGATON_CHECK(false, "moe_router: unknown score function {}", int(options.score_function));
  return ScoreMode::SoftmaxAfterTopk;
}

// ---- host: door checks ----

// Door checks shared by the CUDA ops (pointwise_util.cuh).
using detail::check_dtype;
using detail::check_shape;

// logits [T, E] F32 on the GPU, E <= kMaxExperts, options consistent with E.
void check_router_args(const Tensor& logits, const RouterTopK& options, const char* op) {
  check_dtype(logits, DType::F32, op, "logits");
  MEGATON_CHECK(logits.ndim() == 2, "{}: logits must be [T, E], got {}", op,
                shape_str(logits.shape()));
  const int64_t T = logits.dim(0), E = logits.dim(1);
  MEGATON_CHECK(E >= 1 && E <= kMaxExperts, "{}: {} experts, the CUDA router takes 1 .. {}", op, E,
                kMaxExperts);
  MEGATON_CHECK(T <= int64_t(INT32_MAX) * kWarpsPerBlock, "{}: {} tokens exceed the grid limit", op,
                T);
  const int k = options.topk;
  MEGATON_CHECK(k >= 1 && k <= E, "{}: top-k {} must be in [1, E = {}]", op, k, E);
  if (options.num_groups > 0) {
    const int G = options.num_groups;
    MEGATON_CHECK(E % G == 0, "{}: {} experts do not split into {} groups", op, E, G);
    MEGATON_CHECK(options.group_topk >= 1 && options.group_topk <= G,
                  "{}: group_topk {} must be in [1, num_groups = {}]", op, options.group_topk, G);
    const int64_t pick = k / options.group_topk;
    MEGATON_CHECK(pick >= 1 && pick <= E / G,
                  "{}: top-k {} / group_topk {} must be in [1, group size {}]", op, k,
                  options.group_topk, E / G);
    MEGATON_CHECK(k <= int64_t(options.group_topk) * (E / G),
                  "{}: top-k {} exceeds the {} experts of the best {} groups", op, k,
                  int64_t(options.group_topk) * (E / G), options.group_topk);
  }
}

TopkParams make_params(const Tensor& logits, const RouterTopK& options) {
  TopkParams p;
  p.T = logits.dim(0);
  p.E = int(logits.dim(1));
  p.k = options.topk;
  p.mode = score_mode(options);
  p.scaling = options.scaling_factor;
  if (options.num_groups > 0) {
    p.num_groups = options.num_groups;
    p.group_topk = options.group_topk;
    p.group_size = p.E / p.num_groups;
    p.group_pick = p.k / p.group_topk;
  }
  return p;
}

// ---- device ----

// Sum of the `pick` best of the `size` selection scores from `first`, best first in fp32
// (the order of Megatron's topk(...)[0].sum() and of the CPU). Each round takes the best
// score ranking after the previous round's winner, so nothing needs marking.
__device__ float group_score(const float* sel, int first, int size, int pick) {
  float sum = 0.0f, prev = 0.0f;
  int prev_e = kNoExpert;
  for (int r = 0; r < pick; ++r) {
    float best = 0.0f;
    int best_e = kNoExpert;
    for (int e = first; e < first + size; ++e) {
      const float v = sel[e];
      if (prev_e != kNoExpert && !ranks_before(prev, prev_e, v, e)) continue;
      if (ranks_before(v, e, best, best_e)) {
        best = v;
        best_e = e;
      }
    }
    sum += best;
    prev = best;
    prev_e = best_e;
  }
  return sum;
}

// Forward of one token row per warp; N experts per lane (expert lane + 32 i in slot i).
// Shared memory (group limit only): per warp E selection scores, then num_groups group
// scores.
template <int N>
__global__ void __launch_bounds__(kThreads)
    router_topk_forward_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                               const float* __restrict__ sinkhorn, TopkParams p,
                               float* __restrict__ probs, int32_t* __restrict__ indices) {
  extern __shared__ float group_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= p.T) return;  // whole warps leave together
  const int E = p.E, k = p.k;
  const float* row = logits + t * E;

  // sel: the selection score; prob: the probability reported for the expert.
  float sel[N], prob[N];
  uint32_t valid = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = lane + 32 * i;
    const float x = e < E ? row[e] : 0.0f;
    if (e < E) valid |= 1u << i;
    sel[i] = x;
    prob[i] = x;
  }
  switch (p.mode) {
    case ScoreMode::SoftmaxAfterTopk:
      break;
    case ScoreMode::PreSoftmax:
      router::warp_softmax(prob, valid);
#pragma unroll
      for (int i = 0; i < N; ++i) sel[i] = prob[i];
      break;
    case ScoreMode::Sigmoid:
    case ScoreMode::SqrtSoftplus:
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int e = lane + 32 * i;
        prob[i] = p.mode == ScoreMode::Sigmoid ? router::sigmoid(prob[i])
                                               : router::sqrt_softplus(prob[i]);
        sel[i] = bias != nullptr && e < E ? prob[i] + bias[e] : prob[i];
      }
      break;
    case ScoreMode::Sinkhorn:
      if (k == 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) prob[i] = router::sigmoid(prob[i]);
      } else {
        router::warp_softmax(prob, valid);
      }
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int e = lane + 32 * i;
        if (e < E) sel[i] = sinkhorn[t * E + e];
      }
      break;
  }

  // Group limit: only experts of the group_topk best groups may be chosen.
  uint32_t allowed = valid;
  if (p.num_groups > 0) {
    const int G = p.num_groups, size = p.group_size;
    float* warp_sel = group_smem + int64_t(warp) * (E + G);
    float* warp_groups = warp_sel + E;
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (valid >> i & 1u) warp_sel[lane + 32 * i] = sel[i];
    __syncwarp();
    for (int g = lane; g < G; g += 32)
      warp_groups[g] = group_score(warp_sel, g * size, size, p.group_pick);
    __syncwarp();
    uint32_t group_taken = 0;  // bit j: group lane + 32 j is already among the best
    allowed = 0;
    for (int j = 0; j < p.group_topk; ++j) {
      Candidate best;
      for (int s = 0, g = lane; g < G; ++s, g += 32)
        if (!(group_taken >> s & 1u)) offer(best, warp_groups[g], g, 0.0f);
      best = warp_best(best);
      if (best.expert != kNoExpert && best.expert % 32 == lane)
        group_taken |= 1u << (best.expert / 32);
#pragma unroll
      for (int i = 0; i < N; ++i)
        if ((valid >> i & 1u) && (lane + 32 * i) / size == best.expert) allowed |= 1u << i;
    }
  }

  // Top-k: lane 0 writes each winner's index and raw probability; the normalisation
  // statistic (softmax sum over the chosen logits, or the sum of the chosen scores) is
  // the same in every lane.
  float* row_probs = probs + t * k;
  int32_t* row_indices = indices + t * k;
  uint32_t taken = 0;
  float top = 0.0f, norm = 0.0f;
  for (int j = 0; j < k; ++j) {
    Candidate best;
#pragma unroll
    for (int i = 0; i < N; ++i)
      if ((allowed & ~taken) >> i & 1u) offer(best, sel[i], lane + 32 * i, prob[i]);
    best = warp_best(best);
    if (best.expert != kNoExpert && best.expert % 32 == lane) taken |= 1u << (best.expert / 32);
    if (p.mode == ScoreMode::SoftmaxAfterTopk) {
      if (j == 0) top = best.key;
      norm += expf(best.key - top);
    } else {
      norm += best.payload;
    }
    if (lane == 0) {
      row_indices[j] = best.expert;
      row_probs[j] = best.payload;
    }
  }
  __syncwarp();  // lane 0's writes are visible to the lanes that normalise
  const bool renormalise =
      k > 1 && (p.mode == ScoreMode::Sigmoid || p.mode == ScoreMode::SqrtSoftplus);
  for (int j = lane; j < k; j += 32) {
    float v = row_probs[j];
    if (p.mode == ScoreMode::SoftmaxAfterTopk)
      v = expf(v - top) / norm;
    else if (renormalise)
      v = v / (norm + 1e-20f);
    if (p.scaling != 0.0f) v *= p.scaling;
    row_probs[j] = v;
  }
}

// Backward of one token row per warp: every expert's gradient is written. The row is
// first written with what unchosen experts get (zero, or -s_e <s, g> through a softmax
// over all E), then the chosen experts' entries are overwritten, one lane per choice.
__global__ void __launch_bounds__(kThreads)
    router_topk_backward_kernel(const float* __restrict__ dprobs, const float* __restrict__ logits,
                                const int32_t* __restrict__ indices, TopkParams p,
                                float* __restrict__ dlogits) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= p.T) return;
  const int E = p.E, k = p.k;
  const float* row = logits + t * E;
  const float* row_dprobs = dprobs + t * k;
  const int32_t* row_indices = indices + t * k;
  float* drow = dlogits + t * E;
  const float scale = p.scaling != 0.0f ? p.scaling : 1.0f;

  const bool full_softmax =
      p.mode == ScoreMode::PreSoftmax || (p.mode == ScoreMode::Sinkhorn && k > 1);
  if (full_softmax) {
    // probs_j = scale * s[i_j], s = softmax(x): dx = s o (g - <s, g>), g = scale * dprobs
    // on the chosen experts.
    float row_max, row_sum;
    router::warp_softmax_stats(row, E, lane, row_max, row_sum);
    float dot = 0.0f;
    for (int j = lane; j < k; j += 32)
      dot += expf(row[row_indices[j]] - row_max) / row_sum * (scale * row_dprobs[j]);
    dot = router::warp_sum(dot);
    for (int e = lane; e < E; e += 32) drow[e] = -(expf(row[e] - row_max) / row_sum) * dot;
    __syncwarp();
    for (int j = lane; j < k; j += 32) {
      const int e = row_indices[j];
      const float s = expf(row[e] - row_max) / row_sum;
      drow[e] = s * (scale * row_dprobs[j] - dot);
    }
    return;
  }

  for (int e = lane; e < E; e += 32) drow[e] = 0.0f;
  __syncwarp();
  switch (p.mode) {
    case ScoreMode::SoftmaxAfterTopk: {
      // q = softmax over the chosen logits (the first is the largest): dz = q o (g - <q, g>).
      const float top = row[row_indices[0]];
      float sum = 0.0f, dot = 0.0f;
      for (int j = lane; j < k; j += 32) {
        const float w = expf(row[row_indices[j]] - top);
        sum += w;
        dot += w * (scale * row_dprobs[j]);
      }
      sum = router::warp_sum(sum);
      dot = router::warp_sum(dot) / sum;
      for (int j = lane; j < k; j += 32) {
        const int e = row_indices[j];
        const float q = expf(row[e] - top) / sum;
        drow[e] = q * (scale * row_dprobs[j] - dot);
      }
      break;
    }
    case ScoreMode::Sigmoid:
    case ScoreMode::SqrtSoftplus: {
      // probs_j = scale * s_j / D with D = sum_l s_l + 1e-20 when k > 1 (else D = 1):
      // d/ds_j = scale * (dprobs_j - <dprobs, s> / D) / D, then times s'(x).
      const bool sigmoid = p.mode == ScoreMode::Sigmoid;
      float denom = 1.0f, dot = 0.0f;
      if (k > 1) {
        float sum = 0.0f;
        for (int j = lane; j < k; j += 32) {
          const float x = row[row_indices[j]];
          const float s = sigmoid ? router::sigmoid(x) : router::sqrt_softplus(x);
          sum += s;
          dot += s * row_dprobs[j];
        }
        denom = router::warp_sum(sum) + 1e-20f;
        dot = router::warp_sum(dot) / denom;
      }
      for (int j = lane; j < k; j += 32) {
        const int e = row_indices[j];
        const float x = row[e];
        const float s = sigmoid ? router::sigmoid(x) : router::sqrt_softplus(x);
        const float ds = sigmoid ? router::sigmoid_grad(s) : router::sqrt_softplus_grad(x, s);
        drow[e] = scale * (row_dprobs[j] - dot) / denom * ds;
      }
      break;
    }
    case ScoreMode::Sinkhorn: {  // k == 1: probs = scale * sigmoid(x)
      if (lane == 0) {
        const int e = row_indices[0];
        const float s = router::sigmoid(row[e]);
        drow[e] = scale * row_dprobs[0] * router::sigmoid_grad(s);
      }
      break;
    }
    case ScoreMode::PreSoftmax:
      break;  // handled above
  }
}

}  // namespace

void moe_router_topk_forward(const Tensor& logits, const Tensor& expert_bias,
                             const RouterTopK& options, Tensor& probs, Tensor& indices) {
  constexpr const char* op = "moe_router_topk_forward";
  check_router_args(logits, options, op);
  const TopkParams p = make_params(logits, options);
  check_dtype(probs, DType::F32, op, "probs");
  check_shape(probs, {p.T, p.k}, op, "probs");
  check_dtype(indices, DType::I32, op, "indices");
  check_shape(indices, {p.T, p.k}, op, "indices");
  const float* bias = nullptr;
  if (expert_bias.defined()) {
    check_dtype(expert_bias, DType::F32, op, "expert_bias");
    check_shape(expert_bias, {p.E}, op, "expert_bias");
    MEGATON_CHECK(p.mode == ScoreMode::Sigmoid || p.mode == ScoreMode::SqrtSoftplus,
                  "{}: an expert bias needs the sigmoid or sqrtsoftplus score function", op);
    bias = expert_bias.f32();
  }
  if (p.T == 0) return;

  // Sinkhorn selection scores (no gradient, as Megatron's torch.no_grad block).
  Tensor sinkhorn_scores;
  if (p.mode == ScoreMode::Sinkhorn) {
    sinkhorn_scores = Tensor::empty({p.T, p.E}, DType::F32, Device::CUDA);
    moe_sinkhorn(logits, sinkhorn_scores);
  }
  const float* sinkhorn_ptr = sinkhorn_scores.defined() ? sinkhorn_scores.f32() : nullptr;

  const size_t smem =
      p.num_groups > 0 ? size_t(kWarpsPerBlock) * size_t(p.E + p.num_groups) * sizeof(float) : 0;
  router::with_experts_per_lane(p.E, [&](auto n) {
    constexpr int kN = decltype(n)::value;
    auto kernel = router_topk_forward_kernel<kN>;
    if (smem > 48 * 1024)
      MEGATON_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<row_blocks(p.T), kThreads, smem, ::megaton::cuda::stream()>>>(
        logits.f32(), bias, sinkhorn_ptr, p, probs.f32(), indices.i32());
    MEGATON_CUDA_CHECK_LAUNCH();
  });
}

void moe_router_topk_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& probs,
                              const Tensor& indices, const RouterTopK& options, Tensor& dlogits) {
  constexpr const char* op = "moe_router_topk_backward";
  check_router_args(logits, options, op);
  const TopkParams p = make_params(logits, options);
  check_dtype(dprobs, DType::F32, op, "dprobs");
  check_shape(dprobs, {p.T, p.k}, op, "dprobs");
  check_dtype(probs, DType::F32, op, "probs");
  check_shape(probs, {p.T, p.k}, op, "probs");
  check_dtype(indices, DType::I32, op, "indices");
  check_shape(indices, {p.T, p.k}, op, "indices");
  check_dtype(dlogits, DType::F32, op, "dlogits");
  check_shape(dlogits, {p.T, p.E}, op, "dlogits");
  if (p.T == 0) return;
  // The probabilities are recomputed from the logits (no division by a scaling factor);
  // indices come from the forward, in [0, E) (checking them would cost a host copy).
  router_topk_backward_kernel<<<row_blocks(p.T), kThreads, 0, ::megaton::cuda::stream()>>>(
      dprobs.f32(), logits.f32(), indices.i32(), p, dlogits.f32());
  MEGATON_CUDA_CHECK_LAUNCH();
}

}  // namespace megaton::ops::cuda
