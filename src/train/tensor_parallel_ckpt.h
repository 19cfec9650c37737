// Checkpoint tensors under tensor parallelism: slices assembled into full tensors for
// saving, full tensors cut into this rank's slice for loading, so a checkpoint is the
// same whatever the tensor-parallel size (Megatron's dist-checkpointing idea, simplified).
#pragma once
#include <map>
#include <string>

#include "dist/gather.h"
#include "model/parallel.h"
#include "model/param.h"

namespace megaton {

// The group that splits param p (Param::tp_split_dim): etp for experts, else tp.
const dist::Group& tensor_parallel_group(const Param& p, const ModelParallel& mp);

// The param a checkpoint entry belongs to: "model.<name>", "optimizer.<name>.exp_avg",
// "optimizer.<name>.exp_avg_sq" (Adam; Lion's exp_avg) or "optimizer.<name>.momentum_buffer"
// (Muon, SGD); null when `params` has no such name, and for the scales of
// fp16 and fp8 moments ("optimizer.<name>.exp_avg.scale", F32 [1]: not shaped like the
// param, never sliced) and of fp16 main params ("optimizer.<name>.main_param.scale").
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

// A checkpoint tensor whose rows are a padded vocabulary (Param::padded_vocab_rows:
// [checkpoint_rows, ...], any dtype, on the host) refitted to `padded_vocab_size` rows for a
// vocabulary of `vocab_size` real tokens. The padding depends on the tensor-parallel size
// (padded = vocab rounded up to make-vocab-size-divisible-by x TP), so a checkpoint
// saved under one TP size holds another number of rows than the model under another.
// Rows past padded_vocab_size are trimmed (they are padding: padded_vocab_size >=
// vocab_size); missing rows are added as copies of the checkpoint's last row when that
// row is itself padding, so the new rows start as the trained padding rows are (Megatron's
// checkpoint converter, tools/checkpoint, pads by replicating the last row), and as zeros
// when the checkpoint has no padding row (copying a real token's row would give its logit
// to the padding). The same rule applied to the weights and to both Adam moments keeps
// them consistent. Returns `full` itself when the rows already match.
// Throws megaton::Error naming `entry` and `source` when the checkpoint has fewer rows
// than the vocabulary (another tokenizer).
Tensor fit_padded_vocab_rows(const Tensor& full, int64_t padded_vocab_size, int64_t vocab_size,
                             const std::string& entry, const std::string& source);

}  // namespace megaton
