// Checkpoint tensors under tensor parallelism: slices assembled into full tensors for
// saving, full tensors cut into this rank's slice for loading, so a checkpoint is the
// same whatever the tensor-parallel size (Megatron's dist-checkpointing idea, simplified).
#pragma once
#include <map>
#include <string>

#include "dist/gather.h"
#include "model/param.h"
#include "model/parallel.h"

namespace megaton {

// The param a checkpoint entry belongs to: "model.<name>", "optimizer.<name>.exp_avg" or
// "optimizer.<name>.exp_avg_sq"; null when `params` has no such name.
const Param* param_of_entry(const std::string& entry,
                            const std::map<std::string, const Param*>& params);

// entries: this rank's checkpoint tensors (each the tensor-parallel slice its param holds,
// Param::tp_split_dim). Returns the full tensors on rank 0 of each tensor-parallel group
// (etp for expert params): sliced entries all-gathered over the group and assembled
// (SwiGLU halves included), replicated entries kept once; other ranks get none of them.
// Every member of a group must pass the same entry names in the same order (collective).
dist::NamedTensors assemble_tensor_parallel(const dist::NamedTensors& entries,
                                            const std::map<std::string, const Param*>& params,
                                            const ModelParallel& mp);

// This rank's slice of `full` for param p (the full tensor itself when p is not sliced).
Tensor tensor_parallel_slice(const Tensor& full, const Param& p, const ModelParallel& mp);

}  // namespace megaton
