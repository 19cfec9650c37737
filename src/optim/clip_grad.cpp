// Global gradient norm and clipping (Megatron-LM optimizer/clip_grads.py).
#include "optim/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/ops.h"

namespace megaton::optim {

namespace {

std::vector<Tensor> main_grads(const std::vector<Param*>& params) {
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (const Param* p : params) {
    MEGATON_CHECK(p->main_grad.defined(), "param '{}' has no main_grad", p->name);
    grads.push_back(p->main_grad);
  }
  return grads;
}

}  // namespace

double global_grad_norm(const std::vector<Param*>& params) {
  // One fp64 sum over every main_grad: a single host synchronization on the GPU.
  return std::sqrt(ops::multi_tensor_sum_of_squares(main_grads(params)));
}

double clip_coefficient(double max_norm, double total_norm) {
  const double clip_coeff = max_norm / (total_norm + 1.0e-6);
  // Written so that a NaN coefficient (NaN norm) also gives 1.
  return clip_coeff < 1.0 ? clip_coeff : 1.0;
}

double clip_grad_by_norm(const std::vector<Param*>& params, double max_norm, double total_norm) {
  const double clip_coeff = clip_coefficient(max_norm, total_norm);
  if (clip_coeff == 1.0) return 1.0;
  std::vector<Tensor> grads = main_grads(params);
  ops::multi_tensor_scale_(grads, float(clip_coeff));
  return clip_coeff;
}

int64_t count_zeros_in_grads(const std::vector<Tensor>& grads) {
  std::vector<Tensor> f32, bf16;
  for (const Tensor& g : grads) (g.dtype() == DType::BF16 ? bf16 : f32).push_back(g);
  int64_t zeros = f32.empty() ? 0 : ops::multi_tensor_count_zeros(f32);
  if (bf16.empty()) return zeros;
  constexpr int64_t kScratch = int64_t(1) << 24;
  int64_t total = 0;
  for (const Tensor& g : bf16) total += g.numel();
  if (total == 0) return zeros;
  Tensor scratch = Tensor::empty({std::min(total, kScratch)}, DType::F32, bf16[0].device());
  for (const Tensor& g : bf16) {
    const Tensor flat = g.view({g.numel()});
    for (int64_t at = 0; at < g.numel(); at += kScratch) {
      const int64_t len = std::min(kScratch, g.numel() - at);
      Tensor widened = scratch.rows(0, len);
      ops::cast(flat.rows(at, len), widened);
      zeros += ops::multi_tensor_count_zeros({widened});
    }
  }
  return zeros;
}

}  // namespace megaton::optim
