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

// --weight-decay-incr-style: how the weight decay goes from --start-weight-decay to
// --end-weight-decay over the run.
enum class WeightDecayIncrStyle : uint8_t { Constant, Linear, Cosine };
// Megatron's spelling: "constant", "linear", "cosine". Throws megaton::Error naming
// --weight-decay-incr-style and the valid values on anything else.
WeightDecayIncrStyle parse_weight_decay_incr_style(std::string_view name);

// The schedule's settings. Lengths are in Megatron's scheduler steps, which are samples
// (OptimizerParamScheduler counts them: each applied update adds the iteration's global
// batch size): iteration flags become samples by multiplying by the global batch size, as
// Megatron's get_optimizer_param_scheduler does (train/args/optimizer_flags.cpp).
struct LRScheduleConfig {
  double lr = 0.0;              // --lr: peak (max) learning rate
  double min_lr = 0.0;          // --min-lr: floor after decay
  double lr_warmup_init = 0.0;  // --lr-warmup-init: learning rate at step 0 of warmup
  // Warmup length: --lr-warmup-iters x batch, --lr-warmup-samples, or --lr-warmup-fraction
  // x lr_decay_steps (so not always an integer).
  double lr_warmup_steps = 0;
  int64_t lr_decay_steps = 0;  // --lr-decay-iters x batch or --lr-decay-samples (default: the run)
  LRDecayStyle lr_decay_style = LRDecayStyle::Linear;             // --lr-decay-style
  WSDDecayStyle lr_wsd_decay_style = WSDDecayStyle::Exponential;  // --lr-wsd-decay-style
  int64_t lr_wsd_decay_steps = -1;  // --lr-wsd-decay-iters x batch or --lr-wsd-decay-samples
  // Weight decay from start_weight_decay to end_weight_decay over wd_incr_steps (the run's
  // samples); both --weight-decay under the constant style (Megatron's arguments.py).
  double start_weight_decay = 0.01;
  double end_weight_decay = 0.01;
  WeightDecayIncrStyle weight_decay_incr_style = WeightDecayIncrStyle::Constant;
  int64_t wd_incr_steps = 0;
};

// Checks what Megatron's scheduler asserts, in samples: 0 <= min_lr <= lr,
// lr_warmup_init <= lr, lr_decay_steps > 0, 0 <= lr_warmup_steps < lr_decay_steps, for WSD
// 0 < lr_wsd_decay_steps <= lr_decay_steps, weight decays >= 0 and equal under the constant
// style, wd_incr_steps > 0. Throws megaton::Error naming the schedule's part; the flags'
// own checks (train/args/optimizer_flags.cpp) come first and name the flags.
void validate(const LRScheduleConfig& config);

// Learning rate after `num_steps` scheduler steps (samples of the updates already applied:
// the first update of a run uses 0), Megatron's OptimizerParamScheduler.get_lr. Computed
// in fp64 like Megatron's Python floats. Does not validate; call validate() once.
double learning_rate(const LRScheduleConfig& config, int64_t num_steps);
// Weight decay after `num_steps` scheduler steps, Megatron's get_wd: end_weight_decay past
// wd_incr_steps; otherwise start + coeff x (end - start), coeff = ratio (linear) or
// 0.5 (cos(pi (1 - ratio)) + 1) (cosine), ratio = num_steps / wd_incr_steps.
double weight_decay(const LRScheduleConfig& config, int64_t num_steps);

}  // namespace megaton::optim
