// BF16 main grads (--main-grads-dtype bf16) read by the Adam ops on the CPU: a BF16 grad is
// widened to fp32 as it is read, so every update is bit for bit the update of an F32 grad
// holding the same values: multi_tensor_adamw with fp32 moments, bf16 moments and one of
// each, from host scalars and from a control tensor (a skipped step included);
// multi_tensor_adamw_param_remainder; AdamW over a bf16 model (remainders) and an fp32
// model; and the host half of --optimizer-cpu-offload.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "ops/adam_precision.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"
#include "optim/adamw.h"

namespace megaton {
namespace {

using testing::randn;

::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  if (std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0) return ::testing::AssertionSuccess();
  for (int64_t i = 0; i < a.numel(); ++i)
    if (a.item(i) != b.item(i))
      return ::testing::AssertionFailure() << "element " << i << ": " << a.item(i) << " vs "
                                           << b.item(i);
  return ::testing::AssertionFailure() << "bytes differ";
}

// Random gradient values that a BF16 tensor holds exactly, as F32 (the reference) or BF16.
Tensor grad_values(const Shape& shape, uint64_t seed, DType dtype) {
  const Tensor rounded = randn(shape, seed, 0.3f).to(DType::BF16);
  return dtype == DType::BF16 ? rounded : rounded.to(DType::F32);
}

struct Lists {
  std::vector<Tensor> params, grads, m, v, copies;
  std::vector<float> decays;
  std::vector<ops::MomentRoundingKey> keys;
};

// Moments per tensor cycle through (F32, F32), (BF16, BF16), (BF16, F32); copies through
// BF16, none, F16. Moments start nonzero.
Lists make_lists(uint64_t seed) {
  const Shape shapes[] = {{37, 5}, {1001}, {4, 4, 3}, {70000}, {9}, {33, 3}};
  const DType moments[3][2] = {
      {DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}};
  Lists l;
  for (size_t i = 0; i < std::size(shapes); ++i) {
    const Shape& s = shapes[i];
    const uint64_t base = seed + 100 * i;
    l.params.push_back(randn(s, base, 0.5f));
    l.m.push_back(randn(s, base + 2, 0.01f).to(moments[i % 3][0]));
    Tensor v = randn(s, base + 3, 1e-3f);
    for (int64_t k = 0; k < v.numel(); ++k) v.f32()[k] *= v.f32()[k];
    l.v.push_back(v.to(moments[i % 3][1]));
    const DType copy_dtypes[3] = {DType::BF16, DType::F32, DType::F16};
    l.copies.push_back(i % 3 == 1 ? Tensor() : Tensor::zeros(s, copy_dtypes[i % 3]));
    l.decays.push_back(i % 2 ? 0.0f : 0.1f);
    ops::MomentRoundingKey key;
    key.param_key = 77 + i;
    key.offset = int64_t(3 * i);
    l.keys.push_back(key);
  }
  return l;
}

void set_grads(Lists& l, uint64_t seed, DType dtype) {
  l.grads.clear();
  for (size_t i = 0; i < l.params.size(); ++i)
    l.grads.push_back(grad_values(l.params[i].shape(), seed + 7 * i, dtype));
}

void expect_lists_equal(const Lists& a, const Lists& b) {
  for (size_t i = 0; i < a.params.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_TRUE(same_bytes(a.params[i], b.params[i]));
    EXPECT_TRUE(same_bytes(a.m[i], b.m[i]));
    EXPECT_TRUE(same_bytes(a.v[i], b.v[i]));
    if (a.copies[i].defined()) {
      EXPECT_TRUE(same_bytes(a.copies[i], b.copies[i]));
    }
  }
}

// The control tensor adamw_step_control would write for (lr, step, grad_scale); the CPU
// update reads only the skip flag, lr, step and grad scale.
Tensor control_for(float lr, int64_t step, float grad_scale, bool skip) {
  Tensor c = Tensor::zeros({ops::kAdamControlSize});
  c.f32()[ops::kAdamLr] = lr;
  c.f32()[ops::kAdamStep] = float(step);
  c.f32()[ops::kAdamGradScale] = grad_scale;
  c.f32()[ops::kAdamSkip] = skip ? 1.0f : 0.0f;
  return c;
}

TEST(AdamWBf16Grads, MultiTensorAdamwReadsBf16GradsAsTheirFp32Values) {
  const uint64_t seed = testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Lists ref = make_lists(seed), bf = make_lists(seed);
  const Lists fresh = make_lists(seed);
  for (int64_t step = 1; step <= 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    set_grads(ref, seed * 31 + step, DType::F32);
    set_grads(bf, seed * 31 + step, DType::BF16);
    ASSERT_EQ(bf.grads[0].dtype(), DType::BF16);
    const float lr = 1e-2f * float(step), scale = step == 2 ? 1.0f : 0.37f;
    for (Lists* l : {&ref, &bf}) {
      if (step <= 2) {
        ops::multi_tensor_adamw(l->params, l->grads, l->m, l->v, l->copies, l->decays, lr, 0.9f,
                                0.95f, 1e-8f, step, scale, l->keys);
      } else if (step == 3) {  // the ops.h overload (list-order keys)
        ops::multi_tensor_adamw(l->params, l->grads, l->m, l->v, l->copies, l->decays, lr, 0.9f,
                                0.95f, 1e-8f, step, scale);
      } else {  // the device-decided step, skipped at step 5
        const Tensor control = control_for(lr, step, scale, step == 5);
        ops::multi_tensor_adamw(l->params, l->grads, l->m, l->v, l->copies, l->decays, 0.9f, 0.95f,
                                1e-8f, control, l->keys);
      }
    }
    expect_lists_equal(bf, ref);
  }
  // Every kind of tensor moved (a test of an update, not of two no-ops).
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_FALSE(same_bytes(bf.params[i], fresh.params[i])) << i;
    EXPECT_FALSE(same_bytes(bf.m[i], fresh.m[i])) << i;
  }
}

TEST(AdamWBf16Grads, ParamRemainderUpdateReadsBf16GradsAsTheirFp32Values) {
  const uint64_t seed = testing::test_seed() + 5;
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct RemainderLists {
    std::vector<Tensor> weights, remainders, grads, m, v;
  };
  const Shape shapes[] = {{41, 3}, {5000}, {7}};
  std::vector<float> decays = {0.1f, 0.0f, 0.1f};
  std::vector<ops::MomentRoundingKey> keys = ops::list_order_rounding_keys(3);
  auto make = [&] {
    RemainderLists l;
    for (size_t i = 0; i < std::size(shapes); ++i) {
      const Tensor master = randn(shapes[i], seed + i, 0.5f);
      l.weights.push_back(Tensor::empty(shapes[i], DType::BF16));
      l.remainders.push_back(Tensor::empty(shapes[i], DType::I16));
      ops::split_param_remainders(master, l.weights.back(), l.remainders.back());
      l.m.push_back(Tensor::zeros(shapes[i], i == 1 ? DType::F32 : DType::BF16));
      l.v.push_back(Tensor::zeros(shapes[i], i == 2 ? DType::F32 : DType::BF16));
    }
    return l;
  };
  RemainderLists ref = make(), bf = make();
  const RemainderLists fresh = make();
  for (int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (RemainderLists* l : {&ref, &bf}) {
      l->grads.clear();
      for (size_t i = 0; i < std::size(shapes); ++i)
        l->grads.push_back(grad_values(shapes[i], seed * 17 + 3 * i + step,
                                       l == &bf ? DType::BF16 : DType::F32));
      const float lr = 3e-3f, scale = 0.8f;
      if (step % 2) {
        ops::multi_tensor_adamw_param_remainder(l->weights, l->remainders, l->grads, l->m, l->v,
                                                decays, lr, 0.9f, 0.999f, 1e-8f, step, scale,
                                                keys);
      } else {
        ops::multi_tensor_adamw_param_remainder(l->weights, l->remainders, l->grads, l->m, l->v,
                                                decays, 0.9f, 0.999f, 1e-8f,
                                                control_for(lr, step, scale, false), keys);
      }
    }
    for (size_t i = 0; i < std::size(shapes); ++i) {
      SCOPED_TRACE("tensor " + std::to_string(i));
      EXPECT_TRUE(same_bytes(bf.weights[i], ref.weights[i]));
      EXPECT_TRUE(same_bytes(bf.remainders[i], ref.remainders[i]));
      EXPECT_TRUE(same_bytes(bf.m[i], ref.m[i]));
      EXPECT_TRUE(same_bytes(bf.v[i], ref.v[i]));
    }
  }
  EXPECT_FALSE(same_bytes(bf.remainders[0], fresh.remainders[0]));
}

// A small model's params: bf16 weights over fp32 main params (kept as remainders unless
// offloaded) or fp32 weights; main grads in `grad_dtype`.
struct Model {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
  Model(uint64_t seed, DType weight_dtype, DType grad_dtype) {
    const Shape shapes[] = {{300, 113}, {7}, {64, 40}, {33}};
    for (size_t i = 0; i < std::size(shapes); ++i) {
      auto p = std::make_unique<Param>();
      p->name = "p" + std::to_string(i);
      p->main_param = randn(shapes[i], seed + i, 0.5f);
      p->weight = weight_dtype == DType::F32 ? p->main_param : p->main_param.to(weight_dtype);
      p->main_grad = Tensor::zeros(shapes[i], grad_dtype);
      p->no_weight_decay = i % 2 == 1;
      params.push_back(p.get());
      owned.push_back(std::move(p));
    }
  }
  void set_grads(uint64_t seed) {
    for (size_t i = 0; i < params.size(); ++i)
      params[i]->main_grad.copy_from(
          grad_values(params[i]->weight.shape(), seed + i, params[i]->main_grad.dtype()));
  }
};

void check_adamw(DType weight_dtype, bool offload) {
  const uint64_t seed = testing::test_seed() + 23;
  SCOPED_TRACE(std::string(dtype_name(weight_dtype)) + (offload ? " offloaded" : ""));
  optim::AdamWConfig config;
  config.weight_decay = 0.1f;
  config.use_precision_aware_optimizer = true;
  config.exp_avg_dtype = DType::BF16;
  config.optimizer_cpu_offload = offload;
  config.optimizer_offload_fraction = 0.5;
  Model ref(seed, weight_dtype, DType::F32), bf(seed, weight_dtype, DType::BF16);
  optim::AdamW a(ref.params, config), b(bf.params, config);
  if (offload) {
    EXPECT_GT(b.offloaded_numel(), 0);
  }
  for (int64_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ref.set_grads(seed * 13 + step);
    bf.set_grads(seed * 13 + step);
    const float lr = 1e-2f / float(1 + step % 3);
    if (step % 2) {
      a.step(lr, 0.7f);
      b.step(lr, 0.7f);
    } else {
      const Tensor control = control_for(lr, step, 0.7f, false);
      a.set_step_count(step);
      b.set_step_count(step);
      a.step(control);
      b.step(control);
    }
    auto sa = a.state_tensors(), sb = b.state_tensors();
    for (size_t i = 0; i < ref.params.size(); ++i) {
      SCOPED_TRACE(ref.params[i]->name);
      ASSERT_TRUE(same_bytes(optim::main_param_value(*bf.params[i]),
                             optim::main_param_value(*ref.params[i])));
      ASSERT_TRUE(same_bytes(bf.params[i]->weight, ref.params[i]->weight));
      ASSERT_TRUE(same_bytes(*sb[2 * i].second, *sa[2 * i].second));
      ASSERT_TRUE(same_bytes(*sb[2 * i + 1].second, *sa[2 * i + 1].second));
    }
  }
}

TEST(AdamWBf16Grads, AdamWWithBf16MainGradsIsTheFp32GradRun) {
  check_adamw(DType::BF16, false);  // remainders
  check_adamw(DType::F32, false);   // the weight is the main param
  check_adamw(DType::BF16, true);   // the host half of --optimizer-cpu-offload
}

TEST(AdamWBf16Grads, OtherGradDtypesAreRefused) {
  Lists l = make_lists(3);
  set_grads(l, 4, DType::F32);
  l.grads[1] = l.grads[1].to(DType::F16);
  EXPECT_THROW(ops::multi_tensor_adamw(l.params, l.grads, l.m, l.v, l.copies, l.decays, 1e-3f,
                                       0.9f, 0.95f, 1e-8f, 1, 1.0f, l.keys),
               InternalError);
}

}  // namespace
}  // namespace megaton
