// The trainer's side of the sharded checkpoint format (ckpt/sharded.h): which pieces of
// which global tensors this rank writes, and reading back this rank's tensor-parallel
// slices from any layout's pieces.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ckpt/sharded.h"
#include "model/parallel.h"
#include "model/param.h"

namespace megaton {

// A box of a global tensor: global offsets and extent, one per dimension.
struct SliceBox {
  std::vector<int64_t> offsets, shape;
};

// The boxes of this rank's tensor-parallel slice of p (Param::tp_split_dim; the group is
// tp, or etp for experts), in the slice's row-major order: one box, or one per stacked
// block of Param::tp_blocks (SwiGLU's [gate; up] halves, a Mamba in_proj's [z; x; B; C;
// dt]); the whole tensor when p is not split.
std::vector<SliceBox> tensor_parallel_boxes(const Param& p, const ModelParallel& mp);

// The pieces of checkpoint entry `name` that this rank writes, on the host. `data` holds
// the elements [param_offset, param_offset + data.numel()) of this rank's slice of param
// p (Param::tp_split_dim; the whole param when it is not split), flattened row-major, in
// the dtype to store. The global tensor is p's full_shape; the rank's slice is a box of it
// at tp_rank x (full / tp) along the split dimension (a box per stacked block of
// Param::tp_blocks, the flat range cut between them). A param replicated over its tensor-parallel
// group (tp, or etp for experts) is written by the group's rank 0 only (none elsewhere).
// p null: one piece, the whole of `data` (an expert bias, FP8 state).
// InternalError when data does not fit p's slice.
// snapshot: makes the host copy of `data` the pieces view (null: a new host tensor).
std::vector<ckpt::ShardedPiece> sharded_pieces(
    const std::string& name, const Param* p, const Tensor& data, int64_t param_offset,
    const ModelParallel& mp, const std::function<Tensor(const Tensor&)>& snapshot = nullptr);

// A per-parameter scale entry of the optimizer ("optimizer.<name>.exp_avg.scale",
// ".exp_avg_sq.scale", ".main_param.scale": F32 [1], the same on every tensor-parallel rank):
// one whole piece from rank 0 of its param's tensor-parallel group (tp, or etp for
// experts), none elsewhere. InternalError when the name belongs to no param of `params`.
std::vector<ckpt::ShardedPiece> sharded_scale_pieces(
    const std::string& name, const Tensor& data, const std::map<std::string, const Param*>& params,
    const ModelParallel& mp, const std::function<Tensor(const Tensor&)>& snapshot = nullptr);

// This rank's tensor-parallel slice of param p's checkpoint entry `name` (p.weight's shape,
// the stored dtype, on the host), read by offset from the pieces of whatever layout wrote
// it. A padded-vocabulary param saved with another padding (another TP size) is read whole
// and refitted first (fit_padded_vocab_rows). Throws megaton::Error naming the checkpoint
// and the tensor when its global shape is not p's full_shape (vocabulary rows aside), and
// the reader's errors (a missing, short or corrupt file).
Tensor read_tensor_parallel_slice(ckpt::ShardedCheckpointReader& reader, const std::string& name,
                                  const Param& p, const ModelParallel& mp,
                                  int64_t padded_vocab_size, int64_t vocab_size);

// Elements [offset, offset + numel) of what read_tensor_parallel_slice returns, flattened
// row-major (a 1-D host tensor of the stored dtype), reading only the boxes' bytes that
// hold them (the distributed optimizer's shard of a moment). The same errors, and
// InternalError for a range outside p.weight's elements.
Tensor read_tensor_parallel_range(ckpt::ShardedCheckpointReader& reader, const std::string& name,
                                  const Param& p, const ModelParallel& mp,
                                  int64_t padded_vocab_size, int64_t vocab_size, int64_t offset,
                                  int64_t numel);

}  // namespace megaton
