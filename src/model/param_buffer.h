// ParamAndGradBuffer: one contiguous block for the weights and one for the main gradients
// of a set of parameters (Megatron's _ParamAndGradBuffer), cut into equal shards for the
// data-parallel reduce-scatter and all-gather of the distributed optimizer.
#pragma once
#include <cstdint>
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

class ParamAndGradBuffer {
 public:
  // Moves the params' compute weights into one buffer of their dtype and gives each a
  // zeroed fp32 main_grad in a second buffer, both laid out alike: params in the given
  // order, each starting at a multiple of 64 elements, the total padded to a multiple of
  // 64 x num_shards so that num_shards equal shards start aligned. p->weight and
  // p->main_grad become views into the buffers (p->main_param too when it is the weight,
  // in fp32 runs). All params share one device and one compute dtype (InternalError
  // otherwise). is_expert: the buffer of expert parameters (reduced over the
  // expert-data-parallel group), else of dense ones.
  ParamAndGradBuffer(std::vector<Param*> params, int64_t num_shards, bool is_expert);

  const std::vector<Param*>& params() const { return params_; }
  bool is_expert() const { return is_expert_; }
  int64_t numel() const { return weights_.numel(); }
  int64_t num_shards() const { return num_shards_; }
  int64_t shard_numel() const { return numel() / num_shards_; }
  // Element offset of param i in the buffers.
  int64_t offset(size_t i) const { return offsets_[i]; }

  Tensor& weights() { return weights_; }  // [numel] compute dtype
  Tensor& grads() { return grads_; }      // [numel] fp32
  // Shard `index` of the weights and grads ([shard_numel] views).
  Tensor weight_shard(int64_t index) { return weights_.rows(index * shard_numel(), shard_numel()); }
  Tensor grad_shard(int64_t index) { return grads_.rows(index * shard_numel(), shard_numel()); }

  // The param elements inside buffer range [begin, end), in buffer order (padding skipped).
  std::vector<BufferPiece> pieces(int64_t begin, int64_t end) const;

 private:
  std::vector<Param*> params_;
  std::vector<int64_t> offsets_;
  int64_t num_shards_;
  bool is_expert_;
  Tensor weights_, grads_;
};

}  // namespace megaton
