// The CPU MoE router ops (ops.h, "MoE router, all of Megatron's options") against
// Megatron-LM's own functions: tests/golden/router_golden.safetensors, written by
// tools/make_router_golden.py from Megatron-LM d98e8a64 (TopKRouter.routing on seeded
// logits, and moe_utils functions called directly). Each check prints its worst
// difference. Finite differences, door checks and the fills: test_ops_moe_router.cpp.
//
// Tolerances: Megatron's fp32 results come from torch's fp32 kernels, ours from fp64
// accumulation rounded once; the two differ by a few fp32 ulps of the intermediate
// values, so fp32 comparisons use 1e-6 absolute and 1e-5 relative (CONVENTIONS' CPU-vs-CPU
// 5e-6 relative is for two fp32 implementations of the same summation order). fp64 cases
// are compared at fp32 tolerance (Megatron computes the router's scores in fp32 there
// too); the bf16 case at bf16 tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "common/testing.h"
#include "ops/ops.h"

namespace megaton {
namespace {

using nlohmann::json;
using ops::RouterScoreFunction;
using ops::RouterTopK;
using testing::poison;

constexpr double kGoldenAtol = 1e-6, kGoldenRtol = 1e-5;
constexpr double kBf16Atol = 1e-5, kBf16Rtol = 1e-2;

// ---------------------------------------------------------------------------------------
// Golden data

const ckpt::SafetensorsFile& golden() {
  static const ckpt::SafetensorsFile f = ckpt::load_safetensors(
      std::string(MEGATON_SOURCE_DIR) + "/tests/golden/router_golden.safetensors");
  return f;
}
const json& golden_meta() {
  static const json j = json::parse(golden().metadata.at("golden"));
  return j;
}
const json& golden_case(const std::string& name) { return golden_meta().at("cases").at(name); }
bool has_tensor(const std::string& name) { return golden().tensors.count(name) > 0; }

const Tensor& raw_tensor(const std::string& name) {
  auto it = golden().tensors.find(name);
  if (it == golden().tensors.end()) throw std::runtime_error("golden tensor missing: " + name);
  return it->second;
}
bool is_f64(const std::string& name) {
  const json& names = golden_meta().at("f64_tensors");
  return std::find(names.begin(), names.end(), name) != names.end();
}
// A golden float tensor as fp32: fp64 ones (stored as I64 bit patterns) rounded, BF16
// widened. Megaton's router math is fp32 (Megatron's fp64 router dtype also computes its
// scores in fp32).
Tensor golden_f32(const std::string& name) {
  const Tensor& t = raw_tensor(name);
  if (is_f64(name)) {
    Tensor out = Tensor::empty(t.shape());
    for (int64_t i = 0; i < t.numel(); ++i) out.f32()[i] = float(std::bit_cast<double>(t.i64()[i]));
    return out;
  }
  if (t.dtype() == DType::F32) return t.clone();
  return t.to(DType::F32);
}
// An integer golden tensor (I32 0/1 maps, I64 indices).
std::vector<int64_t> golden_ints(const std::string& name) {
  const Tensor& t = raw_tensor(name);
  std::vector<int64_t> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i)
    v[i] = t.dtype() == DType::I64 ? t.i64()[i] : int64_t(t.i32()[i]);
  return v;
}
double golden_scalar(const std::string& name) {
  const Tensor& t = raw_tensor(name);
  return is_f64(name) ? std::bit_cast<double>(t.i64()[0]) : double(t.f32()[0]);
}

// Checks got against Megatron's want elementwise (at most 5 failures reported) and prints
// the worst absolute difference.
void expect_close(const Tensor& got, const Tensor& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  int bad = 0;
  double worst = 0, worst_rel = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.item(i), w = want.item(i);
    const double diff = std::abs(g - w);
    worst = std::max(worst, diff);
    if (w != 0) worst_rel = std::max(worst_rel, diff / std::abs(w));
    if (!(diff <= atol + rtol * std::abs(w)) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: " << g << " vs Megatron " << w;
  }
  std::printf("  %-58s max |diff| %.2e (rel %.2e)\n", what.c_str(), worst, worst_rel);
}
void expect_scalar_close(double got, double want, double rtol, const std::string& what) {
  EXPECT_LE(std::abs(got - want), rtol * std::abs(want)) << what << ": " << got << " vs " << want;
  std::printf("  %-58s |diff| %.2e (rel %.2e)\n", what.c_str(), std::abs(got - want),
              std::abs(got - want) / std::max(std::abs(want), 1e-30));
}

RouterScoreFunction score_function_of(const std::string& s) {
  if (s == "softmax") return RouterScoreFunction::Softmax;
  if (s == "sigmoid") return RouterScoreFunction::Sigmoid;
  if (s == "sqrtsoftplus") return RouterScoreFunction::SqrtSoftplus;
  throw std::runtime_error("unknown score function " + s);
}

std::vector<std::string> string_list(const json& j) {
  if (j.is_null()) return {};
  if (j.is_string()) return {j.get<std::string>()};
  return j.get<std::vector<std::string>>();
}

// The options of TopKRouter.routing for a golden router case. Megatron's sinkhorn router
// routes by sinkhorn in training; in evaluation it takes the top-k of sigmoid (k = 1) or
// of the softmax over all experts, which are these ops' sigmoid and pre-softmax modes.
RouterTopK options_of(const json& c) {
  RouterTopK o;
  o.topk = c.at("topk");
  o.score_function = score_function_of(c.at("score_function"));
  o.pre_softmax = c.at("pre_softmax");
  if (!c.at("topk_scaling_factor").is_null()) o.scaling_factor = c.at("topk_scaling_factor");
  if (!c.at("num_groups").is_null()) {
    o.num_groups = c.at("num_groups");
    o.group_topk = c.at("group_topk");
  }
  const auto types = string_list(c.at("load_balancing_type"));
  if (std::find(types.begin(), types.end(), "sinkhorn") != types.end()) {
    if (c.value("training", true)) {
      o.sinkhorn = true;
    } else if (o.topk == 1) {
      o.score_function = RouterScoreFunction::Sigmoid;
    } else {
      o.score_function = RouterScoreFunction::Softmax;
      o.pre_softmax = true;
    }
  }
  return o;
}

// Megatron row s * B + b <-> Megaton row b * S + s (seq_aux_loss groups rows by sequence).
Tensor to_megaton_rows(const Tensor& t, int64_t B, int64_t S) {
  const int64_t T = B * S, E = t.numel() / T;
  Tensor out = Tensor::empty({T, E});
  for (int64_t r = 0; r < T; ++r)
    std::memcpy(out.f32() + ((r % B) * S + r / B) * E, t.f32() + r * E, E * sizeof(float));
  return out;
}
Tensor to_megatron_rows(const Tensor& t, int64_t B, int64_t S) {
  const int64_t T = B * S, E = t.numel() / T;
  Tensor out = Tensor::empty({T, E});
  for (int64_t r = 0; r < T; ++r)
    std::memcpy(out.f32() + r * E, t.f32() + ((r % B) * S + r / B) * E, E * sizeof(float));
  return out;
}

// ---------------------------------------------------------------------------------------
// Golden: TopKRouter.routing cases (routing, probabilities, logit gradients, aux losses)

// The gradient Megatron's injected losses put on the logits of one micro-batch (z_loss,
// aux_loss, seq_aux_loss, global_aux_loss), built from this file's ops as the router
// will: statistics, the switch loss c E / (k T^2) sum_e score_sums[e] counts[e], and its
// coeffs. Also checks each injected loss value. running_counts carries global_aux_loss's
// tokens per expert over micro-batches.
Tensor injected_loss_gradient(const std::string& prefix, const json& c, const Tensor& logits,
                              int64_t S, int64_t B, int64_t micro_batch,
                              std::vector<double>& running_counts) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const int k = c.at("topk");
  const RouterScoreFunction sf = score_function_of(c.at("score_function"));
  const double backward_scale = c.at("aux_loss_backward_scale");
  // --calculate-per-token-loss: each loss is injected times the local token count.
  const double per_token = c.value("calculate_per_token_loss", false) ? double(T) : 1.0;
  const auto injected = string_list(c.at("injected_losses"));
  const auto types = string_list(c.at("load_balancing_type"));
  auto coeff_of = [&](const std::string& type) {
    const json& coeffs = c.at("aux_loss_coeff");
    if (!coeffs.is_array()) return coeffs.get<double>();
    const auto it = std::find(types.begin(), types.end(), type);
    return coeffs.at(it - types.begin()).get<double>();
  };
  auto injects = [&](const std::string& loss) {
    return std::find(injected.begin(), injected.end(), loss) != injected.end();
  };
  Tensor dlogits = Tensor::zeros({T, E});

  if (injects("z_loss")) {
    // z_loss_func: coeff * mean_t lse_t^2 (TP x CP = 1).
    const double coeff = c.at("z_loss_coeff");
    Tensor lse = Tensor::empty({T});
    ops::moe_router_logsumexp(logits, lse);
    double sum_sq = 0;
    for (int64_t t = 0; t < T; ++t) sum_sq += double(lse.f32()[t]) * lse.f32()[t];
    expect_scalar_close(coeff * sum_sq / double(T) * per_token,
                        golden_scalar(prefix + ".loss.z_loss"), 1e-5, prefix + " loss.z_loss");
    ops::moe_z_loss_backward(float(2.0 * coeff / double(T) * backward_scale * per_token), logits,
                             lse, dlogits);
  }

  Tensor scores = Tensor::empty({T, E}), sums = Tensor::empty({1, E}),
         counts = Tensor::empty({1, E});
  ops::moe_aux_loss_statistics(logits, sf, k, 0, T, scores, sums, counts);
  // switch_load_balancing_loss_func with tokens per expert n over `tokens` tokens.
  auto switch_loss = [&](double coeff, const std::vector<double>& n, double tokens) {
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += double(sums.f32()[e]) * n[e];
    return coeff * double(E) / (double(k) * tokens * tokens) * sum;
  };
  auto add_switch_gradient = [&](double coeff, const std::vector<double>& n, double tokens) {
    Tensor coeffs = Tensor::empty({1, E});
    for (int64_t e = 0; e < E; ++e)
      coeffs.f32()[e] = float(coeff * double(E) / (double(k) * tokens * tokens) * n[e] *
                              backward_scale * per_token);
    ops::moe_aux_loss_statistics_backward(coeffs, logits, scores, sf, 0, T, dlogits);
  };
  std::vector<double> n(E);
  for (int64_t e = 0; e < E; ++e) n[e] = counts.f32()[e];

  if (injects("aux_loss")) {
    const double coeff = coeff_of("aux_loss");
    expect_scalar_close(switch_loss(coeff, n, double(T)) * per_token,
                        golden_scalar(prefix + ".loss.aux_loss"), 1e-5, prefix + " loss.aux_loss");
    add_switch_gradient(coeff, n, double(T));
  }
  if (injects("global_aux_loss")) {
    // Tokens per expert summed over the step's micro-batches so far, averaged.
    const double coeff = coeff_of("global_aux_loss");
    std::vector<double> mean(E);
    Tensor running = Tensor::empty({E});
    for (int64_t e = 0; e < E; ++e) {
      running_counts[e] += n[e];
      running.f32()[e] = float(running_counts[e]);
      mean[e] = running_counts[e] / double(micro_batch + 1);
    }
    expect_close(running, golden_f32(prefix + ".global_tokens_per_expert"), 0, 0,
                 prefix + " global_tokens_per_expert");
    expect_scalar_close(switch_loss(coeff, mean, double(T)) * per_token,
                        golden_scalar(prefix + ".loss.global_aux_loss"), 1e-5,
                        prefix + " loss.global_aux_loss");
    add_switch_gradient(coeff, mean, double(T));
  }
  if (injects("seq_aux_loss")) {
    // Per sequence: statistics over the sequence's S tokens (Megaton's batch-major rows,
    // one group per sequence), the loss summed over sequences and divided by B.
    const double coeff = coeff_of("seq_aux_loss");
    Tensor x = to_megaton_rows(logits, B, S);
    Tensor seq_scores = Tensor::empty({T, E}), seq_sums = Tensor::empty({B, E}),
           seq_counts = Tensor::empty({B, E}), seq_coeffs = Tensor::empty({B, E});
    ops::moe_aux_loss_statistics(x, sf, k, 0, S, seq_scores, seq_sums, seq_counts);
    const double factor = coeff * double(E) / (double(k) * double(S) * double(S) * double(B));
    double loss = 0;
    for (int64_t i = 0; i < B * E; ++i) {
      loss += factor * double(seq_sums.f32()[i]) * seq_counts.f32()[i];
      seq_coeffs.f32()[i] = float(factor * seq_counts.f32()[i] * backward_scale * per_token);
    }
    expect_scalar_close(loss * per_token, golden_scalar(prefix + ".loss.seq_aux_loss"), 1e-5,
                        prefix + " loss.seq_aux_loss");
    Tensor dx = Tensor::zeros({T, E});
    ops::moe_aux_loss_statistics_backward(seq_coeffs, x, seq_scores, sf, 0, S, dx);
    ops::add_(dlogits, to_megatron_rows(dx, B, S));
  }
  return dlogits;
}

TEST(MoeRouterGolden, RoutingCasesMatchMegatron) {
  int cases_run = 0;
  for (const auto& [name, c] : golden_meta().at("cases").items()) {
    if (name.starts_with("fn.") || name.starts_with("dist.")) continue;
    SCOPED_TRACE(name);
    std::printf("%s\n", name.c_str());
    const RouterTopK options = options_of(c);
    const int k = options.topk;
    const bool bf16 = c.value("dtype", "fp32") == "bf16";
    const double atol = bf16 ? kBf16Atol : kGoldenAtol, rtol = bf16 ? kBf16Rtol : kGoldenRtol;
    const bool capacity = !c.at("capacity_factor").is_null();
    const bool force = c.value("force_load_balancing", false);
    const int64_t M = c.value("micro_batches", 1);
    const int64_t S = c.at("seq_length"), B = c.at("micro_batch_size");
    std::vector<double> running_counts(int64_t(c.at("num_experts")), 0.0);
    for (int64_t m = 0; m < M; ++m) {
      const std::string p = M > 1 ? name + ".mb" + std::to_string(m) : name;
      Tensor logits = golden_f32(p + ".logits");
      const int64_t E = logits.dim(-1), T = logits.numel() / E;
      ASSERT_EQ(T, S * B);
      logits = logits.view({T, E});
      // Forced balancing routes on the random logits; its backward passes the gradient
      // through to the real logits unchanged (RandomSTE).
      const Tensor routed = force ? golden_f32(p + ".random_logits").view({T, E}) : logits;
      Tensor bias;
      if (has_tensor(p + ".expert_bias")) bias = golden_f32(p + ".expert_bias");

      Tensor probs = Tensor::empty({T, k}), indices = Tensor::empty({T, k}, DType::I32);
      poison(probs);
      indices.fill(-7);
      ops::moe_router_topk_forward(routed, bias, options, probs, indices);
      // Capacity cases: routing before token dropping (dropping is not this op's).
      const std::string probs_name = capacity ? p + ".pre_drop_probs" : p + ".probs";
      const std::string map_name = capacity ? p + ".pre_drop_routing_map" : p + ".routing_map";
      const std::vector<int64_t> want_map = golden_ints(map_name);
      Tensor dense = Tensor::zeros({T, E});
      std::vector<int64_t> map(T * E, 0);
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
          const int32_t e = indices.i32()[t * k + j];
          ASSERT_TRUE(e >= 0 && e < E) << "row " << t << " slot " << j << ": " << e;
          map[t * E + e] = 1;
          dense.f32()[t * E + e] = probs.f32()[t * k + j];
        }
      EXPECT_EQ(map, want_map) << "routing map";
      if (bf16) dense = dense.to(DType::BF16).to(DType::F32);  // Megatron's probs.type_as
      expect_close(dense, golden_f32(probs_name), atol, rtol, p + " probs");
      if (has_tensor(p + ".local_tokens_per_expert")) {
        Tensor tokens = Tensor::zeros({E});
        ops::moe_tokens_per_expert(indices, E, tokens);
        expect_close(tokens, golden_f32(p + ".local_tokens_per_expert"), 0, 0,
                     p + " tokens_per_expert");
      }

      // d sum(final_probs * upstream) / d probs: the upstream at the chosen experts, where
      // token dropping kept them (final_probs = probs * final_map).
      const Tensor upstream = golden_f32(p + ".upstream");
      const std::vector<int64_t> final_map = golden_ints(p + ".routing_map");
      Tensor dprobs = Tensor::empty({T, k});
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
          const int64_t i = t * E + indices.i32()[t * k + j];
          dprobs.f32()[t * k + j] = upstream.f32()[i] * float(capacity ? final_map[i] : 1);
        }
      Tensor dlogits = Tensor::empty({T, E});
      poison(dlogits);
      ops::moe_router_topk_backward(dprobs, routed, probs, indices, options, dlogits);
      Tensor want_dlogits = golden_f32(p + ".dlogits").view({T, E});
      if (has_tensor(p + ".dlogits_aux")) {
        const Tensor aux = golden_f32(p + ".dlogits_aux").view({T, E});
        // The routing's share of Megatron's gradient (the injected losses' share apart).
        ops::add_(want_dlogits, aux, -1.0f);
        // The injected losses, where this op set can build them (no padding mask).
        if (!c.value("padding", false)) {
          const Tensor ours = injected_loss_gradient(p, c, logits, S, B, m, running_counts);
          expect_close(ours, aux, atol, rtol, p + " dlogits_aux");
        }
      }
      expect_close(dlogits, want_dlogits, atol, rtol, p + " dlogits (routing)");

      if (has_tensor(p + ".sinkhorn_out")) {
        Tensor out = Tensor::empty({T, E});
        poison(out);
        ops::moe_sinkhorn(logits, out);
        expect_close(out, golden_f32(p + ".sinkhorn_out"), kGoldenAtol, kGoldenRtol,
                     p + " sinkhorn_out");
      }
    }
    ++cases_run;
  }
  EXPECT_EQ(cases_run, 52);  // every TopKRouter.routing case of the file
}

// ---------------------------------------------------------------------------------------
// Golden: token dropping (apply_router_token_dropping, the "cap_*" cases)

// get_capacity(num_tokens = T k, E, cf) as apply_router_token_dropping calls it:
// ceil((T k / E) cf) in double.
int64_t expert_capacity(int64_t T, int64_t k, int64_t E, double capacity_factor) {
  return int64_t(std::ceil(double(T * k) / double(E) * capacity_factor));
}

TEST(MoeRouterGolden, ExpertCapacityIsMegatronsGetCapacity) {
  int entries = 0;
  for (const json& c : golden_meta().at("capacity")) {
    EXPECT_EQ(expert_capacity(c.at("num_tokens"), c.at("topk"), c.at("num_experts"),
                              c.at("capacity_factor")),
              c.at("expert_capacity").get<int64_t>())
        << c.dump();
    ++entries;
  }
  EXPECT_EQ(entries, 10);
}

TEST(MoeRouterGolden, CapacityDropMatchesMegatron) {
  int cases_run = 0, exact_cases = 0;
  for (const auto& [name, c] : golden_meta().at("cases").items()) {
    if (!name.starts_with("cap_")) continue;
    SCOPED_TRACE(name);
    std::printf("%s\n", name.c_str());
    const int64_t T = c.at("num_tokens"), E = c.at("num_experts");
    const int k = c.at("topk");
    const int64_t capacity = expert_capacity(T, k, E, c.at("capacity_factor"));
    EXPECT_EQ(capacity, c.at("expert_capacity").get<int64_t>());
    const bool by_position = c.at("drop_policy") == "position";
    const std::string map_check = c.at("checks").at("routing_map");
    const std::string probs_check = c.at("checks").at("probs");
    const std::vector<int64_t> pre_map = golden_ints(name + ".pre_drop_routing_map");
    const std::vector<int64_t> want_map = golden_ints(name + ".routing_map");
    const Tensor pre_probs = golden_f32(name + ".pre_drop_probs");
    const Tensor want_probs = golden_f32(name + ".probs");
    ASSERT_EQ(int64_t(pre_map.size()), T * E);
    ASSERT_EQ(int64_t(want_map.size()), T * E);

    // The router's outputs [T, k] for Megatron's pre-drop routing: each row's k experts
    // (ascending; the order within a row does not change what is dropped) and their
    // probabilities, bit for bit.
    Tensor probs = Tensor::empty({T, k}), indices = Tensor::empty({T, k}, DType::I32);
    for (int64_t t = 0; t < T; ++t) {
      int j = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (!pre_map[t * E + e]) continue;
        ASSERT_LT(j, k) << "row " << t;
        indices.i32()[t * k + j] = int32_t(e);
        probs.f32()[t * k + j] = pre_probs.f32()[t * E + e];
        ++j;
      }
      ASSERT_EQ(j, k) << "row " << t;
    }
    Tensor keep = Tensor::empty({T, k}), kept_counts = Tensor::zeros({E});
    poison(keep);
    ops::moe_capacity_drop(probs, indices, E, capacity, by_position, keep, kept_counts);

    // Ours as Megatron's dense map and probs.
    std::vector<int64_t> map(T * E, 0);
    Tensor dense = Tensor::zeros({T, E});
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        const float v = keep.f32()[t * k + j];
        ASSERT_TRUE(v == 0.0f || v == 1.0f) << "row " << t << " slot " << j << ": " << v;
        const int64_t i = t * E + indices.i32()[t * k + j];
        map[i] = int64_t(v);
        dense.f32()[i] = probs.f32()[t * k + j] * v;
      }
    // Every case: per expert, min(routed, capacity) kept, as many routed tokens as Megatron
    // kept (with pad_to_capacity its map also holds padding slots: routed ones only).
    for (int64_t e = 0; e < E; ++e) {
      int64_t routed = 0, megatron_kept = 0;
      for (int64_t t = 0; t < T; ++t) {
        routed += pre_map[t * E + e];
        megatron_kept += pre_map[t * E + e] & want_map[t * E + e];
      }
      EXPECT_EQ(kept_counts.f32()[e], float(std::min(routed, capacity))) << "expert " << e;
      EXPECT_EQ(kept_counts.f32()[e], float(megatron_kept)) << "expert " << e;
    }
    if (map_check == "exact") {
      EXPECT_EQ(map, want_map) << "routing map after dropping";
      ++exact_cases;
    } else if (map_check == "exact where probs != 0") {
      // pad_to_capacity: Megatron's map adds padding slots of probability 0.
      for (int64_t i = 0; i < T * E; ++i) {
        if (want_probs.f32()[i] != 0.0f || pre_probs.f32()[i] != 0.0f) {
          EXPECT_EQ(map[i], want_map[i]) << "row " << i / E << " expert " << i % E;
        }
      }
      ++exact_cases;
    } else {
      // Megatron's position policy keeps torch.topk's choice among equal 0/1 values: only
      // the counts above compare.
      ASSERT_EQ(map_check, "invariants");
    }
    if (probs_check == "exact") expect_close(dense, want_probs, 0, 0, name + " probs");
    ++cases_run;
  }
  EXPECT_EQ(cases_run, 8);    // every capacity case of the file
  EXPECT_EQ(exact_cases, 6);  // those with the probs policy
}

// ---------------------------------------------------------------------------------------
// Golden: moe_utils functions called directly ("fn.*" cases)

TEST(MoeRouterGolden, GroupLimitedTopkSelectsMegatronsExperts) {
  for (const char* name : {"fn.group_limited_topk_g4_t2_k4", "fn.group_limited_topk_g4_t3_k4",
                           "fn.group_limited_topk_g8_t4_k8"}) {
    SCOPED_TRACE(name);
    const json& c = golden_case(name);
    const Tensor scores = golden_f32(std::string(name) + ".scores");
    const std::vector<int64_t> want = golden_ints(std::string(name) + ".top_indices");
    const int64_t T = scores.dim(0), E = scores.dim(1);
    RouterTopK o;
    o.topk = c.at("topk");
    o.num_groups = c.at("num_groups");
    o.group_topk = c.at("group_topk");
    // Softmax after the top-k selects on its input itself; pre-softmax selects on
    // softmax(log s) = s / sum(s), a per-row positive multiple of s (every group score
    // scales alike), so both must pick Megatron's experts in Megatron's order.
    Tensor log_scores = Tensor::empty({T, E});
    for (int64_t i = 0; i < T * E; ++i) log_scores.f32()[i] = std::log(scores.f32()[i]);
    for (bool pre_softmax : {false, true}) {
      o.pre_softmax = pre_softmax;
      Tensor probs = Tensor::empty({T, o.topk}), indices = Tensor::empty({T, o.topk}, DType::I32);
      ops::moe_router_topk_forward(pre_softmax ? log_scores : scores, Tensor(), o, probs, indices);
      std::vector<int64_t> got(indices.i32(), indices.i32() + indices.numel());
      EXPECT_EQ(got, want) << (pre_softmax ? "pre-softmax" : "softmax after top-k");
    }
  }
}

TEST(MoeRouterGolden, AuxLossScoresAndRoutingMapMatchMegatron) {
  for (const char* name :
       {"fn.aux_scores_softmax", "fn.aux_scores_sigmoid", "fn.aux_scores_sqrtsoftplus"}) {
    SCOPED_TRACE(name);
    std::printf("%s\n", name);
    const json& c = golden_case(name);
    const Tensor logits = golden_f32(std::string(name) + ".logits");
    const int64_t T = logits.dim(0), E = logits.dim(1);
    // One row per group: score_sums are the scores and counts the routing map.
    Tensor scores = Tensor::empty({T, E}), sums = Tensor::empty({T, E}),
           counts = Tensor::empty({T, E});
    poison(scores);
    poison(sums);
    poison(counts);
    ops::moe_aux_loss_statistics(logits, score_function_of(c.at("score_function")), c.at("topk"), 0,
                                 1, scores, sums, counts);
    const Tensor want = golden_f32(std::string(name) + ".scores");
    expect_close(scores, want, kGoldenAtol, kGoldenRtol, std::string(name) + " scores");
    expect_close(sums, want, kGoldenAtol, kGoldenRtol, std::string(name) + " score_sums");
    const std::vector<int64_t> map = golden_ints(std::string(name) + ".routing_map");
    for (int64_t i = 0; i < T * E; ++i) ASSERT_EQ(counts.f32()[i], float(map[i])) << i;

    // All rows as one group: column sums of the same.
    Tensor all_scores = Tensor::empty({T, E}), col_sums = Tensor::empty({1, E}),
           col_counts = Tensor::empty({1, E});
    ops::moe_aux_loss_statistics(logits, score_function_of(c.at("score_function")), c.at("topk"), 0,
                                 T, all_scores, col_sums, col_counts);
    for (int64_t e = 0; e < E; ++e) {
      double sum = 0, count = 0;
      for (int64_t t = 0; t < T; ++t) {
        sum += want.f32()[t * E + e];
        count += double(map[t * E + e]);
      }
      EXPECT_NEAR(col_sums.f32()[e], sum, 1e-5) << "expert " << e;
      EXPECT_EQ(col_counts.f32()[e], count) << "expert " << e;
    }
  }
}

TEST(MoeRouterGolden, SwitchLoadBalancingLossMatchesMegatron) {
  for (const char* name : {"fn.switch_loss", "fn.switch_loss_fp64"}) {
    SCOPED_TRACE(name);
    std::printf("%s\n", name);
    const json& c = golden_case(name);
    const Tensor probs = golden_f32(std::string(name) + ".probs");
    const Tensor tokens = golden_f32(std::string(name) + ".tokens_per_expert");
    const int64_t T = probs.dim(0), E = probs.dim(1);
    const double coeff = c.at("moe_aux_loss_coeff"), total = c.at("total_num_tokens");
    const int k = c.at("topk");
    // Megatron's probs are softmax scores (rows sum to 1): softmax(log p) = p, so the
    // statistics of logits log p give Megatron's score sums.
    Tensor logits = Tensor::empty({T, E});
    for (int64_t i = 0; i < T * E; ++i) logits.f32()[i] = std::log(probs.f32()[i]);
    Tensor scores = Tensor::empty({T, E}), sums = Tensor::empty({1, E}),
           counts = Tensor::empty({1, E});
    ops::moe_aux_loss_statistics(logits, RouterScoreFunction::Softmax, k, 0, T, scores, sums,
                                 counts);
    expect_close(scores, probs, kGoldenAtol, kGoldenRtol, std::string(name) + " scores");
    // ops.h: loss = c E / (k T^2) sum_e score_sums[e] n[e], with n and T at the loss's level
    // (here tokens_per_expert and total_num_tokens, not this call's rows).
    const double factor = coeff * double(E) / (double(k) * total * total);
    double loss = 0;
    for (int64_t e = 0; e < E; ++e) loss += factor * double(sums.f32()[e]) * tokens.f32()[e];
    expect_scalar_close(loss, golden_scalar(std::string(name) + ".loss"), 1e-5,
                        std::string(name) + " loss");
    // ops.h: coeffs[e] = c E / (k T^2) n[e] is d loss / d scores[t, e] for every row.
    const Tensor dprobs = golden_f32(std::string(name) + ".dprobs");
    Tensor coeffs = Tensor::empty({1, E}), expanded = Tensor::empty({T, E});
    for (int64_t e = 0; e < E; ++e) coeffs.f32()[e] = float(factor * tokens.f32()[e]);
    for (int64_t i = 0; i < T * E; ++i) expanded.f32()[i] = coeffs.f32()[i % E];
    expect_close(expanded, dprobs, kGoldenAtol, kGoldenRtol, std::string(name) + " dprobs");
    // The logits' gradient: the softmax Jacobian applied to Megatron's dprobs, in fp64.
    Tensor dlogits = Tensor::zeros({T, E}), want = Tensor::empty({T, E});
    ops::moe_aux_loss_statistics_backward(coeffs, logits, scores, RouterScoreFunction::Softmax, 0,
                                          T, dlogits);
    for (int64_t t = 0; t < T; ++t) {
      double dot = 0;
      for (int64_t e = 0; e < E; ++e)
        dot += double(probs.f32()[t * E + e]) * dprobs.f32()[t * E + e];
      for (int64_t e = 0; e < E; ++e)
        want.f32()[t * E + e] = float(probs.f32()[t * E + e] * (dprobs.f32()[t * E + e] - dot));
    }
    expect_close(dlogits, want, kGoldenAtol, kGoldenRtol, std::string(name) + " dlogits");
  }
}

TEST(MoeRouterGolden, ZLossMatchesMegatron) {
  for (const char* name : {"fn.z_loss", "fn.z_loss_padding"}) {
    SCOPED_TRACE(name);
    std::printf("%s\n", name);
    const json& c = golden_case(name);
    const double coeff = c.at("z_loss_coeff");
    const Tensor all = golden_f32(std::string(name) + ".logits");
    const Tensor want_all = golden_f32(std::string(name) + ".dlogits");
    const int64_t E = all.dim(1);
    // Padding rows (mask true) are left out of the mean and get no gradient.
    std::vector<int64_t> rows;
    const bool padded = has_tensor(std::string(name) + ".padding_mask");
    const std::vector<int64_t> mask = padded ? golden_ints(std::string(name) + ".padding_mask")
                                             : std::vector<int64_t>(all.dim(0), 0);
    for (int64_t t = 0; t < all.dim(0); ++t) {
      if (!mask[t]) {
        rows.push_back(t);
      } else {
        for (int64_t e = 0; e < E; ++e) EXPECT_EQ(want_all.f32()[t * E + e], 0.0f);
      }
    }
    const int64_t T = int64_t(rows.size());
    Tensor logits = Tensor::empty({T, E}), want = Tensor::empty({T, E});
    for (int64_t i = 0; i < T; ++i) {
      std::memcpy(logits.f32() + i * E, all.f32() + rows[i] * E, E * sizeof(float));
      std::memcpy(want.f32() + i * E, want_all.f32() + rows[i] * E, E * sizeof(float));
    }
    Tensor lse = Tensor::empty({T});
    poison(lse);
    ops::moe_router_logsumexp(logits, lse);
    double sum_sq = 0;
    for (int64_t t = 0; t < T; ++t) sum_sq += double(lse.f32()[t]) * lse.f32()[t];
    expect_scalar_close(coeff * sum_sq / double(T), golden_scalar(std::string(name) + ".loss"),
                        1e-5, std::string(name) + " loss");
    Tensor dlogits = Tensor::zeros({T, E});
    ops::moe_z_loss_backward(float(2.0 * coeff / double(T)), logits, lse, dlogits);
    expect_close(dlogits, want, kGoldenAtol, kGoldenRtol, std::string(name) + " dlogits");
  }
}

TEST(MoeRouterGolden, SinkhornMatchesMegatron) {
  for (const char* name : {"fn.sinkhorn_t24_e8", "fn.sinkhorn_t32_e16"}) {
    SCOPED_TRACE(name);
    std::printf("%s\n", name);
    const Tensor cost = golden_f32(std::string(name) + ".cost");
    Tensor out = Tensor::empty(cost.shape());
    poison(out);
    ops::moe_sinkhorn(cost, out);
    expect_close(out, golden_f32(std::string(name) + ".out"), kGoldenAtol, kGoldenRtol,
                 std::string(name) + " out");
  }
}

}  // namespace
}  // namespace megaton
