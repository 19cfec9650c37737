// Megatron's --use-checkpoint-args: the model's arguments taken from the checkpoint being
// loaded, so a script can resume or finetune a checkpoint without repeating its shape.
#pragma once
#include <string>
#include <vector>

#include "train/arguments.h"

namespace megaton {

// What apply_checkpoint_args did: the options to parse, and the lines rank 0 prints.
struct CheckpointArgs {
  RawOptions raw;
  std::vector<std::string> messages;
};

// When `raw` gives --use-checkpoint-args (as true), returns `raw` with the model arguments
// of the checkpoint --load names (the tracker's iteration, or --ckpt-step's) put in, as
// Megatron's load_args_from_checkpoint (megatron/training/checkpointing.py) does:
// - the shape arguments Megatron leaves to the command line when given (num-layers,
//   hidden-size, ffn-hidden-size, seq-length, num-attention-heads, kv-channels,
//   max-position-embeddings) are taken from the checkpoint only when not given;
// - the others (attention groups, position embedding and RoPE, biases, activation,
//   normalization, dropout, tied embeddings, the MoE layer arguments, and Megaton's
//   qk-layernorm, norm-epsilon, rope-type and MoE router groups, which a checkpoint's
//   weights depend on too) always come from the checkpoint: a flag the saving run did
//   not give returns to its default;
// - the tokenizer (tokenizer-type and its files, as absolute paths) likewise, unless
//   --no-use-tokenizer-model-from-checkpoint-args;
// - with --use-mp-args-from-checkpoint-args, the tensor-, pipeline- and expert-parallel
//   sizes and the virtual pipeline split.
// A flag in a group (e.g. swiglu) counts with its other names (Megatron's deprecated
// forms). Without a checkpoint in --load, or one saved without arguments, `raw` is
// returned unchanged with Megatron's message. Otherwise `raw` is returned as given.
// Throws megaton::Error (exit 2) when --use-checkpoint-args comes without --load, or the
// checkpoint's metadata is unreadable or --ckpt-step names a missing iteration.
CheckpointArgs apply_checkpoint_args(const RawOptions& raw);

// The TrainArgs of a checkpoint's saved "args" (as raw options) for use outside a training
// run (generation, conversion): the device this machine's default, and the flags every run must give
// that the model does not depend on filled in when absent (train-iters 1, mock-data when
// no data source is named), so the args of a checkpoint `megaton convert` wrote (model
// and tokenizer flags only) parse too. Throws as parse_train_args.
TrainArgs parse_model_args(RawOptions raw);

// Every flag apply_checkpoint_args may take from a checkpoint (for the tests: each is one
// of `megaton train`'s flags).
std::vector<std::string> checkpoint_arg_keys();

}  // namespace megaton
