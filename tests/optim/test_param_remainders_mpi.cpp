// The distributed optimizer keeping main params as int16 remainders (store_param_remainders)
// on 4 CPU ranks (data-parallel 4, bf16 weights, bf16 moments): each rank's shard pieces,
// params cut at shard boundaries included, give after every step and the weights'
// all-gather the one-rank AdamW with fp32 main params, bit for bit (its weights rounded as
// the split rounds); the assembled full state holds those fp32 main params; its params
// norm is theirs; loading the one-rank state resumes on the same bits.
#include <gtest/gtest.h>

#include <cmath>
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
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/distrib_optimizer.h"

namespace megaton::optim {
namespace {

using megaton::testing::randn;
using megaton::testing::test_seed;

const uint16_t* u16(const Tensor& t) { return static_cast<const uint16_t*>(t.raw()); }
const uint32_t* u32(const Tensor& t) { return static_cast<const uint32_t*>(t.raw()); }

uint16_t te_weight(uint32_t master) {
  int16_t high = int16_t(uint16_t(master >> 16));
  if (int16_t(uint16_t(master & 0xFFFFu)) < 0) high = int16_t(high + 1);
  return uint16_t(high);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

struct Model {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
};

// The same params on every rank: fp32 main params (one element in seven a rounding tie)
// and their bf16 casts. Sizes that cut the first param across the four shards.
Model make_model(uint64_t seed) {
  Model m;
  const std::pair<const char*, Shape> specs[] = {{"decoder.layers.0.mlp.linear_fc1.weight", {300, 113}},
                                                 {"decoder.layers.0.mlp.linear_fc1.bias", {7}},
                                                 {"decoder.final_layernorm.weight", {33}}};
  uint64_t k = 0;
  for (const auto& [name, shape] : specs) {
    auto p = std::make_unique<Param>();
    p->name = name;
    p->main_param = randn(shape, seed + ++k, 0.5f);
    auto* bits = static_cast<uint32_t*>(p->main_param.raw());
    for (int64_t i = 0; i < p->main_param.numel(); i += 7) bits[i] = (bits[i] & 0xFFFF0000u) | 0x8000u;
    p->weight = p->main_param.to(DType::BF16);
    p->main_grad = Tensor::zeros(shape);
    p->no_weight_decay = k > 1;
    m.params.push_back(p.get());
    m.owned.push_back(std::move(p));
  }
  return m;
}

AdamWConfig config(bool remainders) {
  AdamWConfig c;
  c.weight_decay = 0.1f;
  c.use_precision_aware_optimizer = true;
  c.exp_avg_dtype = DType::BF16;
  c.exp_avg_sq_dtype = DType::BF16;
  c.store_param_remainders = remainders;
  return c;
}

dist::Comm& comm() {
  static std::unique_ptr<dist::Comm> c = dist::make_comm(Device::CPU);
  return *c;
}

// DP 4: a model in a 4-shard buffer with its sharded DistributedAdamW.
struct ShardedRun {
  Model model;
  std::unique_ptr<ParamAndGradBuffer> buffer;
  std::unique_ptr<DistributedAdamW> opt;
  ShardedRun(uint64_t seed, const dist::Grid& grid) : model(make_model(seed)) {
    buffer = std::make_unique<ParamAndGradBuffer>(model.params, 4, false);
    opt = std::make_unique<DistributedAdamW>(std::vector<ParamAndGradBuffer*>{buffer.get()}, grid,
                                             comm(), config(true), true);
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

// Each weight is the reference's main param rounded as the split rounds it.
void expect_weights_follow(const Model& sharded, const Model& reference) {
  for (size_t i = 0; i < sharded.params.size(); ++i) {
    const Param& p = *sharded.params[i];
    const Param& r = *reference.params[i];
    for (int64_t k = 0; k < p.weight.numel(); ++k)
      ASSERT_EQ(u16(p.weight)[k], te_weight(u32(r.main_param)[k])) << p.name << " element " << k;
  }
}

TEST(ParamRemaindersMpi, ShardedRemaindersGiveTheOneRankFp32Run) {
  if (dist::world_size() != 4) GTEST_SKIP() << "needs 4 ranks: mpirun -np 4";
  const int me = dist::world_rank();
  const dist::Grid grid(dist::ParallelSizes{}, 4, me);
  ASSERT_EQ(grid.dp().size(), 4);
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", rank " + std::to_string(me));
  ShardedRun run(seed, grid);
  Model reference = make_model(seed);
  AdamW one_rank(reference.params, config(false));
  // Before any step every rank already holds the weights the owners will write.
  expect_weights_follow(run.model, reference);
  for (int64_t step = 1; step <= 5; ++step) {
    std::vector<Tensor> grads;
    for (size_t i = 0; i < reference.params.size(); ++i)
      grads.push_back(randn(reference.params[i]->weight.shape(), seed * 10 + uint64_t(step) + 100 * i, 0.3f));
    run.step(grads, 1e-2f, grid);
    for (size_t i = 0; i < grads.size(); ++i) reference.params[i]->main_grad.copy_from(grads[i]);
    one_rank.step(1e-2f, 1.0f);
    expect_weights_follow(run.model, reference);
  }
  // The full state (assembled on data-parallel rank 0) holds the fp32 main params.
  std::map<std::string, Tensor> state;
  for (auto& [name, t] : run.opt->full_state()) state[name] = t.clone();
  auto moments = one_rank.state_tensors();
  if (me == 0) {
    ASSERT_EQ(state.size(), 3 * reference.params.size());
    for (size_t i = 0; i < reference.params.size(); ++i) {
      const Param& r = *reference.params[i];
      EXPECT_TRUE(same_bytes(state.at("model." + r.name), r.main_param)) << r.name;
      EXPECT_TRUE(same_bytes(state.at("optimizer." + moments[2 * i].first), *moments[2 * i].second));
    }
  } else {
    EXPECT_TRUE(state.empty());
  }
  double sum = 0;
  for (Param* p : reference.params) sum += ops::sum_of_squares(p->main_param);
  EXPECT_NEAR(run.opt->params_norm(), std::sqrt(sum), 1e-12 * std::sqrt(sum));

  // Every rank loads the one-rank state into a fresh sharded run, which then steps as the
  // one-rank run does.
  std::map<std::string, Tensor> full;
  for (size_t i = 0; i < reference.params.size(); ++i) {
    full["model." + reference.params[i]->name] = reference.params[i]->main_param.clone();
    full["optimizer." + moments[2 * i].first] = moments[2 * i].second->clone();
    full["optimizer." + moments[2 * i + 1].first] = moments[2 * i + 1].second->clone();
  }
  ShardedRun resumed(seed + 1000, grid);
  resumed.opt->load_full_state(
      [&](const std::string& name) -> const Tensor* {
        auto it = full.find(name);
        return it == full.end() ? nullptr : &it->second;
      },
      "one-rank state", true);
  resumed.opt->set_step_count(5);
  expect_weights_follow(resumed.model, reference);
  std::vector<Tensor> grads;
  for (size_t i = 0; i < reference.params.size(); ++i)
    grads.push_back(randn(reference.params[i]->weight.shape(), seed * 77 + i, 0.3f));
  resumed.step(grads, 5e-3f, grid);
  for (size_t i = 0; i < grads.size(); ++i) reference.params[i]->main_grad.copy_from(grads[i]);
  one_rank.step(5e-3f, 1.0f);
  expect_weights_follow(resumed.model, reference);
  std::map<std::string, Tensor> after;
  for (auto& [name, t] : resumed.opt->full_state()) after[name] = t.clone();
  if (me == 0) {
    for (const Param* r : reference.params)
      EXPECT_TRUE(same_bytes(after.at("model." + r->name), r->main_param)) << r->name;
  }
}

}  // namespace
}  // namespace megaton::optim

int main(int argc, char** argv) { return megaton::testing::run_mpi_tests(argc, argv); }
