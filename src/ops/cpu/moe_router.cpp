// MoE top-k routing with all of Megatron's router options, and Megatron's sinkhorn, on the
// CPU (the fp32 reference of ops/cuda/moe_router.cu). Semantics: ops.h; source: Megatron-LM
// transformer/moe/moe_utils.py (topk_routing_with_score_function, group_limited_topk,
// sinkhorn) and router.py (TopKRouter.sinkhorn_load_balancing).
//
// Scores and selection scores are fp32 values as Megatron computes them (softmax,
// sigmoid and sqrt-softplus are evaluated in fp64 and rounded once; bias added in fp32);
// normalisations and every gradient are accumulated in fp64 and rounded once.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/cpu/moe_router_math.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

using router_math::check_logits;
using router_math::check_shape;
using router_math::check_tensor;
using router_math::kParallelMin;
using router_math::ranks_before;
using router_math::sigmoid;
using router_math::softmax_row;
using router_math::sqrt_softplus;
using router_math::sqrt_softplus_grad;

// What a row's selection score and probability are (ops.h, moe_router_topk_forward).
enum class ScoreMode {
  SoftmaxAfterTopk,  // select on the logits, probs = softmax over the k chosen
  PreSoftmax,        // s = softmax over E, select on s, probs = s
  Sigmoid,           // s = sigmoid(x), select on s + bias, probs = s (normalised if k > 1)
  SqrtSoftplus,      // s = sqrt(softplus(x)), as sigmoid
  Sinkhorn,          // select on sinkhorn(exp(x)), probs = sigmoid(x) (k == 1) or softmax
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

// The options must make sense for E experts (Megatron's TransformerConfig checks, and
// what group_limited_topk needs to select k experts).
void check_options(const RouterTopK& o, int64_t E, const char* op) {
  MEGATON_CHECK(o.topk >= 1 && o.topk <= E, "{}: top-k {} must be in [1, E = {}]", op, o.topk, E);
  MEGATON_CHECK(std::isfinite(o.scaling_factor), "{}: scaling factor {} is not finite", op,
                o.scaling_factor);
  MEGATON_CHECK(o.num_groups >= 0, "{}: num_groups {} must be >= 0", op, o.num_groups);
  if (o.num_groups == 0) return;
  const int64_t G = o.num_groups;
  MEGATON_CHECK(E % G == 0, "{}: {} experts do not split into {} groups", op, E, G);
  MEGATON_CHECK(o.group_topk >= 1 && o.group_topk <= G,
                "{}: group_topk {} must be in [1, num_groups = {}]", op, o.group_topk, G);
  // Megatron sums the top (k // group_topk) scores of a group: at least one, at most a group.
  const int64_t pick = o.topk / o.group_topk;
  MEGATON_CHECK(pick >= 1 && pick <= E / G,
                "{}: top-k {} / group_topk {} must be in [1, group size {}]", op, o.topk,
                o.group_topk, E / G);
  MEGATON_CHECK(o.topk <= int64_t(o.group_topk) * (E / G),
                "{}: top-k {} exceeds the {} experts of the best {} groups", op, o.topk,
                int64_t(o.group_topk) * (E / G), o.group_topk);
}

// The routing of one row: the k allowed experts of largest `sel`, best first (ranks_before
// order), written to out. allowed (size E) marks the experts the group limit leaves.
void topk_allowed(const float* sel, const std::vector<char>& allowed, int k,
                  std::vector<int32_t>& order, int32_t* out) {
  order.clear();
  for (int32_t e = 0; e < int32_t(allowed.size()); ++e)
    if (allowed[e]) order.push_back(e);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [sel](int32_t a, int32_t b) { return ranks_before(sel[a], a, sel[b], b); });
  std::copy(order.begin(), order.begin() + k, out);
}

// Megatron group_limited_topk's mask: experts split into num_groups consecutive groups,
// a group's score is the fp32 sum of its `pick` largest selection scores (best first, the
// order of topk(...)[0].sum()), and only the group_topk best groups stay allowed.
void group_limit(const float* sel, int64_t E, const RouterTopK& o, std::vector<int32_t>& order,
                 std::vector<float>& group_scores, std::vector<char>& allowed) {
  const int G = o.num_groups;
  const int64_t size = E / G;
  const int pick = o.topk / o.group_topk;
  group_scores.resize(G);
  for (int g = 0; g < G; ++g) {
    order.resize(size);
    std::iota(order.begin(), order.end(), int32_t(g * size));
    std::partial_sort(order.begin(), order.begin() + pick, order.end(),
                      [sel](int32_t a, int32_t b) { return ranks_before(sel[a], a, sel[b], b); });
    float sum = 0.0f;
    for (int j = 0; j < pick; ++j) sum += sel[order[j]];
    group_scores[g] = sum;
  }
  order.resize(G);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(
      order.begin(), order.begin() + o.group_topk, order.end(),
      [&](int32_t a, int32_t b) { return ranks_before(group_scores[a], a, group_scores[b], b); });
  std::fill(allowed.begin(), allowed.end(), char(0));
  for (int j = 0; j < o.group_topk; ++j)
    std::fill(allowed.begin() + order[j] * size, allowed.begin() + (order[j] + 1) * size, char(1));
}

// Megatron-LM moe_utils.sinkhorn on logits [T, E]: cost = exp(logits) (no max subtracted),
// d0 = 1/T / (sum_e d1 cost + eps), d1 = 1/E / (sum_t d0 cost + eps) from d1 = 1, while
// mean |d1_old - d1| > 1e-4; out = d1 * cost * d0. d0, d1, the error and every product
// are fp32 values as in torch (1/T times the reciprocal: torch's scalar / tensor); the
// sums are fp64, the column sums over fixed chunks of rows added in chunk order so the
// result does not depend on the thread count.
void sinkhorn(const float* logits, int64_t T, int64_t E, float* out) {
  constexpr float kEps = 1e-8f, kTol = 1e-4f;
  constexpr int64_t kChunkRows = 256;
  const int64_t n = T * E;
  std::vector<float> cost(n), d0(T, 1.0f), d1(E, 1.0f), d1_old(E, 1.0f);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) cost[i] = std::exp(logits[i]);
  const float inv_T = float(1.0 / double(T)), inv_E = float(1.0 / double(E));
  const int64_t chunks = (T + kChunkRows - 1) / kChunkRows;
  std::vector<double> partial(chunks * E);
  float error = 1e9f;
  while (error > kTol) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = cost.data() + t * E;
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += double(d1[e] * row[e]);
      d0[t] = (1.0f / (float(sum) + kEps)) * inv_T;
    }
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t c = 0; c < chunks; ++c) {
      double* acc = partial.data() + c * E;
      std::fill(acc, acc + E, 0.0);
      for (int64_t t = c * kChunkRows; t < std::min(T, (c + 1) * kChunkRows); ++t)
        for (int64_t e = 0; e < E; ++e) acc[e] += double(d0[t] * cost[t * E + e]);
    }
    double abs_change = 0;
    for (int64_t e = 0; e < E; ++e) {
      double sum = 0;
      for (int64_t c = 0; c < chunks; ++c) sum += partial[c * E + e];
      d1[e] = (1.0f / (float(sum) + kEps)) * inv_E;
      abs_change += std::fabs(double(d1_old[e]) - double(d1[e]));
    }
    error = float(abs_change / double(E));
    d1_old = d1;
  }
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) out[t * E + e] = d1[e] * cost[t * E + e] * d0[t];
}

void check_sinkhorn_args(const Tensor& logits, const Tensor& out) {
  constexpr const char* op = "moe_sinkhorn";
  check_logits(logits, op);
  check_tensor(out, DType::F32, op, "out");
  check_shape(out, logits.shape(), op, "out");
}

}  // namespace

void moe_router_topk_forward(const Tensor& logits, const Tensor& expert_bias,
                             const RouterTopK& options, Tensor& probs, Tensor& indices) {
  MEGATON_CUDA_DISPATCH(
      logits, cuda::moe_router_topk_forward(logits, expert_bias, options, probs, indices));
  constexpr const char* op = "moe_router_topk_forward";
  check_logits(logits, op);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_options(options, E, op);
  const int k = options.topk;
  const ScoreMode mode = score_mode(options);
  check_tensor(probs, DType::F32, op, "probs");
  check_shape(probs, {T, k}, op, "probs");
  check_tensor(indices, DType::I32, op, "indices");
  check_shape(indices, {T, k}, op, "indices");
  const float* bias = nullptr;
  if (expert_bias.defined()) {
    check_tensor(expert_bias, DType::F32, op, "expert_bias");
    check_shape(expert_bias, {E}, op, "expert_bias");
    MEGATON_CHECK(mode == ScoreMode::Sigmoid || mode == ScoreMode::SqrtSoftplus,
                  "{}: an expert bias needs the sigmoid or sqrtsoftplus score function (and no "
                  "sinkhorn)",
                  op);
    bias = expert_bias.f32();
  }
  if (T == 0) return;

  // Sinkhorn selection scores (no gradient: Megatron computes them under torch.no_grad).
  std::vector<float> sinkhorn_scores;
  if (mode == ScoreMode::Sinkhorn) {
    sinkhorn_scores.resize(T * E);
    sinkhorn(logits.f32(), T, E, sinkhorn_scores.data());
  }
  const float* x = logits.f32();
  float* p = probs.f32();
  int32_t* idx = indices.i32();
  const double scale = options.scaling_factor != 0.0f ? double(options.scaling_factor) : 1.0;
#pragma omp parallel if (T * E >= kParallelMin)
  {
    // sel: the selection score; prob: the probability reported for the expert.
    std::vector<float> sel(E), prob(E), group_scores;
    std::vector<char> allowed(E);
    std::vector<int32_t> order;
    std::vector<double> weights(k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = x + t * E;
      switch (mode) {
        case ScoreMode::SoftmaxAfterTopk:
          std::copy(row, row + E, sel.begin());
          break;
        case ScoreMode::PreSoftmax:
          softmax_row(row, E, prob.data());
          sel = prob;
          break;
        case ScoreMode::Sigmoid:
        case ScoreMode::SqrtSoftplus:
          for (int64_t e = 0; e < E; ++e) {
            prob[e] = float(mode == ScoreMode::Sigmoid ? sigmoid(row[e]) : sqrt_softplus(row[e]));
            sel[e] = bias ? prob[e] + bias[e] : prob[e];
          }
          break;
        case ScoreMode::Sinkhorn:
          // Megatron's _sinkhorn_activation: sigmoid for k == 1, else softmax over E.
          if (k == 1) {
            for (int64_t e = 0; e < E; ++e) prob[e] = float(sigmoid(row[e]));
          } else {
            softmax_row(row, E, prob.data());
          }
          std::copy(sinkhorn_scores.data() + t * E, sinkhorn_scores.data() + (t + 1) * E,
                    sel.begin());
          break;
      }
      if (options.num_groups > 0) {
        group_limit(sel.data(), E, options, order, group_scores, allowed);
      } else {
        std::fill(allowed.begin(), allowed.end(), char(1));
      }
      int32_t* row_idx = idx + t * k;
      topk_allowed(sel.data(), allowed, k, order, row_idx);

      float* row_p = p + t * k;
      if (mode == ScoreMode::SoftmaxAfterTopk) {
        // Softmax over the k chosen logits; the first chosen is the largest.
        const double top = row[row_idx[0]];
        double sum = 0;
        for (int j = 0; j < k; ++j) sum += (weights[j] = std::exp(double(row[row_idx[j]]) - top));
        for (int j = 0; j < k; ++j) row_p[j] = float(weights[j] / sum * scale);
      } else if ((mode == ScoreMode::Sigmoid || mode == ScoreMode::SqrtSoftplus) && k > 1) {
        double sum = 0;
        for (int j = 0; j < k; ++j) sum += prob[row_idx[j]];
        for (int j = 0; j < k; ++j)
          row_p[j] = float(double(prob[row_idx[j]]) / (sum + 1e-20) * scale);
      } else {
        for (int j = 0; j < k; ++j) row_p[j] = float(double(prob[row_idx[j]]) * scale);
      }
    }
  }
}

void moe_router_topk_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& probs,
                              const Tensor& indices, const RouterTopK& options, Tensor& dlogits) {
  MEGATON_CUDA_DISPATCH(
      dprobs, cuda::moe_router_topk_backward(dprobs, logits, probs, indices, options, dlogits));
  constexpr const char* op = "moe_router_topk_backward";
  check_logits(logits, op);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_options(options, E, op);
  const int k = options.topk;
  const ScoreMode mode = score_mode(options);
  check_tensor(dprobs, DType::F32, op, "dprobs");
  check_shape(dprobs, {T, k}, op, "dprobs");
  check_tensor(probs, DType::F32, op, "probs");
  check_shape(probs, {T, k}, op, "probs");
  check_tensor(indices, DType::I32, op, "indices");
  check_shape(indices, {T, k}, op, "indices");
  check_tensor(dlogits, DType::F32, op, "dlogits");
  check_shape(dlogits, {T, E}, op, "dlogits");
  const int32_t* idx = indices.i32();
  for (int64_t i = 0; i < T * k; ++i)
    MEGATON_CHECK(idx[i] >= 0 && idx[i] < E, "{}: index {} at {} not in [0, {})", op, idx[i], i, E);
  if (T == 0) return;

  // The probabilities are recomputed from the logits in fp64 (probs carries the scaling
  // factor and fp32 rounding); g = scale * dprobs is the gradient of the unscaled probs.
  const float *x = logits.f32(), *dp = dprobs.f32();
  float* dx = dlogits.f32();
  const double scale = options.scaling_factor != 0.0f ? double(options.scaling_factor) : 1.0;
  const bool full_softmax = mode == ScoreMode::PreSoftmax || (mode == ScoreMode::Sinkhorn && k > 1);
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<double> s(std::max<int64_t>(E, k)), g(k), G(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = x + t * E;
      const int32_t* row_idx = idx + t * k;
      float* drow = dx + t * E;
      for (int j = 0; j < k; ++j) g[j] = scale * double(dp[t * k + j]);
      std::fill(drow, drow + E, 0.0f);
      if (full_softmax) {
        // probs_j = s[i_j], s = softmax(x): dx = s o (G - <s, G>), G = g on the chosen.
        router_math::softmax_row_f64(row, E, s.data());
        double dot = 0;
        for (int j = 0; j < k; ++j) dot += s[row_idx[j]] * g[j];
        std::fill(G.begin(), G.end(), 0.0);
        for (int j = 0; j < k; ++j) G[row_idx[j]] += g[j];
        for (int64_t e = 0; e < E; ++e) drow[e] = float(s[e] * (G[e] - dot));
        continue;
      }
      switch (mode) {
        case ScoreMode::SoftmaxAfterTopk: {
          // q = softmax over the chosen logits: dz_j = q_j (g_j - <q, g>).
          const double top = row[row_idx[0]];
          double sum = 0;
          for (int j = 0; j < k; ++j) sum += (s[j] = std::exp(double(row[row_idx[j]]) - top));
          double dot = 0;
          for (int j = 0; j < k; ++j) dot += (s[j] /= sum) * g[j];
          for (int j = 0; j < k; ++j) drow[row_idx[j]] = float(s[j] * (g[j] - dot));
          break;
        }
        case ScoreMode::Sigmoid:
        case ScoreMode::SqrtSoftplus: {
          // probs_j = s_j / D, D = sum_l s_l + 1e-20 when k > 1 (else D = 1):
          // d/ds_j = (g_j - <g, s> / D) / D, then times s'(x).
          const bool is_sigmoid = mode == ScoreMode::Sigmoid;
          for (int j = 0; j < k; ++j) {
            const double v = row[row_idx[j]];
            s[j] = is_sigmoid ? sigmoid(v) : sqrt_softplus(v);
          }
          double denom = 1.0, dot = 0.0;
          if (k > 1) {
            double sum = 0;
            for (int j = 0; j < k; ++j) {
              sum += s[j];
              dot += s[j] * g[j];
            }
            denom = sum + 1e-20;
            dot /= denom;
          }
          for (int j = 0; j < k; ++j) {
            const double v = row[row_idx[j]];
            const double ds = is_sigmoid ? s[j] * (1.0 - s[j]) : sqrt_softplus_grad(v, s[j]);
            drow[row_idx[j]] = float((g[j] - dot) / denom * ds);
          }
          break;
        }
        case ScoreMode::Sinkhorn: {  // k == 1: probs = sigmoid(x)
          const double sv = sigmoid(row[row_idx[0]]);
          drow[row_idx[0]] = float(g[0] * sv * (1.0 - sv));
          break;
        }
        case ScoreMode::PreSoftmax:
          break;  // handled above
      }
    }
  }
}

void moe_sinkhorn(const Tensor& logits, Tensor& out) {
  MEGATON_CUDA_DISPATCH(logits, cuda::moe_sinkhorn(logits, out));
  check_sinkhorn_args(logits, out);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  if (T == 0) return;
  sinkhorn(logits.f32(), T, E, out.f32());
}

}  // namespace megaton::ops
