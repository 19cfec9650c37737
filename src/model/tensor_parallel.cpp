// Tensor- and sequence-parallel activation collectives.
#include "model/tensor_parallel.h"

#include "core/error.h"

namespace megaton {

Tensor gather_sequence(const Tensor& x, const ModelParallel& mp) {
  const int tp = mp.tp_size();
  if (tp == 1) return x;
  Tensor out = Tensor::empty({x.dim(0) * tp, x.dim(1)}, x.dtype(), x.device());
  mp.comm->all_gather(x, out, mp.tp());
  return out;
}

Tensor reduce_scatter_sequence(const Tensor& x, const ModelParallel& mp) {
  const int tp = mp.tp_size();
  if (tp == 1) return x;
  MEGATON_CHECK(x.dim(0) % tp == 0,
                "sequence parallel: {} token rows are not divisible by tensor-parallel size {}",
                x.dim(0), tp);
  Tensor out = Tensor::empty({x.dim(0) / tp, x.dim(1)}, x.dtype(), x.device());
  mp.comm->reduce_scatter(x, out, mp.tp());
  return out;
}

void all_reduce_tensor_parallel(Tensor& x, const ModelParallel& mp) {
  if (mp.tp_size() == 1) return;
  mp.comm->all_reduce(x, mp.tp());
}

void all_reduce_sequence_parallel_grads(const std::vector<Param*>& params,
                                        const ModelParallel& mp) {
  if (mp.tp_size() == 1) return;
  // One collective for all of them (norm weights and biases: many small tensors).
  std::vector<Param*> marked;
  int64_t total = 0;
  for (Param* p : params)
    if (p->sequence_parallel) {
      marked.push_back(p);
      total += p->main_grad.numel();
    }
  if (marked.empty()) return;
  // In the main grads' dtype: BF16 main grads are summed as BF16 tensors, as Megatron
  // all-reduces its bf16 grads (the MPI backend sums them in fp32, dist/comm_mpi.cpp).
  const DType dtype = marked[0]->main_grad.dtype();
  for (const Param* p : marked)
    MEGATON_CHECK(p->main_grad.dtype() == dtype, "param '{}': main grad {}, '{}' has {}", p->name,
                  dtype_name(p->main_grad.dtype()), marked[0]->name, dtype_name(dtype));
  Tensor flat = Tensor::empty({total}, dtype, marked[0]->main_grad.device());
  int64_t at = 0;
  for (Param* p : marked) {
    flat.rows(at, p->main_grad.numel()).copy_from(p->main_grad.view({p->main_grad.numel()}));
    at += p->main_grad.numel();
  }
  mp.comm->all_reduce(flat, mp.tp());
  at = 0;
  for (Param* p : marked) {
    p->main_grad.view({p->main_grad.numel()}).copy_from(flat.rows(at, p->main_grad.numel()));
    at += p->main_grad.numel();
  }
}

}  // namespace megaton
