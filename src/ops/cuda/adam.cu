// AdamW optimizer step on the GPU: the one-tensor case of multi_tensor_adamw (multi_tensor.cu).
//
// One kernel serves both entry points, so ops::adamw_step and ops::multi_tensor_adamw give
// the same bits by construction: two copies of the update expression, however carefully
// kept "term for term" alike, let nvcc contract them into different FMAs.
#include <vector>

#include "ops/cuda/cuda_ops.h"

namespace megaton::ops::cuda {

// multi_tensor_adamw checks everything adam.cu used to (each tensor defined, on the GPU,
// F32, with param's numel; step >= 1; betas in [0, 1)) before launching anything, so its
// errors stand for this op's: they name multi_tensor_adamw and the entry params[0],
// grads[0], exp_avg[0] or exp_avg_sq[0]. The lists hold handles sharing the callers'
// storage (Tensor copies are views), so the update lands in param, exp_avg and exp_avg_sq.
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, float lr,
                float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  std::vector<Tensor> params{param}, grads{grad}, exp_avgs{exp_avg}, exp_avg_sqs{exp_avg_sq};
  std::vector<Tensor> no_copies(1);  // undefined: no param copy
  multi_tensor_adamw(params, grads, exp_avgs, exp_avg_sqs, no_copies, {weight_decay}, lr, beta1,
                     beta2, eps, step, /*grad_scale=*/1.0f);
}

}  // namespace megaton::ops::cuda
