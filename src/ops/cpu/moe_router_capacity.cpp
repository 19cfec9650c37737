// Token dropping by expert capacity on the CPU (the reference of
// ops/cuda/moe_router_capacity.cu). Semantics: ops.h; source: Megatron-LM
// transformer/moe/moe_utils.py (apply_router_token_dropping, get_capacity). Also
// moe_mark_dropped, the routing map after dropping that the token dispatchers take.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "ops/cpu/moe_router_math.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace megaton::ops {

using router_math::check_shape;
using router_math::check_tensor;

void moe_capacity_drop(const Tensor& probs, const Tensor& indices, int64_t num_experts,
                       int64_t capacity, bool by_position, Tensor& keep, Tensor& kept_counts) {
  MEGATON_CUDA_DISPATCH(probs, cuda::moe_capacity_drop(probs, indices, num_experts, capacity,
                                                       by_position, keep, kept_counts));
  constexpr const char* op = "moe_capacity_drop";
  check_tensor(probs, DType::F32, op, "probs");
  MEGATON_CHECK(probs.ndim() == 2, "{}: probs must be [T, k], got {}", op,
                shape_str(probs.shape()));
  check_tensor(indices, DType::I32, op, "indices");
  check_shape(indices, probs.shape(), op, "indices");
  check_tensor(keep, DType::F32, op, "keep");
  check_shape(keep, probs.shape(), op, "keep");
  MEGATON_CHECK(num_experts >= 1, "{}: num_experts {} must be >= 1", op, num_experts);
  MEGATON_CHECK(capacity >= 0, "{}: capacity {} must be >= 0", op, capacity);
  check_tensor(kept_counts, DType::F32, op, "kept_counts");
  check_shape(kept_counts, {num_experts}, op, "kept_counts");

  // Entries (flat index t * k + j) grouped by expert, in flat order: a counting sort.
  const int32_t* idx = indices.i32();
  const int64_t n = indices.numel();
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    MEGATON_CHECK(idx[i] >= 0 && idx[i] < num_experts, "{}: index {} at {} not in [0, {})", op,
                  idx[i], i, num_experts);
    ++start[idx[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> entries(n), next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n; ++i) entries[next[idx[i]]++] = i;

  const float* p = probs.f32();
  float* kept = keep.f32();
  std::fill(kept, kept + n, 0.0f);
  for (int64_t e = 0; e < num_experts; ++e) {
    const auto first = entries.begin() + start[e], last = entries.begin() + start[e + 1];
    const int64_t routed = last - first, kept_here = std::min(routed, capacity);
    // Policy probs: the kept_here largest probabilities, lower flat index (row, then slot)
    // first among equals; a strict total order, so the chosen set is unique.
    if (!by_position && kept_here < routed)
      std::nth_element(first, first + kept_here, last, [p](int64_t a, int64_t b) {
        return p[a] > p[b] || (p[a] == p[b] && a < b);
      });
    for (auto it = first; it != first + kept_here; ++it) kept[*it] = 1.0f;
    kept_counts.f32()[e] += float(kept_here);
  }
}

void moe_mark_dropped(const Tensor& indices, const Tensor& keep, int64_t num_experts,
                      Tensor& routed) {
  MEGATON_CUDA_DISPATCH(indices, cuda::moe_mark_dropped(indices, keep, num_experts, routed));
  constexpr const char* op = "moe_mark_dropped";
  check_tensor(indices, DType::I32, op, "indices");
  MEGATON_CHECK(indices.ndim() == 2, "{}: indices must be [T, k], got {}", op,
                shape_str(indices.shape()));
  check_tensor(keep, DType::F32, op, "keep");
  check_shape(keep, indices.shape(), op, "keep");
  check_tensor(routed, DType::I32, op, "routed");
  check_shape(routed, indices.shape(), op, "routed");
  MEGATON_CHECK(num_experts >= 1 && num_experts < INT32_MAX,
                "{}: num_experts {} must be in [1, {})", op, num_experts, INT32_MAX);
  MEGATON_CHECK(indices.numel() == 0 || routed.raw() != indices.raw(),
                "{}: routed must not alias indices", op);
  const int32_t* idx = indices.i32();
  const float* kept = keep.f32();
  int32_t* out = routed.i32();
  for (int64_t i = 0; i < indices.numel(); ++i) {
    if (kept[i] == 0.0f) {
      out[i] = int32_t(num_experts);
      continue;
    }
    MEGATON_CHECK(idx[i] >= 0 && idx[i] < num_experts, "{}: index {} at {} not in [0, {})", op,
                  idx[i], i, num_experts);
    out[i] = idx[i];
  }
}

}  // namespace megaton::ops
