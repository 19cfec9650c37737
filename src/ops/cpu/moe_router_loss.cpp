// Statistics and gradients of the MoE router's auxiliary losses on the CPU (the fp32
// reference of ops/cuda/moe_router_stats.cu): the load-balancing scores, their per-group
// sums and top-k counts, the z-loss log-sum-exp, tokens per expert. Semantics: ops.h;
// source: Megatron-LM transformer/moe/moe_utils.py (compute_routing_scores_for_aux_loss,
// switch_load_balancing_loss_func, z_loss_func) and router.py (the aux-loss types).
#include <algorithm>
#include <cmath>
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
using router_math::softmax_row_f64;
using router_math::softplus;
using router_math::sqrt_softplus_grad;

// Rows first_row .. first_row + T - 1, in groups of rows_per_group rows, fall in [0, G).
void check_groups(int64_t T, int64_t first_row, int64_t rows_per_group, int64_t G, const char* op) {
  MEGATON_CHECK(first_row >= 0 && rows_per_group >= 1,
                "{}: first_row {} must be >= 0 and rows_per_group {} >= 1", op, first_row,
                rows_per_group);
  MEGATON_CHECK(T == 0 || (first_row + T - 1) / rows_per_group < G,
                "{}: rows {} .. {} in groups of {} need more than {} groups", op, first_row,
                first_row + T - 1, rows_per_group, G);
}

// The scores of compute_routing_scores_for_aux_loss for one row, in fp64: softmax over
// E, or a = sigmoid(x) / sqrt(softplus(x)) divided by (sum_e a + 1e-20). With raw
// (size n) receiving a (sigmoid / sqrt-softplus only) and returning the denominator.
double aux_scores_row(const float* x, int64_t E, RouterScoreFunction f, double* scores,
                      double* raw) {
  if (f == RouterScoreFunction::Softmax) {
    softmax_row_f64(x, E, scores);
    return 1.0;
  }
  MEGATON_CHECK(f == RouterScoreFunction::Sigmoid || f == RouterScoreFunction::SqrtSoftplus,
                "moe_aux_loss_statistics: unknown score function {}", int(f));
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    raw[e] = f == RouterScoreFunction::Sigmoid ? sigmoid(x[e]) : std::sqrt(softplus(x[e]));
    sum += raw[e];
  }
  const double denom = sum + 1e-20;
  for (int64_t e = 0; e < E; ++e) scores[e] = raw[e] / denom;
  return denom;
}

}  // namespace

void moe_aux_loss_statistics(const Tensor& logits, RouterScoreFunction score_function, int topk,
                             int64_t first_row, int64_t rows_per_group, Tensor& scores,
                             Tensor& score_sums, Tensor& counts) {
  MEGATON_CUDA_DISPATCH(
      logits, cuda::moe_aux_loss_statistics(logits, score_function, topk, first_row, rows_per_group,
                                            scores, score_sums, counts));
  constexpr const char* op = "moe_aux_loss_statistics";
  check_logits(logits, op);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  MEGATON_CHECK(topk >= 1 && topk <= E, "{}: top-k {} must be in [1, E = {}]", op, topk, E);
  check_tensor(scores, DType::F32, op, "scores");
  check_shape(scores, {T, E}, op, "scores");
  check_tensor(score_sums, DType::F32, op, "score_sums");
  MEGATON_CHECK(score_sums.ndim() == 2 && score_sums.dim(1) == E,
                "{}: score_sums must be [G, E = {}], got {}", op, E, shape_str(score_sums.shape()));
  const int64_t G = score_sums.dim(0);
  check_tensor(counts, DType::F32, op, "counts");
  check_shape(counts, {G, E}, op, "counts");
  check_groups(T, first_row, rows_per_group, G, op);

  const float* x = logits.f32();
  float* s = scores.f32();
  // Each row's top-k, counted serially afterwards (deterministic, no atomics).
  std::vector<int32_t> chosen(T * topk);
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<double> row_scores(E), raw(E);
    std::vector<int32_t> order(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* srow = s + t * E;
      aux_scores_row(x + t * E, E, score_function, row_scores.data(), raw.data());
      for (int64_t e = 0; e < E; ++e) srow[e] = float(row_scores[e]);
      // Megatron's map: top-k of the fp32 scores (no bias, no group limit).
      for (int32_t e = 0; e < int32_t(E); ++e) order[e] = e;
      std::partial_sort(
          order.begin(), order.begin() + topk, order.end(),
          [srow](int32_t a, int32_t b) { return ranks_before(srow[a], a, srow[b], b); });
      std::copy(order.begin(), order.begin() + topk, chosen.begin() + t * topk);
    }
  }
  // Per-group sums in row order, fp64.
  std::vector<double> sums(G * E, 0.0), tallies(G * E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t g = (first_row + t) / rows_per_group;
    for (int64_t e = 0; e < E; ++e) sums[g * E + e] += s[t * E + e];
    for (int j = 0; j < topk; ++j) tallies[g * E + chosen[t * topk + j]] += 1.0;
  }
  for (int64_t i = 0; i < G * E; ++i) {
    score_sums.f32()[i] = float(sums[i]);
    counts.f32()[i] = float(tallies[i]);
  }
}

void moe_aux_loss_statistics_backward(const Tensor& coeffs, const Tensor& logits,
                                      const Tensor& scores, RouterScoreFunction score_function,
                                      int64_t first_row, int64_t rows_per_group, Tensor& dlogits) {
  MEGATON_CUDA_DISPATCH(
      coeffs, cuda::moe_aux_loss_statistics_backward(coeffs, logits, scores, score_function,
                                                     first_row, rows_per_group, dlogits));
  constexpr const char* op = "moe_aux_loss_statistics_backward";
  check_logits(logits, op);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_tensor(coeffs, DType::F32, op, "coeffs");
  MEGATON_CHECK(coeffs.ndim() == 2 && coeffs.dim(1) == E, "{}: coeffs must be [G, E = {}], got {}",
                op, E, shape_str(coeffs.shape()));
  check_groups(T, first_row, rows_per_group, coeffs.dim(0), op);
  check_tensor(scores, DType::F32, op, "scores");
  check_shape(scores, {T, E}, op, "scores");
  check_tensor(dlogits, DType::F32, op, "dlogits");
  check_shape(dlogits, {T, E}, op, "dlogits");
  MEGATON_CHECK(score_function == RouterScoreFunction::Softmax ||
                    score_function == RouterScoreFunction::Sigmoid ||
                    score_function == RouterScoreFunction::SqrtSoftplus,
                "{}: unknown score function {}", op, int(score_function));

  // The scores are recomputed from the logits in fp64 (the fp32 `scores` are only
  // checked): the reference's Jacobian is the exact one at these logits.
  const float *x = logits.f32(), *c = coeffs.f32();
  float* dx = dlogits.f32();
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<double> n(E), raw(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = x + t * E;
      const float* crow = c + (first_row + t) / rows_per_group * E;
      float* drow = dx + t * E;
      const double denom = aux_scores_row(row, E, score_function, n.data(), raw.data());
      // Softmax: dx = n o (c - <n, c>). Normalised a: n = a / D, d/da = (c - <n, c>) / D,
      // then times a'(x).
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += n[e] * double(crow[e]);
      for (int64_t e = 0; e < E; ++e) {
        const double da = (double(crow[e]) - dot);
        double g;
        switch (score_function) {
          case RouterScoreFunction::Softmax:
            g = n[e] * da;
            break;
          case RouterScoreFunction::Sigmoid:
            g = da / denom * raw[e] * (1.0 - raw[e]);
            break;
          default:
            g = da / denom * sqrt_softplus_grad(row[e], raw[e]);
            break;
        }
        drow[e] += float(g);
      }
    }
  }
}

void moe_router_logsumexp(const Tensor& logits, Tensor& lse) {
  MEGATON_CUDA_DISPATCH(logits, cuda::moe_router_logsumexp(logits, lse));
  constexpr const char* op = "moe_router_logsumexp";
  check_logits(logits, op);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_tensor(lse, DType::F32, op, "lse");
  check_shape(lse, {T}, op, "lse");
  const float* x = logits.f32();
  float* out = lse.f32();
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * E;
    const double row_max = *std::max_element(row, row + E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(double(row[e]) - row_max);
    out[t] = float(row_max + std::log(sum));
  }
}

void moe_z_loss_backward(float scale, const Tensor& logits, const Tensor& lse, Tensor& dlogits) {
  MEGATON_CUDA_DISPATCH(logits, cuda::moe_z_loss_backward(scale, logits, lse, dlogits));
  constexpr const char* op = "moe_z_loss_backward";
  check_logits(logits, op);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_tensor(lse, DType::F32, op, "lse");
  check_shape(lse, {T}, op, "lse");
  check_tensor(dlogits, DType::F32, op, "dlogits");
  check_shape(dlogits, {T, E}, op, "dlogits");
  const float *x = logits.f32(), *l = lse.f32();
  float* dx = dlogits.f32();
  // d(scale / 2 * lse^2) / dx = scale * lse * softmax(x): the softmax is recomputed in
  // fp64 from the logits, lse is the forward's value.
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<double> p(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      softmax_row_f64(x + t * E, E, p.data());
      const double factor = double(scale) * double(l[t]);
      for (int64_t e = 0; e < E; ++e) dx[t * E + e] += float(factor * p[e]);
    }
  }
}

void moe_tokens_per_expert(const Tensor& indices, int64_t num_experts, Tensor& counts) {
  MEGATON_CUDA_DISPATCH(indices, cuda::moe_tokens_per_expert(indices, num_experts, counts));
  constexpr const char* op = "moe_tokens_per_expert";
  check_tensor(indices, DType::I32, op, "indices");
  MEGATON_CHECK(indices.ndim() == 2, "{}: indices must be [T, k], got {}", op,
                shape_str(indices.shape()));
  MEGATON_CHECK(num_experts >= 1, "{}: num_experts {} must be >= 1", op, num_experts);
  check_tensor(counts, DType::F32, op, "counts");
  check_shape(counts, {num_experts}, op, "counts");
  const int32_t* idx = indices.i32();
  const int64_t n = indices.numel();
  std::vector<int64_t> tally(num_experts, 0);
  for (int64_t i = 0; i < n; ++i) {
    MEGATON_CHECK(idx[i] >= 0 && idx[i] < num_experts, "{}: index {} at {} not in [0, {})", op,
                  idx[i], i, num_experts);
    ++tally[idx[i]];
  }
  for (int64_t e = 0; e < num_experts; ++e) counts.f32()[e] += float(tally[e]);
}

void moe_expert_bias_update(const Tensor& counts, float rate, Tensor& bias) {
  MEGATON_CUDA_DISPATCH(counts, cuda::moe_expert_bias_update(counts, rate, bias));
  constexpr const char* op = "moe_expert_bias_update";
  check_tensor(counts, DType::F32, op, "counts");
  MEGATON_CHECK(counts.ndim() == 1, "{}: counts must be [E], got {}", op, shape_str(counts.shape()));
  const int64_t E = counts.numel();
  check_tensor(bias, DType::F32, op, "bias");
  check_shape(bias, {E}, op, "bias");
  float total = 0;
  for (int64_t e = 0; e < E; ++e) total += counts.f32()[e];
  const float mean = total / float(E);
  for (int64_t e = 0; e < E; ++e) {
    const float d = mean - counts.f32()[e];
    bias.f32()[e] += rate * float((d > 0) - (d < 0));
  }
}

}  // namespace megaton::ops
