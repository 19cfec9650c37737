// Data-parallel setup from the flags (train/data_parallel_setup.h).
#include "train/data_parallel_setup.h"

#include "model/tensor_parallel.h"
#include "train/pipeline_schedule.h"

namespace megaton {

namespace {
DType fsdp_dtype(const std::string& name, DType automatic) {
  if (name == "fp32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  return automatic;  // "auto" (the flag parser refused anything else)
}
}  // namespace

ChunkSharding chunk_sharding(const TrainArgs& args, const dist::Grid* grid) {
  ChunkSharding s;
  const ParallelArgs& p = args.parallel;
  // Megatron's layer-wise distributed optimizer: Muon with --use-distributed-optimizer.
  s.layer_wise = args.optimizer.kind == optim::OptimizerKind::Muon && p.use_distributed_optimizer;
  if (!p.use_megatron_fsdp) return s;
  s.use_megatron_fsdp = true;
  s.strategy = parse_sharding_strategy(p.data_parallel_sharding_strategy);
  if (grid && s.strategy != ShardingStrategy::NoShard) {  // no_shard: the whole buffer
    s.dense_index = grid->dp_cp().rank;
    s.expert_index = grid->edp().rank;
  }
  s.main_grad_dtype = fsdp_dtype(p.megatron_fsdp_main_grads_dtype, args.model.main_grads_dtype);
  s.grad_comm_dtype = fsdp_dtype(p.megatron_fsdp_grad_comm_dtype, s.main_grad_dtype);
  s.double_buffer = p.fsdp_double_buffer;
  return s;
}

optim::DataParallelConfig data_parallel_config(const TrainArgs& args, int64_t num_micro_batches) {
  const ParallelArgs& p = args.parallel;
  optim::DataParallelConfig c;
  c.use_distributed_optimizer = p.use_distributed_optimizer;
  c.overlap_grad_reduce = p.overlap_grad_reduce;
  c.overlap_param_gather = p.overlap_param_gather;
  c.num_micro_batches = num_micro_batches;
  c.use_megatron_fsdp = p.use_megatron_fsdp;
  if (p.use_megatron_fsdp) {
    c.overlap_grad_reduce = true;
    c.overlap_param_gather = p.use_distributed_optimizer;
  }
  return c;
}

ParamHooks data_parallel_hooks(optim::DistributedDataParallel& ddp) {
  ParamHooks h;
  h.before_forward = [&ddp](std::span<Param* const> ps) { ddp.before_forward(ps); };
  h.after_backward = [&ddp](std::span<Param* const> ps) { ddp.grads_ready(ps); };
  h.after_forward = [&ddp](std::span<Param* const> ps) { ddp.after_forward(ps); };
  h.before_backward = [&ddp](std::span<Param* const> ps) { ddp.before_backward(ps); };
  return h;
}

void finalize_model_grads(const std::vector<GPTModel*>& chunks, const dist::Grid& grid,
                          dist::Comm& comm, optim::DistributedDataParallel& ddp) {
  if (!ddp.grads_sharded()) {
    for (GPTModel* chunk : chunks)
      all_reduce_sequence_parallel_grads(chunk->params(), chunk->model_parallel());
    all_reduce_embedding_grads(chunks, grid, comm);
    return;
  }
  // Sharded: every rank of these groups holds the same own shard of alike buffers.
  std::vector<const Param*> sequence_parallel;
  for (GPTModel* chunk : chunks)
    for (const Param* p : chunk->params())
      if (p->sequence_parallel) sequence_parallel.push_back(p);
  if (grid.tp().size() > 1) ddp.all_reduce_own_grads(sequence_parallel, grid.tp());
  if (const Param* p = embedding_grad_to_sum(chunks, grid)) {
    const Param* one[] = {p};
    ddp.all_reduce_own_grads(one, grid.embedding());
  }
}

}  // namespace megaton
