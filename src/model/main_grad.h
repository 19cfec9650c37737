// Weight-gradient accumulation into main_grad tensors of either dtype: F32, or BF16 (the
// grad buffers of --main-grads-dtype bf16 / --grad-reduce-in-bf16; docs/memory.md "BF16
// main gradients").
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include "core/tensor.h"

namespace megaton {

// Runs `accumulate` on one fp32 target per main grad and leaves each main_grads[i] holding
// its old value plus what `accumulate` added to targets[i] (same shape as main_grads[i]).
// - An F32 main grad is its own target: the op accumulates straight into it, so an fp32
//   main-grad run computes exactly what it did before this helper existed (bitwise).
// - A BF16 main grad gets a zeroed fp32 view of a pooled scratch (one growing device
//   buffer, sized by the largest set of gradients one call has served, never freed per
//   call); after `accumulate` the scratch is added into the main grad with ops::add_
//   (fp32 sum of the bf16 value and the scratch, rounded once to nearest even). That is
//   Transformer Engine's rule for a wgrad GEMM with accumulate=True into a bf16 main_grad:
//   fp32 math, one rounding when adding into the bf16 tensor.
// main_grads: F32 or BF16, all on one device; a null or undefined entry gets an undefined
// target. InternalError on another dtype, mixed devices, or when called from inside
// another accumulate_main_grads (the scratch is in use).
void accumulate_main_grads(const std::vector<Tensor*>& main_grads,
                           const std::function<void(std::vector<Tensor>& targets)>& accumulate);
// The same for one main grad.
void accumulate_main_grad(Tensor& main_grad, const std::function<void(Tensor& target)>& accumulate);

// Whether ops::gemm accumulates op(a) @ op(b) straight into a main grad of this dtype with
// fp32 math and one rounding: always for F32; for BF16 only on CUDA with BF16 a and b
// (cuBLASLt's bf16 C with beta 1, as TE's wgrad GEMM). The CPU gemm is F32-only.
bool gemm_accumulates_into(const Tensor& a, const Tensor& b, const Tensor& main_grad);

// The weight-gradient GEMM: main_grad [M, N] += op(a) @ op(b) (ops::gemm with alpha 1,
// beta 1; a, b as ops::gemm). Straight into main_grad where gemm_accumulates_into says so,
// else through accumulate_main_grad's fp32 scratch.
void gemm_main_grad(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    Tensor& main_grad);

// Bytes the scratch pool holds on `device` now (0 when no BF16 main grad went through it).
int64_t main_grad_scratch_bytes(Device device);
// Frees the pool's buffers (tests; a later call allocates again).
void release_main_grad_scratch();

}  // namespace megaton
