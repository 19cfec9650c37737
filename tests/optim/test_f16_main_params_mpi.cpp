// fp16 main params (--main-params-dtype fp16) under the distributed optimizer on 4 CPU
// ranks (data-parallel 4, one param cut across the four shards; hand-made BF16 weights):
// each parameter's absmax is reduced over the shards, so after every step the assembled
// main params (fp32 values), their scales, the moments and the all-gathered weights are
// the one-rank AdamW's bit for bit; a one-rank state loaded into a fresh sharded run steps
// on the same bits.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/mpi_testing.h"
#include "core/dtype.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "dist/runtime.h"
#include "model/param_buffer.h"
#include "ops/adam_f16_main_param.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/distrib_optimizer.h"

namespace megaton::optim {
namespace {

using megaton::testing::randn;
using megaton::testing::test_seed;

::testing::AssertionResult same_bytes(const Tensor& a_any, const Tensor& b_any) {
  const Tensor a = a_any.to(Device::CPU), b = b_any.to(Device::CPU);
  if (a.nbytes() != b.nbytes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "different sizes or dtypes";
  if (std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0) return ::testing::AssertionSuccess();
  for (int64_t i = 0; i < a.numel(); ++i)
    if (a.item(i) != b.item(i))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << a.item(i) << " vs " << b.item(i);
  return ::testing::AssertionFailure() << "bytes differ";
}

struct Model {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
};

// bf16 weights over fp32 main params; the first param is cut across the four shards.
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

AdamWConfig config() {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.use_precision_aware_optimizer = true;
  c.main_params_dtype = DType::F16;
  c.exp_avg_dtype = DType::BF16;
  c.exp_avg_sq_dtype = DType::F16;
  return c;
}

dist::Comm& comm() {
  static std::unique_ptr<dist::Comm> c = dist::make_comm(Device::CPU);
  return *c;
}

struct ShardedRun {
  Model model;
  std::unique_ptr<ParamAndGradBuffer> buffer;
  std::unique_ptr<DistributedAdamW> opt;
  ShardedRun(uint64_t seed, const dist::Grid& grid) : model(make_model(seed)) {
    buffer = std::make_unique<ParamAndGradBuffer>(model.params, 4, false);
    opt = std::make_unique<DistributedAdamW>(std::vector<ParamAndGradBuffer*>{buffer.get()}, grid,
                                             comm(), config(), true);
  }
  // The reduced gradients (sums over the 4 ranks: 4 g), the step, the weights' all-gather.
  void step(const std::vector<Tensor>& grads, float lr, const dist::Grid& grid) {
    for (size_t i = 0; i < grads.size(); ++i) {
      Tensor g = grads[i].clone();
      ops::scale_(g, 4.0f);
      model.params[i]->main_grad.copy_from(g);
    }
    opt->step(lr, 1.0f);
    for (size_t b = 0; b < buffer->buckets().size(); ++b) {
      Tensor all = buffer->bucket_weights(b);
      comm().all_gather(buffer->weight_shard(b, grid.dp().rank), all, grid.dp());
    }
  }
};

// The assembled state (on data-parallel rank 0) against the one-rank AdamW.
void expect_state_equal(DistributedAdamW& opt, AdamW& one_rank, const Model& reference, int me) {
  std::map<std::string, Tensor> state;
  for (auto& [name, t] : opt.full_state()) state[name] = t.clone();
  if (me != 0) {
    EXPECT_TRUE(state.empty());
    return;
  }
  auto moments = one_rank.state_tensors();
  // main, 2 moments, exp_avg_sq's scale, the main param's scale
  ASSERT_EQ(state.size(), 5 * reference.params.size());
  for (size_t i = 0; i < reference.params.size(); ++i) {
    const Param& r = *reference.params[i];
    SCOPED_TRACE(r.name);
    ASSERT_TRUE(r.main_param_f16.defined());
    EXPECT_TRUE(same_bytes(state.at("model." + r.name), main_param_value(r)));
    EXPECT_TRUE(same_bytes(state.at("optimizer." + r.name + ".main_param.scale"),
                           r.main_param_scale.view({1})));
    EXPECT_GT(r.main_param_scale.f32()[0], 0.0f);
    EXPECT_TRUE(same_bytes(state.at("optimizer." + r.name + ".exp_avg"), *moments[2 * i].second));
    EXPECT_TRUE(
        same_bytes(state.at("optimizer." + r.name + ".exp_avg_sq"), *moments[2 * i + 1].second));
    EXPECT_TRUE(same_bytes(state.at("optimizer." + r.name + ".exp_avg_sq.scale"),
                           one_rank.moment_scales(i).rows(1, 1)));
  }
}

void expect_weights_equal(const Model& a, const Model& b) {
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(same_bytes(a.params[i]->weight, b.params[i]->weight)) << a.params[i]->name;
}

TEST(F16MainParamsMpi, ShardedFp16MainParamsGiveTheOneRankRun) {
  if (dist::world_size() != 4) GTEST_SKIP() << "needs 4 ranks: mpirun -np 4";
  const int me = dist::world_rank();
  const dist::Grid grid(dist::ParallelSizes{}, 4, me);
  ASSERT_EQ(grid.dp().size(), 4);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", rank " + std::to_string(me));
  ShardedRun run(seed, grid);
  Model reference = make_model(seed);
  AdamW one_rank(reference.params, config());
  for (int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<Tensor> grads;
    for (size_t i = 0; i < reference.params.size(); ++i)
      grads.push_back(
          randn(reference.params[i]->weight.shape(), seed * 10 + uint64_t(step) + 100 * i, 0.3f));
    run.step(grads, 1e-2f, grid);
    for (size_t i = 0; i < grads.size(); ++i) reference.params[i]->main_grad.copy_from(grads[i]);
    one_rank.step(1e-2f, 1.0f);
    expect_state_equal(*run.opt, one_rank, reference, me);
    expect_weights_equal(run.model, reference);
  }
  // The one-rank state, scales included, resumes in a fresh sharded run on the same bits.
  std::map<std::string, Tensor> full;
  auto moments = one_rank.state_tensors();
  for (size_t i = 0; i < reference.params.size(); ++i) {
    const std::string& name = reference.params[i]->name;
    full["model." + name] = main_param_value(*reference.params[i]).clone();
    full["optimizer." + name + ".main_param.scale"] =
        reference.params[i]->main_param_scale.view({1}).clone();
    full["optimizer." + name + ".exp_avg"] = moments[2 * i].second->clone();
    full["optimizer." + name + ".exp_avg_sq"] = moments[2 * i + 1].second->clone();
    full["optimizer." + name + ".exp_avg_sq.scale"] = one_rank.moment_scales(i).rows(1, 1).clone();
  }
  ShardedRun resumed(seed + 1000, grid);
  resumed.opt->load_full_state(
      [&](const std::string& name) -> const Tensor* {
        auto it = full.find(name);
        return it == full.end() ? nullptr : &it->second;
      },
      "one-rank state", true);
  resumed.opt->set_step_count(4);
  std::vector<Tensor> grads;
  for (size_t i = 0; i < reference.params.size(); ++i)
    grads.push_back(randn(reference.params[i]->weight.shape(), seed * 77 + i, 0.3f));
  resumed.step(grads, 5e-3f, grid);
  for (size_t i = 0; i < grads.size(); ++i) reference.params[i]->main_grad.copy_from(grads[i]);
  one_rank.step(5e-3f, 1.0f);
  expect_state_equal(*resumed.opt, one_rank, reference, me);
  expect_weights_equal(resumed.model, reference);
}

}  // namespace
}  // namespace megaton::optim

int main(int argc, char** argv) { return megaton::testing::run_mpi_tests(argc, argv); }
