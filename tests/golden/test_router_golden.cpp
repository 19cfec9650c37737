// TopKRouter against Megatron-LM's own router (tools/make_router_golden.py ran
// TopKRouter.routing of Megatron-LM d98e8a64 and recorded probabilities, routing maps,
// injected loss values, logged metrics, logit gradients and expert-bias updates).
//
// The gating GEMM is made the identity (hidden = E, weight = I), so the router's input
// is the golden logits and its input gradient the logit gradient. Megatron's rows are
// sequence-major ([S, B]: row s B + b), Megaton's batch-major (row b S + s): the test
// permutes between them, which matters for seq_aux_loss.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "ckpt/safetensors.h"
#include "model/router.h"

namespace megaton {
namespace {

const ckpt::SafetensorsFile& golden() {
  static const ckpt::SafetensorsFile f =
      ckpt::load_safetensors(std::string(MEGATON_SOURCE_DIR) + "/tests/golden/router_golden.safetensors");
  return f;
}
const nlohmann::json& cases() {
  static const nlohmann::json j = nlohmann::json::parse(golden().metadata.at("golden")).at("cases");
  return j;
}
// A golden tensor; fp64 ones (stored as I64 bit patterns, safetensors metadata
// "f64_tensors") are returned rounded to fp32: Megaton's router runs in fp32, and
// Megatron's fp64 router dtype computes its scores in fp32 too.
const Tensor& tensor(const std::string& name) {
  static std::map<std::string, Tensor> decoded;
  auto it = golden().tensors.find(name);
  if (it == golden().tensors.end()) throw std::runtime_error("golden tensor missing: " + name);
  if (it->second.dtype() != DType::I64) return it->second;
  auto [slot, fresh] = decoded.try_emplace(name);
  if (fresh) {
    slot->second = Tensor::empty(it->second.shape(), DType::F32);
    for (int64_t i = 0; i < it->second.numel(); ++i)
      slot->second.f32()[i] = float(std::bit_cast<double>(it->second.i64()[i]));
  }
  return slot->second;
}
double scalar(const std::string& name) { return double(tensor(name).f32()[0]); }

// Megatron row s * B + b <-> Megaton row b * S + s.
int64_t megaton_row(int64_t megatron_row, int64_t B, int64_t S) {
  return (megatron_row % B) * S + megatron_row / B;
}
// [T, E] in Megatron row order -> Megaton row order.
Tensor to_megaton_rows(const Tensor& t, int64_t B, int64_t S) {
  const int64_t T = B * S, E = t.numel() / T;
  Tensor out = Tensor::empty({T, E}, t.dtype());
  const size_t bytes = size_t(E) * dtype_size(t.dtype());
  for (int64_t r = 0; r < T; ++r)
    std::memcpy(static_cast<char*>(out.raw()) + megaton_row(r, B, S) * bytes,
                static_cast<const char*>(t.raw()) + r * bytes, bytes);
  return out;
}

GPTConfig config_of(const nlohmann::json& c) {
  GPTConfig cfg;
  cfg.num_layers = 1;
  cfg.num_experts = c.at("num_experts");
  cfg.hidden_size = cfg.num_experts;  // identity gating
  cfg.num_attention_heads = 1;
  cfg.seq_length = c.at("seq_length");
  cfg.vocab_size = 64;
  cfg.moe_router_topk = c.at("topk");
  cfg.moe_router_pre_softmax = c.at("pre_softmax");
  cfg.moe_router_score_function = c.at("score_function");
  if (!c.at("topk_scaling_factor").is_null()) cfg.moe_router_topk_scaling_factor = c.at("topk_scaling_factor");
  if (!c.at("capacity_factor").is_null()) cfg.moe_expert_capacity_factor = c.at("capacity_factor");
  if (!c.at("num_groups").is_null()) {
    cfg.moe_router_num_groups = c.at("num_groups");
    cfg.moe_router_group_topk = c.at("group_topk");
  }
  const nlohmann::json& types = c.at("load_balancing_type");
  cfg.moe_router_load_balancing_type.clear();
  if (types.is_string()) cfg.moe_router_load_balancing_type.push_back(types.get<std::string>());
  else for (const auto& t : types) cfg.moe_router_load_balancing_type.push_back(t.get<std::string>());
  const nlohmann::json& coeff = c.at("aux_loss_coeff");
  if (coeff.is_array()) for (const auto& v : coeff) cfg.moe_aux_loss_coeffs.push_back(v.get<float>());
  else cfg.moe_aux_loss_coeff = coeff.get<float>();
  if (!c.at("z_loss_coeff").is_null()) cfg.moe_z_loss_coeff = c.at("z_loss_coeff");
  cfg.moe_router_enable_expert_bias = c.at("expert_bias");
  cfg.moe_router_bias_update_rate = c.at("bias_update_rate");
  cfg.finalize();
  return cfg;
}

// Whether the test can run the case: Megaton has no padding mask, no token dropping yet;
// forced balancing draws other random numbers than torch; the bf16 case computes its
// logits in bf16.
bool supported(const nlohmann::json& c, std::string* why) {
  if (c.value("padding", false)) return *why = "padding mask", false;
  // Megatron's position policy keeps whichever entries torch.topk returns among equal 0/1
  // values, and padding adds zero-weight entries to the map: only the probs policy
  // without padding has one answer.
  if (!c.at("capacity_factor").is_null() &&
      (c.value("drop_policy", "probs") != "probs" || c.value("pad_to_capacity", false)))
    return *why = "position policy / padding", false;
  if (c.value("force_load_balancing", false)) return *why = "torch random numbers", false;
  if (c.value("dtype", "fp32") == "bf16") return *why = "bf16 logits", false;
  return true;
}

void expect_close(const Tensor& got, const Tensor& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  int bad = 0;
  for (int64_t i = 0; i < got.numel() && bad < 5; ++i) {
    const double g = got.f32()[i], w = want.f32()[i];
    if (!(std::abs(g - w) <= atol + rtol * std::abs(w))) {
      ADD_FAILURE() << what << "[" << i << "]: " << g << " vs Megatron " << w;
      ++bad;
    }
  }
}

TEST(RouterGolden, EveryRoutingAndLossOptionMatchesMegatron) {
  int run = 0;
  for (const auto& [name, c] : cases().items()) {
    if (name.starts_with("fn.") || name.starts_with("dist.")) continue;
    std::string why;
    if (!supported(c, &why)) continue;
    SCOPED_TRACE(name);
    const GPTConfig cfg = config_of(c);
    const int64_t E = cfg.num_experts, k = cfg.moe_router_topk;
    const int64_t S = cfg.seq_length, B = c.at("micro_batch_size");
    const int64_t M = c.at("micro_batches");
    TopKRouter router("decoder.layers.0.mlp", cfg, 1, {}, 0);
    for (int64_t e = 0; e < E * E; ++e) router.weight.weight.f32()[e] = e % (E + 1) == 0 ? 1.0f : 0.0f;
    router.weight.main_grad = Tensor::zeros({E, E});
    if (cfg.moe_router_enable_expert_bias) router.expert_bias.copy_from(tensor(name + ".expert_bias"));
    router.start_step();
    ForwardContext ctx;
    ctx.training = c.value("training", true);
    for (int64_t m = 0; m < M; ++m) {
      const std::string p = M > 1 ? name + ".mb" + std::to_string(m) : name;
      Tensor x = to_megaton_rows(tensor(p + ".logits"), B, S);
      ctx.micro_batch = m;
      TopKRouter::Output out = router.forward(x, ctx, 0);
      // probs and routing map, [T, E] in Megatron's rows.
      const Tensor want_probs = to_megaton_rows(tensor(p + ".probs"), B, S);
      const Tensor want_map = to_megaton_rows(tensor(p + ".routing_map"), B, S);
      // Copies dropped by capacity have index E (sent to no expert) and probability 0, and
      // are not in Megatron's map.
      Tensor got_probs = Tensor::zeros({B * S, E});
      int64_t kept = 0, want_kept = 0;
      for (int64_t t = 0; t < B * S; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = out.indices.i32()[t * k + j];
          if (e == E) {
            ASSERT_GT(cfg.moe_expert_capacity_factor, 0) << "row " << t << " dropped";
            ASSERT_EQ(out.probs.f32()[t * k + j], 0.0f) << "row " << t << " dropped";
            continue;
          }
          ASSERT_TRUE(e >= 0 && e < E) << "row " << t << " picks expert " << e;
          ++kept;
          ASSERT_EQ(want_map.i32()[t * E + e], 1) << "row " << t << " picks expert " << e;
          got_probs.f32()[t * E + e] = out.probs.f32()[t * k + j];
        }
      for (int64_t i = 0; i < B * S * E; ++i) want_kept += want_map.i32()[i];
      EXPECT_EQ(kept, want_kept) << "routed copies";
      expect_close(got_probs, want_probs, 1e-6, 1e-5, "probs");
      if (!ctx.training) continue;
      // Backward of sum(probs * upstream) + the injected losses.
      const Tensor upstream = to_megaton_rows(tensor(p + ".upstream"), B, S);
      Tensor dprobs = Tensor::empty({B * S, k});
      // A dropped copy's probability is the constant 0: its upstream value (any finite
      // number) must not reach the logits.
      for (int64_t t = 0; t < B * S; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = out.indices.i32()[t * k + j];
          dprobs.f32()[t * k + j] = e == E ? 1e3f : upstream.f32()[t * E + e];
        }
      Tensor dx = Tensor::zeros({B * S, E});
      // --calculate-per-token-loss: Megatron's router multiplies each injected loss by its
      // tokens x TP x CP size (here B x S); Megaton's trainer passes that factor in the
      // aux-loss gradient scale.
      const double per_token = c.value("calculate_per_token_loss", false) ? double(B * S) : 1.0;
      router.backward(dprobs, float(c.at("aux_loss_backward_scale").get<double>() * per_token), dx);
      expect_close(dx, to_megaton_rows(tensor(p + ".dlogits"), B, S), 1e-7, 2e-5, "dlogits");
      double injected = 0;
      for (const auto& l : c.at("injected_losses")) injected += scalar(p + ".loss." + l.get<std::string>());
      // (Megatron's recorded injected losses carry the per-token factor.)
      EXPECT_NEAR(router.last_loss() * per_token, injected, 1e-6 * std::abs(injected) + 1e-9)
          << "injected losses";
    }
    // Logged values: sums over micro-batches / M (the trainer's scaling for one rank).
    const TopKRouter::Metrics& got = router.metrics();
    for (const auto& l : c.at("logged_names")) {
      const std::string n = l.get<std::string>();
      const double want = scalar(name + ".logged." + n);
      const double v = n == "load_balancing_loss" ? got.aux_loss
                       : n == "seq_load_balancing_loss" ? got.seq_aux_loss
                       : n == "global_load_balancing_loss" ? got.global_aux_loss : got.z_loss;
      EXPECT_NEAR(v / double(M), want, 1e-5 * std::abs(want)) << n;
    }
    if (golden().tensors.count(name + ".updated_expert_bias")) {
      Tensor counts = tensor(name + ".local_tokens_per_expert");
      expect_close(router.tokens_per_expert(), counts, 0, 0, "tokens per expert");
      router.update_expert_bias(router.tokens_per_expert());
      expect_close(router.expert_bias, tensor(name + ".updated_expert_bias"), 0, 0, "updated bias");
    }
    ++run;
  }
  EXPECT_EQ(run, 45)
      << "golden cases run (of 70: fn.* and dist.* are tested at op and layout level)";
}

}  // namespace
}  // namespace megaton
