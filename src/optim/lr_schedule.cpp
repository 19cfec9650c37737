// Learning-rate schedules (Megatron-LM optimizer_param_scheduler.py, get_lr).
#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace megaton::optim {

LRDecayStyle parse_lr_decay_style(std::string_view name) {
  if (name == "constant") return LRDecayStyle::Constant;
  if (name == "linear") return LRDecayStyle::Linear;
  if (name == "cosine") return LRDecayStyle::Cosine;
  if (name == "inverse-square-root") return LRDecayStyle::InverseSquareRoot;
  if (name == "WSD") return LRDecayStyle::WSD;
  fail(
      "--lr-decay-style: unknown style '{}' (expected constant, linear, cosine, "
      "inverse-square-root or WSD)",
      name);
}

std::string_view lr_decay_style_name(LRDecayStyle style) {
  switch (style) {
    case LRDecayStyle::Constant:
      return "constant";
    case LRDecayStyle::Linear:
      return "linear";
    case LRDecayStyle::Cosine:
      return "cosine";
    case LRDecayStyle::InverseSquareRoot:
      return "inverse-square-root";
    case LRDecayStyle::WSD:
      return "WSD";
  }
  return "?";
}

WSDDecayStyle parse_wsd_decay_style(std::string_view name) {
  if (name == "exponential") return WSDDecayStyle::Exponential;
  if (name == "linear") return WSDDecayStyle::Linear;
  if (name == "cosine") return WSDDecayStyle::Cosine;
  if (name == "minus_sqrt") return WSDDecayStyle::MinusSqrt;
  fail(
      "--lr-wsd-decay-style: unknown style '{}' (expected exponential, linear, cosine or "
      "minus_sqrt)",
      name);
}

std::string_view wsd_decay_style_name(WSDDecayStyle style) {
  switch (style) {
    case WSDDecayStyle::Exponential:
      return "exponential";
    case WSDDecayStyle::Linear:
      return "linear";
    case WSDDecayStyle::Cosine:
      return "cosine";
    case WSDDecayStyle::MinusSqrt:
      return "minus_sqrt";
  }
  return "?";
}

WeightDecayIncrStyle parse_weight_decay_incr_style(std::string_view name) {
  if (name == "constant") return WeightDecayIncrStyle::Constant;
  if (name == "linear") return WeightDecayIncrStyle::Linear;
  if (name == "cosine") return WeightDecayIncrStyle::Cosine;
  fail("--weight-decay-incr-style: unknown style '{}' (expected constant, linear or cosine)", name);
}

void validate(const LRScheduleConfig& c) {
  if (!(c.min_lr >= 0.0)) fail("--min-lr: {} must be >= 0", c.min_lr);
  if (!(c.lr >= c.min_lr)) fail("--lr: {} must be >= --min-lr ({})", c.lr, c.min_lr);
  if (!(c.lr_warmup_init <= c.lr))
    fail("--lr-warmup-init: {} must be <= --lr ({})", c.lr_warmup_init, c.lr);
  if (c.lr_decay_steps <= 0)
    fail(
        "--lr-decay-iters/--lr-decay-samples: the decay ({} samples) must be longer than 0 "
        "(it defaults to the run)",
        c.lr_decay_steps);
  if (!(c.lr_warmup_steps >= 0 && c.lr_warmup_steps < double(c.lr_decay_steps)))
    fail(
        "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction: the warmup ({} samples) "
        "must be shorter than the decay, --lr-decay-iters/--lr-decay-samples ({} samples)",
        c.lr_warmup_steps, c.lr_decay_steps);
  if (c.lr_decay_style == LRDecayStyle::WSD &&
      (c.lr_wsd_decay_steps <= 0 || c.lr_wsd_decay_steps > c.lr_decay_steps))
    fail(
        "--lr-wsd-decay-iters/--lr-wsd-decay-samples: the WSD decay ({} samples) must be in "
        "(0, {}] (the decay) with --lr-decay-style WSD",
        c.lr_wsd_decay_steps, c.lr_decay_steps);
  if (!(c.start_weight_decay >= 0 && c.end_weight_decay >= 0))
    fail("--start-weight-decay and --end-weight-decay must be >= 0 (got {} and {})",
         c.start_weight_decay, c.end_weight_decay);
  if (c.weight_decay_incr_style == WeightDecayIncrStyle::Constant &&
      c.start_weight_decay != c.end_weight_decay)
    fail(
        "--weight-decay-incr-style constant needs equal start and end weight decays (got {} "
        "and {})",
        c.start_weight_decay, c.end_weight_decay);
  if (c.wd_incr_steps <= 0)
    fail("weight-decay schedule: the run ({} samples) must be longer than 0", c.wd_incr_steps);
}

double weight_decay(const LRScheduleConfig& c, int64_t num_steps) {
  MEGATON_CHECK(num_steps >= 0, "weight decay asked for step {}", num_steps);
  if (num_steps > c.wd_incr_steps) return c.end_weight_decay;
  if (c.weight_decay_incr_style == WeightDecayIncrStyle::Constant) return c.end_weight_decay;
  const double ratio = double(num_steps) / double(c.wd_incr_steps);
  const double coeff = c.weight_decay_incr_style == WeightDecayIncrStyle::Linear
                           ? ratio
                           : 0.5 * (std::cos(std::numbers::pi * (1 - ratio)) + 1.0);
  return c.start_weight_decay + coeff * (c.end_weight_decay - c.start_weight_decay);
}

double learning_rate(const LRScheduleConfig& c, int64_t step) {
  MEGATON_CHECK(step >= 0, "learning rate asked for step {}", step);
  const double max_lr = c.lr, min_lr = c.min_lr;
  // Linear warmup from lr_warmup_init, step 0 included (Megatron's `<=`).
  if (c.lr_warmup_steps > 0 && double(step) <= c.lr_warmup_steps)
    return c.lr_warmup_init + (max_lr - c.lr_warmup_init) * double(step) / c.lr_warmup_steps;
  if (c.lr_decay_style == LRDecayStyle::Constant) return max_lr;
  if (step > c.lr_decay_steps) return min_lr;
  if (c.lr_decay_style == LRDecayStyle::InverseSquareRoot) {
    double warmup = std::max(c.lr_warmup_steps, 1.0);
    double steps = double(std::max<int64_t>(step, 1));
    return std::max(min_lr, max_lr * std::sqrt(warmup) / std::sqrt(steps));
  }
  double decay_ratio =
      (double(step) - c.lr_warmup_steps) / (double(c.lr_decay_steps) - c.lr_warmup_steps);
  MEGATON_CHECK(decay_ratio >= 0.0 && decay_ratio <= 1.0, "decay ratio {} at step {}", decay_ratio,
                step);
  double coeff = 0.0;
  switch (c.lr_decay_style) {
    case LRDecayStyle::Linear:
      coeff = 1.0 - decay_ratio;
      break;
    case LRDecayStyle::Cosine:
      coeff = 0.5 * (std::cos(std::numbers::pi * decay_ratio) + 1.0);
      break;
    case LRDecayStyle::WSD: {
      // Stable at max_lr until the last lr_wsd_decay_steps steps, then anneal.
      int64_t anneal_start = c.lr_decay_steps - c.lr_wsd_decay_steps;
      if (step <= anneal_start) {
        coeff = 1.0;
        break;
      }
      double w = double(step - anneal_start) / double(c.lr_wsd_decay_steps);
      switch (c.lr_wsd_decay_style) {
        case WSDDecayStyle::Linear:
          coeff = 1.0 - w;
          break;
        case WSDDecayStyle::Cosine:
          coeff = 0.5 * (std::cos(std::numbers::pi * w) + 1.0);
          break;
        case WSDDecayStyle::Exponential:
          coeff = 2.0 * std::pow(0.5, w) - 1.0;
          break;
        case WSDDecayStyle::MinusSqrt:
          coeff = 1.0 - std::sqrt(w);
          break;
      }
      break;
    }
    case LRDecayStyle::Constant:
    case LRDecayStyle::InverseSquareRoot:
      break;  // handled above
  }
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace megaton::optim
