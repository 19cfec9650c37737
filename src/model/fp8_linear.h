// Fp8LinearGemms: the three GEMMs of one linear layer in FP8, as Transformer Engine's
// Linear runs them, shared by Linear (model/layers.h) and the MoE experts (model/moe.h).
#pragma once
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/fp8.h"
#include "model/fp8_config.h"
#include "model/param.h"

namespace megaton {

// For y = x W^T of one linear layer (x [T, in], W [out, in], y [T, out], bf16 or fp32):
//   forward   y  = deq(q(x)) @ deq(q(W))^T          (fast accumulation: per-tensor recipes)
//   backward  dx = deq(q(dy)) @ deq(q(W^T))^T       (dx [T, in], overwritten)
//             main_grad += deq(q(dy^T)) @ deq(q(x^T))^T   (fp32 [out, in]; in bf16 with
//                                                          --no-fp8-wgrad)
// with one Fp8Quantizer per operand (input, weight, grad_output: e4m3, e4m3, and e5m2
// under hybrid), scales by config's recipe (model/fp8.h). Every GEMM dimension (T, in,
// out) must be a multiple of config.dimension_multiple() (ops::fp8_gemm raises
// InternalError otherwise; the trainer checks the flags and the MoE layer pads).
// With --fp8-param-gather the weight is already FP8 (Param::fp8_param: quantized after the
// optimizer step, all-gathered in FP8): the GEMMs read it and its fp8_scales, and
// backward transposes its bytes (ops::fp8_transpose) for W^T.
class Fp8LinearGemms {
 public:
  Fp8LinearGemms() = default;
  Fp8LinearGemms(const Fp8Config& config, Device device);
  bool enabled() const { return enabled_; }
  // Marks `weight` as kept in FP8 (Param::fp8_param, with its fp8_scales allocated) under
  // --fp8-param-gather; nothing otherwise. Called before the ParamAndGradBuffers are built.
  void adopt_weight(Param& weight) const;

  // The ranks over which each operand is split (its amax maxed over them, so that every
  // piece gets the scale of the whole tensor the one-rank run quantizes; none: this
  // rank's own): the weight shards of a tensor-parallel layer over TP; the input of a
  // row-parallel one (features split) and the output gradient of a column-parallel one
  // over TP, and under context parallelism every input and output gradient also over the
  // CP ranks (tokens split): TP x CP or CP.
  struct Sharding {
    Fp8AmaxGroup input, weight, grad_output;
  };

  // What forward keeps for backward.
  struct Saved {
    // x^T [in, T] FP8 with its scale, when forward kept the input; otherwise only its
    // scale (backward requantizes the recomputed x it is given).
    Fp8Tensor x;
    // The weight's scale: backward requantizes W^T [in, out] from the unchanged weight
    // (kept from forward it would hold a byte per parameter through the whole step).
    Fp8Tensor w;
    bool defined() const { return w.scale_inv.defined(); }
  };

  // y [T, out] (allocated by the caller, overwritten) = x W^T, W = weight.weight.
  // keep_input: save x^T (FP8) for the weight gradient; false when the caller recomputes
  // x for backward.
  Saved forward(const Tensor& x, const Param& weight, bool keep_input, const Sharding& sharding,
                Tensor& y);
  // dx [T, in] (allocated, overwritten) and main_grad [out, in] (fp32, accumulated) from dy
  // [T, out]. x() gives forward's input, called only when `saved` holds no x^T (a
  // recomputed input) or the weight gradient runs in bf16, and after dx is written.
  void backward(const Tensor& dy, const Param& weight, const Saved& saved,
                const std::function<Tensor()>& x, const Sharding& sharding, Tensor& dx,
                Tensor& main_grad);

  // The delayed recipe's state (checkpoints), by name: "<prefix>._extra_state.fp8.<operand>.
  // amax_history" [L, 1] and ".scales" [2] ({scale_inv, scale}), operand input, weight or
  // grad_output. Empty unless the delayed recipe.
  std::vector<std::pair<std::string, Tensor*>> state(const std::string& prefix);

 private:
  friend class Fp8GroupedLinearGemms;
  bool enabled_ = false, wgrad_ = false, fast_forward_ = false, param_gather_ = false;
  Fp8Quantizer input_, weight_, grad_;
};

// The same three GEMMs for G linear layers applied to consecutive row groups of one input
// (the MoE experts, Transformer Engine's GroupedLinear): group g's rows
// [r_g, r_g + group_rows[g]) of x go through W_g. Each group keeps its own quantizers
// (an Fp8LinearGemms per group: the results equal G separate Fp8LinearGemms calls). Under
// the per-tensor recipes each step runs once for all groups: ops::fp8_*_multi for the
// quantization and ops::fp8_grouped_gemm for each GEMM; blockwise runs group by group
// (cuBLASLt's block-scaled GEMM). group_rows are host counts, each a multiple of the
// recipe's dimension_multiple() (the MoE layer pads); groups of 0 rows are skipped.
class Fp8GroupedLinearGemms {
 public:
  Fp8GroupedLinearGemms() = default;
  Fp8GroupedLinearGemms(const Fp8Config& config, Device device, int64_t groups);
  bool enabled() const { return !gemms_.empty(); }
  // Fp8LinearGemms::adopt_weight for each group's weight.
  void adopt_weights(const std::vector<Param*>& weights) const;

  struct Saved {
    std::vector<Fp8LinearGemms::Saved> groups;  // one per group (empty ones for 0 rows)
  };
  // y [R, out] (allocated, overwritten) from x [R, in]; weights[g]: group g's [out, in].
  Saved forward(const Tensor& x, const std::vector<int64_t>& group_rows,
                const std::vector<const Param*>& weights, bool keep_input,
                const Fp8LinearGemms::Sharding& sharding, Tensor& y);
  // dx [R, in] (allocated, overwritten; its rows of empty groups untouched) and each
  // weights[g]->main_grad (accumulated) from dy [R, out]; x() gives forward's input when
  // `saved` holds no x^T: after dx is complete under the per-tensor recipes, after the
  // first group's rows of dx under blockwise (which runs group by group).
  void backward(const Tensor& dy, const std::vector<int64_t>& group_rows,
                const std::vector<Param*>& weights, const Saved& saved,
                const std::function<Tensor()>& x, const Fp8LinearGemms::Sharding& sharding,
                Tensor& dx);
  // Group g's delayed-recipe state (Fp8LinearGemms::state).
  std::vector<std::pair<std::string, Tensor*>> state(size_t g, const std::string& prefix) {
    return gemms_[g].state(prefix);
  }

 private:
  std::vector<Fp8LinearGemms> gemms_;
  bool per_tensor_ = true;  // not blockwise: the batched path
};

}  // namespace megaton
