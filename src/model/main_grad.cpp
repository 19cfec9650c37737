// accumulate_main_grads: the fp32 scratch between an fp32-only op and a BF16 main grad.
#include "model/main_grad.h"

#include <utility>

#include "core/error.h"
#include "ops/ops.h"

namespace megaton {

namespace {

// One growing fp32 buffer per device. Backward runs its ops on one stream in order, so a
// view handed out by one call is done with (its add_ enqueued) before the next call
// reuses it; `busy` catches a nested call.
struct ScratchPool {
  Tensor buffer[2];
  bool busy = false;
};

ScratchPool& pool() {
  static ScratchPool p;
  return p;
}

int device_index(Device d) { return d == Device::CUDA ? 1 : 0; }

// A [numel] fp32 view of the pool's buffer on `device`, grown when too small.
Tensor scratch(Device device, int64_t numel) {
  Tensor& buffer = pool().buffer[device_index(device)];
  if (!buffer.defined() || buffer.numel() < numel) {
    buffer = Tensor();  // the old block goes back before the larger one is taken
    buffer = Tensor::empty({numel}, DType::F32, device);
  }
  return buffer.rows(0, numel);
}

}  // namespace

void accumulate_main_grads(const std::vector<Tensor*>& main_grads,
                           const std::function<void(std::vector<Tensor>& targets)>& accumulate) {
  std::vector<Tensor> targets(main_grads.size());
  int64_t scratch_numel = 0;
  const Tensor* first = nullptr;
  for (const Tensor* g : main_grads) {
    if (g == nullptr || !g->defined()) continue;
    MEGATON_CHECK(g->dtype() == DType::F32 || g->dtype() == DType::BF16,
                  "accumulate_main_grads: main grad must be F32 or BF16, got {}",
                  dtype_name(g->dtype()));
    if (first == nullptr) first = g;
    MEGATON_CHECK(g->device() == first->device(),
                  "accumulate_main_grads: main grads on different devices");
    if (g->dtype() == DType::BF16) scratch_numel += g->numel();
  }
  if (scratch_numel == 0) {  // every main grad F32 (or none): the op writes into them
    for (size_t i = 0; i < main_grads.size(); ++i)
      if (main_grads[i] != nullptr) targets[i] = *main_grads[i];
    accumulate(targets);
    return;
  }
  ScratchPool& p = pool();
  MEGATON_CHECK(!p.busy, "accumulate_main_grads: nested call (the scratch is in use)");
  p.busy = true;
  struct Release {
    ~Release() { pool().busy = false; }
  } release;
  Tensor space = scratch(first->device(), scratch_numel);
  space.zero();
  int64_t at = 0;
  for (size_t i = 0; i < main_grads.size(); ++i) {
    Tensor* g = main_grads[i];
    if (g == nullptr || !g->defined()) continue;
    if (g->dtype() == DType::F32) {
      targets[i] = *g;
      continue;
    }
    targets[i] = space.rows(at, g->numel()).view(g->shape());
    at += g->numel();
  }
  accumulate(targets);
  for (size_t i = 0; i < main_grads.size(); ++i) {
    Tensor* g = main_grads[i];
    if (g != nullptr && g->defined() && g->dtype() == DType::BF16) ops::add_(*g, targets[i]);
  }
}

void accumulate_main_grad(Tensor& main_grad, const std::function<void(Tensor& target)>& accumulate) {
  accumulate_main_grads({&main_grad}, [&](std::vector<Tensor>& targets) { accumulate(targets[0]); });
}

bool gemm_accumulates_into(const Tensor& a, const Tensor& b, const Tensor& main_grad) {
  if (main_grad.dtype() == DType::F32) return true;
  return main_grad.dtype() == DType::BF16 && main_grad.device() == Device::CUDA &&
         a.dtype() == DType::BF16 && b.dtype() == DType::BF16;
}

void gemm_main_grad(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    Tensor& main_grad) {
  if (gemm_accumulates_into(a, b, main_grad)) {
    // One rounding into a BF16 main grad on CUDA: ops::cuda::gemm hands cuBLASLt a separate
    // D (a transient bf16 tensor, copied back), since in place it rounds the product to
    // bf16 before adding C (docs/memory.md "BF16 main gradients").
    ops::gemm(a, trans_a, b, trans_b, main_grad, 1.0f, 1.0f);
    return;
  }
  accumulate_main_grad(main_grad,
                       [&](Tensor& target) { ops::gemm(a, trans_a, b, trans_b, target, 1.0f, 1.0f); });
}

int64_t main_grad_scratch_bytes(Device device) {
  const Tensor& buffer = pool().buffer[device_index(device)];
  return buffer.defined() ? buffer.numel() * 4 : 0;
}

void release_main_grad_scratch() {
  for (Tensor& buffer : pool().buffer) buffer = Tensor();
}

}  // namespace megaton
