// ParamAndGradBuffer: one contiguous block for the weights and one for the main gradients
// of a set of parameters (Megatron's _ParamAndGradBuffer), cut into buckets that are
// reduced (and, under the distributed optimizer, sharded and gathered) one at a time.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "model/param.h"

namespace megaton {

// A run of one parameter's elements inside a buffer range: elements
// [param_offset, param_offset + numel) of `param`, stored at buffer element buffer_offset.
struct BufferPiece {
  Param* param;
  int64_t param_offset;
  int64_t buffer_offset;
  int64_t numel;
};

// Buffer elements [begin, end) holding whole params; its length is a multiple of
// 64 x num_shards, so each of the num_shards equal shards starts aligned.
struct BufferBucket {
  int64_t begin = 0, end = 0;
  std::vector<Param*> params;  // in buffer order
  int64_t numel() const { return end - begin; }
};

// Megatron-FSDP's --data-parallel-sharding-strategy: what each data-parallel rank of a
// buffer's group keeps whole. NoShard: everything (plain data parallelism); Optim: the
// weights and gradients (the optimizer state is the optimizer's to shard: ZeRO-1, as the
// distributed optimizer); OptimGrads: the weights, and only its own shard of the main
// gradients between backward passes (ZeRO-2); OptimGradsParams: only its own shard of the
// weights too (ZeRO-3).
enum class ShardingStrategy { NoShard, Optim, OptimGrads, OptimGradsParams };
ShardingStrategy parse_sharding_strategy(const std::string& name);  // megaton::Error if unknown
const char* sharding_strategy_name(ShardingStrategy s);             // Megatron's spelling

// How a buffer stores what it shards (OptimGrads, OptimGradsParams).
struct BufferSharding {
  ShardingStrategy strategy = ShardingStrategy::NoShard;
  int64_t shard_index = 0;  // this rank's shard: its rank in the buffer's group
  // The dtype of the own gradient shard (Megatron-FSDP's main grads dtype); the bucket
  // gradients the layers accumulate into, and which are reduce-scattered, keep the
  // constructor's grad_dtype (its grad comm dtype). F32 or BF16.
  DType main_grad_dtype = DType::F32;
  // Megatron-FSDP's --fsdp-double-buffer (its FixedPoolAllocator): the released bucket
  // memory comes from two persistent slots per buffer (weights, and gradients), each as
  // large as the buffer's most common bucket (a transformer layer's), bucket b taking slot
  // b % 2 so that neighbouring units alternate; a bucket of another size, or one whose slot
  // is taken (a unit kept live past its neighbour's turn), is allocated as without the flag.
  bool double_buffer = false;
  bool sharded_grads() const { return strategy >= ShardingStrategy::OptimGrads; }
  bool sharded_params() const { return strategy == ShardingStrategy::OptimGradsParams; }
};

// Where a buffer places its params in each bucket (ParamAndGradBuffer). Flat: one after
// another in reverse order, the shards cut wherever they fall (a param may straddle two:
// the distributed optimizer's elementwise Adam does not mind). WholeParams: every param
// wholly inside one shard, the shards balanced by Newton-Schulz cost (Megatron's
// LayerWiseDistributedOptimizer._compute_per_buffer_param_layout), so that the reduce-
// scatter brings each data-parallel rank whole gradients of the matrices it owns and the
// all-gather everyone their updated weights (Muon under --use-distributed-optimizer).
enum class BufferLayout { Flat, WholeParams };

// Megatron's _ns_compute_cost: the leading term of Newton-Schulz on a weight of local
// (tensor-parallel) shape [m, n], max(m, n) x min(m, n)^2; numel for any other shape. The
// cost the WholeParams layout balances.
int64_t newton_schulz_cost(const Shape& shape);

// Where BufferLayout::WholeParams puts each param (ParamAndGradBuffer's constructor says
// how), computed from the params' sizes alone, so that the memory plan
// (train/memory_plan_state.cpp) lays out the Muon buffers as the model does.
struct WholeParamsLayout {
  struct Bucket {
    int64_t begin = 0, end = 0;  // buffer elements; num_shards x shard_numel
    int64_t shard_numel = 0;     // a multiple of 64, at least 64
    std::vector<size_t> params;  // indices into the input, in buffer order
  };
  std::vector<int64_t> offsets;  // per param (input order): its first buffer element
  std::vector<int64_t> shards;   // per param: the shard of its bucket that holds it whole
  std::vector<Bucket> buckets;
  int64_t numel = 0;  // the whole buffer (buckets.back().end)
};
// numels[i], costs[i]: param i's elements and newton_schulz_cost, in constructor (forward)
// order, at least one param; num_shards >= 1; bucket_size <= 0: one bucket. Pure: the
// same inputs give the same layout. InternalError on empty or mismatched inputs.
WholeParamsLayout whole_params_layout(const std::vector<int64_t>& numels,
                                      const std::vector<int64_t>& costs, int64_t num_shards,
                                      int64_t bucket_size);

class ParamAndGradBuffer {
 public:
  // Moves the params' compute weights into one buffer of their dtype and gives each a
  // zeroed main_grad in a second buffer of grad_dtype (F32, or BF16 for Megatron's bf16
  // grad buffers: --main-grads-dtype bf16 / --grad-reduce-in-bf16; InternalError
  // otherwise), both laid out alike. As in Megatron the
  // params are laid out in REVERSE of the given (forward) order, so the gradients that
  // backward finishes first fill the first bucket. Each param starts at a multiple of 64
  // elements. A bucket is closed after the param that brings it to bucket_size elements
  // or more (Megatron's --ddp-bucket-size; <= 0: one bucket for everything); a param in
  // own_bucket gets a bucket to itself (Megatron does this for the word embeddings tied
  // across pipeline stages under the distributed optimizer, so that both stages shard
  // them alike). Buckets are padded to a multiple of 64 x num_shards.
  // p->weight and p->main_grad become views into the buffers (p->main_param too when it
  // is the weight, in fp32 runs). All params share one device and one compute dtype
  // (InternalError otherwise). FP8 weights (--fp8-param-gather): when every param is
  // Param::fp8_param, the weight buffer is F8E4M3 and left zero (the optimizer quantizes
  // the main params into it: DistributedAdamW), and p->main_param keeps the fp32 values
  // (in fp32 runs the former weight tensor); a mix of FP8 and other params is an
  // InternalError. is_expert: the buffer of expert parameters (reduced over
  // the expert-data-parallel group), else of dense ones.
  // param_units (empty, or one per param): a bucket is also closed where the unit changes
  // between neighbours in buffer order (FSDP: one bucket per layer, gathered and reduced
  // as that layer runs). sharding: sharded_grads() gives every bucket its own gradient
  // storage, released (Storage::release) until restore_grads, and keeps the own shard of
  // the reduced gradients apart (own_grad_shard); sharded_params() does the same for the
  // weights (released by release_weights once the optimizer has read them; the own shard
  // in own_weight_shard). FP8 buffers are not sharded so (InternalError). With one shard
  // the strategy is at most Optim (the whole buffer is the shard: nothing is released).
  //
  // layout WholeParams (Megatron's LayerWiseDistributedOptimizer layout; Flat is all the
  // above) cuts buckets and places params in them as follows, so that every param lies
  // wholly inside one shard, starting at a multiple of 64 elements:
  // - Buckets: the params are walked in reverse, as for Flat. With n the elements of the
  //   params collected so far (unpadded) and L the largest of them, the bucket is closed
  //   before the next param q when n >= max(bucket_size, floor(0.9 x num_shards x L))
  //   (Megatron's PADDING_FLOOR: a bucket is at least num_shards x L long anyway) and q
  //   cannot be absorbed into the bucket's padding: placing the collected params in walk
  //   order, each at round_up(load, 64) of the least-loaded shard (loads in elements),
  //   q is absorbed when round_up(min load, 64) + numel(q) <= round_up(max load, 64).
  //   bucket_size <= 0: one bucket.
  // - Placement in a bucket: by Newton-Schulz cost, max(m, n) x min(m, n)^2 for a weight of
  //   local (tensor-parallel) shape [m, n], numel for any other shape; costliest first (ties
  //   in walk order). A param goes to the shard of least accumulated cost among those where
  //   it fits, round_up(cursor, 64) + numel <= 1.3 x (the bucket's param elements) /
  //   num_shards; when it fits nowhere, to the shard of the lowest cursor. Ties go to the
  //   lowest shard index. It lies at round_up(cursor, 64) of that shard, and the cursor moves
  //   past it. The costs accumulate over the whole buffer (balance over all its buckets);
  //   the cursors restart at each bucket.
  // - Every shard of a bucket then has round_up(max cursor, 64) elements (so shard_numel
  //   stays bucket numel / num_shards); bucket b's params are listed in buffer order.
  // WholeParams with param_units, own_bucket, FP8 weights or sharded storage
  // (sharding.sharded_grads()): InternalError.
  ParamAndGradBuffer(std::vector<Param*> params, int64_t num_shards, bool is_expert,
                     int64_t bucket_size = 0, const std::vector<const Param*>& own_bucket = {},
                     DType grad_dtype = DType::F32, const std::vector<int>& param_units = {},
                     const BufferSharding& sharding = {}, BufferLayout layout = BufferLayout::Flat);

  // The params in the order given to the constructor.
  const std::vector<Param*>& params() const { return params_; }
  bool is_expert() const { return is_expert_; }
  BufferLayout layout() const { return layout_; }
  // The weights are FP8 (--fp8-param-gather, Param::fp8_param).
  bool fp8() const { return weights_.dtype() == DType::F8E4M3; }
  int64_t numel() const { return numel_; }
  int64_t num_shards() const { return num_shards_; }
  // Element offset of param i (constructor order) in the buffers.
  int64_t offset(size_t i) const { return offsets_[i]; }

  // The whole buffers, [numel] compute dtype / grad_dtype: only when neither is stored by
  // bucket (sharding.sharded_grads(): InternalError).
  Tensor& weights();
  Tensor& grads();
  DType weight_dtype() const { return weight_dtype_; }
  DType grad_dtype() const { return grad_dtype_; }
  Device device() const { return device_; }
  const BufferSharding& sharding() const { return sharding_; }

  const std::vector<BufferBucket>& buckets() const { return buckets_; }
  // The bucket holding p, or -1 when p is not in this buffer.
  int bucket_of(const Param* p) const;
  // The shard (0 .. num_shards - 1) of p's bucket that holds all of p: in a WholeParams
  // buffer always (the data-parallel rank that owns p: its reduce-scatter gets p's whole
  // gradient, its all-gather sends p's weights), in a Flat one when p happens not to
  // straddle a shard boundary (always with one shard); -1 when it does. InternalError when
  // p is not in this buffer.
  int64_t owner_shard(const Param* p) const;
  // Bucket b's weights and gradients [bucket numel] (in their own storage when sharded).
  Tensor bucket_weights(size_t b) const;
  Tensor bucket_grads(size_t b) const;
  // Elements per shard of bucket b, and buffer range [begin, end) of its shard `index`.
  int64_t shard_numel(size_t b) const { return buckets_[b].numel() / num_shards_; }
  int64_t shard_begin(size_t b, int64_t index) const {
    return buckets_[b].begin + index * shard_numel(b);
  }
  // Shard `index` of bucket b, a view into bucket_weights / bucket_grads.
  Tensor weight_shard(size_t b, int64_t index) const {
    return bucket_weights(b).rows(index * shard_numel(b), shard_numel(b));
  }
  Tensor grad_shard(size_t b, int64_t index) const {
    return bucket_grads(b).rows(index * shard_numel(b), shard_numel(b));
  }
  // This rank's shard of bucket b as the optimizer reads and writes it: its own storage
  // when sharded (grads: main_grad_dtype, the sum of the reduce-scattered micro-batches),
  // else the view weight_shard / grad_shard(b, sharding.shard_index).
  Tensor own_weight_shard(size_t b) const;
  Tensor own_grad_shard(size_t b) const;
  // The weights / main gradients of a piece of this rank's shard (shard_pieces(shard_index)).
  Tensor weight_piece(const BufferPiece& piece) const;
  Tensor grad_piece(const BufferPiece& piece) const;
  // Zeroes the main gradients: the own shards and whatever bucket gradients are allocated.
  void zero_grads();

  // Sharded storage (sharding above). release_* gives a bucket's memory back (its params'
  // weight / main_grad views keep their shapes, without data); restore_weights takes it
  // anew, uninitialised (an all-gather fills it), restore_grads zeroed. *_live: allocated.
  // (With sharding.double_buffer from the bucket's slot when it fits and is free.)
  void release_weights(size_t b) { release(bucket_weights_, weight_slots_, b); }
  void restore_weights(size_t b) { restore(bucket_weights_, weight_slots_, b); }
  bool weights_live(size_t b) const;
  void release_grads(size_t b) { release(bucket_grads_, grad_slots_, b); }
  // Double buffering: the bucket in slot s (-1: free) of the weights and of the gradients,
  // and the slots' size in elements (0: not double-buffered).
  int weight_slot_user(int s) const { return weight_slots_.user[size_t(s)]; }
  int grad_slot_user(int s) const { return grad_slots_.user[size_t(s)]; }
  int64_t slot_numel() const { return slot_numel_; }
  void restore_grads(size_t b);
  bool grads_live(size_t b) const;
  // Copies this rank's shard of the (live) bucket weights into own_weight_shard (after
  // the whole weights were written: initialisation, a checkpoint load).
  void store_own_weight_shard(size_t b);
  // The param elements of shard `index` over every bucket, in buffer order.
  std::vector<BufferPiece> shard_pieces(int64_t index) const;

  // The param elements inside buffer range [begin, end), in buffer order (padding skipped).
  std::vector<BufferPiece> pieces(int64_t begin, int64_t end) const;

 private:
  std::vector<Param*> params_;
  std::vector<int64_t> offsets_;
  std::vector<BufferBucket> buckets_;
  std::unordered_map<const Param*, int> bucket_index_;
  std::unordered_map<const Param*, size_t> param_index_;  // constructor order
  int64_t num_shards_;
  bool is_expert_;
  BufferLayout layout_;
  BufferSharding sharding_;
  int64_t numel_ = 0;  // elements of the whole buffer (every bucket, padding included)
  DType weight_dtype_, grad_dtype_;
  Device device_;
  Tensor weights_, grads_;  // whole buffers, unless stored by bucket
  // Stored by bucket (sharding): each bucket's weights / grads, and the own shards.
  std::vector<Tensor> bucket_weights_, bucket_grads_, weight_shards_, grad_shards_;
  // --fsdp-double-buffer: two persistent slots and the bucket each lends its memory to.
  struct Slots {
    std::array<Tensor, 2> memory;
    std::array<int, 2> user{-1, -1};
  };
  Slots weight_slots_, grad_slots_;
  int64_t slot_numel_ = 0;
  // Set offsets_, buckets_ and numel_ (the constructor's two layouts).
  void lay_out_flat(int64_t bucket_size, const std::vector<const Param*>& own_bucket,
                    const std::vector<int>& param_units);
  void lay_out_whole_params(int64_t bucket_size);
  void restore(std::vector<Tensor>& buckets, Slots& slots, size_t b);
  void release(std::vector<Tensor>& buckets, Slots& slots, size_t b);
};

}  // namespace megaton
