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

  // Which operands are split over ranks (their amaxes reduced over `group`, so that a
  // shard gets the scale of the whole tensor): the weight shards of a tensor-parallel
  // layer, the input of a row-parallel one (its features split) and the output gradient
  // of a column-parallel one.
  struct Sharding {
    Fp8AmaxGroup group;
    bool input = false, weight = false, grad_output = false;
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
  // recomputed input) or the weight gradient runs in bf16.
  void backward(const Tensor& dy, const Param& weight, const Saved& saved,
                const std::function<Tensor()>& x, const Sharding& sharding, Tensor& dx,
                Tensor& main_grad);

  // The delayed recipe's state (checkpoints), by name: "<prefix>._extra_state.fp8.<operand>.
  // amax_history" [L, 1] and ".scales" [2] ({scale_inv, scale}), operand input, weight or
  // grad_output. Empty unless the delayed recipe.
  std::vector<std::pair<std::string, Tensor*>> state(const std::string& prefix);

 private:
  bool enabled_ = false, wgrad_ = false, fast_forward_ = false, param_gather_ = false;
  Fp8Quantizer input_, weight_, grad_;
};

}  // namespace megaton
