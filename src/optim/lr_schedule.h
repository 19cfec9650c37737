// Learning-rate schedules: warmup then constant, linear, cosine, inverse-square-root or WSD
// decay, as Megatron-LM's OptimizerParamScheduler.get_lr.
#pragma once
#include <cstdint>
#include <string_view>

namespace megaton::optim {

// --lr-decay-style.
enum class LRDecayStyle : uint8_t { Constant, Linear, Cosine, InverseSquareRoot, WSD };
// --lr-wsd-decay-style: the annealing shape of the last --lr-wsd-decay-iters of a WSD run.
enum class WSDDecayStyle : uint8_t { Exponential, Linear, Cosine, MinusSqrt };

// Megatron's spelling: "constant", "linear", "cosine", "inverse-square-root", "WSD".
// Throws megaton::Error naming --lr-decay-style and the valid values on anything else.
LRDecayStyle parse_lr_decay_style(std::string_view name);
std::string_view lr_decay_style_name(LRDecayStyle style);
// Megatron's spelling: "exponential", "linear", "cosine", "minus_sqrt". Throws
// megaton::Error naming --lr-wsd-decay-style and the valid values on anything else.
WSDDecayStyle parse_wsd_decay_style(std::string_view name);
std::string_view wsd_decay_style_name(WSDDecayStyle style);

// The schedule's settings, in iterations (optimizer steps). Defaults are Megatron's
// argument defaults, except lr_decay_iters whose default (--train-iters) the caller fills.
struct LRScheduleConfig {
  double lr = 0.0;              // --lr: peak (max) learning rate
  double min_lr = 0.0;          // --min-lr: floor after decay
  double lr_warmup_init = 0.0;  // --lr-warmup-init: learning rate at step 0 of warmup
  int64_t lr_warmup_iters = 0;  // --lr-warmup-iters
  int64_t lr_decay_iters = 0;   // --lr-decay-iters (Megatron: defaults to --train-iters)
  LRDecayStyle lr_decay_style = LRDecayStyle::Linear;             // --lr-decay-style
  WSDDecayStyle lr_wsd_decay_style = WSDDecayStyle::Exponential;  // --lr-wsd-decay-style
  int64_t lr_wsd_decay_iters = -1;  // --lr-wsd-decay-iters; required (>= 0) for WSD
};

// Checks what Megatron's scheduler asserts: 0 <= min_lr <= lr, lr_warmup_init <= lr,
// lr_decay_iters > 0, 0 <= lr_warmup_iters < lr_decay_iters, and for WSD
// 0 < lr_wsd_decay_iters <= lr_decay_iters. Throws megaton::Error naming the flag.
void validate(const LRScheduleConfig& config);

// Learning rate for `step` = the number of optimizer steps already taken (Megatron's
// num_steps counted in iterations: the first update of a run uses step 0, the update of
// iteration i uses step i - 1). Computed in fp64 like Megatron's Python floats. Does not
// validate; call validate() once when the config is built.
double learning_rate(const LRScheduleConfig& config, int64_t step);

}  // namespace megaton::optim
