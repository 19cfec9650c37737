// MoELayer under expert, expert-tensor and tensor parallelism on 4 CPU ranks
// (`mpirun -np 4`), both token dispatchers, against the one-rank layer run on the same
// tokens: outputs, input gradients, the aux loss, the router gradient and every local
// expert's gradients (the one-rank expert's slice under etp). Some layouts force every
// token to experts 0 and 1, so the ranks holding experts 2 and 3 receive no token: they
// must take part in every collective, not hang, and get zero expert gradients. Layouts with
// a capacity factor (token dropping, per rank as Megatron's, so only without TP, where a
// rank's tokens are the reference's) drop copies before the exchange; with
// --moe-pad-expert-input-to-capacity each local expert's input is then exactly capacity x
// (ep x etp) rows, against the one-rank layer's capacity rows. Layouts with a gated shared
// expert run it beside the exchanges (--moe-shared-expert-overlap) and must also equal the
// same layout without the overlap bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>

#include "common/mpi_testing.h"
#include "common/testing.h"
#include "dist/comm.h"
#include "dist/runtime.h"
#include "model/layers.h"
#include "model/moe.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using ::megaton::testing::randn;
using ::megaton::testing::rel_error;

constexpr int64_t kTokens = 12;  // per rank (a TP group's tokens are its members' in order)
constexpr int64_t kHidden = 16;
constexpr double kRelTol = 1e-5;  // whole tensors, fp32 with other summation orders

struct Layout {
  const char* name;
  int64_t tp, ep, etp;
  TokenDispatcher dispatcher;
  bool sequence_parallel;
  // Every token routed to experts 0 and 1 (the ranks of experts 2 and 3 get none).
  bool skewed;
  float capacity_factor = 0.0f;  // token dropping when > 0
  bool pad = false;              // --moe-pad-expert-input-to-capacity
  const char* drop_policy = "probs";
  AlltoAllExchange exchange = AlltoAllExchange::Auto;  // CPU ranks: Regroup
  // A gated shared expert, run beside the exchanges (--moe-shared-expert-overlap).
  bool shared_overlap = false;
  // --overlap-moe-expert-parallel-comm: the rows in two chunks (with a gated shared expert
  // beside the exposed exchanges).
  bool ep_overlap = false;
};

std::string layout_name(const ::testing::TestParamInfo<Layout>& info) { return info.param.name; }

GPTConfig moe_config() {
  GPTConfig c;
  c.num_layers = 2;
  c.hidden_size = kHidden;
  c.num_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 8;
  c.swiglu = true;
  c.disable_bias_linear = false;  // biases: the fc1 bias is split over etp, fc2's is not
  c.moe_aux_loss_coeff = 0.1f;
  c.init_method_std = 0.3f;
  return c;
}

// Nonzero fc2 biases (a function of the global expert index, the same in every layout):
// the experts scale them by the routing probability, so the probabilities' gradient takes
// <dy, b2> (added once under etp).
void set_fc2_biases(MoELayer& layer) {
  for (size_t l = 0; l < layer.experts.size(); ++l) {
    Tensor& b = layer.experts[l].fc2_bias.weight;
    const double g = double(layer.first_local_expert() + int64_t(l));
    for (int64_t h = 0; h < b.numel(); ++h)
      b.f32()[h] = float(0.2 * std::sin(1.3 * (g + 1) + 0.7 * double(h)));
  }
}

// Main grads (zeroed) for a layer's params, as the model's grad buffer would give them.
void attach_grads(MoELayer& layer) {
  std::vector<Param*> params;
  layer.collect_params(params);
  for (Param* p : params) p->main_grad = Tensor::zeros(p->weight.shape());
}

// This rank's tokens and output gradient: seeded by world rank (and salted per layout).
Tensor rank_input(int rank, uint64_t salt, bool skewed) {
  Tensor x = randn({kTokens, kHidden}, ::megaton::testing::test_seed() + 100 * salt + rank);
  if (skewed)  // feature 0 positive: the router below then prefers experts 0 and 1
    for (int64_t t = 0; t < kTokens; ++t)
      x.f32()[t * kHidden] = std::fabs(x.f32()[t * kHidden]) + 3;
  return x;
}
Tensor rank_grad(int rank, uint64_t salt) {
  return randn({kTokens, kHidden}, ::megaton::testing::test_seed() + 100 * salt + 50 + rank);
}

// Rows of several [n, H] tensors stacked in order.
Tensor stack(const std::vector<Tensor>& parts) {
  int64_t rows = 0;
  for (const Tensor& p : parts) rows += p.dim(0);
  Tensor out = Tensor::empty({rows, kHidden});
  int64_t at = 0;
  for (const Tensor& p : parts) {
    out.rows(at, p.dim(0)).copy_from(p);
    at += p.dim(0);
  }
  return out;
}

// The router weight of the skewed layouts: experts 0 and 1 strongly favoured by feature 0.
void skew_router(MoELayer& layer) {
  Tensor& w = layer.router.weight.weight;
  for (int64_t e = 0; e < 4; ++e) w.f32()[e * kHidden] = e < 2 ? 4.0f - float(e) : -4.0f;
}

class MoEParallelTest : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override {
    if (dist::world_size() != 4) GTEST_SKIP() << "needs 4 ranks: mpirun -np 4";
  }
  static dist::Comm& comm() {
    static std::unique_ptr<dist::Comm> c = dist::make_comm(Device::CPU);
    return *c;
  }
};

TEST_P(MoEParallelTest, MatchesOneRank) {
  const Layout& layout = GetParam();
  const int me = dist::world_rank();
  dist::ParallelSizes sizes;
  sizes.tp = layout.tp;
  sizes.ep = layout.ep;
  sizes.etp = layout.etp;
  dist::Grid grid(sizes, 4, me);
  ModelParallel mp;
  mp.grid = &grid;
  mp.comm = &comm();
  mp.sequence_parallel = layout.sequence_parallel;
  mp.dispatcher = layout.dispatcher;
  mp.alltoall_exchange = layout.exchange;
  const uint64_t seed = ::megaton::testing::test_seed();
  SCOPED_TRACE(fmt::format("layout {}, seed {}, world rank {}", layout.name, seed, me));
  const uint64_t salt = std::hash<std::string>{}(layout.name) % 1000;
  GPTConfig cfg = moe_config();
  cfg.moe_expert_capacity_factor = layout.capacity_factor;
  cfg.moe_pad_expert_input_to_capacity = layout.pad;
  cfg.moe_token_drop_policy = layout.drop_policy;
  if (layout.shared_overlap || layout.ep_overlap) {
    cfg.moe_shared_expert_intermediate_size = 8;
    cfg.moe_shared_expert_gate = true;
    cfg.moe_shared_expert_overlap = layout.shared_overlap;
    cfg.overlap_moe_expert_parallel_comm = layout.ep_overlap;
  }
  const std::string prefix = "decoder.layers.0.mlp";

  // The tokens a TP group works on: its members' rows in TP rank order. Under sequence
  // parallelism each member holds its own rows; without, every member holds all of them.
  auto group_tokens = [&](const std::vector<int>& members) {
    std::vector<Tensor> x, dy;
    for (int r : members) {
      x.push_back(rank_input(r, salt, layout.skewed));
      dy.push_back(rank_grad(r, salt));
    }
    return std::pair{stack(x), stack(dy)};
  };
  const dist::Group& tp = grid.tp();
  auto [group_x, group_dy] = group_tokens(tp.ranks);
  const int64_t block = kTokens * tp.size();
  Tensor my_x = layout.sequence_parallel ? rank_input(me, salt, layout.skewed) : group_x;
  Tensor my_dy = layout.sequence_parallel ? rank_grad(me, salt) : group_dy;

  // The parallel layer.
  MoELayer layer(prefix, cfg, seed, mp);
  attach_grads(layer);
  set_fc2_biases(layer);
  if (layout.skewed) skew_router(layer);
  Tensor out = layer.forward(my_x, ForwardContext{});
  const int64_t local = cfg.num_experts / layout.ep;
  if (layout.ep_overlap) {  // the layer really ran in two chunks
    MoELayer::Activations saved = layer.take_saved();
    EXPECT_EQ(saved.moe.chunks.size(), 2u);
    layer.restore_saved(std::move(saved));
  }
  if (layout.pad) {
    // capacity = ceil(T k / E cf) per rank, times the ranks that can send an expert copies.
    const int64_t capacity = int64_t(std::ceil(double(kTokens) * double(cfg.moe_router_topk) /
                                               double(cfg.num_experts) * layout.capacity_factor));
    MoELayer::Activations saved = layer.take_saved();
    EXPECT_EQ(saved.moe.expert_in.dim(0), local * capacity * layout.ep * layout.etp)
        << "padded expert input";
    layer.restore_saved(std::move(saved));
  }
  Tensor dx = layer.backward(my_dy);
  std::vector<Param*> params;
  layer.collect_params(params);
  if (layout.shared_overlap || layout.ep_overlap) {
    // The shared-expert overlap changes the order of work only: the same layout without it
    // gives the same bits, the shared expert's gradients included. The chunks of the
    // expert-parallel overlap also run each expert GEMM per chunk: the expert weight
    // gradients add two partial sums (and the chunked GEMMs may block differently).
    const double tol = layout.ep_overlap ? 1e-6 : 0.0;
    GPTConfig plain_cfg = cfg;
    plain_cfg.moe_shared_expert_overlap = false;
    plain_cfg.overlap_moe_expert_parallel_comm = false;
    MoELayer plain(prefix, plain_cfg, seed, mp);
    attach_grads(plain);
    set_fc2_biases(plain);
    if (layout.skewed) skew_router(plain);
    EXPECT_LE(rel_error(plain.forward(my_x, ForwardContext{}), out), tol) << "output";
    EXPECT_EQ(plain.last_tokens_per_local_expert(), layer.last_tokens_per_local_expert());
    EXPECT_LE(rel_error(plain.backward(my_dy), dx), tol) << "input gradient";
    std::vector<Param*> plain_params;
    plain.collect_params(plain_params);
    ASSERT_EQ(plain_params.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_LE(rel_error(plain_params[i]->main_grad, params[i]->main_grad), tol)
          << params[i]->name;
  }
  all_reduce_sequence_parallel_grads(params, mp);  // the router under TP, as the trainer does
  // Expert replicas on other expert-data-parallel ranks saw other tokens: summed as the
  // optimizer's gradient reduction sums them.
  for (Param* p : params)
    if (p->is_expert) comm().all_reduce(p->main_grad, grid.edp());
  Tensor aux = Tensor::from({1}, {layer.last_aux_loss()});
  comm().all_reduce(aux, grid.tp_cp());
  int64_t routed_here = 0;
  for (int64_t n : layer.last_tokens_per_local_expert()) routed_here += n;
  if (layout.capacity_factor > 0) {
    // Copies were dropped: fewer reached the experts than were routed (each copy is on
    // every ETP member of its expert's ranks).
    Tensor reached = Tensor::from({1}, {float(routed_here)});
    comm().all_reduce(reached, grid.world());
    EXPECT_LT(reached.f32()[0] / float(layout.etp), float(4 * kTokens * cfg.moe_router_topk))
        << "no copy dropped";
  }

  // One-rank references: one per TP group (outputs, dx, aux, router), and the expert
  // gradients summed over all groups (every rank's tokens reach the experts).
  std::map<std::string, Tensor> expert_grad_sum;
  Tensor ref_out, ref_dx, ref_router_grad;
  float ref_aux = 0;
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < 4; ++r) {
    dist::Grid other(sizes, 4, r);
    if (other.tp().ranks[0] == r) groups.push_back(other.tp().ranks);
  }
  for (const std::vector<int>& members : groups) {
    auto [gx, gdy] = group_tokens(members);
    MoELayer ref(prefix, cfg, seed);
    attach_grads(ref);
    set_fc2_biases(ref);
    if (layout.skewed) skew_router(ref);
    Tensor o = ref.forward(gx, ForwardContext{});
    Tensor d = ref.backward(gdy);
    std::vector<Param*> ref_params;
    ref.collect_params(ref_params);
    for (Param* p : ref_params) {
      if (!p->is_expert) continue;
      auto [it, fresh] = expert_grad_sum.try_emplace(p->name, p->main_grad.clone());
      if (!fresh) ops::add_(it->second, p->main_grad);
    }
    if (members == tp.ranks) {
      ref_out = o;
      ref_dx = d;
      ref_aux = ref.last_aux_loss();
      ref_router_grad = ref.router.weight.main_grad;
    }
  }
  if (layout.sequence_parallel) {  // this rank's block of the group's rows
    ref_out = ref_out.rows(tp.rank * kTokens, kTokens);
    ref_dx = ref_dx.rows(tp.rank * kTokens, kTokens);
  } else {
    ASSERT_EQ(ref_out.dim(0), block);
  }

  EXPECT_LE(rel_error(out, ref_out), kRelTol) << "output";
  EXPECT_LE(rel_error(dx, ref_dx), kRelTol) << "input gradient";
  EXPECT_NEAR(aux.f32()[0], ref_aux, 1e-6 + 1e-5 * std::fabs(ref_aux)) << "aux loss";
  EXPECT_LE(rel_error(layer.router.weight.main_grad, ref_router_grad), kRelTol) << "router";

  // Local experts: global names, the one-rank gradient (its etp slice).
  ASSERT_EQ(int64_t(layer.experts.size()), local);
  EXPECT_EQ(layer.first_local_expert(), grid.ep().rank * local);
  for (Param* p : params) {
    if (!p->is_expert) continue;
    SCOPED_TRACE(p->name);
    auto it = expert_grad_sum.find(p->name);
    ASSERT_NE(it, expert_grad_sum.end()) << "not a one-rank parameter";
    Tensor want = p->tp_split_dim < 0 ? it->second
                                      : shard_of(it->second, p->tp_split_dim, grid.etp().rank,
                                                 grid.etp().size(), p->tp_blocks);
    ASSERT_EQ(p->main_grad.shape(), want.shape());
    if (ops::sum_of_squares(want) == 0.0) {
      EXPECT_EQ(ops::sum_of_squares(p->main_grad), 0.0);
    } else {
      EXPECT_LE(rel_error(p->main_grad, want), kRelTol);
    }
  }
  if (layout.skewed) {
    // Experts 2 and 3 got nothing: their ranks' expert inputs were empty.
    if (layer.first_local_expert() >= 2) {
      EXPECT_EQ(routed_here, 0);
      for (Param* p : params)
        if (p->is_expert) {
          EXPECT_EQ(ops::sum_of_squares(p->main_grad), 0.0) << p->name;
        }
    } else {
      EXPECT_GT(routed_here, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MoEParallelTest,
    ::testing::Values(
        Layout{"ep4_alltoall_skewed", 1, 4, 1, TokenDispatcher::AllToAll, false, true},
        Layout{"ep4_allgather_skewed", 1, 4, 1, TokenDispatcher::AllGather, false, true},
        Layout{"ep2_alltoall", 1, 2, 1, TokenDispatcher::AllToAll, false, false},
        Layout{"ep2_etp2_alltoall_skewed", 1, 2, 2, TokenDispatcher::AllToAll, false, true},
        Layout{"ep2_etp2_allgather_skewed", 1, 2, 2, TokenDispatcher::AllGather, false, true},
        Layout{"etp4_alltoall", 1, 1, 4, TokenDispatcher::AllToAll, false, false},
        Layout{"tp2_sp_ep2_etp2_alltoall", 2, 2, 2, TokenDispatcher::AllToAll, true, false},
        Layout{"tp2_sp_ep2_etp1_allgather", 2, 2, 1, TokenDispatcher::AllGather, true, false},
        Layout{"tp2_sp_ep1_etp1_alltoall", 2, 1, 1, TokenDispatcher::AllToAll, true, false},
        Layout{"tp2_nosp_ep1_etp2_alltoall", 2, 1, 2, TokenDispatcher::AllToAll, false, false},
        Layout{"tp4_sp_ep2_etp2_allgather_skewed", 4, 2, 2, TokenDispatcher::AllGather, true, true},
        // Token dropping (capacity 3 of about 6 copies per expert at factor 0.5; the skewed
        // layouts send 12 copies to experts 0 and 1).
        Layout{"ep2_alltoall_capacity", 1, 2, 1, TokenDispatcher::AllToAll, false, false, 0.5f},
        Layout{"ep2_allgather_capacity", 1, 2, 1, TokenDispatcher::AllGather, false, false, 0.5f},
        Layout{"ep2_alltoall_capacity_pad", 1, 2, 1, TokenDispatcher::AllToAll, false, false, 0.5f,
               true},
        Layout{"ep2_allgather_capacity_pad_position", 1, 2, 1, TokenDispatcher::AllGather, false,
               false, 0.5f, true, "position"},
        Layout{"ep4_alltoall_skewed_capacity_pad", 1, 4, 1, TokenDispatcher::AllToAll, false, true,
               1.0f, true},
        Layout{"ep4_allgather_skewed_capacity", 1, 4, 1, TokenDispatcher::AllGather, false, true,
               1.0f},
        Layout{"ep2_etp2_alltoall_skewed_capacity_pad", 1, 2, 2, TokenDispatcher::AllToAll, false,
               true, 0.5f, true},
        Layout{"ep2_etp2_allgather_capacity_position", 1, 2, 2, TokenDispatcher::AllGather, false,
               false, 1.0f, false, "position"},
        Layout{"etp4_alltoall_capacity_pad", 1, 1, 4, TokenDispatcher::AllToAll, false, false, 0.5f,
               true},
        // The all-to-all's chunks pulled straight into their expert groups and back
        // (MEGATON_MOE_ALLTOALL_EXCHANGE=pull; CPU ranks exchange the run lists first);
        // the skewed layouts have empty runs, the capacity ones dropped copies.
        Layout{"ep4_alltoall_skewed_pull", 1, 4, 1, TokenDispatcher::AllToAll, false, true, 0.0f,
               false, "probs", AlltoAllExchange::Pull},
        Layout{"ep2_alltoall_pull", 1, 2, 1, TokenDispatcher::AllToAll, false, false, 0.0f, false,
               "probs", AlltoAllExchange::Pull},
        Layout{"tp2_sp_ep2_etp1_alltoall_pull", 2, 2, 1, TokenDispatcher::AllToAll, true, false,
               0.0f, false, "probs", AlltoAllExchange::Pull},
        Layout{"ep4_alltoall_skewed_capacity_pad_pull", 1, 4, 1, TokenDispatcher::AllToAll, false,
               true, 1.0f, true, "probs", AlltoAllExchange::Pull},
        Layout{"ep2_alltoall_capacity_pull", 1, 2, 1, TokenDispatcher::AllToAll, false, false, 0.5f,
               false, "probs", AlltoAllExchange::Pull},
        // A gated shared expert beside the exchanges: all-to-all, pull, under etp and TP + SP.
        Layout{"ep4_alltoall_skewed_shared_overlap", 1, 4, 1, TokenDispatcher::AllToAll, false,
               true, 0.0f, false, "probs", AlltoAllExchange::Auto, true},
        Layout{"ep2_alltoall_pull_shared_overlap", 1, 2, 1, TokenDispatcher::AllToAll, false, false,
               0.0f, false, "probs", AlltoAllExchange::Pull, true},
        Layout{"ep2_etp2_alltoall_capacity_shared_overlap", 1, 2, 2, TokenDispatcher::AllToAll,
               false, false, 0.5f, false, "probs", AlltoAllExchange::Auto, true},
        Layout{"tp2_sp_ep2_etp1_alltoall_shared_overlap", 2, 2, 1, TokenDispatcher::AllToAll, true,
               false, 0.0f, false, "probs", AlltoAllExchange::Auto, true},
        // The rows in two chunks, each one's exchanges beside the other's experts: skewed
        // (empty chunks on the idle ranks), under etp, with dropping, TP + SP,
        // and pull asked for (the chunks regroup).
        Layout{"ep4_alltoall_skewed_ep_overlap", 1, 4, 1, TokenDispatcher::AllToAll, false, true,
               0.0f, false, "probs", AlltoAllExchange::Auto, false, true},
        Layout{"ep2_etp2_alltoall_ep_overlap", 1, 2, 2, TokenDispatcher::AllToAll, false, false,
               0.0f, false, "probs", AlltoAllExchange::Auto, false, true},
        Layout{"ep2_alltoall_capacity_ep_overlap", 1, 2, 1, TokenDispatcher::AllToAll, false, false,
               0.5f, false, "probs", AlltoAllExchange::Auto, false, true},
        Layout{"tp2_sp_ep2_etp1_alltoall_pull_ep_overlap", 2, 2, 1, TokenDispatcher::AllToAll, true,
               false, 0.0f, false, "probs", AlltoAllExchange::Pull, false, true},
        // Pull asked for where it cannot pull (experts split over etp): the regrouping path.
        Layout{"ep2_etp2_alltoall_pull_falls_back", 1, 2, 2, TokenDispatcher::AllToAll, false,
               false, 0.0f, false, "probs", AlltoAllExchange::Pull}),
    layout_name);

}  // namespace
}  // namespace megaton

int main(int argc, char** argv) { return megaton::testing::run_mpi_tests(argc, argv); }
