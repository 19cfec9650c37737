// optim::Muon and the rules DistributedAdamW hosts (--optimizer muon, sgd, lion) on one CPU
// rank: Muon's steps replay Emerging-Optimizers v0.3.0's (tests/golden/muon_golden.safetensors,
// tools/make_muon_golden.py), its QKV split replays Megatron's TensorParallelMuon, the
// device control's skip and gradient scale act as on Adam, and DistributedAdamW routes each
// param to its rule, writes each rule's state by parameter and loads it back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/muon_golden.h"
#include "common/testing.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "model/param_buffer.h"
#include "ops/muon.h"
#include "ops/ops.h"
#include "optim/distrib_optimizer.h"
#include "optim/muon_optimizer.h"

namespace megaton::optim {
namespace {

using megaton::testing::randn;
using nlohmann::json;

using testing::muon_golden::cases;
using testing::muon_golden::tensor;

dist::Comm& cpu_comm() {
  static std::unique_ptr<dist::Comm> comm = dist::make_comm(Device::CPU);
  return *comm;
}
const dist::Grid& one_rank_grid() {
  static const dist::Grid grid(dist::ParallelSizes{}, 1, 0);
  return grid;
}

// An fp32 param (its weight is its main param) with a main grad.
std::unique_ptr<Param> matrix(const std::string& name, const Tensor& value) {
  auto p = std::make_unique<Param>();
  p->name = name;
  p->weight = value.clone();
  p->main_param = p->weight;
  p->main_grad = Tensor::zeros(value.shape());
  p->full_shape = value.shape();
  return p;
}

double rel(const Tensor& got, const Tensor& want) { return megaton::testing::rel_error(got, want); }

MuonConfig golden_config(const json& settings) {
  MuonConfig c;
  c.momentum = float(settings.at("momentum").get<double>());
  c.extra_scale_factor = float(settings.at("extra_scale_factor").get<double>());
  c.coefficients = ops::parse_ns_coefficients(settings.at("coefficient_type"));
  c.num_ns_steps = settings.at("num_ns_steps");
  c.scale_mode = ops::parse_muon_scale_mode(settings.at("scale_mode"));
  return c;
}

// EO's three OrthogonalizedOptimizer steps (decoupled weight decay, EMA momentum with and
// without Nesterov, spectral scale) through Muon::step. Tolerance as test_muon_golden's
// optimizer cases (1e-5 relative; the CPU iterates in fp64, EO in fp32).
TEST(MuonOptimizer, GoldenStepsThroughMuon) {
  const json& muon = cases("muon");
  const json& settings = muon.at("settings");
  const float lr = float(settings.at("lr").get<double>());
  const float wd = float(settings.at("weight_decay").get<double>());
  for (const auto& [name, c] : muon.at("cases").items()) {
    MuonConfig config = golden_config(settings);
    config.nesterov = c.at("nesterov");
    auto p = matrix("decoder.layers.0.mlp.linear_fc1.weight", tensor(name + ".param.0"));
    Muon opt({{p.get(), p.get()}}, config, wd, one_rank_grid(), cpu_comm());
    ASSERT_EQ(opt.state_tensors().size(), 1u);
    EXPECT_EQ(opt.state_tensors()[0].first, p->name + ".momentum_buffer");
    for (int k = 1; k <= muon.at("steps").get<int>(); ++k) {
      p->main_grad.copy_from(tensor(name + ".grad." + std::to_string(k)));
      opt.step(testing::step_control(lr, 1.0f, false));
      const double dm =
          rel(*opt.state_tensors()[0].second, tensor(name + ".momentum." + std::to_string(k)));
      const double dp = rel(p->weight, tensor(name + ".param." + std::to_string(k)));
      std::printf("  %s step %d: momentum rel %.2e, param rel %.2e\n", name.c_str(), k, dm, dp);
      EXPECT_LE(dm, 1e-5) << name << " step " << k;
      EXPECT_LE(dp, 1e-5) << name << " step " << k;
    }
  }
}

// A skipped step changes nothing (momentum nor param); a gradient scale s on g equals the
// step on s g, bit for bit (powers of two are exact).
TEST(MuonOptimizer, ControlSkipsAndScales) {
  const Tensor w = randn({24, 40}, 11), g = randn({24, 40}, 12);
  auto a = matrix("a.weight", w), b = matrix("b.weight", w);
  Muon ma({{a.get(), a.get()}}, MuonConfig{}, 0.1f, one_rank_grid(), cpu_comm());
  Muon mb({{b.get(), b.get()}}, MuonConfig{}, 0.1f, one_rank_grid(), cpu_comm());
  a->main_grad.copy_from(g);
  ma.step(testing::step_control(0.02f, 1.0f, /*skip=*/true));
  EXPECT_EQ(std::memcmp(a->weight.raw(), w.raw(), w.nbytes()), 0);
  EXPECT_EQ(rel(*ma.state_tensors()[0].second, Tensor::zeros(w.shape())), 0.0);
  Tensor g2 = g.clone();
  ops::scale_(g2, 4.0f);
  a->main_grad.copy_from(g2);
  b->main_grad.copy_from(g);
  ma.step(testing::step_control(0.02f, 0.25f, false));
  mb.step(testing::step_control(0.02f, 1.0f, false));
  EXPECT_EQ(std::memcmp(a->weight.raw(), b->weight.raw(), w.nbytes()), 0);
  EXPECT_GT(rel(a->weight, w), 1e-4);  // it did move
}

// Matrices of one shape go through one batched Newton-Schulz call: the same bits as each
// param's own optimizer (the CPU iterates each matrix in fp64 either way).
TEST(MuonOptimizer, BatchedEqualsOneByOne) {
  std::vector<std::unique_ptr<Param>> together, alone;
  const Shape shapes[] = {{24, 40}, {24, 40}, {40, 24}, {24, 40}};
  for (size_t k = 0; k < std::size(shapes); ++k) {
    together.push_back(matrix("m" + std::to_string(k), randn(shapes[k], 20 + k)));
    alone.push_back(matrix("m" + std::to_string(k), randn(shapes[k], 20 + k)));
  }
  std::vector<RuleParam> all;
  for (auto& p : together) all.push_back({p.get(), p.get()});
  Muon batched(all, MuonConfig{}, 0.1f, one_rank_grid(), cpu_comm());
  std::vector<std::unique_ptr<Muon>> singles;
  for (auto& p : alone)
    singles.push_back(std::make_unique<Muon>(std::vector<RuleParam>{{p.get(), p.get()}},
                                             MuonConfig{}, 0.1f, one_rank_grid(), cpu_comm()));
  for (int step = 0; step < 2; ++step) {
    for (size_t k = 0; k < together.size(); ++k) {
      const Tensor g = randn(shapes[k], 100 * step + k);
      together[k]->main_grad.copy_from(g);
      alone[k]->main_grad.copy_from(g);
      singles[k]->step(testing::step_control(0.02f, 1.0f, false));
    }
    batched.step(testing::step_control(0.02f, 1.0f, false));
  }
  for (size_t k = 0; k < together.size(); ++k)
    EXPECT_EQ(std::memcmp(together[k]->weight.raw(), alone[k]->weight.raw(),
                          together[k]->weight.nbytes()),
              0)
        << k;
}

// The QKV split of TensorParallelMuon (golden "qkv" cases): with momentum 0 the update is
// the gradient, and lr 1 with no weight decay leaves -O in a zero param.
TEST(MuonOptimizer, QkvSplitThroughMuon) {
  const json& qkv = cases("qkv");
  const int64_t groups = qkv.at("num_query_groups"), heads_per_group = qkv.at("heads_per_group");
  const json& settings = qkv.at("settings");
  const Tensor& u = tensor("qkv.update");
  for (const auto& [name, c] : qkv.at("cases").items()) {
    MuonConfig config;
    config.momentum = 0.0f;
    config.coefficients = ops::parse_ns_coefficients(settings.at("coefficient_type"));
    config.num_ns_steps = settings.at("num_ns_steps");
    config.extra_scale_factor = float(settings.at("extra_scale_factor").get<double>());
    config.scale_mode = ops::parse_muon_scale_mode(c.at("scale_mode"));
    config.split_qkv = c.at("split_qkv");
    auto p = matrix("decoder.layers.0.self_attention.linear_qkv.weight", Tensor::zeros(u.shape()));
    p->qkv_split_rows = ops::qkv_split_shapes(groups * heads_per_group, groups, qkv.at("head_dim"));
    Muon opt({{p.get(), p.get()}}, config, 0.0f, one_rank_grid(), cpu_comm());
    p->main_grad.copy_from(u);
    opt.step(testing::step_control(1.0f, 1.0f, false));
    Tensor minus = p->weight.clone();
    ops::scale_(minus, -1.0f);
    const double d = rel(minus, tensor(name));
    std::printf("  %s: rel %.2e\n", name.c_str(), d);
    EXPECT_LE(d, 1e-5) << name;
  }
}

// DistributedAdamW with --optimizer muon routes a 2-D weight to Muon and the rest (a bias, a
// norm, the word embeddings) to Adam; full_state names each rule's state; a load into a
// fresh optimizer gives the same next step, bit for bit.
struct RoutedRun {
  std::vector<std::unique_ptr<Param>> owned;
  std::vector<Param*> params;
  std::unique_ptr<ParamAndGradBuffer> buffer;
  std::unique_ptr<DistributedAdamW> opt;
  explicit RoutedRun(OptimizerConfig optimizer, AdamWConfig adam = {}) {
    owned.push_back(matrix("embedding.word_embeddings.weight", randn({32, 16}, 1)));
    owned.back()->padded_vocab_rows = true;
    owned.push_back(matrix("decoder.layers.0.mlp.linear_fc1.weight", randn({48, 16}, 2)));
    owned.push_back(matrix("decoder.layers.0.mlp.linear_fc1.bias", randn({48}, 3)));
    owned.back()->no_weight_decay = true;
    owned.push_back(matrix("decoder.layers.0.mlp.linear_fc2.weight", randn({16, 48}, 4)));
    for (auto& p : owned) params.push_back(p.get());
    buffer = std::make_unique<ParamAndGradBuffer>(params, 1, false);
    opt = std::make_unique<DistributedAdamW>(std::vector<ParamAndGradBuffer*>{buffer.get()},
                                             one_rank_grid(), cpu_comm(), adam, false, optimizer);
  }
  void step(uint64_t seed) {
    for (size_t i = 0; i < params.size(); ++i)
      params[i]->main_grad.copy_from(randn(params[i]->weight.shape(), seed * 10 + i));
    opt->step(1e-2f, 1.0f);
  }
  std::map<std::string, Tensor> state() {
    std::map<std::string, Tensor> out;
    for (auto& [name, t] : opt->full_state()) out[name] = t.clone();
    return out;
  }
};

TEST(MuonOptimizer, DistributedAdamWRoutesAndCheckpointsByParameter) {
  OptimizerConfig muon;
  muon.kind = OptimizerKind::Muon;
  using Rule = DistributedAdamW::Rule;
  RoutedRun run(muon);
  EXPECT_EQ(DistributedAdamW::rule_of(muon, *run.params[0]), Rule::Adam);  // embeddings
  EXPECT_EQ(DistributedAdamW::rule_of(muon, *run.params[1]), Rule::Muon);
  EXPECT_EQ(DistributedAdamW::rule_of(muon, *run.params[2]), Rule::Adam);  // 1-D
  Param in_proj = *run.params[1];
  in_proj.use_muon = false;  // Mamba's in_proj
  EXPECT_EQ(DistributedAdamW::rule_of(muon, in_proj), Rule::Adam);
  OptimizerConfig lion;
  lion.kind = OptimizerKind::Lion;
  EXPECT_EQ(DistributedAdamW::rule_of(lion, in_proj), Rule::Lion);  // no use_muon for Lion
  muon.muon.scalar_optimizer = OptimizerKind::Lion;
  EXPECT_EQ(DistributedAdamW::rule_of(muon, *run.params[2]), Rule::Lion);
  muon.muon.scalar_optimizer = OptimizerKind::Adam;

  run.step(1);
  run.step(2);
  const std::map<std::string, Tensor> saved = run.state();
  EXPECT_TRUE(saved.count("optimizer.decoder.layers.0.mlp.linear_fc1.weight.momentum_buffer"));
  EXPECT_FALSE(saved.count("optimizer.decoder.layers.0.mlp.linear_fc1.weight.exp_avg"));
  EXPECT_TRUE(saved.count("optimizer.decoder.layers.0.mlp.linear_fc1.bias.exp_avg_sq"));
  EXPECT_TRUE(saved.count("optimizer.embedding.word_embeddings.weight.exp_avg"));
  EXPECT_EQ(saved.size(), 4u + 2u + 1u + 2u + 1u);  // 4 main params, 2 Adam x 2, 2 Muon x 1
  // Resume: a fresh optimizer loaded from the state steps to the same bits.
  RoutedRun resumed(muon);
  resumed.opt->load_full_state(
      [&](const std::string& name) -> const Tensor* {
        auto it = saved.find(name);
        return it == saved.end() ? nullptr : &it->second;
      },
      "test state", true);
  resumed.opt->set_step_count(run.opt->step_count());
  run.step(3);
  resumed.step(3);
  for (size_t i = 0; i < run.params.size(); ++i)
    EXPECT_EQ(std::memcmp(run.params[i]->weight.raw(), resumed.params[i]->weight.raw(),
                          run.params[i]->weight.nbytes()),
              0)
        << run.params[i]->name;
  // A missing Muon state is named.
  std::map<std::string, Tensor> missing = saved;
  missing.erase("optimizer.decoder.layers.0.mlp.linear_fc2.weight.momentum_buffer");
  RoutedRun other(muon);
  try {
    other.opt->load_full_state(
        [&](const std::string& name) -> const Tensor* {
          auto it = missing.find(name);
          return it == missing.end() ? nullptr : &it->second;
        },
        "test state", true);
    FAIL() << "loaded without a momentum buffer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear_fc2.weight.momentum_buffer"), std::string::npos)
        << e.what();
  }
}

// SGD and Lion through DistributedAdamW: one step from zero state against the closed forms
// (SGD: p - lr (g + wd p); Lion: p (1 - lr wd) - lr sign((1 - beta1) g)).
TEST(MuonOptimizer, SgdAndLionRules) {
  for (OptimizerKind kind : {OptimizerKind::Sgd, OptimizerKind::Lion}) {
    OptimizerConfig config;
    config.kind = kind;
    RoutedRun run(config);
    std::vector<Tensor> before;
    for (Param* p : run.params) before.push_back(p->weight.clone());
    run.step(7);
    const float lr = 1e-2f, wd = AdamWConfig{}.weight_decay;
    for (size_t i = 0; i < run.params.size(); ++i) {
      const Param& p = *run.params[i];
      const DistributedAdamW::Rule rule = DistributedAdamW::rule_of(config, p);
      if (rule == DistributedAdamW::Rule::Adam) continue;  // Lion's embeddings and bias
      const float d = p.no_weight_decay ? 0.0f : wd;
      for (int64_t e = 0; e < p.weight.numel(); ++e) {
        const float w = before[i].f32()[e], g = p.main_grad.f32()[e];
        const float want = kind == OptimizerKind::Sgd
                               ? w - lr * (g + d * w)
                               : w * (1 - lr * d) - lr * (g > 0 ? 1.0f : (g < 0 ? -1.0f : 0.0f));
        ASSERT_NEAR(p.weight.f32()[e], want, 1e-6f * (1 + std::fabs(want)))
            << optimizer_kind_name(kind) << " " << p.name << " " << e;
      }
    }
  }
}

// Three steps against the closed forms with every beta set apart, so that a swapped or
// wrong beta shows: SGD's --sgd-momentum, a top-level Lion's Adam betas (Megatron's
// _default_adam_based_eopt_config_to_kwargs), Muon's scalar Lion's --lion-beta1/2.
TEST(MuonOptimizer, SgdAndLionBetasOverSteps) {
  struct Case {
    const char* name;
    OptimizerKind kind;
    bool scalar_lion;
  };
  for (const Case& c :
       {Case{"sgd", OptimizerKind::Sgd, false}, Case{"lion", OptimizerKind::Lion, false},
        Case{"muon scalar lion", OptimizerKind::Muon, true}}) {
    SCOPED_TRACE(c.name);
    OptimizerConfig config;
    config.kind = c.kind;
    config.sgd_momentum = 0.7f;
    config.lion_beta1 = 0.6f;
    config.lion_beta2 = 0.8f;
    if (c.scalar_lion) config.muon.scalar_optimizer = OptimizerKind::Lion;
    AdamWConfig adam;
    adam.adam_beta1 = 0.3f;
    adam.adam_beta2 = 0.5f;
    adam.weight_decay = 0.05f;
    RoutedRun run(config, adam);
    // The closed forms in fp64, param by param, for the params of the rule under test.
    const float lr = 1e-2f;
    const double b1 = c.kind == OptimizerKind::Sgd ? 0.7 : c.scalar_lion ? 0.6 : 0.3;
    const double b2 = c.scalar_lion ? 0.8 : 0.5;
    std::vector<std::vector<double>> w(run.params.size()), m(run.params.size());
    for (size_t i = 0; i < run.params.size(); ++i) {
      const Tensor& t = run.params[i]->weight;
      w[i].assign(t.f32(), t.f32() + t.numel());
      m[i].assign(size_t(t.numel()), 0.0);
    }
    for (uint64_t step = 1; step <= 3; ++step) {
      run.step(step);
      for (size_t i = 0; i < run.params.size(); ++i) {
        const Param& p = *run.params[i];
        const DistributedAdamW::Rule rule = DistributedAdamW::rule_of(config, p);
        if (rule != DistributedAdamW::Rule::Sgd && rule != DistributedAdamW::Rule::Lion) continue;
        const double wd = p.no_weight_decay ? 0.0 : 0.05;
        for (int64_t e = 0; e < p.weight.numel(); ++e) {
          const double g = p.main_grad.f32()[e];
          double& x = w[i][size_t(e)];
          double& mom = m[i][size_t(e)];
          if (rule == DistributedAdamW::Rule::Sgd) {
            mom = b1 * mom + (g + wd * x);
            x -= lr * mom;
          } else {
            const double u = b1 * mom + (1 - b1) * g;
            x = x * (1 - lr * wd) - lr * (u > 0 ? 1.0 : u < 0 ? -1.0 : 0.0);
            mom = b2 * mom + (1 - b2) * g;
          }
          ASSERT_NEAR(p.weight.f32()[e], x, 1e-5 * (1 + std::fabs(x)))
              << p.name << " element " << e << " step " << step;
        }
      }
    }
  }
}

}  // namespace
}  // namespace megaton::optim
