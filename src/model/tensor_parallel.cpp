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
  // One collective for all of them (norm weights and biases: many small tensors), in the
  // main grads' dtype: BF16 main grads are summed as BF16 tensors, as Megatron all-reduces
  // its bf16 grads (the MPI backend sums them in fp32, dist/comm_mpi.cpp).
  std::vector<Tensor> grads;
  for (Param* p : params)
    if (p->sequence_parallel) grads.push_back(p->main_grad);
  dist::all_reduce_coalesced(*mp.comm, grads, mp.tp());
}

}  // namespace megaton
