// How the trainer sets up data parallelism from the flags: the FSDP storage of the model
// chunks (--use-megatron-fsdp), the DistributedDataParallel configuration and the model
// hooks that drive it, and the gradient sums over other groups after the reduction.
#pragma once
#include <memory>
#include <vector>

#include "dist/grid.h"
#include "model/gpt.h"
#include "optim/distributed_data_parallel.h"
#include "train/arguments.h"

namespace megaton {

// The buffers' storage for this rank (model/gpt.h ChunkSharding): NoShard without
// --use-megatron-fsdp, else the strategy, this rank's shard in dp_cp (dense) and edp
// (experts), and the gradient dtypes ("auto": the run's main grads dtype). grid null: shard
// indices 0 (the memory plan). layer_wise under --optimizer muon with
// --use-distributed-optimizer (the Muon params in whole-parameter buffers).
ChunkSharding chunk_sharding(const TrainArgs& args, const dist::Grid* grid);

// DistributedDataParallel's configuration: the distributed optimizer and the overlap
// flags, and under FSDP the reductions started as each unit's backward finishes
// (overlap_grad_reduce) and, while the weights stay whole (optim, optim_grads), their
// all-gather left running into the next forward (overlap_param_gather).
optim::DataParallelConfig data_parallel_config(const TrainArgs& args, int64_t num_micro_batches);

// The model hooks (ParamHooks) calling ddp's before_forward, after_forward,
// before_backward and grads_ready; ddp must outlive the chunks' use of them.
ParamHooks data_parallel_hooks(optim::DistributedDataParallel& ddp);

// After DistributedDataParallel::finish_grad_sync: the sums Megatron's finalize_model_grads
// makes after the data-parallel reduction: sequence-parallel params over the tensor-
// parallel group, the tied embeddings over the pipeline ends (on the own shards when the
// gradients are sharded).
void finalize_model_grads(const std::vector<GPTModel*>& chunks, const dist::Grid& grid,
                          dist::Comm& comm, optim::DistributedDataParallel& ddp);

}  // namespace megaton
