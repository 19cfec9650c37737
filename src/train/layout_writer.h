// Writing a sharded checkpoint as the ranks of a parallel layout would, without running
// that layout (one process, no model built): `megaton convert --target-*-parallel-size`.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/grid.h"
#include "model/config.h"

namespace megaton {

// The layout to write for; Megatron's flag names. etp 0: tp (Megatron's default).
struct TargetLayout {
  int64_t tp = 1, pp = 1, ep = 1, etp = 0;
};

// The ranks of `target` for model `cfg` (finalized): world = tp x pp x dp with the
// smallest data-parallel size dp for which the expert grid (etp x ep) divides tp x dp.
// Runs Megatron's layout checks (dist::validate_layout, with sequence parallelism under
// tp > 1, which MoE with ep > 1 needs and which changes no stored tensor). Throws
// megaton::Error as validate_layout does (e.g. "num-attention-heads (4) is not divisible by
// tensor-model-parallel-size (3)").
dist::ValidatedLayout resolve_target_layout(const GPTConfig& cfg, const TargetLayout& target);

// Writes <save_dir>/iter_<iteration>/ as the `layout`'s ranks would save the weights of
// `tensors` (Megaton names without "model.", F32, whole: model_param_specs(cfg) says which
// and of what shape; vocabulary rows already cfg.padded_vocab_size) with
// ckpt/sharded.h: rank r's file holds the tensor-parallel slices (train/sharded_ckpt.h's
// boxes: SwiGLU halves as two) of the parameters of its pipeline stage, dense ones on
// data-parallel rank 0, experts on expert-data-parallel rank 0 of the expert-parallel rank
// holding them; a replicated tensor on tensor-parallel rank 0; the router expert biases
// whole, as the trainer writes them. `run_metadata_json` is the checkpoint's run metadata
// (ckpt::commit_sharded_checkpoint's); the tracker then names `iteration`.
// Throws megaton::Error naming the tensor when one is missing, extra or of another shape,
// or a dimension does not divide among the tensor-parallel ranks; and the writer's errors.
void write_checkpoint_for_layout(const std::string& save_dir, int64_t iteration,
                                 const std::map<std::string, Tensor>& tensors, const GPTConfig& cfg,
                                 const dist::ValidatedLayout& layout,
                                 const std::string& run_metadata_json);

// The tensors of a checkpoint made on demand (megaton convert reading a Hugging Face model
// by mmap): `names` every tensor `make` can return; make(name) the whole tensor, F32 (it may
// throw megaton::Error naming what it could not read).
struct TensorSource {
  std::vector<std::string> names;
  std::function<Tensor(const std::string&)> make;
};

// write_checkpoint_for_layout with each tensor made when a rank file reaches it and
// released after that file's pieces of it are written: a writer holds one tensor (and its
// slice) at a time, whatever the model's size. Each rank file calls make() once per tensor
// it holds. The same files and errors; a shape mismatch is found when the tensor is made
// (the staged output is then removed by the caller's StagedDirectory).
void write_checkpoint_for_layout(const std::string& save_dir, int64_t iteration,
                                 const TensorSource& tensors, const GPTConfig& cfg,
                                 const dist::ValidatedLayout& layout,
                                 const std::string& run_metadata_json);

}  // namespace megaton
