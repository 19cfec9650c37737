// Attention of new queries over a KV cache (generation), CPU fp32 reference.
//
// Plain loops: one task per (query, head) reads its causal prefix of the cache once for
// the scores and once for the weighted sum of values. The work is n x L x D per head,
// small beside the layer's GEMMs for a decode step (n = 1).
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {
namespace {

// Below this many multiply-adds (n * Hq * keys * Dqk) the call stays on the calling thread:
// waking an OpenMP team costs more than a decode step's attention.
constexpr int64_t kParallelMinWork = int64_t(1) << 18;

void check_f32_cpu(const Tensor& t, const char* name) {
  MEGATON_CHECK(t.defined(), "attention_kv_cache: {} must be allocated", name);
  MEGATON_CHECK(t.device() == Device::CPU, "attention_kv_cache: {}: only the CPU backend is built",
                name);
  MEGATON_CHECK(t.dtype() == DType::F32, "attention_kv_cache: {} must be F32, got {}", name,
                dtype_name(t.dtype()));
}

}  // namespace

void attention_kv_cache(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                        int64_t first_position, Tensor& out, float softmax_scale) {
  MEGATON_CUDA_DISPATCH(
      q, cuda::attention_kv_cache(q, key_cache, value_cache, first_position, out, softmax_scale));
  check_f32_cpu(q, "q");
  check_f32_cpu(key_cache, "key_cache");
  check_f32_cpu(value_cache, "value_cache");
  check_f32_cpu(out, "out");
  MEGATON_CHECK(q.ndim() == 3, "attention_kv_cache: q must be [n, Hq, Dqk], got {}",
                shape_str(q.shape()));
  MEGATON_CHECK(key_cache.ndim() == 3,
                "attention_kv_cache: key_cache must be [max_positions, Hkv, Dqk], got {}",
                shape_str(key_cache.shape()));
  MEGATON_CHECK(value_cache.ndim() == 3,
                "attention_kv_cache: value_cache must be [max_positions, Hkv, Dv], got {}",
                shape_str(value_cache.shape()));
  const int64_t n = q.dim(0), Hq = q.dim(1), D = q.dim(2), Dv = value_cache.dim(2);
  const int64_t max_positions = key_cache.dim(0), Hkv = key_cache.dim(1);
  MEGATON_CHECK(Hq > 0 && D > 0 && Dv > 0,
                "attention_kv_cache: q {} or value_cache {} has no heads or an empty head dim",
                shape_str(q.shape()), shape_str(value_cache.shape()));
  MEGATON_CHECK(Hkv > 0 && Hq % Hkv == 0,
                "attention_kv_cache: query heads {} must be a multiple of key/value heads {}", Hq,
                Hkv);
  MEGATON_CHECK(key_cache.dim(2) == D, "attention_kv_cache: key_cache {} and q {} differ in Dqk",
                shape_str(key_cache.shape()), shape_str(q.shape()));
  MEGATON_CHECK(value_cache.dim(0) == max_positions && value_cache.dim(1) == Hkv,
                "attention_kv_cache: value_cache {} must have key_cache {}'s positions and heads",
                shape_str(value_cache.shape()), shape_str(key_cache.shape()));
  MEGATON_CHECK(out.shape() == Shape({n, Hq, Dv}),
                "attention_kv_cache: out {} must be [n, Hq, Dv] = [{}, {}, {}]",
                shape_str(out.shape()), n, Hq, Dv);
  MEGATON_CHECK(first_position >= 0 && first_position + n <= max_positions,
                "attention_kv_cache: positions [{}, {}) outside the cache's {}", first_position,
                first_position + n, max_positions);
  if (n == 0) return;

  // As attention_forward.
  const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(float(D));
  const int64_t group = Hq / Hkv, k_row = Hkv * D, v_row = Hkv * Dv;
  const float *qp = q.f32(), *kp = key_cache.f32(), *vp = value_cache.f32();
  float* op = out.f32();
  const bool parallel = n * Hq * (first_position + n) * D >= kParallelMinWork;

#pragma omp parallel if (parallel)
  {
    std::vector<float> scores(static_cast<size_t>(first_position + n));
    std::vector<float> acc(static_cast<size_t>(Dv));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * Hq; ++task) {
      const int64_t i = task / Hq, h = task % Hq, kv_head = h / group;
      const int64_t keys = first_position + i + 1;  // the causal prefix of query i
      const float* q_i = qp + (i * Hq + h) * D;
      float row_max = -INFINITY;
      for (int64_t j = 0; j < keys; ++j) {
        const float* k_j = kp + j * k_row + kv_head * D;
        float dot = 0.0f;
        for (int64_t c = 0; c < D; ++c) dot += q_i[c] * k_j[c];
        scores[j] = dot * scale;
        row_max = std::max(row_max, scores[j]);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < keys; ++j) {
        const float p = std::exp(scores[j] - row_max);
        sum += p;
        const float* v_j = vp + j * v_row + kv_head * Dv;
        for (int64_t c = 0; c < Dv; ++c) acc[c] += p * v_j[c];
      }
      const float inv_sum = float(1.0 / sum);
      float* o_i = op + (i * Hq + h) * Dv;
      for (int64_t c = 0; c < Dv; ++c) o_i[c] = acc[c] * inv_sum;
    }
  }
}

}  // namespace megaton::ops
