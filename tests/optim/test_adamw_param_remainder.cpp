// AdamW and DistributedAdamW keeping the fp32 main params of bf16 weights as int16
// remainders (AdamWConfig::store_param_remainders, on by default), on the CPU with bf16
// weights: the constructor splits the main params exactly and releases them; every step
// gives, bit for bit, the main params and moments of the run that keeps fp32 main params
// (bf16 moments: one formula for both), with the weight rounded as the split rounds it
// (ties away from zero) where the fp32 run rounds to nearest even; the switch off, fp32
// and fp16 weights keep fp32 main params; the distributed optimizer (replicated and
// sharded) writes the fp32 main params to its full state, equal to the fp32 run's, its
// params norm is theirs, a restored state resumes bit for bit, and states load across the
// two storages.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "model/param_buffer.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"
#include "optim/adamw.h"
#include "optim/distrib_optimizer.h"

namespace megaton::optim {
namespace {

using megaton::testing::randn;
using megaton::testing::test_seed;

const uint16_t* u16(const Tensor& t) { return static_cast<const uint16_t*>(t.raw()); }
const uint32_t* u32(const Tensor& t) { return static_cast<const uint32_t*>(t.raw()); }

::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  const size_t elem = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.raw());
  const auto* pb = static_cast<const unsigned char*>(b.raw());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + i * elem, pb + i * elem, elem) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a.item(i) << " vs "
                                           << b.item(i);
  return ::testing::AssertionSuccess();
}

// Transformer Engine's rounding of a main param into its bf16 weight (int16 arithmetic).
uint16_t te_weight(uint32_t master) {
  int16_t high = int16_t(uint16_t(master >> 16));
  if (int16_t(uint16_t(master & 0xFFFFu)) < 0) high = int16_t(high + 1);
  return uint16_t(high);
}

// Params as a bf16 model builds them: an fp32 main param and its bf16 cast (round to
// nearest even), with one element in seven a tie so that the two roundings differ.
struct Model {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
  void add(const std::string& name, const Shape& shape, uint64_t seed, bool no_wd,
           DType weight_dtype) {
    auto p = std::make_unique<Param>();
    p->name = name;
    p->main_param = randn(shape, seed, 0.5f);
    auto* bits = static_cast<uint32_t*>(p->main_param.raw());
    for (int64_t i = 0; i < p->main_param.numel(); i += 7) bits[i] = (bits[i] & 0xFFFF0000u) | 0x8000u;
    p->weight = p->main_param.to(weight_dtype);
    if (weight_dtype == DType::F32) p->weight = p->main_param;
    p->main_grad = Tensor::zeros(shape);
    p->no_weight_decay = no_wd;
    params.push_back(p.get());
    owned.push_back(std::move(p));
  }
};

Model make_model(uint64_t seed, DType weight_dtype = DType::BF16) {
  Model m;
  m.add("decoder.layers.0.mlp.linear_fc1.weight", {300, 113}, seed + 1, false, weight_dtype);
  m.add("decoder.layers.0.mlp.linear_fc1.bias", {7}, seed + 2, true, weight_dtype);
  m.add("decoder.final_layernorm.weight", {33}, seed + 3, true, weight_dtype);
  return m;
}

AdamWConfig bf16_moments(bool remainders) {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.use_precision_aware_optimizer = true;
  c.exp_avg_dtype = DType::BF16;
  c.exp_avg_sq_dtype = DType::BF16;
  c.store_param_remainders = remainders;
  return c;
}

void set_grads(const std::vector<Param*>& params, uint64_t seed) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i]->main_grad.copy_from(randn(params[i]->weight.shape(), seed + 7 * i, 0.3f));
}

TEST(AdamWParamRemainder, ConstructionSplitsTheMainParamsExactly) {
  Model model = make_model(test_seed());
  std::vector<Tensor> masters;
  for (Param* p : model.params) masters.push_back(p->main_param.clone());
  AdamW opt(model.params, AdamWConfig{});  // the default stores remainders
  int ties = 0;
  for (size_t i = 0; i < model.params.size(); ++i) {
    const Param& p = *model.params[i];
    SCOPED_TRACE(p.name);
    EXPECT_FALSE(p.main_param.defined());
    ASSERT_TRUE(p.main_param_remainder.defined());
    EXPECT_EQ(p.main_param_remainder.dtype(), DType::I16);
    EXPECT_EQ(p.main_param_remainder.shape(), p.weight.shape());
    EXPECT_TRUE(same_bytes(main_param_value(p), masters[i]));
    for (int64_t k = 0; k < p.weight.numel(); ++k) {
      ASSERT_EQ(u16(p.weight)[k], te_weight(u32(masters[i])[k])) << "element " << k;
      ties += u16(p.weight)[k] != float_to_bf16(masters[i].f32()[k]);
    }
  }
  EXPECT_GT(ties, 0);  // the weights were rewritten, not left as the model's cast
}

// 20 steps, host and device-control paths alternating: the remainder run's main params
// and moments are the fp32 run's, bit for bit.
TEST(AdamWParamRemainder, StepsGiveTheFp32MainParamRunBitForBit) {
  const uint64_t seed = test_seed() + 3;
  SCOPED_TRACE("seed " + std::to_string(seed));
  Model with = make_model(seed), without = make_model(seed);
  AdamW a(with.params, bf16_moments(true)), b(without.params, bf16_moments(false));
  ASSERT_TRUE(without.params[0]->main_param.defined());
  Tensor control = Tensor::empty({ops::kAdamControlSize});
  Tensor norm_bits = Tensor::empty({1}, DType::I64);
  for (int64_t step = 1; step <= 20; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    set_grads(with.params, seed * 10 + uint64_t(step));
    set_grads(without.params, seed * 10 + uint64_t(step));
    const float lr = 1e-2f / float(1 + step % 4);
    if (step % 2) {
      a.step(lr, 0.8f);
      b.step(lr, 0.8f);
    } else {  // the device-decided step, clipped at norm 1
      for (AdamW* opt : {&a, &b}) {
        std::vector<Tensor> grads;
        for (Param* p : opt->params()) grads.push_back(p->main_grad);
        Tensor parts = Tensor::empty({1}, DType::I64);
        ops::multi_tensor_sum_of_squares(grads, parts);
        ops::adamw_step_control(parts, 1.0, 1.0, 1.0f, Tensor(), false, Tensor::from({1}, {lr}),
                                0.9f, 0.999f, opt->device_state(), control, norm_bits);
        opt->step(control);
      }
    }
    auto sa = a.state_tensors(), sb = b.state_tensors();
    for (size_t i = 0; i < with.params.size(); ++i) {
      const Param& pa = *with.params[i];
      const Param& pb = *without.params[i];
      ASSERT_TRUE(same_bytes(main_param_value(pa), pb.main_param)) << pa.name;
      for (int64_t k = 0; k < pb.weight.numel(); ++k) {
        const uint32_t master = u32(pb.main_param)[k];
        ASSERT_EQ(u16(pa.weight)[k], te_weight(master)) << pa.name << " element " << k;
        ASSERT_EQ(u16(pb.weight)[k], float_to_bf16(pb.main_param.f32()[k]));
      }
      EXPECT_TRUE(same_bytes(*sa[2 * i].second, *sb[2 * i].second));
      EXPECT_TRUE(same_bytes(*sa[2 * i + 1].second, *sb[2 * i + 1].second));
    }
  }
  EXPECT_EQ(a.step_count(), 20);
}

TEST(AdamWParamRemainder, SwitchOffAndNonBf16WeightsKeepFp32MainParams) {
  Model off = make_model(test_seed() + 5);
  AdamWConfig c;
  c.store_param_remainders = false;
  AdamW a(off.params, c);
  for (Param* p : off.params) {
    EXPECT_TRUE(p->main_param.defined());
    EXPECT_FALSE(p->main_param_remainder.defined());
  }
  for (DType weight : {DType::F32, DType::F16}) {
    Model m = make_model(test_seed() + 6, weight);
    AdamW b(m.params, AdamWConfig{});
    for (Param* p : m.params) {
      EXPECT_TRUE(p->main_param.defined()) << dtype_name(weight);
      EXPECT_FALSE(p->main_param_remainder.defined()) << dtype_name(weight);
      EXPECT_FALSE(stores_param_remainder(AdamWConfig{}, *p));
    }
  }
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

// A model in a ParamAndGradBuffer (one shard) with its DistributedAdamW.
struct OptimizerRun {
  Model model;
  std::unique_ptr<ParamAndGradBuffer> buffer;
  std::unique_ptr<DistributedAdamW> opt;
  OptimizerRun(uint64_t seed, bool remainders, bool distributed) : model(make_model(seed)) {
    buffer = std::make_unique<ParamAndGradBuffer>(model.params, 1, false);
    opt = std::make_unique<DistributedAdamW>(std::vector<ParamAndGradBuffer*>{buffer.get()},
                                             one_rank_grid(), cpu_comm(),
                                             bf16_moments(remainders), distributed);
  }
  void step(uint64_t grad_seed, float lr) {
    set_grads(model.params, grad_seed);
    opt->step(lr, 1.0f);
  }
  // full_state as copies (some entries are views of live tensors).
  std::map<std::string, Tensor> state() {
    std::map<std::string, Tensor> out;
    for (auto& [name, t] : opt->full_state()) out[name] = t.clone();
    return out;
  }
  void load(const std::map<std::string, Tensor>& state, int64_t steps) {
    opt->load_full_state(
        [&](const std::string& name) -> const Tensor* {
          auto it = state.find(name);
          return it == state.end() ? nullptr : &it->second;
        },
        "test state", true);
    opt->set_step_count(steps);
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

class DistributedRemainders : public ::testing::TestWithParam<bool> {};

TEST_P(DistributedRemainders, FullStateIsTheFp32RunsAndResumesBitForBit) {
  const bool distributed = GetParam();
  const uint64_t seed = test_seed() + 9;
  SCOPED_TRACE("seed " + std::to_string(seed));
  OptimizerRun with(seed, true, distributed), without(seed, false, distributed);
  for (int64_t step = 1; step <= 4; ++step) {
    with.step(seed + uint64_t(step), 1e-2f);
    without.step(seed + uint64_t(step), 1e-2f);
  }
  const std::map<std::string, Tensor> state = with.state();
  EXPECT_EQ(state.at("model." + with.model.params[0]->name).dtype(), DType::F32);
  expect_same_state(state, without.state());
  // Joined tensor by tensor and summed in the same order: the same fp64 sum.
  EXPECT_EQ(with.opt->params_norm(), without.opt->params_norm());

  // Resume: a fresh run loaded from the state continues as the first one does.
  OptimizerRun resumed(seed + 1000, true, distributed);
  resumed.load(state, with.opt->step_count());
  expect_same_state(resumed.state(), state);
  for (int64_t step = 5; step <= 7; ++step) {
    with.step(seed + uint64_t(step), 5e-3f);
    resumed.step(seed + uint64_t(step), 5e-3f);
  }
  expect_same_state(resumed.state(), with.state());
  for (size_t i = 0; i < with.model.params.size(); ++i)
    EXPECT_TRUE(same_bytes(resumed.model.params[i]->weight, with.model.params[i]->weight));

  // Either storage loads the other's state: the same full state comes back.
  OptimizerRun fp32_from_remainders(seed + 2000, false, distributed);
  fp32_from_remainders.load(state, 4);
  expect_same_state(fp32_from_remainders.state(), state);
  OptimizerRun remainders_from_fp32(seed + 3000, true, distributed);
  const std::map<std::string, Tensor> fp32_state = without.state();
  remainders_from_fp32.load(fp32_state, 4);
  expect_same_state(remainders_from_fp32.state(), fp32_state);
}

INSTANTIATE_TEST_SUITE_P(ReplicatedAndSharded, DistributedRemainders, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Distributed" : "Replicated"; });

}  // namespace
}  // namespace megaton::optim
