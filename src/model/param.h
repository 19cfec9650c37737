// Param: one trainable tensor with its fp32 main gradient.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace megaton {

// How a parameter's initial values are drawn (model/layers.h make_param*), kept so that a
// run with --init-model-with-meta-device can draw any range of them later, on the rank
// that stores it (initial_values). Normal: element i of the full tensor (row-major over
// Param::full_shape) is std x Philox(seed).normal(stream, i); this rank's slice is that of
// tp_rank of tp_size along Param::tp_split_dim (tp_blocks as there). Constant: value.
// Uniform: map(low + (high - low) x Philox(seed).uniform(stream, i)), with map one of
// Identity, Log (log u: Mamba's A_log from A ~ U[1, 16]) or MambaDt (u is log dt: dt =
// max(exp(u), 1e-4), the value is softplus^-1(dt) = dt + log(-expm1(-dt)); Mamba's dt_bias,
// megatron/core/ssm/mamba_mixer.py).
struct ParamInit {
  enum class Kind { None, Normal, Constant, Uniform };
  enum class Map { Identity, Log, MambaDt };
  Kind kind = Kind::None;
  Map map = Map::Identity;
  uint64_t seed = 0, stream = 0;
  float std = 0, value = 0, low = 0, high = 0;
  int tp_rank = 0, tp_size = 1;
};

// A model parameter on the model's device. `weight` is the compute copy the layers use
// (bf16 in a bf16 GPU run, else fp32); `main_param` is the fp32 master copy the optimizer
// updates (the same tensor as `weight` when the compute dtype is fp32); `main_grad`
// (fp32, same shape) accumulates gradients over micro-batches and is zeroed by the
// trainer before each step. `name` follows the checkpoint key
// (e.g. "decoder.layers.0.self_attention.linear_qkv.weight").
struct Param {
  std::string name;
  Tensor weight;
  Tensor main_param;
  // Transformer Engine's store_param_remainders (optim::AdamWConfig, on by default in bf16
  // runs): the fp32 main param held as the bf16 weight plus this I16 tensor of its low 16
  // bits (same shape; ops/param_remainder.h joins the two back into the fp32 value), in
  // place of main_param, which is then undefined. Set by the optimizer; undefined otherwise.
  Tensor main_param_remainder;
  // --main-params-dtype fp16 (Transformer Engine's FusedAdam master_weight_dtype fp16;
  // ops/adam_f16_main_param.h): the main param held as this F16 tensor (same shape) with
  // the per-tensor F32 [1] scale main_param_scale (value = stored * scale), in place of
  // main_param, which is then undefined. Set by the optimizer; undefined otherwise.
  Tensor main_param_f16;
  Tensor main_param_scale;
  Tensor main_grad;
  // Megatron applies no weight decay to biases and normalization weights.
  bool no_weight_decay = false;
  // An expert's weight (MoE experts, not the router): its gradient is reduced over the
  // expert-data-parallel group and it lives in the expert ParamAndGradBuffer.
  bool is_expert = false;
  // Tensor parallelism (Megatron's tensor_model_parallel / partition_dim): the dimension
  // along which this rank holds a 1/tp (experts: 1/etp) slice of the full tensor, -1 when
  // every rank of the group holds all of it. full_shape is the unsliced shape (the
  // checkpoint's). tp_blocks: the full sizes of blocks stacked along dim 0 that are split
  // over the group one by one, each rank holding its slice of each block, in order
  // (Megatron's partition_sizes): a SwiGLU fc1's [gate; up] is {F, F} (Megatron's swiglu
  // sharded factory), a Mamba in_proj's [z; x; B; C; dt] five blocks. Empty: one block.
  int tp_split_dim = -1;
  std::vector<int64_t> tp_blocks;
  Shape full_shape;
  // Rows (dim 0 of full_shape) are the padded vocabulary: the word embeddings and the
  // output layer. The padding depends on the tensor-parallel size (Megatron's
  // _vocab_size_with_padding), so a checkpoint of another layout may hold more or fewer
  // rows; loading pads or trims them (fit_padded_vocab_rows).
  bool padded_vocab_rows = false;
  // Replicated over the tensor-parallel group but fed by this rank's sequence shard only
  // (norm weights and the router under --sequence-parallel), or by this rank's attention
  // heads only (--qk-layernorm's q_layernorm / k_layernorm, with or without SP): the
  // gradient is summed over the tensor-parallel group after backward (Megatron's
  // sequence_parallel attribute; for the q/k norms, finalize_model_grads' TP all-reduce).
  bool sequence_parallel = false;
  // A second copy of a tied weight: the word embeddings that the last pipeline stage keeps
  // for its output layer. Its gradient is summed with the first stage's, so it is left out
  // of the grad norm and of checkpoints, where the first stage's copy stands for both
  // (Megatron's `shared` attribute, param_is_not_shared).
  bool shared = false;
  // --fp8-param-gather: the compute copy `weight` is FP8 (e4m3, a view into an FP8
  // ParamAndGradBuffer), quantized from the fp32 main params after each optimizer step
  // with one per-tensor scale (DistributedAdamW::quantize_fp8_weights) and all-gathered in
  // FP8. fp8_scales [2] F32 = {scale_inv, scale} of that quantization (its own allocation:
  // cuBLASLt reads scale_inv and wants it aligned). Set by the layer that runs the
  // weight's GEMMs in FP8 (Fp8LinearGemms).
  bool fp8_param = false;
  Tensor fp8_scales;
  // Muon (--optimizer muon, optim/muon_optimizer.h) may take this param when it is 2-D
  // (muon_param). False where Megatron sets `use_muon = False`: a Mamba in_proj, which
  // then takes the scalar optimizer although it is 2-D (docs/research/muon.md 3.1).
  bool use_muon = true;
  // The fused QKV weight's rows per query group of each of Q, K and V
  // (ops::qkv_split_shapes; Megatron's is_qkv tag): Muon orthogonalises the three apart
  // unless --muon-no-split-qkv. Empty for every other param.
  std::vector<int64_t> qkv_split_rows;
  // The recipe of the initial values; under --init-model-with-meta-device `weight` and
  // `main_param` start unallocated (Tensor::unallocated) and the buffers and the optimizer
  // draw only the pieces this rank stores (model/layers.h initial_values).
  ParamInit init;
};

// A run of consecutive dim-0 rows that tensor-parallel rank `rank` of `size` holds of a
// tensor whose rows stack the blocks `blocks` (Param::tp_blocks; empty: one block of
// `rows`): rows [full_first, full_first + count) of the full tensor are rows
// [local_first, local_first + count) of the rank's slice.
struct TpRowRun {
  int64_t full_first = 0, local_first = 0, count = 0;
};
// The runs, one per block in order. InternalError when the blocks do not add up to `rows`
// or a block does not divide by `size`.
std::vector<TpRowRun> tp_row_runs(const std::vector<int64_t>& blocks, int64_t rows, int rank,
                                  int size);
// Whether Muon updates p (Megatron's routing, docs/research/muon.md section 3.1): a 2-D
// weight (p.weight's local shape) with use_muon, other than the word embeddings and the
// output layer (padded_vocab_rows). Everything else takes the scalar optimizer.
inline bool muon_param(const Param& p) {
  return p.use_muon && p.weight.ndim() == 2 && !p.padded_vocab_rows;
}

// {n / 2, n / 2}: a SwiGLU fc1's [gate; up] blocks of n rows in all.
inline std::vector<int64_t> swiglu_blocks(int64_t n) { return {n / 2, n / 2}; }

}  // namespace megaton
