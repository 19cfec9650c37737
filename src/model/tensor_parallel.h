// Tensor- and sequence-parallel communication of activations (Megatron's mappings.py):
// the collectives around column- and row-parallel layers, over the tensor-parallel group.
// Every function is the identity (no copy, no communication) when tp_size() == 1.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "model/param.h"
#include "model/parallel.h"

namespace megaton {

// Sequence parallelism splits the token rows of [T, H] activations into tp_size
// contiguous blocks of T / tp rows; rank r holds block r (T must be divisible by tp).
// x [T / tp, H] (this rank's rows) -> [T, H], every rank's block in rank order
// (Megatron's gather_from_sequence_parallel_region).
Tensor gather_sequence(const Tensor& x, const ModelParallel& mp);
// x [T, H] (a partial sum on each rank) -> [T / tp, H]: the sum over ranks of block r
// (Megatron's reduce_scatter_to_sequence_parallel_region).
Tensor reduce_scatter_sequence(const Tensor& x, const ModelParallel& mp);
// x [T, H] partial sums -> their sum on every rank, in place
// (Megatron's reduce_from_tensor_model_parallel_region).
void all_reduce_tensor_parallel(Tensor& x, const ModelParallel& mp);

// After backward: the main_grad of every param marked sequence_parallel (replicated over
// the tensor-parallel group, fed by this rank's sequence shard only) summed over the
// tensor-parallel group (Megatron's _allreduce_layernorm_grads).
void all_reduce_sequence_parallel_grads(const std::vector<Param*>& params,
                                        const ModelParallel& mp);

}  // namespace megaton
