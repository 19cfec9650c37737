// GradScaler: the loss scale of fp16 (and optionally bf16) training, Megatron's
// ConstantGradScaler and DynamicGradScaler (megatron/core/optimizer/grad_scaler.py).
//
// The backward pass starts from the loss times scale(), so the gradients reach the main
// grads multiplied by it (small fp16 gradients stay above fp16's underflow); the
// optimizer divides them by it. A step whose gradients hold inf or NaN (fp16 overflowed)
// is skipped and reported to update(), which may lower the scale; a run of clean steps
// raises it. docs/memory.md, "fp16 and loss scaling".
#pragma once
#include <cstdint>

namespace megaton::optim {

// Megatron's flags (arguments.py, "mixed precision") and their defaults; growth and
// backoff factors are Megatron's fixed 2 and 0.5 (optimizer/__init__.py).
struct GradScalerConfig {
  // --loss-scale: a static scale (ConstantGradScaler); 0: not given, dynamic under --fp16.
  double loss_scale = 0;
  double initial_loss_scale = 4294967296.0;  // --initial-loss-scale, 2^32
  double min_loss_scale = 1.0;               // --min-loss-scale
  int64_t loss_scale_window = 1000;          // --loss-scale-window (growth interval)
  int64_t hysteresis = 2;                    // --hysteresis
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
};

class GradScaler {
 public:
  // The scaler Megatron's get_megatron_optimizer builds: static (loss_scale > 0), else
  // dynamic when `dynamic` (fp16), else none (a scale of 1 that never changes: bf16 and
  // fp32 runs). megaton::Error (exit 2) naming the flag when the dynamic settings break
  // DynamicGradScaler's assertions: initial and min scale > 0, min <= initial, window
  // and hysteresis >= 1.
  GradScaler(const GradScalerConfig& config, bool dynamic);

  // The current loss scale (fp32, as Megatron keeps it in a float tensor).
  float scale() const { return scale_; }
  // 1 / scale() computed in fp64 then rounded to fp32 (Megatron's inv_scale).
  float inv_scale() const { return float(1.0 / double(scale_)); }
  bool dynamic() const { return dynamic_; }
  // Whether the loss is scaled at all (a static scale or dynamic).
  bool active() const { return dynamic_ || config_.loss_scale > 0; }

  // DynamicGradScaler.update: after a step with non-finite gradients (found_inf) the growth
  // tracker restarts and the hysteresis tracker drops by one; at zero or below the scale is
  // multiplied by the backoff factor (at least min_loss_scale). After a clean step the
  // growth tracker counts up; at loss_scale_window it restarts, the hysteresis tracker is
  // refilled, and the scale is multiplied by the growth factor. As in Megatron, a clean
  // step does not refill the hysteresis tracker: only a growth does. Unlike Megatron, a
  // growth that would reach inf keeps the scale. Nothing for a static scale or none.
  void update(bool found_inf);

  // Checkpoint state (Megatron's state_dict: scale, growth_tracker, hysteresis_tracker).
  struct State {
    float scale = 1.0f;
    int64_t growth_tracker = 0;
    int64_t hysteresis_tracker = 0;
  };
  State state() const { return {scale_, growth_tracker_, hysteresis_tracker_}; }
  // Restores a dynamic scaler's state (ignored by a static scaler or none, as Megatron's
  // ConstantGradScaler ignores its state dict). megaton::Error naming `source` when the
  // scale is not a positive finite number or a tracker is negative.
  void load_state(const State& state, const char* source);

 private:
  GradScalerConfig config_;
  bool dynamic_ = false;
  float scale_ = 1.0f;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_ = 0;
};

}  // namespace megaton::optim
