// DistributedDataParallel: bucketed gradient reduction and weight all-gather.
#include "optim/distributed_data_parallel.h"

#include "core/error.h"
#include "ops/ops.h"

namespace megaton::optim {

const dist::Group& DistributedDataParallel::group_of(const ParamAndGradBuffer& b) const {
  return b.is_expert() ? grid_.edp() : grid_.dp_cp();
}

int64_t DistributedDataParallel::needed_reports(const ParamAndGradBuffer& b, size_t bucket) const {
  // Sharded gradients are reduced after each micro-batch's backward, others once a step.
  const int64_t params = int64_t(b.buckets()[bucket].params.size());
  return b.sharding().sharded_grads() ? params : params * config_.num_micro_batches;
}

DistributedDataParallel::DistributedDataParallel(std::vector<ParamAndGradBuffer*> buffers,
                                                 const dist::Grid& grid, dist::Comm& comm,
                                                 DataParallelConfig config)
    : grid_(grid), comm_(comm), config_(config) {
  MEGATON_CHECK(config_.num_micro_batches >= 1, "DistributedDataParallel: {} micro-batches",
                config_.num_micro_batches);
  for (ParamAndGradBuffer* b : buffers) {
    const dist::Group& g = group_of(*b);
    // The params lie in reverse in a buffer: its last bucket is the first the forward reads.
    for (size_t i = b->buckets().size(); i-- > 0;) param_sync_order_.push_back(states_.size() + i);
    MEGATON_CHECK(!config_.use_distributed_optimizer || b->num_shards() == g.size(),
                  "buffer of {} shards for group {}", b->num_shards(), g.describe());
    MEGATON_CHECK(!b->sharding().sharded_grads() ||
                      (config_.use_megatron_fsdp && b->sharding().shard_index == g.rank),
                  "a buffer storing shard {} is not this rank's of group {} under FSDP",
                  b->sharding().shard_index, g.describe());
    grads_sharded_ = grads_sharded_ || b->sharding().sharded_grads();
    params_sharded_ = params_sharded_ || b->sharding().sharded_params();
    for (size_t i = 0; i < b->buckets().size(); ++i) {
      BucketState s;
      s.buffer = b;
      s.index = i;
      s.needed = needed_reports(*b, i);
      for (const Param* p : b->buckets()[i].params) state_index_[p] = states_.size();
      states_.push_back(std::move(s));
    }
  }
}

DistributedDataParallel::BucketState* DistributedDataParallel::state_of(const Param* p) {
  auto it = state_index_.find(p);
  return it == state_index_.end() ? nullptr : &states_[it->second];
}

void DistributedDataParallel::start_grad_sync_step(int64_t num_micro_batches) {
  MEGATON_CHECK(num_micro_batches >= 0, "{} micro-batches in a step", num_micro_batches);
  if (num_micro_batches > 0) config_.num_micro_batches = num_micro_batches;
  for (BucketState& s : states_) {
    MEGATON_CHECK(!s.grad_work, "a gradient reduction is still running at the start of a step");
    s.reported = 0;
    s.needed = needed_reports(*s.buffer, s.index);
  }
  reports_.clear();
}

void DistributedDataParallel::grads_ready(std::span<Param* const> params) {
  for (const Param* p : params) {
    BucketState* s = state_of(p);
    if (!s) continue;
    MEGATON_CHECK(++reports_[p] <= config_.num_micro_batches,
                  "gradient of '{}' reported final more than {} times in a step", p->name,
                  config_.num_micro_batches);
    if (++s->reported == s->needed && config_.overlap_grad_reduce) {
      start_grad_sync(*s);
      if (s->buffer->sharding().sharded_grads()) {
        s->reported = 0;  // the next micro-batch's
        pending_.push_back(s);
      }
    }
  }
  // FSDP: a bucket's memory goes once its reduce-scatter is done; the one or two started
  // last keep running under the next unit's backward, the older ones are finished now.
  while (pending_.size() > kPendingReduceScatters) {
    finish_sharded_grad_sync(*pending_.front());
    pending_.pop_front();
  }
  // FSDP: these weights are not read again before the next forward.
  if (params_sharded_)
    for (BucketState* st : states_of(params))
      if (st->buffer->sharding().sharded_params()) {
        wait_gather(*st);
        st->buffer->release_weights(st->index);
      }
}

void DistributedDataParallel::start_grad_sync(BucketState& s) {
  ParamAndGradBuffer& b = *s.buffer;
  const dist::Group& g = group_of(b);
  if (b.sharding().sharded_grads()) {
    // Into a shard of its own (the bucket's memory goes once it is reduced); added into
    // the own shard by finish_sharded_grad_sync.
    MEGATON_CHECK(!s.grad_work && !s.reduced.defined(), "a bucket's reduce-scatter started twice");
    if (g.size() == 1) {
      s.reduced = b.bucket_grads(s.index);
      return;
    }
    s.reduced = Tensor::empty({b.shard_numel(s.index)}, b.grad_dtype(), b.device());
    s.grad_work = comm_.reduce_scatter_async(b.bucket_grads(s.index), s.reduced, g);
    return;
  }
  if (g.size() == 1) return;  // nothing to reduce
  if (config_.use_distributed_optimizer) {
    // In place: this rank's shard of the bucket receives the sum of everyone's shard.
    Tensor shard = b.grad_shard(s.index, g.rank);
    s.grad_work = comm_.reduce_scatter_async(b.bucket_grads(s.index), shard, g);
  } else {
    Tensor grads = b.bucket_grads(s.index);
    s.grad_work = comm_.all_reduce_async(grads, g);
  }
}

void DistributedDataParallel::finish_grad_sync() {
  // Buckets not started yet (all of them without overlap_grad_reduce), in buffer order:
  // the same order on every rank.
  for (BucketState& s : states_) {
    const bool sharded = s.buffer->sharding().sharded_grads();
    // A sharded bucket's reduce-scatter started with its last micro-batch's backward.
    if (!s.grad_work && (!sharded || (s.buffer->grads_live(s.index) && !s.reduced.defined())))
      start_grad_sync(s);
  }
  pending_.clear();
  for (BucketState& s : states_)
    if (s.buffer->sharding().sharded_grads()) {
      finish_sharded_grad_sync(s);
    } else if (s.grad_work) {
      s.grad_work->wait();
      s.grad_work.reset();
    }
  for (BucketState& s : states_) s.reported = 0;
  reports_.clear();
}

void DistributedDataParallel::start_param_sync() {
  if (!config_.use_distributed_optimizer) return;
  for (BucketState& s : states_) MEGATON_CHECK(!s.param_work, "an all-gather is still running");
  for (size_t i : param_sync_order_) {
    BucketState& s = states_[i];
    ParamAndGradBuffer& b = *s.buffer;
    const dist::Group& g = group_of(b);
    // Sharded weights are gathered by unit as the forward reaches them.
    if (g.size() == 1 || b.sharding().sharded_params()) continue;
    // In place: this rank's shard is already its chunk of the gathered bucket.
    Tensor all = b.bucket_weights(s.index);
    s.param_work = comm_.all_gather_async(b.weight_shard(s.index, g.rank), all, g);
    if (!config_.overlap_param_gather) {
      s.param_work->wait();
      s.param_work.reset();
    }
  }
}

void DistributedDataParallel::wait_param_sync(std::span<Param* const> params) {
  for (const Param* p : params) {
    BucketState* s = state_of(p);
    if (s && s->param_work) {
      s->param_work->wait();
      s->param_work.reset();
    }
  }
}

void DistributedDataParallel::finish_param_sync() {
  for (BucketState& s : states_)
    if (s.param_work) {
      s.param_work->wait();
      s.param_work.reset();
    }
}

}  // namespace megaton::optim
