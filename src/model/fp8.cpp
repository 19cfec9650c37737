// FP8 recipes of the linear layers: the operand quantizers.
#include "model/fp8.h"

#include <algorithm>

#include "core/error.h"
#include "dist/comm.h"

namespace megaton {

const char* fp8_recipe_name(Fp8Recipe recipe) {
  switch (recipe) {
    case Fp8Recipe::Delayed: return "delayed";
    case Fp8Recipe::Tensorwise: return "tensorwise";
    case Fp8Recipe::Blockwise: return "blockwise";
  }
  return "?";
}

bool Fp8Config::layer_in_fp8(int64_t layer, int64_t num_layers) const {
  if (!enabled) return false;
  if (!first_last_layers_bf16) return true;
  return layer >= num_layers_at_start_in_bf16 && layer < num_layers - num_layers_at_end_in_bf16;
}

Fp8Quantizer::Fp8Quantizer(const Fp8Config& config, Fp8Role role, Device device)
    : recipe_(config.recipe), role_(role), amax_compute_max_(config.amax_compute_max) {
  MEGATON_CHECK(config.enabled, "Fp8Quantizer without --fp8-format");
  rule_.fp8 = role == Fp8Role::GradOutput ? config.gradient_dtype() : config.forward_dtype();
  // The margin is the delayed recipe's: TE's current and block scaling have none.
  rule_.margin = config.recipe == Fp8Recipe::Delayed ? float(config.margin) : 0.0f;
  // Transformer Engine's Float8BlockScaling uses power-of-two scales for every operand;
  // its per-tensor recipes do not.
  rule_.power_of_2 = config.recipe == Fp8Recipe::Blockwise;
  if (recipe_ == Fp8Recipe::Blockwise) return;  // the scales live with each quantized copy
  const int64_t rows = recipe_ == Fp8Recipe::Delayed ? config.amax_history_len : 1;
  amax_history_ = Tensor::zeros({rows, 1}, DType::F32, device);
  ones_ = Tensor::empty({2}, DType::F32, device);
  ones_.fill(1.0f);
  scales_ = Tensor::empty({2}, DType::F32, device);
  scales_.copy_from(ones_);
  scale_inv_ = scales_.rows(0, 1);  // first: cuBLASLt reads it and wants it aligned
  scale_ = scales_.rows(1, 1);
}

namespace {
// x viewed as [numel / C, C], C its last dimension (the quantize ops' 2-d view).
Tensor rows_by_last_dim(const Tensor& x) {
  const int64_t cols = x.dim(-1);
  return x.view({x.numel() / std::max<int64_t>(cols, 1), cols});
}
}  // namespace

Fp8Tensor Fp8Quantizer::quantize_blockwise(const Tensor& x2, bool columnwise) const {
  const int64_t rows = x2.dim(0), cols = x2.dim(1);
  const Device device = x2.device();
  const int64_t block_rows = role_ == Fp8Role::Weight ? 128 : 1;
  Fp8Tensor out;
  // The op always writes the row-wise copy.
  out.data = Tensor::empty({rows, cols}, rule_.fp8, device);
  out.scale_inv =
      Tensor::empty({(rows + block_rows - 1) / block_rows, (cols + 127) / 128}, DType::F32, device);
  if (columnwise) {
    out.data_t = Tensor::empty({cols, rows}, rule_.fp8, device);
    out.scale_inv_t = block_rows == 128
                          ? Tensor::empty({out.scale_inv.dim(1), out.scale_inv.dim(0)}, DType::F32, device)
                          : Tensor::empty({cols, (rows + 127) / 128}, DType::F32, device);
  }
  ops::fp8_quantize_blockwise(x2, block_rows, rule_, out.data, out.scale_inv, out.data_t,
                              out.scale_inv_t);
  return out;
}

Fp8Tensor Fp8Quantizer::quantize(const Tensor& x, bool rowwise, bool columnwise,
                                 const Fp8AmaxGroup& reduce_over) {
  MEGATON_CHECK(rowwise || columnwise, "Fp8Quantizer::quantize: nothing asked for");
  const Tensor x2 = rows_by_last_dim(x);
  const int64_t rows = x2.dim(0), cols = x2.dim(1);
  const Device device = x.device();
  if (recipe_ == Fp8Recipe::Blockwise) {
    Fp8Tensor out = quantize_blockwise(x2, columnwise);
    if (!rowwise) out.data = out.scale_inv = Tensor();
    return out;
  }
  Fp8Tensor out;
  // The quantize op always writes the row-wise copy; it is dropped when not asked for.
  out.data = Tensor::empty({rows, cols}, rule_.fp8, device);
  if (columnwise) out.data_t = Tensor::empty({cols, rows}, rule_.fp8, device);

  MEGATON_CHECK(initialized(), "Fp8Quantizer::quantize before construction");
  const bool reduce = reduce_over.active();
  Tensor amax_slot = amax_history_.rows(0, 1).view({1});
  Tensor no_amax;
  // This quantization's {scale_inv, scale}, its own: the GEMM reads the factor after the
  // next quantization may have changed the quantizer's (the weight's copy is used again in
  // backward). One copy of two floats per quantization. scale_inv comes first, at the
  // allocation's start: cuBLASLt refuses a scale pointer 4 bytes into one ("not
  // supported", measured on an H200).
  Tensor scales = Tensor::empty({2}, DType::F32, device);
  Tensor scale_inv = scales.rows(0, 1), scale = scales.rows(1, 1);
  if (recipe_ == Fp8Recipe::Delayed) {
    // The amax recorded at the previous quantization becomes the scale of this one; the
    // history then rolls and row 0 takes this x's amax, agreed over the group at once so
    // that the state (checkpoints) is the whole tensor's on every rank.
    ops::fp8_delayed_scaling_update(amax_history_, rule_, amax_compute_max_, scale_, scale_inv_);
    scales.copy_from(scales_);
    ops::fp8_quantize(x2, scale, out.data, out.data_t, amax_slot);
    if (reduce) reduce_over.comm->all_reduce(amax_slot, *reduce_over.group, dist::ReduceOp::Max);
  } else {  // tensorwise: this tensor's own amax
    ops::fp8_amax(x2, amax_slot);
    if (reduce) reduce_over.comm->all_reduce(amax_slot, *reduce_over.group, dist::ReduceOp::Max);
    scales.copy_from(ones_);  // an all-zero tensor keeps scale 1 (fp8_update_scale)
    ops::fp8_update_scale(amax_slot, rule_, scale, scale_inv);
    ops::fp8_quantize(x2, scale, out.data, out.data_t, no_amax);
  }
  out.scale_inv = scale_inv;
  out.scale_inv_t = scale_inv;
  if (!rowwise) out.data = Tensor();
  if (!columnwise) out.scale = scale;  // requantize_columnwise may need it later
  return out;
}

Fp8Tensor Fp8Quantizer::requantize_columnwise(const Tensor& x, const Fp8Tensor& earlier) const {
  const Tensor x2 = rows_by_last_dim(x);
  if (recipe_ == Fp8Recipe::Blockwise) {
    Fp8Tensor out = quantize_blockwise(x2, true);
    out.data = out.scale_inv = Tensor();
    return out;
  }
  MEGATON_CHECK(earlier.scale.defined() && earlier.scale_inv.defined(),
                "Fp8Quantizer::requantize_columnwise: the earlier quantization kept no scale");
  const int64_t rows = x2.dim(0), cols = x2.dim(1);
  Tensor rowwise = Tensor::empty({rows, cols}, rule_.fp8, x.device());  // written, dropped
  Fp8Tensor out;
  out.data_t = Tensor::empty({cols, rows}, rule_.fp8, x.device());
  Tensor no_amax;
  ops::fp8_quantize(x2, earlier.scale, rowwise, out.data_t, no_amax);
  out.scale_inv_t = earlier.scale_inv;
  return out;
}

}  // namespace megaton
