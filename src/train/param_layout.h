// The parameters a GPTConfig's model holds, with their tensor-parallel split rules, without
// building the model (for writing checkpoints of another layout: `megaton convert`).
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/param.h"

namespace megaton {

// One checkpoint entry "model.<name>" of the model: a Param's metadata as the model's
// layers set it (model/param.h), plus where it lives.
struct ParamSpec {
  std::string name;            // Megatron's name, e.g. "decoder.layers.0.mlp.linear_fc1.weight"
  Shape full_shape;            // the whole tensor (vocabulary rows: cfg.padded_vocab_size)
  int tp_split_dim = -1;       // Param::tp_split_dim: -1 replicated, 0 column / vocab, 1 row
  std::vector<int64_t> tp_blocks;  // Param::tp_blocks
  bool is_expert = false;      // Param::is_expert: split over etp, held by one ep rank
  bool padded_vocab_rows = false;
  int64_t layer = -1;   // its decoder layer; -1: the embedding, final norm or output layer
  int64_t expert = -1;  // its global expert index; -1: not an expert's
  // Where it lives in a pipeline: the first stage (embedding), a layer's stage, or the last
  // stage (final norm, output layer).
  enum class Stage { First, Layer, Last } stage = Stage::Layer;
  // Not a Param but state saved with the model: the router's expert bias [E] (F32,
  // TopKRouter::expert_bias, saved whole).
  bool router_state = false;

  // A Param carrying this metadata (name, full_shape, tp_split_dim, tp_blocks,
  // is_expert, padded_vocab_rows; no tensors), for train/sharded_ckpt.h's rules.
  Param as_param() const;
};

// Every checkpoint entry of the model `cfg` describes (finalized: padded_vocab_size set),
// in the model's order (embedding, layers, final norm, output layer), router expert biases
// included (router_state) when --moe-router-enable-expert-bias. Covers the models
// `megaton convert` writes: RoPE or no position embedding, RMSNorm, no linear biases,
// SwiGLU or not, self attention (with --qk-layernorm) or multi-latent attention, dense and
// MoE layers (shared experts and their gate included), hybrid models (Mamba-2 layers and
// layers of a mixer or an MLP alone), tied or untied output layer. Throws megaton::Error
// naming the flag for a model outside that set (learned positions, LayerNorm, biases, MTP).
std::vector<ParamSpec> model_param_specs(const GPTConfig& cfg);

}  // namespace megaton
