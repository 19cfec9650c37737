// FP8 execution of the linear layers' GEMMs: Transformer Engine's recipes (per-tensor
// delayed and current scaling, DeepSeek-V3 blockwise scaling) on top of ops/fp8.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/comm.h"
#include "model/fp8_config.h"
#include "ops/fp8.h"

namespace megaton {

// A quantized operand: its row-wise copy (the tensor as laid out) and/or its column-wise
// copy (the transpose), each with the dequantization factors the FP8 GEMM reads
// (ops::fp8_gemm). Per-tensor recipes share one scale_inv [1] between the two copies.
struct Fp8Tensor {
  Tensor data;         // [R, C] FP8, undefined when the row-wise copy was not asked for
  Tensor scale_inv;    // F32: [1], or the blockwise [R / block_rows, C / 128]
  Tensor data_t;       // [C, R] FP8, undefined when the column-wise copy was not asked for
  Tensor scale_inv_t;  // F32: [1], or the blockwise scales of data_t
  Tensor scale;        // F32 [1]: the per-tensor scale used (undefined for blockwise)
  bool defined() const { return data.defined() || data_t.defined(); }
};

// What a GEMM operand is, which fixes its FP8 dtype and its blockwise block shape.
enum class Fp8Role {
  Input,       // a layer's input activation: e4m3, 1x128 blocks
  Weight,      // e4m3, 128x128 blocks
  GradOutput,  // the gradient of a layer's output: e5m2 under hybrid, 1x128 blocks
};

// The ranks over which a sharded operand's amax is reduced (max) before its scale is
// chosen: the tensor-parallel group of a TP-sharded weight, input or gradient, the
// expert-tensor-parallel group of an expert's. Default (no comm): no reduction.
struct Fp8AmaxGroup {
  dist::Comm* comm = nullptr;
  const dist::Group* group = nullptr;
  bool active() const { return comm != nullptr && group != nullptr && group->size() > 1; }
};

// One operand's quantization state across steps (each FP8 Linear has one per role):
// delayed scaling's amax history and scale; current scaling's scale of this step.
class Fp8Quantizer {
 public:
  Fp8Quantizer() = default;
  Fp8Quantizer(const Fp8Config& config, Fp8Role role, Device device);

  // Quantizes x [R, C] (F32 or BF16; higher ranks viewed as [numel / C, C]):
  // rowwise -> data [R, C], columnwise -> data_t [C, R]. Under a per-tensor recipe the
  // amax is the max over `reduce_over` (when active), so that a tensor-parallel shard
  // gets the scale the one-rank run gives the whole tensor (Transformer Engine reduces
  // amaxes over the same group). Delayed scaling first turns
  // the amax recorded at this operand's previous quantization into its scale
  // (ops::fp8_delayed_scaling_update), then records x's amax for the next one; the first
  // quantization uses scale 1, as TE does.
  Fp8Tensor quantize(const Tensor& x, bool rowwise, bool columnwise,
                     const Fp8AmaxGroup& reduce_over = {});
  // The column-wise copy of an x that an earlier quantize() saw (`earlier` is what it
  // returned) and the caller did not keep: a recomputed activation. It equals the copy that
  // quantize() would have written: the same scale (per-tensor recipes), the same blocks
  // (blockwise, which has no state); the history is not touched.
  Fp8Tensor requantize_columnwise(const Tensor& x, const Fp8Tensor& earlier) const;

  // quantize(x[i], rowwise, columnwise, reduce_over) by quantizers[i] for every i (one
  // recipe for all): the same results, with one launch per step for all entries under the
  // per-tensor recipes (ops::fp8_*_multi: the MoE experts' operands); blockwise
  // quantizes entry by entry. Every x[i] is 2-d with numel > 0.
  static std::vector<Fp8Tensor> quantize_multi(const std::vector<Fp8Quantizer*>& quantizers,
                                               const std::vector<Tensor>& x, bool rowwise,
                                               bool columnwise, const Fp8AmaxGroup& reduce_over = {});
  // requantize_columnwise(x[i], earlier[i]) by quantizers[i] for every i, likewise batched.
  static std::vector<Fp8Tensor> requantize_columnwise_multi(
      const std::vector<const Fp8Quantizer*>& quantizers, const std::vector<Tensor>& x,
      const std::vector<Fp8Tensor>& earlier);

  bool initialized() const { return scale_.defined(); }
  bool delayed() const { return initialized() && recipe_ == Fp8Recipe::Delayed; }
  // Delayed scaling state (checkpoints): amax history [L, 1], {scale_inv, scale} [2].
  Tensor& amax_history() { return amax_history_; }
  Tensor& scales() { return scales_; }

 private:
  // The blockwise quantization of x2 [R, C] (both copies when columnwise), with its scales.
  Fp8Tensor quantize_blockwise(const Tensor& x2, bool columnwise) const;

  Fp8Recipe recipe_ = Fp8Recipe::Delayed;
  Fp8Role role_ = Fp8Role::Input;
  ops::Fp8ScaleRule rule_;
  bool amax_compute_max_ = false;
  Tensor amax_history_;  // [L, 1] (delayed) or [1, 1] (tensorwise: this step's amax)
  Tensor scales_;            // [2]: the delayed recipe's {scale_inv, scale}
  Tensor scale_, scale_inv_;  // its rows
  Tensor ones_;               // [2] = {1, 1}: current scaling starts each scale from it
};

}  // namespace megaton
