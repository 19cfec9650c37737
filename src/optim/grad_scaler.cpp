// GradScaler: Megatron's constant and dynamic loss scalers.
#include "optim/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace megaton::optim {

GradScaler::GradScaler(const GradScalerConfig& config, bool dynamic) : config_(config) {
  const double fp32_max = double(std::numeric_limits<float>::max());
  if (config_.loss_scale < 0 || config_.loss_scale > fp32_max)
    fail("loss-scale must be a positive fp32 number (got {})", config_.loss_scale);
  if (config_.loss_scale > 0) {  // ConstantGradScaler, whatever the precision
    scale_ = float(config_.loss_scale);
    return;
  }
  dynamic_ = dynamic;
  if (!dynamic_) return;
  // DynamicGradScaler's assertions, as one-line errors.
  if (!(config_.initial_loss_scale > 0) || config_.initial_loss_scale > fp32_max)
    fail("initial-loss-scale must be a positive fp32 number (got {})", config_.initial_loss_scale);
  if (!(config_.min_loss_scale > 0))
    fail("min-loss-scale must be positive (got {})", config_.min_loss_scale);
  if (config_.min_loss_scale > config_.initial_loss_scale)
    fail("min-loss-scale ({}) must not exceed initial-loss-scale ({})", config_.min_loss_scale,
         config_.initial_loss_scale);
  if (config_.loss_scale_window < 1)
    fail("loss-scale-window must be at least 1 (got {})", config_.loss_scale_window);
  if (config_.hysteresis < 1) fail("hysteresis must be at least 1 (got {})", config_.hysteresis);
  scale_ = float(config_.initial_loss_scale);
  hysteresis_tracker_ = config_.hysteresis;
}

void GradScaler::update(bool found_inf) {
  if (!dynamic_) return;
  if (found_inf) {
    growth_tracker_ = 0;
    --hysteresis_tracker_;
    // torch.max(scale * backoff, min_scale) on fp32 tensors.
    if (hysteresis_tracker_ <= 0)
      scale_ = std::max(scale_ * float(config_.backoff_factor), float(config_.min_loss_scale));
    return;
  }
  if (++growth_tracker_ == config_.loss_scale_window) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = config_.hysteresis;
    // Megaton stops at fp32's largest power of two instead of growing into inf (a scale of
    // inf makes every later step NaN and skipped, for good); fp16 overflows long before.
    const float grown = scale_ * float(config_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
  }
}

void GradScaler::load_state(const State& state, const char* source) {
  if (!dynamic_) return;
  if (!(state.scale > 0) || !std::isfinite(state.scale))
    fail("checkpoint '{}': loss scale {} is not a positive finite number", source, state.scale);
  if (state.growth_tracker < 0 || state.hysteresis_tracker < 0)
    fail("checkpoint '{}': loss scaler trackers {} / {} must be >= 0", source,
         state.growth_tracker, state.hysteresis_tracker);
  scale_ = state.scale;
  growth_tracker_ = state.growth_tracker;
  hysteresis_tracker_ = state.hysteresis_tracker;
}

}  // namespace megaton::optim
