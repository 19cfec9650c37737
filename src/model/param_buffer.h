// ParamAndGradBuffer: one contiguous block for the weights and one for the main gradients
// of a set of parameters (Megatron's _ParamAndGradBuffer), cut into buckets that are
// reduced (and, under the distributed optimizer, sharded and gathered) one at a time.
#pragma once
#include <cstdint>
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
  ParamAndGradBuffer(std::vector<Param*> params, int64_t num_shards, bool is_expert,
                     int64_t bucket_size = 0, const std::vector<const Param*>& own_bucket = {},
                     DType grad_dtype = DType::F32);

  // The params in the order given to the constructor.
  const std::vector<Param*>& params() const { return params_; }
  bool is_expert() const { return is_expert_; }
  // The weights are FP8 (--fp8-param-gather, Param::fp8_param).
  bool fp8() const { return weights_.dtype() == DType::F8E4M3; }
  int64_t numel() const { return weights_.numel(); }
  int64_t num_shards() const { return num_shards_; }
  // Element offset of param i (constructor order) in the buffers.
  int64_t offset(size_t i) const { return offsets_[i]; }

  Tensor& weights() { return weights_; }  // [numel] compute dtype
  Tensor& grads() { return grads_; }      // [numel] grad_dtype (F32 or BF16)

  const std::vector<BufferBucket>& buckets() const { return buckets_; }
  // The bucket holding p, or -1 when p is not in this buffer.
  int bucket_of(const Param* p) const;
  Tensor bucket_weights(size_t b) { return weights_.rows(buckets_[b].begin, buckets_[b].numel()); }
  Tensor bucket_grads(size_t b) { return grads_.rows(buckets_[b].begin, buckets_[b].numel()); }
  // Elements per shard of bucket b, and buffer range [begin, end) of its shard `index`.
  int64_t shard_numel(size_t b) const { return buckets_[b].numel() / num_shards_; }
  int64_t shard_begin(size_t b, int64_t index) const {
    return buckets_[b].begin + index * shard_numel(b);
  }
  Tensor weight_shard(size_t b, int64_t index) {
    return weights_.rows(shard_begin(b, index), shard_numel(b));
  }
  Tensor grad_shard(size_t b, int64_t index) {
    return grads_.rows(shard_begin(b, index), shard_numel(b));
  }
  // The param elements of shard `index` over every bucket, in buffer order.
  std::vector<BufferPiece> shard_pieces(int64_t index) const;

  // The param elements inside buffer range [begin, end), in buffer order (padding skipped).
  std::vector<BufferPiece> pieces(int64_t begin, int64_t end) const;

 private:
  std::vector<Param*> params_;
  std::vector<int64_t> offsets_;
  std::vector<BufferBucket> buckets_;
  std::unordered_map<const Param*, int> bucket_index_;
  int64_t num_shards_;
  bool is_expert_;
  Tensor weights_, grads_;
};

}  // namespace megaton
