// --optimizer-cpu-offload (optim/optimizer_offload.h, Megatron's HybridDeviceOptimizer): the
// choice of offloaded params (Megatron's threshold rule); an AdamW whose first fraction of
// params keeps its main params and moments in host buffers updates them, over host-path
// and device-controlled steps, bit for bit as the AdamW that keeps them with the params
// (on the CPU backend both run the same CPU update: the GPU's host half is that update
// too); the offloaded state leaves the tensor allocator; a skipped step changes nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/testing.h"
#include "core/dtype.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/optimizer_offload.h"

namespace megaton::optim {
namespace {

using megaton::testing::randn;
using megaton::testing::test_seed;

::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  if (std::memcmp(a.raw(), b.raw(), a.nbytes()) != 0) {
    for (int64_t i = 0; i < a.numel(); ++i)
      if (a.item(i) != b.item(i))
        return ::testing::AssertionFailure() << "element " << i << ": " << a.item(i) << " vs "
                                             << b.item(i);
    return ::testing::AssertionFailure() << "bytes differ";
  }
  return ::testing::AssertionSuccess();
}

// A bf16 (or fp16) model's params (fp32 main param, 16-bit weight) or an fp32 one's (the
// weight is the main param).
struct Model {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
  Model(uint64_t seed, DType weight_dtype) {
    const Shape shapes[] = {{300, 113}, {7}, {64, 40}, {33}};
    for (size_t i = 0; i < std::size(shapes); ++i) {
      auto p = std::make_unique<Param>();
      p->name = "p" + std::to_string(i);
      p->main_param = randn(shapes[i], seed + i, 0.5f);
      p->weight = weight_dtype == DType::F32 ? p->main_param : p->main_param.to(weight_dtype);
      p->main_grad = Tensor::zeros(shapes[i]);
      p->no_weight_decay = i % 2 == 1;
      params.push_back(p.get());
      owned.push_back(std::move(p));
    }
  }
};

AdamWConfig config(bool offload, double fraction) {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.use_precision_aware_optimizer = true;
  c.exp_avg_dtype = DType::BF16;  // the stochastic rounding's keys must follow the params
  c.store_param_remainders = false;  // the offloaded params keep fp32 main params
  c.optimizer_cpu_offload = offload;
  c.optimizer_offload_fraction = fraction;
  return c;
}

TEST(OptimizerOffload, ChoiceFollowsMegatronsThreshold) {
  Model m(1, DType::BF16);  // numels 33900, 7, 2560, 33
  auto flags = [&](double f) {
    std::vector<int> out;
    for (uint8_t b : choose_offloaded_params(m.params, f)) out.push_back(b);
    return out;
  };
  EXPECT_EQ(flags(0.0), (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(flags(0.5), (std::vector<int>{1, 0, 0, 0}));   // the first crosses the threshold
  EXPECT_EQ(flags(0.9287), (std::vector<int>{1, 0, 0, 0}));  // 33900 / 36500 = 0.92877
  EXPECT_EQ(flags(0.93), (std::vector<int>{1, 1, 1, 0}));    // 33907 < 33945: p2 crosses
  EXPECT_EQ(flags(0.999), (std::vector<int>{1, 1, 1, 0}));
  EXPECT_EQ(flags(1.0), (std::vector<int>{1, 1, 1, 1}));
}

// 12 steps, host path and device-controlled path alternating, with a skipped step.
void check_offload_equals_device(DType weight_dtype, double fraction) {
  const uint64_t seed = test_seed() + 11;
  SCOPED_TRACE(std::string(dtype_name(weight_dtype)) + " fraction " + std::to_string(fraction));
  Model off(seed, weight_dtype), on(seed, weight_dtype);
  AdamW a(off.params, config(true, fraction)), b(on.params, config(false, 0));
  const std::vector<uint8_t> chosen = choose_offloaded_params(on.params, fraction);
  int64_t expected = 0;
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (!chosen[i]) continue;
    expected += off.params[i]->weight.numel();
    EXPECT_EQ(off.params[i]->main_param.device(), Device::CPU);
    EXPECT_NE(off.params[i]->main_param.raw(), off.params[i]->weight.raw());
  }
  EXPECT_EQ(a.offloaded_numel(), expected);
  Tensor control = Tensor::empty({ops::kAdamControlSize});
  Tensor norm_bits = Tensor::empty({1}, DType::I64);
  for (int64_t step = 1; step <= 12; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (Model* m : {&off, &on})
      for (size_t i = 0; i < m->params.size(); ++i)
        m->params[i]->main_grad.copy_from(randn(m->params[i]->weight.shape(), seed * 100 + 7 * i + step, 0.3f));
    if (step == 6)  // an overflow: the device-decided step skips
      for (Model* m : {&off, &on}) m->params[2]->main_grad.f32()[3] = INFINITY;
    const float lr = 1e-2f / float(1 + step % 3);
    if (step % 2) {
      a.step(lr, 0.7f);
      b.step(lr, 0.7f);
    } else {
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
    if (step == 6) EXPECT_EQ(control.f32()[ops::kAdamSkip], 1.0f);
    auto sa = a.state_tensors(), sb = b.state_tensors();
    for (size_t i = 0; i < on.params.size(); ++i) {
      const Param& pa = *off.params[i];
      const Param& pb = *on.params[i];
      ASSERT_TRUE(same_bytes(main_param_value(pa), main_param_value(pb))) << pa.name;
      ASSERT_TRUE(same_bytes(pa.weight, pb.weight)) << pa.name;
      ASSERT_TRUE(same_bytes(*sa[2 * i].second, *sb[2 * i].second)) << pa.name;
      ASSERT_TRUE(same_bytes(*sa[2 * i + 1].second, *sb[2 * i + 1].second)) << pa.name;
    }
  }
  EXPECT_EQ(a.step_count(), b.step_count());
}

TEST(OptimizerOffload, UpdatesEqualTheDeviceUpdateBitForBit) {
  for (double fraction : {0.5, 1.0}) {
    check_offload_equals_device(DType::BF16, fraction);
    check_offload_equals_device(DType::F16, fraction);  // --fp16's compute weights
    check_offload_equals_device(DType::F32, fraction);
  }
}

// The offloaded main params and moments are in the offload's host buffer, outside the
// tensor allocator: with everything offloaded the allocator holds 4 + 2 + 4 bytes per
// element less (fp32 main param, bf16 exp_avg, fp32 exp_avg_sq).
TEST(OptimizerOffload, StateLeavesTheTensorAllocator) {
  int64_t held[2] = {0, 0};
  int64_t numel = 0;
  for (int offload = 0; offload < 2; ++offload) {
    Model m(3, DType::BF16);
    numel = 0;
    for (Param* p : m.params) numel += p->weight.numel();
    const int64_t before = host_allocator_stats().allocated_bytes;
    AdamW opt(m.params, config(offload == 1, 1.0));
    held[offload] = host_allocator_stats().allocated_bytes - before;
  }
  EXPECT_LE(held[1], held[0] - 10 * numel + 4096) << held[0] << " vs " << held[1];
}

}  // namespace
}  // namespace megaton::optim
