// Learning-rate schedules against values worked out by hand from Megatron's get_lr.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "optim/lr_schedule.h"

using namespace megaton;
using namespace megaton::optim;

namespace {

// Steps are samples (Megatron's scheduler steps); with a global batch of 1 they are
// iterations. max 1.0, min 0.1, warmup from 0.05 over 10 steps, decay ends at step 110: in the decay
// phase r = (step - 10) / 100 and lr = 0.1 + 0.9 * coeff.
LRScheduleConfig base(LRDecayStyle style) {
  LRScheduleConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.lr_warmup_init = 0.05;
  c.lr_warmup_steps = 10;
  c.lr_decay_steps = 110;
  c.lr_decay_style = style;
  c.wd_incr_steps = 110;
  return c;
}

constexpr double kTol = 1e-12;

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no megaton::Error thrown>";
}

}  // namespace

TEST(LRSchedule, WarmupIsLinearFromInitForEveryStyle) {
  for (auto style : {LRDecayStyle::Constant, LRDecayStyle::Linear, LRDecayStyle::Cosine,
                     LRDecayStyle::InverseSquareRoot, LRDecayStyle::WSD}) {
    LRScheduleConfig c = base(style);
    c.lr_wsd_decay_steps = 20;
    SCOPED_TRACE(std::string(lr_decay_style_name(style)));
    EXPECT_NEAR(learning_rate(c, 0), 0.05, kTol);
    EXPECT_NEAR(learning_rate(c, 5), 0.525, kTol);  // 0.05 + 0.95 * 5/10
    EXPECT_NEAR(learning_rate(c, 10), 1.0, kTol);   // the last warmup step reaches lr
  }
}

TEST(LRSchedule, WarmupInitDefaultsToZero) {
  LRScheduleConfig c;
  c.lr = 3e-4;
  c.lr_warmup_steps = 4;
  c.lr_decay_steps = 100;
  EXPECT_NEAR(learning_rate(c, 0), 0.0, kTol);
  EXPECT_NEAR(learning_rate(c, 1), 7.5e-5, kTol);
}

TEST(LRSchedule, Constant) {
  LRScheduleConfig c = base(LRDecayStyle::Constant);
  EXPECT_NEAR(learning_rate(c, 11), 1.0, kTol);
  EXPECT_NEAR(learning_rate(c, 60), 1.0, kTol);
  EXPECT_NEAR(learning_rate(c, 110), 1.0, kTol);
  EXPECT_NEAR(learning_rate(c, 5000), 1.0, kTol);  // constant ignores the decay end
}

TEST(LRSchedule, Linear) {
  LRScheduleConfig c = base(LRDecayStyle::Linear);
  EXPECT_NEAR(learning_rate(c, 35), 0.775, kTol);  // r = 0.25: 0.1 + 0.9 * 0.75
  EXPECT_NEAR(learning_rate(c, 60), 0.55, kTol);   // r = 0.5
  EXPECT_NEAR(learning_rate(c, 110), 0.1, kTol);   // r = 1
  EXPECT_NEAR(learning_rate(c, 111), 0.1, kTol);   // past the decay: min_lr
  EXPECT_NEAR(learning_rate(c, 10000), 0.1, kTol);
}

TEST(LRSchedule, LinearWithoutWarmupStartsAtLr) {
  LRScheduleConfig c = base(LRDecayStyle::Linear);
  c.lr_warmup_steps = 0;
  c.lr_decay_steps = 100;
  EXPECT_NEAR(learning_rate(c, 0), 1.0, kTol);
  EXPECT_NEAR(learning_rate(c, 25), 0.775, kTol);
}

TEST(LRSchedule, Cosine) {
  LRScheduleConfig c = base(LRDecayStyle::Cosine);
  // r = 0.25: coeff = (cos(pi/4) + 1) / 2 = 0.8535533905932737.
  EXPECT_NEAR(learning_rate(c, 35), 0.1 + 0.9 * 0.8535533905932737, kTol);
  EXPECT_NEAR(learning_rate(c, 60), 0.55, kTol);  // r = 0.5: coeff 0.5
  // r = 0.75: coeff = (1 - cos(pi/4)) / 2 = 0.14644660940672624.
  EXPECT_NEAR(learning_rate(c, 85), 0.1 + 0.9 * 0.14644660940672624, kTol);
  EXPECT_NEAR(learning_rate(c, 110), 0.1, kTol);
  EXPECT_NEAR(learning_rate(c, 111), 0.1, kTol);
}

TEST(LRSchedule, InverseSquareRoot) {
  LRScheduleConfig c = base(LRDecayStyle::InverseSquareRoot);
  EXPECT_NEAR(learning_rate(c, 40), 0.5, kTol);                   // sqrt(10 / 40)
  EXPECT_NEAR(learning_rate(c, 90), 1.0 / 3.0, kTol);             // sqrt(10 / 90)
  EXPECT_NEAR(learning_rate(c, 110), 0.30151134457776363, kTol);  // sqrt(10 / 110)
  EXPECT_NEAR(learning_rate(c, 111), 0.1, kTol);                  // past the decay: min_lr
  c.min_lr = 0.4;
  EXPECT_NEAR(learning_rate(c, 90), 0.4, kTol);  // clamped at min_lr
  // No warmup: sqrt(max(0, 1)) / sqrt(max(step, 1)).
  c.min_lr = 0.0;
  c.lr_warmup_steps = 0;
  EXPECT_NEAR(learning_rate(c, 0), 1.0, kTol);
  EXPECT_NEAR(learning_rate(c, 1), 1.0, kTol);
  EXPECT_NEAR(learning_rate(c, 4), 0.5, kTol);
}

TEST(LRSchedule, WSDIsStableThenAnneals) {
  // Anneal over the last 20 steps: from step 90 to 110, w = (step - 90) / 20.
  for (auto wsd : {WSDDecayStyle::Exponential, WSDDecayStyle::Linear, WSDDecayStyle::Cosine,
                   WSDDecayStyle::MinusSqrt}) {
    LRScheduleConfig c = base(LRDecayStyle::WSD);
    c.lr_wsd_decay_steps = 20;
    c.lr_wsd_decay_style = wsd;
    SCOPED_TRACE(std::string(wsd_decay_style_name(wsd)));
    EXPECT_NEAR(learning_rate(c, 11), 1.0, kTol);
    EXPECT_NEAR(learning_rate(c, 60), 1.0, kTol);
    EXPECT_NEAR(learning_rate(c, 90), 1.0, kTol);
    EXPECT_NEAR(learning_rate(c, 110), 0.1, kTol);  // every shape ends at coeff 0
    EXPECT_NEAR(learning_rate(c, 111), 0.1, kTol);
  }
  LRScheduleConfig c = base(LRDecayStyle::WSD);
  c.lr_wsd_decay_steps = 20;
  c.lr_wsd_decay_style = WSDDecayStyle::Linear;
  EXPECT_NEAR(learning_rate(c, 100), 0.55, kTol);             // w = 0.5
  EXPECT_NEAR(learning_rate(c, 95), 0.1 + 0.9 * 0.75, kTol);  // w = 0.25
  c.lr_wsd_decay_style = WSDDecayStyle::Cosine;
  EXPECT_NEAR(learning_rate(c, 100), 0.55, kTol);
  EXPECT_NEAR(learning_rate(c, 95), 0.1 + 0.9 * 0.8535533905932737, kTol);
  c.lr_wsd_decay_style = WSDDecayStyle::Exponential;
  // coeff = 2 * 0.5^w - 1: w = 0.5 -> sqrt(2) - 1; w = 0.25 -> 2 * 2^-0.25 - 1.
  EXPECT_NEAR(learning_rate(c, 100), 0.1 + 0.9 * 0.41421356237309515, kTol);
  EXPECT_NEAR(learning_rate(c, 95), 0.1 + 0.9 * 0.6817928305074290, kTol);
  c.lr_wsd_decay_style = WSDDecayStyle::MinusSqrt;
  // coeff = 1 - sqrt(w): w = 0.5 -> 0.2928932188134524; w = 0.25 -> 0.5.
  EXPECT_NEAR(learning_rate(c, 100), 0.1 + 0.9 * 0.2928932188134524, kTol);
  EXPECT_NEAR(learning_rate(c, 95), 0.55, kTol);
}

TEST(LRSchedule, ParsesMegatronStyleNames) {
  EXPECT_EQ(parse_lr_decay_style("constant"), LRDecayStyle::Constant);
  EXPECT_EQ(parse_lr_decay_style("linear"), LRDecayStyle::Linear);
  EXPECT_EQ(parse_lr_decay_style("cosine"), LRDecayStyle::Cosine);
  EXPECT_EQ(parse_lr_decay_style("inverse-square-root"), LRDecayStyle::InverseSquareRoot);
  EXPECT_EQ(parse_lr_decay_style("WSD"), LRDecayStyle::WSD);
  EXPECT_EQ(parse_wsd_decay_style("exponential"), WSDDecayStyle::Exponential);
  EXPECT_EQ(parse_wsd_decay_style("linear"), WSDDecayStyle::Linear);
  EXPECT_EQ(parse_wsd_decay_style("cosine"), WSDDecayStyle::Cosine);
  EXPECT_EQ(parse_wsd_decay_style("minus_sqrt"), WSDDecayStyle::MinusSqrt);
  for (auto s : {LRDecayStyle::Constant, LRDecayStyle::Linear, LRDecayStyle::Cosine,
                 LRDecayStyle::InverseSquareRoot, LRDecayStyle::WSD})
    EXPECT_EQ(parse_lr_decay_style(lr_decay_style_name(s)), s);
}

TEST(LRSchedule, UnknownStyleNamesTheFlagAndTheChoices) {
  std::string e = error_of([] { parse_lr_decay_style("wsd"); });
  EXPECT_NE(e.find("--lr-decay-style"), std::string::npos) << e;
  EXPECT_NE(e.find("'wsd'"), std::string::npos) << e;
  EXPECT_NE(e.find("inverse-square-root"), std::string::npos) << e;
  EXPECT_NE(e.find("WSD"), std::string::npos) << e;
  e = error_of([] { parse_wsd_decay_style("sqrt"); });
  EXPECT_NE(e.find("--lr-wsd-decay-style"), std::string::npos) << e;
  EXPECT_NE(e.find("minus_sqrt"), std::string::npos) << e;
}

TEST(LRSchedule, ValidateNamesTheBadFlag) {
  EXPECT_EQ(error_of([] { validate(base(LRDecayStyle::Cosine)); }), "<no megaton::Error thrown>");
  auto check = [](auto mutate, const char* flag) {
    LRScheduleConfig c = base(LRDecayStyle::Cosine);
    mutate(c);
    std::string e = error_of([&] { validate(c); });
    EXPECT_NE(e.find(flag), std::string::npos) << e;
  };
  check([](LRScheduleConfig& c) { c.min_lr = -1; }, "--min-lr");
  check([](LRScheduleConfig& c) { c.lr = 0.01; }, "--lr");
  check([](LRScheduleConfig& c) { c.lr_warmup_init = 2; }, "--lr-warmup-init");
  check([](LRScheduleConfig& c) { c.lr_decay_steps = 0; }, "--lr-decay-iters");
  check([](LRScheduleConfig& c) { c.lr_warmup_steps = 110; }, "--lr-warmup-iters");
  check([](LRScheduleConfig& c) { c.lr_decay_style = LRDecayStyle::WSD; }, "--lr-wsd-decay-iters");
  check(
      [](LRScheduleConfig& c) {
        c.lr_decay_style = LRDecayStyle::WSD;
        c.lr_wsd_decay_steps = 111;
      },
      "--lr-wsd-decay-iters");
}

TEST(LRSchedule, FractionalWarmup) {
  // --lr-warmup-fraction 0.05 of a 110-step decay: 5.5 steps, Megatron's float warmup.
  LRScheduleConfig c = base(LRDecayStyle::Linear);
  c.lr_warmup_steps = 5.5;
  EXPECT_NEAR(learning_rate(c, 5), 0.05 + 0.95 * 5 / 5.5, kTol);
  // Past the warmup: r = (6 - 5.5) / (110 - 5.5).
  EXPECT_NEAR(learning_rate(c, 6), 0.1 + 0.9 * (1 - 0.5 / 104.5), kTol);
}

TEST(WeightDecaySchedule, MegatronsIncrementStyles) {
  // Megatron's get_wd: start 0.0 to end 0.1 over 200 steps.
  LRScheduleConfig c = base(LRDecayStyle::Linear);
  c.start_weight_decay = 0.0;
  c.end_weight_decay = 0.1;
  c.wd_incr_steps = 200;
  c.weight_decay_incr_style = WeightDecayIncrStyle::Linear;
  EXPECT_NEAR(weight_decay(c, 0), 0.0, kTol);
  EXPECT_NEAR(weight_decay(c, 50), 0.025, kTol);
  EXPECT_NEAR(weight_decay(c, 200), 0.1, kTol);
  EXPECT_NEAR(weight_decay(c, 201), 0.1, kTol);  // past the run: the end value
  c.weight_decay_incr_style = WeightDecayIncrStyle::Cosine;
  // coeff = (cos(pi (1 - r)) + 1) / 2: r = 0.25 -> (1 - cos(pi/4)) / 2 = 0.1464466...
  EXPECT_NEAR(weight_decay(c, 50), 0.1 * 0.14644660940672624, kTol);
  EXPECT_NEAR(weight_decay(c, 100), 0.05, kTol);
  c.weight_decay_incr_style = WeightDecayIncrStyle::Constant;
  c.start_weight_decay = c.end_weight_decay = 0.01;
  EXPECT_NEAR(weight_decay(c, 77), 0.01, kTol);
  EXPECT_EQ(parse_weight_decay_incr_style("cosine"), WeightDecayIncrStyle::Cosine);
  std::string e = error_of([] { parse_weight_decay_incr_style("exp"); });
  EXPECT_NE(e.find("--weight-decay-incr-style"), std::string::npos) << e;
  c.end_weight_decay = 0.02;
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("constant"), std::string::npos) << e;
}
