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

std::vector<Fp8Tensor> Fp8Quantizer::quantize_multi(const std::vector<Fp8Quantizer*>& quantizers,
                                                    const std::vector<Tensor>& x, bool rowwise,
                                                    bool columnwise, const Fp8AmaxGroup& reduce_over) {
  MEGATON_CHECK(quantizers.size() == x.size(), "Fp8Quantizer::quantize_multi: {} quantizers, {} tensors",
                quantizers.size(), x.size());
  std::vector<Fp8Tensor> out(x.size());
  if (x.empty()) return out;
  const Fp8Recipe recipe = quantizers[0]->recipe_;
  if (recipe == Fp8Recipe::Blockwise) {  // no state and one launch per tensor already
    for (size_t i = 0; i < x.size(); ++i)
      out[i] = quantizers[i]->quantize(x[i], rowwise, columnwise, reduce_over);
    return out;
  }
  MEGATON_CHECK(rowwise || columnwise, "Fp8Quantizer::quantize_multi: nothing asked for");
  const size_t n = x.size();
  const Device device = x[0].device();
  const DType fp8 = quantizers[0]->rule_.fp8;
  // Each quantization's own {scale_inv, scale} (see quantize): row i of one [n, 4] block,
  // 16 bytes apart, as cuBLASLt and the grouped GEMM want the factors aligned.
  Tensor scales = Tensor::empty({int64_t(n), 4}, DType::F32, device);
  std::vector<Tensor> scale(n), scale_inv(n), amax(n), data(n), data_t(n), none(n);
  for (size_t i = 0; i < n; ++i) {
    Fp8Quantizer& q = *quantizers[i];
    MEGATON_CHECK(q.initialized() && q.recipe_ == recipe && q.rule_.fp8 == fp8,
                  "Fp8Quantizer::quantize_multi: quantizers of different recipes or formats");
    MEGATON_CHECK(x[i].ndim() == 2 && x[i].numel() > 0, "Fp8Quantizer::quantize_multi: entry {} is {}",
                  i, shape_str(x[i].shape()));
    Tensor row = scales.rows(int64_t(i), 1).view({4});
    scale_inv[i] = row.rows(0, 1);
    scale[i] = row.rows(1, 1);
    amax[i] = q.amax_history_.rows(0, 1).view({1});
    data[i] = Tensor::empty(x[i].shape(), fp8, device);
    if (columnwise) data_t[i] = Tensor::empty({x[i].dim(1), x[i].dim(0)}, fp8, device);
  }
  const auto reduce = [&] {
    if (reduce_over.active())
      for (Tensor& slot : amax) reduce_over.comm->all_reduce(slot, *reduce_over.group, dist::ReduceOp::Max);
  };
  if (recipe == Fp8Recipe::Delayed) {
    // As quantize: last quantization's amax -> this one's scale; then this amax recorded.
    std::vector<Tensor> histories(n), own_scale(n), own_scale_inv(n);
    for (size_t i = 0; i < n; ++i) {
      histories[i] = quantizers[i]->amax_history_;
      own_scale[i] = quantizers[i]->scale_;
      own_scale_inv[i] = quantizers[i]->scale_inv_;
    }
    ops::fp8_delayed_scaling_update_multi(histories, quantizers[0]->rule_,
                                          quantizers[0]->amax_compute_max_, own_scale, own_scale_inv);
    for (size_t i = 0; i < n; ++i)
      scales.rows(int64_t(i), 1).view({4}).rows(0, 2).copy_from(quantizers[i]->scales_);
    ops::fp8_quantize_multi(x, scale, data, data_t, amax);
    reduce();
  } else {  // tensorwise
    ops::fp8_amax_multi(x, amax);
    reduce();
    scales.fill(1.0f);  // an all-zero tensor keeps scale 1 (fp8_update_scale)
    ops::fp8_update_scale_multi(amax, quantizers[0]->rule_, scale, scale_inv);
    ops::fp8_quantize_multi(x, scale, data, data_t, none);
  }
  for (size_t i = 0; i < n; ++i) {
    out[i].data = rowwise ? data[i] : Tensor();
    out[i].data_t = data_t[i];
    out[i].scale_inv = out[i].scale_inv_t = scale_inv[i];
    if (!columnwise) out[i].scale = scale[i];  // requantize_columnwise may need it later
  }
  return out;
}

std::vector<Fp8Tensor> Fp8Quantizer::requantize_columnwise_multi(
    const std::vector<const Fp8Quantizer*>& quantizers, const std::vector<Tensor>& x,
    const std::vector<Fp8Tensor>& earlier) {
  MEGATON_CHECK(quantizers.size() == x.size() && earlier.size() == x.size(),
                "Fp8Quantizer::requantize_columnwise_multi: {} quantizers, {} tensors, {} earlier",
                quantizers.size(), x.size(), earlier.size());
  std::vector<Fp8Tensor> out(x.size());
  if (x.empty()) return out;
  if (quantizers[0]->recipe_ == Fp8Recipe::Blockwise) {
    for (size_t i = 0; i < x.size(); ++i) out[i] = quantizers[i]->requantize_columnwise(x[i], earlier[i]);
    return out;
  }
  const size_t n = x.size();
  std::vector<Tensor> scale(n), rowwise(n), data_t(n), none(n);
  for (size_t i = 0; i < n; ++i) {
    MEGATON_CHECK(earlier[i].scale.defined() && earlier[i].scale_inv.defined(),
                  "Fp8Quantizer::requantize_columnwise_multi: entry {} kept no scale", i);
    const DType fp8 = quantizers[i]->rule_.fp8;
    scale[i] = earlier[i].scale;
    rowwise[i] = Tensor::empty(x[i].shape(), fp8, x[i].device());  // written, dropped
    data_t[i] = Tensor::empty({x[i].dim(1), x[i].dim(0)}, fp8, x[i].device());
    out[i].data_t = data_t[i];
    out[i].scale_inv_t = earlier[i].scale_inv;
  }
  ops::fp8_quantize_multi(x, scale, rowwise, data_t, none);
  return out;
}

}  // namespace megaton
