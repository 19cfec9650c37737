// AdamW and DistributedAdamW with fp16 main params (--main-params-dtype fp16; Transformer
// Engine's FusedAdam master_weight_dtype fp16), on the CPU with hand-made BF16 weights (the
// trainer's CPU runs compute fp32 and refuse the flag): the constructor quantizes the fp32
// main params with the absmax scale and releases them; steps stay within the fp16 rounding
// bound of the run that keeps fp32 main params, the weight within bf16 rounding of its main
// param; the distributed optimizer (replicated and sharded) writes fp32 main params and
// their scales, sharded equals replicated bit for bit, a restored state resumes bit for
// bit, and states convert between fp32 and fp16 main params with one notice.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "model/layers.h"
#include "model/param_buffer.h"
#include "ops/adam_f16_main_param.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/distrib_optimizer.h"

namespace megaton::optim {
namespace {

using megaton::testing::randn;
using megaton::testing::test_seed;

::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  const size_t elem = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.raw());
  const auto* pb = static_cast<const unsigned char*>(b.raw());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + i * elem, pb + i * elem, elem) != 0)
      return ::testing::AssertionFailure()
             << "element " << i << ": " << a.item(i) << " vs " << b.item(i);
  return ::testing::AssertionSuccess();
}

struct Model {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
};

Model make_model(uint64_t seed) {
  Model m;
  const std::pair<const char*, Shape> specs[] = {
      {"decoder.layers.0.mlp.linear_fc1.weight", {300, 113}},
      {"decoder.layers.0.mlp.linear_fc1.bias", {7}},
      {"decoder.final_layernorm.weight", {33}}};
  uint64_t k = 0;
  for (const auto& [name, shape] : specs) {
    auto p = std::make_unique<Param>();
    p->name = name;
    p->main_param = randn(shape, seed + ++k, 0.5f);
    p->weight = p->main_param.to(DType::BF16);
    p->main_grad = Tensor::zeros(shape);
    p->no_weight_decay = k > 1;
    m.params.push_back(p.get());
    m.owned.push_back(std::move(p));
  }
  return m;
}

AdamWConfig config(DType main_params) {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.use_precision_aware_optimizer = true;
  c.main_params_dtype = main_params;
  c.exp_avg_dtype = DType::BF16;
  c.exp_avg_sq_dtype = DType::F16;
  c.store_param_remainders = false;
  return c;
}

void set_grads(const std::vector<Param*>& params, uint64_t seed) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i]->main_grad.copy_from(randn(params[i]->weight.shape(), seed + 7 * i, 0.3f));
}

float absmax(const Tensor& t) { return ops::f16_main_param_absmax(t); }

TEST(AdamWF16MainParam, ConstructionQuantizesAndReleasesTheMainParams) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Model m = make_model(seed), ref = make_model(seed);
  AdamW opt(m.params, config(DType::F16));
  EXPECT_TRUE(opt.scaled_states());
  for (size_t i = 0; i < m.params.size(); ++i) {
    const Param& p = *m.params[i];
    SCOPED_TRACE(p.name);
    EXPECT_FALSE(p.main_param.defined());
    EXPECT_FALSE(p.main_param_remainder.defined());
    ASSERT_TRUE(p.main_param_f16.defined());
    EXPECT_EQ(p.main_param_f16.dtype(), DType::F16);
    const Tensor& fp32 = ref.params[i]->main_param;
    const float scale = p.main_param_scale.f32()[0];
    EXPECT_EQ(scale, absmax(fp32) / 32752.0f);
    const Tensor value = main_param_value(p);
    for (int64_t k = 0; k < value.numel(); ++k)
      ASSERT_LE(std::fabs(value.f32()[k] - fp32.f32()[k]),
                std::fabs(fp32.f32()[k]) * std::ldexp(1.0, -11) + std::ldexp(1.0, -24) * scale)
          << k;
    EXPECT_TRUE(same_bytes(p.weight, ref.params[i]->weight));  // untouched
  }
}

// Five steps against the fp32-main-param run (the same grads): the fp16 main params differ
// by their rounding only, at most half an fp16 ulp of the absmax (absmax * 2^-12) per step,
// and each weight is within bf16 rounding of its fp32 value.
TEST(AdamWF16MainParam, StepsStayWithinFp16RoundingOfTheFp32MainParamRun) {
  const uint64_t seed = test_seed() + 3;
  SCOPED_TRACE("seed " + std::to_string(seed));
  Model f16 = make_model(seed), fp32 = make_model(seed);
  AdamW a(f16.params, config(DType::F16)), b(fp32.params, config(DType::F32));
  const int steps = 5;
  for (int step = 1; step <= steps; ++step) {
    set_grads(f16.params, seed * 3 + uint64_t(step));
    set_grads(fp32.params, seed * 3 + uint64_t(step));
    a.step(1e-2f, 1.0f);
    b.step(1e-2f, 1.0f);
  }
  double worst = 0;
  for (size_t i = 0; i < f16.params.size(); ++i) {
    SCOPED_TRACE(f16.params[i]->name);
    const Tensor got = main_param_value(*f16.params[i]);
    const Tensor& want = fp32.params[i]->main_param;
    const double bound = steps * double(absmax(want)) * std::ldexp(1.0, -12) * 1.5;
    bool differs = false;
    for (int64_t k = 0; k < got.numel(); ++k) {
      const double d = std::fabs(double(got.f32()[k]) - want.f32()[k]);
      ASSERT_LE(d, bound) << k;
      worst = std::max(worst, d / bound);
      differs = differs || d > 0;
      // The weight: the pre-quantization fp32 value to nearest bf16.
      const double w = f16.params[i]->weight.item(k), x = got.f32()[k];
      ASSERT_LE(std::fabs(w - x), std::fabs(x) * std::ldexp(1.0, -8) + bound) << k;
    }
    EXPECT_TRUE(differs);  // fp16 main params do round (the comparison can fail)
  }
  RecordProperty("worst_fraction_of_bound", std::to_string(worst));
}

// ---- DistributedAdamW on one rank ----

dist::Comm& cpu_comm() {
  static std::unique_ptr<dist::Comm> comm = dist::make_comm(Device::CPU);
  return *comm;
}

const dist::Grid& one_rank_grid() {
  static const dist::Grid grid(dist::ParallelSizes{}, 1, 0);
  return grid;
}

struct OptimizerRun {
  Model model;
  std::unique_ptr<ParamAndGradBuffer> buffer;
  std::unique_ptr<DistributedAdamW> opt;
  OptimizerRun(uint64_t seed, DType main_params, bool distributed) : model(make_model(seed)) {
    buffer = std::make_unique<ParamAndGradBuffer>(model.params, 1, false);
    opt = std::make_unique<DistributedAdamW>(std::vector<ParamAndGradBuffer*>{buffer.get()},
                                             one_rank_grid(), cpu_comm(), config(main_params),
                                             distributed);
  }
  void step(uint64_t grad_seed, float lr) {
    set_grads(model.params, grad_seed);
    opt->step(lr, 1.0f);
  }
  std::map<std::string, Tensor> state() {
    std::map<std::string, Tensor> out;
    for (auto& [name, t] : opt->full_state()) out[name] = t.clone();
    return out;
  }
  // Returns what the load printed.
  std::string load(const std::map<std::string, Tensor>& state, int64_t steps) {
    ::testing::internal::CaptureStdout();
    opt->load_full_state(
        [&](const std::string& name) -> const Tensor* {
          auto it = state.find(name);
          return it == state.end() ? nullptr : &it->second;
        },
        "test state", true);
    opt->set_step_count(steps);
    return ::testing::internal::GetCapturedStdout();
  }
};

void expect_same_state(const std::map<std::string, Tensor>& a,
                       const std::map<std::string, Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    EXPECT_TRUE(same_bytes(t, it->second)) << name;
  }
}

TEST(DistributedF16MainParam, ShardedIsReplicatedAndResumesBitForBit) {
  const uint64_t seed = test_seed() + 9;
  SCOPED_TRACE("seed " + std::to_string(seed));
  OptimizerRun replicated(seed, DType::F16, false), sharded(seed, DType::F16, true);
  for (int64_t step = 1; step <= 4; ++step) {
    replicated.step(seed + uint64_t(step), 1e-2f);
    sharded.step(seed + uint64_t(step), 1e-2f);
  }
  const std::map<std::string, Tensor> state = replicated.state();
  const std::string name = replicated.model.params[0]->name;
  EXPECT_EQ(state.at("model." + name).dtype(), DType::F32);
  ASSERT_TRUE(state.count("optimizer." + name + ".main_param.scale"));
  EXPECT_GT(state.at("optimizer." + name + ".main_param.scale").f32()[0], 0.0f);
  expect_same_state(state, sharded.state());
  // (The fp64 sums run over the params in another order: equal up to that.)
  EXPECT_NEAR(replicated.opt->params_norm(), sharded.opt->params_norm(),
              1e-12 * replicated.opt->params_norm());
  for (size_t i = 0; i < replicated.model.params.size(); ++i)
    EXPECT_TRUE(same_bytes(replicated.model.params[i]->weight, sharded.model.params[i]->weight));

  // A fresh run loaded from the state steps on as the original does.
  for (bool distributed : {false, true}) {
    SCOPED_TRACE(distributed ? "sharded" : "replicated");
    OptimizerRun& original = distributed ? sharded : replicated;
    OptimizerRun resumed(seed + 1000, DType::F16, distributed);
    EXPECT_EQ(resumed.load(state, 4), "");  // the same dtypes: no notice
    expect_same_state(resumed.state(), state);
    for (int64_t step = 5; step <= 6; ++step) {
      original.step(seed + uint64_t(step), 5e-3f);
      resumed.step(seed + uint64_t(step), 5e-3f);
    }
    expect_same_state(resumed.state(), original.state());
    for (size_t i = 0; i < original.model.params.size(); ++i)
      EXPECT_TRUE(same_bytes(resumed.model.params[i]->weight, original.model.params[i]->weight));
  }
}

TEST(DistributedF16MainParam, StatesConvertBetweenFp32AndFp16MainParams) {
  const uint64_t seed = test_seed() + 21;
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (bool distributed : {false, true}) {
    SCOPED_TRACE(distributed ? "sharded" : "replicated");
    OptimizerRun fp32(seed, DType::F32, distributed), f16(seed, DType::F16, distributed);
    for (int64_t step = 1; step <= 2; ++step) {
      fp32.step(seed + uint64_t(step), 1e-2f);
      f16.step(seed + uint64_t(step), 1e-2f);
    }
    const std::map<std::string, Tensor> fp32_state = fp32.state(), f16_state = f16.state();
    const std::string name = fp32.model.params[0]->name;
    EXPECT_FALSE(fp32_state.count("optimizer." + name + ".main_param.scale"));

    // fp32 -> fp16: quantized with a scale from the values, one notice.
    OptimizerRun to_f16(seed + 100, DType::F16, distributed);
    const std::string notice = to_f16.load(fp32_state, 2);
    EXPECT_NE(notice.find("holds the main params in F32"), std::string::npos) << notice;
    EXPECT_NE(notice.find("keeps them in F16: converting"), std::string::npos) << notice;
    EXPECT_EQ(notice.find('\n'), notice.size() - 1) << "one line: " << notice;
    const std::map<std::string, Tensor> converted = to_f16.state();
    for (const Param* p : fp32.model.params) {
      const Tensor& want = fp32_state.at("model." + p->name);
      const Tensor& got = converted.at("model." + p->name);
      const float scale = converted.at("optimizer." + p->name + ".main_param.scale").f32()[0];
      EXPECT_EQ(scale, absmax(want) / 32752.0f) << p->name;
      for (int64_t k = 0; k < want.numel(); ++k)
        ASSERT_LE(std::fabs(got.f32()[k] - want.f32()[k]),
                  std::fabs(want.f32()[k]) * std::ldexp(1.0, -11) + std::ldexp(1.0, -24) * scale)
            << p->name << " " << k;
    }

    // fp16 -> fp32: the values as they are, one notice; the state is then the fp16 one's
    // without the scales.
    OptimizerRun to_fp32(seed + 200, DType::F32, distributed);
    const std::string back = to_fp32.load(f16_state, 2);
    EXPECT_NE(back.find("holds the main params in F16"), std::string::npos) << back;
    std::map<std::string, Tensor> without_scales = f16_state;
    for (const Param* p : fp32.model.params)
      without_scales.erase("optimizer." + p->name + ".main_param.scale");
    expect_same_state(to_fp32.state(), without_scales);
  }
}

// --init-model-with-meta-device: params made without values (bf16 weights, fp32 main params
// absent) give the optimizer the same start as params made whole, whatever stores the main
// params (fp16 with a scale, int16 remainders beside the weight) and whether the optimizer
// is distributed: two steps leave byte-identical weights.
std::vector<std::unique_ptr<Param>> made_params(bool meta) {
  const Placement where{Device::CPU, DType::BF16, meta};
  std::vector<std::unique_ptr<Param>> ps;
  ps.push_back(std::make_unique<Param>(make_param("fc1.weight", {40, 24}, 0.3f, 77, where)));
  ps.push_back(std::make_unique<Param>(
      make_param_sharded("proj.weight", {24, 40}, 0.3f, 77, where, 1, 1, 2)));
  ps.push_back(
      std::make_unique<Param>(make_constant_param("norm.weight", {24}, 1.0f, true, where)));
  return ps;
}

TEST(AdamWF16MainParam, MetaDeviceParamsStepLikeWholeOnes) {
  for (const DType main : {DType::F16, DType::F32})
    for (const bool distributed : {false, true}) {
      SCOPED_TRACE(std::string(main == DType::F16 ? "fp16 main params" : "remainders") +
                   (distributed ? ", distributed" : ""));
      auto whole = made_params(false), meta = made_params(true);
      std::vector<Param*> pw, pm;
      for (auto& p : whole) pw.push_back(p.get());
      for (auto& p : meta) pm.push_back(p.get());
      ASSERT_TRUE(pm[0]->main_param.storage_released());
      ParamAndGradBuffer bw(pw, 1, false), bm(pm, 1, false);
      AdamWConfig c = config(main);
      c.store_param_remainders = main == DType::F32;
      DistributedAdamW ow({&bw}, one_rank_grid(), cpu_comm(), c, distributed);
      DistributedAdamW om({&bm}, one_rank_grid(), cpu_comm(), c, distributed);
      for (uint64_t step = 0; step < 2; ++step) {
        set_grads(pw, 100 + step);
        set_grads(pm, 100 + step);
        ow.step(1e-2f, 1.0f);
        om.step(1e-2f, 1.0f);
      }
      for (size_t i = 0; i < pw.size(); ++i)
        EXPECT_TRUE(same_bytes(pm[i]->weight, pw[i]->weight)) << pw[i]->name;
    }
}

}  // namespace
}  // namespace megaton::optim
