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

void validate(const LRScheduleConfig& c) {
  if (!(c.min_lr >= 0.0)) fail("--min-lr: {} must be >= 0", c.min_lr);
  if (!(c.lr >= c.min_lr)) fail("--lr: {} must be >= --min-lr ({})", c.lr, c.min_lr);
  if (!(c.lr_warmup_init <= c.lr))
    fail("--lr-warmup-init: {} must be <= --lr ({})", c.lr_warmup_init, c.lr);
  if (c.lr_decay_iters <= 0)
    fail("--lr-decay-iters: {} must be > 0 (it defaults to --train-iters)", c.lr_decay_iters);
  if (c.lr_warmup_iters < 0) fail("--lr-warmup-iters: {} must be >= 0", c.lr_warmup_iters);
  if (c.lr_warmup_iters >= c.lr_decay_iters)
    fail("--lr-warmup-iters: {} must be < --lr-decay-iters ({})", c.lr_warmup_iters,
         c.lr_decay_iters);
  if (c.lr_decay_style == LRDecayStyle::WSD &&
      (c.lr_wsd_decay_iters <= 0 || c.lr_wsd_decay_iters > c.lr_decay_iters))
    fail(
        "--lr-wsd-decay-iters: {} must be in (0, --lr-decay-iters = {}] with "
        "--lr-decay-style WSD",
        c.lr_wsd_decay_iters, c.lr_decay_iters);
}

double learning_rate(const LRScheduleConfig& c, int64_t step) {
  MEGATON_CHECK(step >= 0, "learning rate asked for step {}", step);
  const double max_lr = c.lr, min_lr = c.min_lr;
  // Linear warmup from lr_warmup_init, step 0 included (Megatron's `<=`).
  if (c.lr_warmup_iters > 0 && step <= c.lr_warmup_iters)
    return c.lr_warmup_init +
           (max_lr - c.lr_warmup_init) * double(step) / double(c.lr_warmup_iters);
  if (c.lr_decay_style == LRDecayStyle::Constant) return max_lr;
  if (step > c.lr_decay_iters) return min_lr;
  if (c.lr_decay_style == LRDecayStyle::InverseSquareRoot) {
    double warmup = double(std::max<int64_t>(c.lr_warmup_iters, 1));
    double steps = double(std::max<int64_t>(step, 1));
    return std::max(min_lr, max_lr * std::sqrt(warmup) / std::sqrt(steps));
  }
  double decay_ratio =
      double(step - c.lr_warmup_iters) / double(c.lr_decay_iters - c.lr_warmup_iters);
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
      // Stable at max_lr until the last lr_wsd_decay_iters steps, then anneal.
      int64_t anneal_start = c.lr_decay_iters - c.lr_wsd_decay_iters;
      if (step <= anneal_start) {
        coeff = 1.0;
        break;
      }
      double w = double(step - anneal_start) / double(c.lr_wsd_decay_iters);
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
