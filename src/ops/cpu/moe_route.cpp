// MoE router math: top-k softmax routing and the aux load-balancing loss, CPU fp32 reference.
// Semantics of Megatron-LM transformer/moe/router.py and moe_utils.py
// (topk_routing_with_score_function, compute_routing_scores_for_aux_loss,
// switch_load_balancing_loss_func).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

// Below this many elements a loop runs on the calling thread: waking an OpenMP team
// costs more than the work (and much more on a loaded machine).
constexpr int64_t kParallelMin = int64_t(1) << 15;

void check_f32_cpu(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "moe_route: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CPU, "moe_route: {}: only the CPU backend is built", name);
  MEGATON_CHECK(t.dtype() == DType::F32, "moe_route: {} must be F32, got {}", name,
                dtype_name(t.dtype()));
}

void check_shape(const Tensor& t, const Shape& want, const char* name) {
  MEGATON_CHECK(t.shape() == want, "moe_route: {} has shape {}, expected {}", name,
                shape_str(t.shape()), shape_str(want));
}

void check_logits(const Tensor& logits, int k) {
  check_f32_cpu(logits, "logits");
  MEGATON_CHECK(logits.ndim() == 2, "moe_route: logits must be [T, E], got {}",
                shape_str(logits.shape()));
  MEGATON_CHECK(k >= 1 && k <= logits.dim(1), "moe_route: top-k {} must be in [1, E = {}]", k,
                logits.dim(1));
}

// Softmax of one row in fp64 accumulation, written as fp32.
void softmax_row(const float* x, int64_t n, float* y) {
  const float row_max = *std::max_element(x, x + n);
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += std::exp(double(x[e]) - row_max);
  for (int64_t e = 0; e < n; ++e) y[e] = float(std::exp(double(x[e]) - row_max) / sum);
}

// The k largest entries of x[0..n) in descending order, ties broken by lower index
// (a stable order, so routing never depends on sort internals). order is scratch of size n.
void topk_row(const float* x, int64_t n, int k, std::vector<int32_t>& order, int32_t* out) {
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  std::copy(order.begin(), order.begin() + k, out);
}

}  // namespace

void moe_topk_softmax_forward(const Tensor& logits, int k, bool pre_softmax, Tensor& probs,
                              Tensor& indices) {
  MEGATON_CUDA_DISPATCH(logits, cuda::moe_topk_softmax_forward(logits, k, pre_softmax, probs, indices));
  check_logits(logits, k);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_f32_cpu(probs, "probs");
  check_shape(probs, {T, k}, "probs");
  MEGATON_CHECK(
      indices.defined() && indices.device() == Device::CPU && indices.dtype() == DType::I32,
      "moe_route: indices must be an allocated CPU I32 tensor");
  check_shape(indices, {T, k}, "indices");
  const float* x = logits.f32();
  float* p = probs.f32();
  int32_t* idx = indices.i32();
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<int32_t> order;
    std::vector<float> scores(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = x + t * E;
      int32_t* row_idx = idx + t * k;
      float* row_p = p + t * k;
      if (pre_softmax) {
        // Megatron --moe-router-pre-softmax: softmax over all E, top-k of the scores.
        softmax_row(row, E, scores.data());
        topk_row(scores.data(), E, k, order, row_idx);
        for (int j = 0; j < k; ++j) row_p[j] = scores[row_idx[j]];
      } else {
        // Megatron default: top-k of the logits, softmax over the k chosen.
        topk_row(row, E, k, order, row_idx);
        for (int j = 0; j < k; ++j) scores[j] = row[row_idx[j]];
        softmax_row(scores.data(), k, row_p);
      }
    }
  }
}

void moe_topk_softmax_backward(const Tensor& dprobs, const Tensor& logits, const Tensor& probs,
                               const Tensor& indices, bool pre_softmax, Tensor& dlogits) {
  MEGATON_CUDA_DISPATCH(dprobs, cuda::moe_topk_softmax_backward(dprobs, logits, probs, indices, pre_softmax, dlogits));
  check_f32_cpu(probs, "probs");
  MEGATON_CHECK(probs.ndim() == 2, "moe_route: probs must be [T, k], got {}",
                shape_str(probs.shape()));
  const int k = int(probs.dim(1));
  check_logits(logits, k);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_shape(probs, {T, k}, "probs");
  check_f32_cpu(dprobs, "dprobs");
  check_shape(dprobs, {T, k}, "dprobs");
  MEGATON_CHECK(
      indices.defined() && indices.device() == Device::CPU && indices.dtype() == DType::I32,
      "moe_route: indices must be an allocated CPU I32 tensor");
  check_shape(indices, {T, k}, "indices");
  check_f32_cpu(dlogits, "dlogits");
  check_shape(dlogits, {T, E}, "dlogits");
  const int32_t* idx = indices.i32();
  for (int64_t i = 0; i < T * k; ++i)
    MEGATON_CHECK(idx[i] >= 0 && idx[i] < E, "moe_route: index {} at {} not in [0, {})", idx[i], i,
                  E);

  const float *x = logits.f32(), *p = probs.f32(), *dp = dprobs.f32();
  float* dx = dlogits.f32();
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<float> scores(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float *row_p = p + t * k, *row_dp = dp + t * k;
      const int32_t* row_idx = idx + t * k;
      float* drow = dx + t * E;
      // Softmax backward: dz = y o (dy - <y, dy>). In both modes <y, dy> over the
      // softmax's outputs reduces to sum_j probs_j dprobs_j, because dy is zero off the
      // chosen experts.
      double dot = 0;
      for (int j = 0; j < k; ++j) dot += double(row_p[j]) * row_dp[j];
      std::fill(drow, drow + E, 0.0f);
      if (pre_softmax) {
        softmax_row(x + t * E, E, scores.data());
        for (int64_t e = 0; e < E; ++e) drow[e] = float(-double(scores[e]) * dot);
        for (int j = 0; j < k; ++j) drow[row_idx[j]] += scores[row_idx[j]] * row_dp[j];
      } else {
        for (int j = 0; j < k; ++j)
          drow[row_idx[j]] = float(double(row_p[j]) * (double(row_dp[j]) - dot));
      }
    }
  }
}

float moe_aux_loss_forward(const Tensor& logits, int k, float coeff, Tensor& scores,
                           Tensor& tokens_per_expert) {
  MEGATON_CUDA_DISPATCH(logits, cuda::moe_aux_loss_forward(logits, k, coeff, scores, tokens_per_expert));
  check_logits(logits, k);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_f32_cpu(scores, "scores");
  check_shape(scores, {T, E}, "scores");
  check_f32_cpu(tokens_per_expert, "tokens_per_expert");
  check_shape(tokens_per_expert, {E}, "tokens_per_expert");
  if (T == 0) {
    tokens_per_expert.zero();
    return 0.0f;
  }
  const float* x = logits.f32();
  float* s = scores.f32();
  // Per-token routing decisions, counted serially afterwards (deterministic, no atomics).
  std::vector<int32_t> chosen(T * k);
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<int32_t> order;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      softmax_row(x + t * E, E, s + t * E);
      topk_row(s + t * E, E, k, order, chosen.data() + t * k);
    }
  }
  std::vector<double> counts(E, 0.0), score_sums(E, 0.0);
  for (int64_t i = 0; i < T * k; ++i) counts[chosen[i]] += 1.0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) score_sums[e] += s[t * E + e];
  // switch_load_balancing_loss_func: coeff * E / (k * T^2) * sum_e (sum_t p[t,e]) * n[e].
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) {
    tokens_per_expert.f32()[e] = float(counts[e]);
    aux += score_sums[e] * counts[e];
  }
  return float(double(coeff) * double(E) / (double(k) * double(T) * double(T)) * aux);
}

void moe_aux_loss_backward(float grad_scale, const Tensor& scores, const Tensor& tokens_per_expert,
                           int k, float coeff, Tensor& dlogits) {
  MEGATON_CUDA_DISPATCH(scores, cuda::moe_aux_loss_backward(grad_scale, scores, tokens_per_expert, k, coeff, dlogits));
  check_f32_cpu(scores, "scores");
  MEGATON_CHECK(scores.ndim() == 2, "moe_route: scores must be [T, E], got {}",
                shape_str(scores.shape()));
  const int64_t T = scores.dim(0), E = scores.dim(1);
  MEGATON_CHECK(k >= 1 && k <= E, "moe_route: top-k {} must be in [1, E = {}]", k, E);
  check_f32_cpu(tokens_per_expert, "tokens_per_expert");
  check_shape(tokens_per_expert, {E}, "tokens_per_expert");
  check_f32_cpu(dlogits, "dlogits");
  check_shape(dlogits, {T, E}, "dlogits");
  if (T == 0) return;
  // d aux / d scores[t, e] = c_e, the same for every token; tokens_per_expert is a
  // constant (counts from a top-k carry no gradient in Megatron either).
  std::vector<double> c(E);
  const double factor =
      double(grad_scale) * double(coeff) * double(E) / (double(k) * double(T) * double(T));
  for (int64_t e = 0; e < E; ++e) c[e] = factor * tokens_per_expert.f32()[e];
  const float* s = scores.f32();
  float* dx = dlogits.f32();
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = s + t * E;
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += double(row[e]) * c[e];
    for (int64_t e = 0; e < E; ++e) dx[t * E + e] += float(double(row[e]) * (c[e] - dot));
  }
}

}  // namespace megaton::ops
