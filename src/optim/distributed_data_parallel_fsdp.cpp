// DistributedDataParallel under Megatron-FSDP: the weights of a unit gathered before its
// forward and backward (the next unit prefetched) and released after, the sharded
// gradients added into each rank's own shard, and the sums over other groups on those
// shards.
#include <algorithm>

#include "core/error.h"
#include "ops/ops.h"
#include "optim/distributed_data_parallel.h"

namespace megaton::optim {

void DistributedDataParallel::set_units(
    const std::vector<std::vector<std::span<Param* const>>>& chunks) {
  units_ = chunks;
  unit_index_.clear();
  for (size_t c = 0; c < units_.size(); ++c)
    for (size_t u = 0; u < units_[c].size(); ++u)
      if (!units_[c][u].empty()) unit_index_[units_[c][u][0]] = {c, u};
  // The all-gathers start in the order the forward first reads the buckets: chunk by chunk,
  // unit by unit, so that a layer's bucket of one buffer (the layer-wise optimizer's Muon
  // buffer) does not queue behind every bucket of another. Buckets no unit reads keep their
  // place after those. Every rank of a group has the same units, hence the same order.
  std::vector<size_t> order;
  std::vector<bool> placed(states_.size(), false);
  auto place = [&](size_t i) {
    if (!placed[i]) order.push_back(i);
    placed[i] = true;
  };
  for (const auto& chunk : units_)
    for (std::span<Param* const> unit : chunk)
      for (const Param* p : unit)
        if (auto it = state_index_.find(p); it != state_index_.end()) place(it->second);
  for (size_t i : param_sync_order_) place(i);
  param_sync_order_ = std::move(order);
}

std::span<Param* const> DistributedDataParallel::neighbour_unit(std::span<Param* const> params,
                                                                int step) const {
  if (params.empty()) return {};
  auto it = unit_index_.find(params[0]);
  if (it == unit_index_.end()) return {};
  const auto [c, u] = it->second;
  const int64_t next = int64_t(u) + step;
  if (next < 0 || next >= int64_t(units_[c].size())) return {};
  return units_[c][size_t(next)];
}

std::vector<DistributedDataParallel::BucketState*> DistributedDataParallel::states_of(
    std::span<Param* const> params) {
  std::vector<BucketState*> out;
  for (const Param* p : params)
    if (BucketState* s = state_of(p); s && std::find(out.begin(), out.end(), s) == out.end())
      out.push_back(s);
  return out;
}

void DistributedDataParallel::start_gather(BucketState& s) {
  ParamAndGradBuffer& b = *s.buffer;
  if (!b.sharding().sharded_params() || b.weights_live(s.index)) return;  // there or coming
  b.restore_weights(s.index);
  Tensor all = b.bucket_weights(s.index);
  const dist::Group& g = group_of(b);
  if (g.size() == 1) {
    all.copy_from(b.own_weight_shard(s.index));
    return;
  }
  s.param_work = comm_.all_gather_async(b.own_weight_shard(s.index), all, g);
}

void DistributedDataParallel::wait_gather(BucketState& s) {
  if (!s.param_work) return;
  s.param_work->wait();
  s.param_work.reset();
}

void DistributedDataParallel::before_forward(std::span<Param* const> params) {
  // The last micro-batch's reduce-scatters end before a forward takes memory again.
  for (BucketState* s : pending_) finish_sharded_grad_sync(*s);
  pending_.clear();
  if (!params_sharded_) {
    wait_param_sync(params);
    return;
  }
  gather(params, +1);
}

void DistributedDataParallel::after_forward(std::span<Param* const> params) {
  if (!params_sharded_) return;
  const std::span<Param* const> next = neighbour_unit(params, +1);
  const std::vector<BucketState*> keep = states_of(next);
  for (BucketState* s : states_of(params)) {
    if (!s->buffer->sharding().sharded_params()) continue;
    if (std::find(keep.begin(), keep.end(), s) != keep.end()) continue;  // read next too
    wait_gather(*s);
    s->buffer->release_weights(s->index);
  }
}

void DistributedDataParallel::before_backward(std::span<Param* const> params) {
  if (!grads_sharded_ && !params_sharded_) return;  // plain DDP / distributed optimizer
  for (BucketState* s : states_of(params)) {
    ParamAndGradBuffer& b = *s->buffer;
    if (b.sharding().sharded_grads()) {
      // The last micro-batch's reduce-scatter of this bucket (reading its memory) is
      // finished and added first; a bucket already live this micro-batch is kept.
      finish_sharded_grad_sync(*s);
      b.restore_grads(s->index);
    }
  }
  if (params_sharded_) gather(params, -1);
}

void DistributedDataParallel::gather(std::span<Param* const> params, int prefetch_step) {
  const std::vector<BucketState*> states = states_of(params);
  for (BucketState* s : states) start_gather(*s);
  for (BucketState* s : states) wait_gather(*s);
  // The neighbour's all-gather runs while this unit computes.
  for (BucketState* s : states_of(neighbour_unit(params, prefetch_step))) start_gather(*s);
}

void DistributedDataParallel::finish_sharded_grad_sync(BucketState& s) {
  if (!s.reduced.defined()) return;
  if (s.grad_work) {
    s.grad_work->wait();
    s.grad_work.reset();
  }
  ParamAndGradBuffer& b = *s.buffer;
  Tensor shard = b.own_grad_shard(s.index);
  if (s.reduced.dtype() == DType::F32) {
    ops::add_(shard, s.reduced);
  } else {  // a BF16 grad comm dtype: widened, then added (rounded once into a BF16 shard)
    Tensor wide = Tensor::empty({s.reduced.numel()}, DType::F32, b.device());
    ops::cast(s.reduced, wide);
    ops::add_(shard, wide);
  }
  s.reduced = Tensor();
  b.release_grads(s.index);
}

void DistributedDataParallel::all_reduce_own_grads(std::span<const Param* const> params,
                                                   const dist::Group& group) {
  if (group.size() == 1 || !group.is_member()) return;
  // Every rank of the group holds the same pieces in the same order (same buffer layout).
  std::vector<Tensor> pieces;
  std::vector<const ParamAndGradBuffer*> seen;
  for (BucketState& s : states_) {
    ParamAndGradBuffer& b = *s.buffer;
    if (std::find(seen.begin(), seen.end(), &b) != seen.end()) continue;
    seen.push_back(&b);
    for (const BufferPiece& piece : b.shard_pieces(b.sharding().shard_index))
      if (std::find(params.begin(), params.end(), piece.param) != params.end())
        pieces.push_back(b.grad_piece(piece));
  }
  dist::all_reduce_coalesced(comm_, pieces, group);
}

void DistributedDataParallel::gather_all_weights() {
  for (BucketState& s : states_) start_gather(s);
  for (BucketState& s : states_) wait_gather(s);
}

void DistributedDataParallel::release_all_weights() {
  for (BucketState& s : states_) {
    ParamAndGradBuffer& b = *s.buffer;
    if (!b.sharding().sharded_params() || !b.weights_live(s.index)) continue;
    wait_gather(s);
    b.store_own_weight_shard(s.index);
    b.release_weights(s.index);
  }
}

}  // namespace megaton::optim
