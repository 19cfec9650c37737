// MoELayer with token dropping by capacity (--moe-expert-capacity-factor) on one rank, both
// token dispatchers, with and without --moe-pad-expert-input-to-capacity: the experts
// receive only the kept copies (or exactly their padded capacity), and the output and every
// gradient equal an explicit fp64 reference in which every routed copy, dropped ones
// included, is computed by its expert and weighted by its probability times keep (0 for a
// dropped copy: the semantics of Megatron's apply_router_token_dropping, and of Megaton
// before dropped copies were skipped). Reference gradients are central finite differences
// of that reference with the routing (chosen experts and kept copies) held fixed, as the
// selection has no gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/testing.h"
#include "model/moe.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using ::megaton::testing::randn;
using ::megaton::testing::rel_error;

constexpr int64_t kTokens = 24, kHidden = 16, kExperts = 4, kTopk = 2, kFfn = 8;
constexpr double kRelTol = 1e-5;  // whole tensors: fp32 layer against the fp64 reference

struct DropCase {
  const char* name;
  TokenDispatcher dispatcher;
  bool pad;
  const char* policy;  // --moe-token-drop-policy
  bool swiglu;
};

std::string case_name(const ::testing::TestParamInfo<DropCase>& info) { return info.param.name; }

GPTConfig drop_config(const DropCase& c, float capacity_factor) {
  GPTConfig cfg;
  cfg.num_layers = 2;
  cfg.hidden_size = kHidden;
  cfg.num_experts = kExperts;
  cfg.moe_router_topk = kTopk;
  cfg.moe_ffn_hidden_size = kFfn;
  cfg.swiglu = c.swiglu;
  cfg.disable_bias_linear = false;  // the expert biases must see the right rows
  cfg.moe_aux_loss_coeff = 0.0f;    // the reference has the routed output only
  cfg.init_method_std = 0.3f;
  cfg.moe_expert_capacity_factor = capacity_factor;
  cfg.moe_token_drop_policy = c.policy;
  cfg.moe_pad_expert_input_to_capacity = c.pad && capacity_factor > 0;
  return cfg;
}

// Main grads (zeroed) and random biases (they are created zero).
void prepare(MoELayer& layer, uint64_t seed) {
  std::vector<Param*> params;
  layer.collect_params(params);
  for (Param* p : params) p->main_grad = Tensor::zeros(p->weight.shape());
  for (size_t e = 0; e < layer.experts.size(); ++e) {
    layer.experts[e].fc1_bias.weight.copy_from(
        randn({layer.experts[e].fc1_bias.weight.numel()}, seed + 10 * e, 0.5f));
    layer.experts[e].fc2_bias.weight.copy_from(randn({kHidden}, seed + 10 * e + 1, 0.5f));
  }
}

std::vector<double> to_double(const Tensor& t) {
  std::vector<double> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.f32()[i];
  return v;
}

Tensor to_tensor(const std::vector<double>& v, const Shape& shape) {
  Tensor t = Tensor::empty(shape);
  for (size_t i = 0; i < v.size(); ++i) t.f32()[i] = float(v[i]);
  return t;
}

// The layer's function in fp64, with a fixed routing: out[t] = sum_j keep[t, j] p[t, j]
// expert_{idx[t, j]}(x[t]), p the softmax over the k chosen router logits.
struct Reference {
  bool swiglu = false;
  std::vector<int32_t> idx;  // [T, k] chosen experts
  std::vector<double> keep;  // [T, k] 1 kept, 0 dropped
  // Inputs and parameters (fp64 copies, perturbed by the finite differences).
  std::vector<double> x, router;                      // [T, H], [E, H]
  std::vector<std::vector<double>> fc1, b1, fc2, b2;  // per expert [f1, H], [f1], [H, F], [H]

  std::vector<double> forward() const {
    const int64_t f1 = swiglu ? 2 * kFfn : kFfn;
    std::vector<double> out(kTokens * kHidden, 0.0);
    for (int64_t t = 0; t < kTokens; ++t) {
      const double* xt = &x[t * kHidden];
      double logit[kTopk], norm = 0, top = -INFINITY;
      for (int64_t j = 0; j < kTopk; ++j) {
        const int64_t e = idx[t * kTopk + j];
        logit[j] = 0;
        for (int64_t h = 0; h < kHidden; ++h) logit[j] += xt[h] * router[e * kHidden + h];
        top = std::max(top, logit[j]);
      }
      for (int64_t j = 0; j < kTopk; ++j) norm += std::exp(logit[j] - top);
      for (int64_t j = 0; j < kTopk; ++j) {
        const int64_t e = idx[t * kTopk + j];
        const double weight = keep[t * kTopk + j] * std::exp(logit[j] - top) / norm;
        // Every copy is computed, a dropped one weighted 0.
        std::vector<double> hidden(f1), act(kFfn);
        for (int64_t o = 0; o < f1; ++o) {
          double s = b1[e][o];
          for (int64_t h = 0; h < kHidden; ++h) s += fc1[e][o * kHidden + h] * xt[h];
          hidden[o] = s;
        }
        for (int64_t o = 0; o < kFfn; ++o) {
          if (swiglu) {
            const double g = hidden[o];
            act[o] = g / (1.0 + std::exp(-g)) * hidden[kFfn + o];
          } else {
            act[o] = 0.5 * hidden[o] * (1.0 + std::erf(hidden[o] / std::sqrt(2.0)));
          }
        }
        for (int64_t h = 0; h < kHidden; ++h) {
          double s = b2[e][h];
          for (int64_t o = 0; o < kFfn; ++o) s += fc2[e][h * kFfn + o] * act[o];
          out[t * kHidden + h] += weight * s;
        }
      }
    }
    return out;
  }

  double objective(const std::vector<double>& dy) const {
    const std::vector<double> out = forward();
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += dy[i] * out[i];
    return s;
  }

  // d objective / d v for every element of v (a member of this reference).
  std::vector<double> gradient(std::vector<double>& v, const std::vector<double>& dy) {
    constexpr double eps = 1e-5;  // fp64: truncation ~1e-10, rounding ~1e-11
    std::vector<double> g(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const double orig = v[i];
      v[i] = orig + eps;
      const double up = objective(dy);
      v[i] = orig - eps;
      const double down = objective(dy);
      v[i] = orig;
      g[i] = (up - down) / (2 * eps);
    }
    return g;
  }
};

class MoEDroppingTest : public ::testing::TestWithParam<DropCase> {};

TEST_P(MoEDroppingTest, ExpertsComputeOnlyKeptCopiesAndMatchTheReference) {
  const DropCase& c = GetParam();
  const uint64_t seed = ::megaton::testing::test_seed();
  SCOPED_TRACE(std::string(c.name) + ", seed " + std::to_string(seed));
  // capacity = ceil(T k / E cf) = ceil(24 x 2 / 4 x 0.5) = 6 of about 12 copies per expert.
  const float capacity_factor = 0.5f;
  const int64_t capacity = 6;
  const GPTConfig cfg = drop_config(c, capacity_factor);
  ModelParallel mp;
  mp.dispatcher = c.dispatcher;
  MoELayer layer("decoder.layers.0.mlp", cfg, seed, mp);
  prepare(layer, seed + 1);
  const Tensor x = randn({kTokens, kHidden}, seed + 2);
  const Tensor dy = randn({kTokens, kHidden}, seed + 3);

  // The routing, from the router ops (tested against Megatron on their own).
  Tensor logits = Tensor::empty({kTokens, kExperts});
  ops::gemm(x, false, layer.router.weight.weight, true, logits);
  Tensor probs = Tensor::empty({kTokens, kTopk});
  Tensor indices = Tensor::empty({kTokens, kTopk}, DType::I32);
  ops::RouterTopK options;
  options.topk = kTopk;
  ops::moe_router_topk_forward(logits, Tensor(), options, probs, indices);
  Tensor keep = Tensor::empty({kTokens, kTopk}), kept = Tensor::zeros({kExperts});
  ops::moe_capacity_drop(probs, indices, kExperts, capacity, std::string(c.policy) == "position",
                         keep, kept);
  int64_t kept_copies = 0;
  for (int64_t i = 0; i < kTokens * kTopk; ++i) kept_copies += keep.f32()[i] != 0.0f;
  ASSERT_LT(kept_copies, kTokens * kTopk) << "the case must drop copies";
  for (int64_t e = 0; e < kExperts; ++e)  // so that every expert has a gradient to compare
    ASSERT_GT(kept.f32()[e], 0.0f) << "expert " << e << " keeps no copy";

  Tensor out = layer.forward(x, ForwardContext{});
  // The experts' input: the kept copies only, or each expert's capacity rows when padded.
  MoELayer::Activations saved = layer.take_saved();
  const int64_t want_rows = c.pad ? kExperts * capacity : kept_copies;
  EXPECT_EQ(saved.moe.expert_in.dim(0), want_rows) << "expert input rows";
  EXPECT_EQ(saved.moe.fc1_out.dim(0), want_rows) << "fc1 rows";
  layer.restore_saved(std::move(saved));
  int64_t reported = 0;
  for (int64_t e = 0; e < kExperts; ++e) {
    EXPECT_EQ(layer.last_tokens_per_local_expert()[e], int64_t(kept.f32()[e])) << "expert " << e;
    reported += layer.last_tokens_per_local_expert()[e];
  }
  EXPECT_EQ(reported, kept_copies);
  // The expert bias's counts: the kept copies, as before.
  EXPECT_EQ(layer.router.tokens_per_expert().to_vector(), kept.to_vector());
  Tensor dx = layer.backward(dy);

  Reference ref;
  ref.swiglu = c.swiglu;
  ref.idx.assign(indices.i32(), indices.i32() + indices.numel());
  ref.keep = to_double(keep);
  ref.x = to_double(x);
  ref.router = to_double(layer.router.weight.weight);
  for (const MoELayer::Expert& e : layer.experts) {
    ref.fc1.push_back(to_double(e.fc1_weight.weight));
    ref.b1.push_back(to_double(e.fc1_bias.weight));
    ref.fc2.push_back(to_double(e.fc2_weight.weight));
    ref.b2.push_back(to_double(e.fc2_bias.weight));
  }
  const std::vector<double> dy64 = to_double(dy);
  EXPECT_LE(rel_error(out, to_tensor(ref.forward(), {kTokens, kHidden})), kRelTol) << "output";
  EXPECT_LE(rel_error(dx, to_tensor(ref.gradient(ref.x, dy64), {kTokens, kHidden})), kRelTol)
      << "input gradient";
  EXPECT_LE(rel_error(layer.router.weight.main_grad,
                      to_tensor(ref.gradient(ref.router, dy64), {kExperts, kHidden})),
            kRelTol)
      << "router gradient";
  for (int64_t e = 0; e < kExperts; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    const MoELayer::Expert& ex = layer.experts[e];
    EXPECT_LE(rel_error(ex.fc1_weight.main_grad,
                        to_tensor(ref.gradient(ref.fc1[e], dy64), ex.fc1_weight.weight.shape())),
              kRelTol)
        << "fc1";
    EXPECT_LE(rel_error(ex.fc1_bias.main_grad,
                        to_tensor(ref.gradient(ref.b1[e], dy64), ex.fc1_bias.weight.shape())),
              kRelTol)
        << "fc1 bias";
    EXPECT_LE(rel_error(ex.fc2_weight.main_grad,
                        to_tensor(ref.gradient(ref.fc2[e], dy64), ex.fc2_weight.weight.shape())),
              kRelTol)
        << "fc2";
    EXPECT_LE(rel_error(ex.fc2_bias.main_grad,
                        to_tensor(ref.gradient(ref.b2[e], dy64), ex.fc2_bias.weight.shape())),
              kRelTol)
        << "fc2 bias";
  }
}

// A capacity no expert's count exceeds drops nothing: the same bits as the dropless layer
// (with padding the GEMMs run on more rows, which may change the summation order of the
// weight gradients: equal to fp32 rounding).
TEST_P(MoEDroppingTest, EnoughCapacityGivesTheDroplessBits) {
  const DropCase& c = GetParam();
  const uint64_t seed = ::megaton::testing::test_seed();
  SCOPED_TRACE(std::string(c.name) + ", seed " + std::to_string(seed));
  const Tensor x = randn({kTokens, kHidden}, seed + 2);
  const Tensor dy = randn({kTokens, kHidden}, seed + 3);
  std::vector<Tensor> results[2];
  for (int run = 0; run < 2; ++run) {
    // capacity factor E / k = 2: capacity = T, the most copies an expert can get.
    const GPTConfig cfg = drop_config(c, run == 0 ? 0.0f : 2.0f);
    ModelParallel mp;
    mp.dispatcher = c.dispatcher;
    MoELayer layer("decoder.layers.0.mlp", cfg, seed, mp);
    prepare(layer, seed + 1);
    results[run].push_back(layer.forward(x, ForwardContext{}));
    results[run].push_back(layer.backward(dy));
    std::vector<Param*> params;
    layer.collect_params(params);
    for (Param* p : params) results[run].push_back(p->main_grad);
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  for (size_t i = 0; i < results[0].size(); ++i) {
    if (c.pad) {
      EXPECT_LE(rel_error(results[1][i], results[0][i]), 1e-6) << "tensor " << i;
    } else {
      EXPECT_TRUE(::megaton::testing::allclose(results[1][i], results[0][i], 0, 0))
          << "tensor " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoEDroppingTest,
    ::testing::Values(
        DropCase{"alltoall_probs_swiglu", TokenDispatcher::AllToAll, false, "probs", true},
        DropCase{"alltoall_position_gelu", TokenDispatcher::AllToAll, false, "position", false},
        DropCase{"alltoall_pad_probs_swiglu", TokenDispatcher::AllToAll, true, "probs", true},
        DropCase{"allgather_probs_gelu", TokenDispatcher::AllGather, false, "probs", false},
        DropCase{"allgather_pad_position_swiglu", TokenDispatcher::AllGather, true, "position",
                 true}),
    case_name);

}  // namespace
}  // namespace megaton
