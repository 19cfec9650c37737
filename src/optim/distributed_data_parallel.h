// DistributedDataParallel: the data-parallel reduction of the main gradients and, under
// the distributed optimizer, the all-gather of the updated weights, one bucket at a time
// (Megatron's DistributedDataParallel and its bucket groups), optionally overlapped with
// backward (--overlap-grad-reduce) and with the next forward (--overlap-param-gather).
// Under Megatron-FSDP (--use-megatron-fsdp) a bucket is one unit (a layer) and the buffers
// keep only their own shard of the gradients (optim_grads) and of the weights too
// (optim_grads_params): a unit's weights are all-gathered just before its forward and its
// backward (the next unit's prefetched), released after, and its gradients reduce-scattered
// into the own shard as each micro-batch's backward of it finishes
// (distributed_data_parallel_fsdp.cpp).
#pragma once
#include <deque>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "dist/comm.h"
#include "dist/grid.h"
#include "model/param_buffer.h"

namespace megaton::optim {

struct DataParallelConfig {
  bool use_distributed_optimizer = false;  // reduce-scatter + all-gather, else all-reduce
  bool overlap_grad_reduce = false;        // start a bucket's reduction when it is ready
  bool overlap_param_gather = false;       // leave the all-gathers running into the forward
  // Backward passes of every parameter per step on this rank: the local micro-batches
  // (each model chunk runs one backward per micro-batch).
  int64_t num_micro_batches = 1;
  // --use-megatron-fsdp: the buffers were built with one bucket per unit and store their
  // shards as their BufferSharding says; reductions start as each unit finishes.
  bool use_megatron_fsdp = false;
};

class DistributedDataParallel {
 public:
  // buffers: every ParamAndGradBuffer of this rank (each model chunk's dense, then expert
  // ones; they must outlive this object). Dense buffers reduce over the grid's dp_cp
  // group, expert buffers over edp; under the distributed optimizer their shard count
  // must be that group's size (InternalError otherwise).
  DistributedDataParallel(std::vector<ParamAndGradBuffer*> buffers, const dist::Grid& grid,
                          dist::Comm& comm, DataParallelConfig config);

  // At the start of a step (with zero_grad): no gradient is final yet. num_micro_batches
  // (>= 1, or 0 to keep the configured count): this step's backward passes per parameter,
  // for a global batch size that changes over the run (a batch-size schedule).
  void start_grad_sync_step(int64_t num_micro_batches = 0);

  // The gradients of `params` are complete for one micro-batch (their layer's backward
  // has run). With overlap_grad_reduce, a bucket whose params have all been reported
  // num_micro_batches times has its reduction started (Megatron's backward hooks).
  // Params of no buffer are ignored. InternalError when a param is reported more than
  // num_micro_batches times in a step.
  void grads_ready(std::span<Param* const> params);

  // After the step's last backward: starts the reductions not started yet and waits for
  // all. Then every main_grad (distributed: this rank's shard of each bucket; the rest of
  // the bucket holds partial sums) is the SUM over its group (dense: dp_cp, expert: edp).
  // The mean the optimizer needs is that sum times 1 / dp_cp size
  // (DistributedAdamW folds the factor into its grad norm and update instead of a pass
  // over the gradients): for dense parameters the mean over the data-parallel ranks; for
  // experts, whose gradients already add the tokens of several data-parallel ranks
  // (expert parallelism), the same mean over the global batch (Megatron's
  // expert_gradient_scaling_factor). Resets the readiness counts.
  void finish_grad_sync();

  // After the optimizer updated this rank's shards (distributed optimizer; otherwise
  // nothing): all-gathers every bucket's weights, first-used buckets first (after
  // set_units: in the order the units first read them, over all buffers; before: buffer by
  // buffer, each in reverse bucket order). With overlap_param_gather they are left running;
  // wait_param_sync waits for them.
  void start_param_sync();
  // Before a forward reads the weights of `params`: waits for their buckets' all-gathers.
  void wait_param_sync(std::span<Param* const> params);
  // Waits for every all-gather still running (before evaluation, checkpoints, the end).
  void finish_param_sync();

  // ---- The model's hooks (model/gpt.h ParamHooks) --------------------------------------
  // The units of each model chunk, in forward order (GPTModel::param_units): FSDP prefetches
  // the next unit's weights in a forward, the previous one's in a backward; start_param_sync
  // starts the buckets' all-gathers in the order these units first read them (chunk by
  // chunk), the buckets of no unit last. Every rank of a data-parallel group must pass the
  // same units (alike models).
  void set_units(const std::vector<std::vector<std::span<Param* const>>>& chunks);
  // Before a forward reads `params`: wait_param_sync; with sharded weights, their buckets
  // gathered (waiting for a prefetch), then the next unit's all-gather started.
  void before_forward(std::span<Param* const> params);
  // Sharded weights: the buckets of `params` released.
  void after_forward(std::span<Param* const> params);
  // Before a backward of `params`: sharded weights gathered (the previous unit's
  // prefetched); sharded gradients allocated zeroed (after the reduce-scatter of the last
  // micro-batch's, still running, has been added into the own shard).
  void before_backward(std::span<Param* const> params);
  // after_backward is grads_ready. With sharded weights it also releases their buckets.

  // Whether the buffers keep only their own gradient shards (optim_grads and up): then
  // only those hold reduced gradients, and sums over other groups go through
  // all_reduce_own_grads.
  bool grads_sharded() const { return grads_sharded_; }
  // After finish_grad_sync, sharded gradients: the own-shard pieces of `params` summed over
  // `group` (every rank of it holds the same shard of the same buffer layout: tensor-
  // parallel peers for sequence-parallel params, the pipeline ends for tied embeddings),
  // in one collective. Params of no buffer or with no piece here are skipped.
  void all_reduce_own_grads(std::span<const Param* const> params, const dist::Group& group);
  // Sharded weights: allocates every bucket and gathers the weights into it (before a
  // checkpoint load or anything else that writes or reads whole weights), and the reverse:
  // each rank's shard taken from the whole weights, the buckets released.
  void gather_all_weights();
  void release_all_weights();

 private:
  struct BucketState {
    ParamAndGradBuffer* buffer;
    size_t index;          // bucket index in its buffer
    int64_t reported = 0;  // param reports this step
    int64_t needed = 0;    // params x num_micro_batches
    std::unique_ptr<dist::CommWork> grad_work, param_work;
    Tensor reduced;  // sharded gradients: the reduce-scatter's output, until added
  };
  const dist::Group& group_of(const ParamAndGradBuffer& b) const;
  // Param reports that complete bucket i of b: its params once per micro-batch (sharded
  // gradients, reduced each micro-batch) or per step.
  int64_t needed_reports(const ParamAndGradBuffer& b, size_t bucket) const;
  void start_grad_sync(BucketState& s);
  BucketState* state_of(const Param* p);
  // FSDP (distributed_data_parallel_fsdp.cpp).
  void start_gather(BucketState& s);
  void wait_gather(BucketState& s);
  // The buckets of `params` gathered (waiting for a prefetch), then the all-gather of the unit
  // prefetch_step (+1 next, -1 previous) away from theirs started.
  void gather(std::span<Param* const> params, int prefetch_step);
  void finish_sharded_grad_sync(BucketState& s);  // wait, add into the own shard, release
  std::vector<BucketState*> states_of(std::span<Param* const> params);  // distinct, in order
  // The unit following (+1) or preceding (-1) the one starting with params[0], or empty.
  std::span<Param* const> neighbour_unit(std::span<Param* const> params, int step) const;
  bool grads_sharded_ = false, params_sharded_ = false;
  // Sharded gradients: buckets whose reduce-scatter runs, oldest first (at most
  // kPendingReduceScatters after a unit's backward; finish_sharded_grad_sync is a no-op on a
  // bucket already finished elsewhere).
  static constexpr size_t kPendingReduceScatters = 2;
  std::deque<BucketState*> pending_;
  std::vector<std::vector<std::span<Param* const>>> units_;                 // per chunk
  std::unordered_map<const Param*, std::pair<size_t, size_t>> unit_index_;  // first param

  const dist::Grid& grid_;
  dist::Comm& comm_;
  DataParallelConfig config_;
  std::vector<BucketState> states_;       // every buffer's buckets, buffer by buffer
  std::vector<size_t> param_sync_order_;  // states_ in the order the forward first reads them
  std::unordered_map<const Param*, size_t> state_index_;
  std::unordered_map<const Param*, int64_t> reports_;  // per param, this step
};

}  // namespace megaton::optim
