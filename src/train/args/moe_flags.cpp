// MoE flags: experts, the router, load balancing, capacity and the token dispatcher
// (Megatron's "moe" group and MoE transformer configuration fields).
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/printable.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

// --moe-token-dispatcher-type flex and its backend, with Megatron's TransformerConfig
// checks (Megatron-LM d98e8a6 transformer_config.py; the TP x EP > 1 assertion of its
// DeepEP and NCCL-EP managers is in parse_parallel, parallel_flags.cpp, once the sizes are
// read).
void parse_flex_dispatcher(const ArgReader& r, TrainArgs& a) {
  ParallelArgs& p = a.parallel;
  const bool flex = p.moe_token_dispatcher_type == "flex";
  r.get("moe-flex-dispatcher-backend", p.moe_flex_dispatcher_backend);
  const std::string& backend = p.moe_flex_dispatcher_backend;
  if (backend != "deepep" && backend != "hybridep" && backend != "ncclep")
    fail("option 'moe-flex-dispatcher-backend' must be deepep, hybridep or ncclep (got '{}')",
         printable(backend));
  bool enable_deepep = false;
  r.get("moe-enable-deepep", enable_deepep);
  if (enable_deepep) {  // the deprecated spelling of backend deepep
    if (!flex)
      fail("moe-enable-deepep (DeepEP) is only supported with moe-token-dispatcher-type flex");
    if (backend == "hybridep")
      fail("moe-enable-deepep with moe-flex-dispatcher-backend hybridep: only one backend");
    p.moe_flex_dispatcher_backend = "deepep";
    a.warnings.push_back(
        "--moe-enable-deepep is deprecated: use --moe-flex-dispatcher-backend deepep");
  }
  if (backend == "ncclep" && !flex)
    fail("moe-flex-dispatcher-backend ncclep needs moe-token-dispatcher-type flex");
  // The ncclep wire dtypes: bf16 (the default) moves bf16 rows, as Megaton's exchange does.
  for (const char* key : {"moe-dispatch-fwd-dtype", "moe-combine-bwd-dtype"}) {
    std::string dtype = "bf16";
    r.get(key, dtype);
    if (dtype != "bf16")
      fail("{} {} (the ncclep dispatcher's MXFP8 wire format) is not supported in Megaton", key,
           printable(dtype));
  }
  if (flex && backend == "deepep" && a.model.moe_pad_expert_input_to_capacity)
    fail(
        "moe-token-dispatcher-type flex with backend deepep does not support "
        "moe-pad-expert-input-to-capacity");
}

void parse_moe(const ArgReader& r, TrainArgs& a) {
  GPTConfig& m = a.model;
  r.get("num-experts", m.num_experts);
  r.get("moe-ffn-hidden-size", m.moe_ffn_hidden_size);
  r.get("moe-router-topk", m.moe_router_topk);
  r.get("moe-router-pre-softmax", m.moe_router_pre_softmax);
  if (r.has("moe-layer-freq")) {
    const std::string& freq = r.one("moe-layer-freq");
    if (freq.find('[') != std::string::npos)
      m.moe_layer_pattern = parse_layer_pattern(freq, "moe-layer-freq");
    else
      r.get("moe-layer-freq", m.moe_layer_freq);
  }
  if (r.has("moe-router-load-balancing-type"))
    m.moe_router_load_balancing_type = r.raw.at("moe-router-load-balancing-type");
  if (r.has("moe-aux-loss-coeff")) {
    const std::vector<std::string>& coeffs = r.raw.at("moe-aux-loss-coeff");
    for (const std::string& c : coeffs) {
      char* end = nullptr;
      const double v = std::strtod(c.c_str(), &end);
      if (c.empty() || *end != '\0')
        fail("option 'moe-aux-loss-coeff' expects numbers (got '{}')", printable(c));
      if (!std::isfinite(v) || v < 0 || v > double(std::numeric_limits<float>::max()))
        fail("option 'moe-aux-loss-coeff' values must be finite and >= 0 (got '{}')", printable(c));
      m.moe_aux_loss_coeffs.push_back(float(v));
    }
    m.moe_aux_loss_coeff = m.moe_aux_loss_coeffs.empty() ? 0.0f : m.moe_aux_loss_coeffs[0];
    if (coeffs.size() == 1) m.moe_aux_loss_coeffs.clear();  // one value for every type
  }
  r.get("moe-router-score-function", m.moe_router_score_function);
  r.get("moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor);
  r.get("moe-router-dtype", m.moe_router_dtype);
  r.get("moe-router-num-groups", m.moe_router_num_groups);
  r.get("moe-router-group-topk", m.moe_router_group_topk);
  r.get("moe-z-loss-coeff", m.moe_z_loss_coeff);
  r.get("moe-input-jitter-eps", m.moe_input_jitter_eps);
  r.get("moe-router-enable-expert-bias", m.moe_router_enable_expert_bias);
  r.get("moe-router-bias-update-rate", m.moe_router_bias_update_rate);
  r.get("moe-router-force-load-balancing", m.moe_router_force_load_balancing);
  r.get("moe-expert-capacity-factor", m.moe_expert_capacity_factor);
  r.get("moe-token-drop-policy", m.moe_token_drop_policy);
  r.get("moe-pad-expert-input-to-capacity", m.moe_pad_expert_input_to_capacity);
  r.get("moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size);
  r.get("moe-shared-expert-gate", m.moe_shared_expert_gate);
  r.get("moe-shared-expert-overlap", m.moe_shared_expert_overlap);
  r.get("overlap-moe-expert-parallel-comm", m.overlap_moe_expert_parallel_comm);
  r.get("moe-per-layer-logging", a.moe_per_layer_logging);
  ParallelArgs& p = a.parallel;
  r.get("moe-token-dispatcher-type", p.moe_token_dispatcher_type);
  if (p.moe_token_dispatcher_type != "alltoall" && p.moe_token_dispatcher_type != "allgather" &&
      p.moe_token_dispatcher_type != "flex")
    fail("option 'moe-token-dispatcher-type' must be alltoall, allgather or flex (got '{}')",
         printable(p.moe_token_dispatcher_type));
  parse_flex_dispatcher(r, a);
  for (auto [key, value] : {std::pair{"moe-ffn-hidden-size", m.moe_ffn_hidden_size},
                            {"moe-router-num-groups", m.moe_router_num_groups},
                            {"moe-router-group-topk", m.moe_router_group_topk}})
    if (r.has(key)) check_positive(key, double(value));
  check_at_least("num-experts", double(m.num_experts), 0);
  check_at_least("moe-router-topk", double(m.moe_router_topk), 1);
  check_at_least("moe-layer-freq", double(m.moe_layer_freq), 1);
  check_at_least("moe-shared-expert-intermediate-size",
                 double(m.moe_shared_expert_intermediate_size), 0);
  check_at_least("moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor, 0);
  check_at_least("moe-aux-loss-coeff", m.moe_aux_loss_coeff, 0);
  check_at_least("moe-z-loss-coeff", m.moe_z_loss_coeff, 0);
  check_fraction("moe-input-jitter-eps", m.moe_input_jitter_eps);
  check_at_least("moe-router-bias-update-rate", m.moe_router_bias_update_rate, 0);
  check_at_least("moe-expert-capacity-factor", m.moe_expert_capacity_factor, 0);
  // Megatron's TransformerConfig: the overlap takes effect only with a shared expert, and
  // then only with the alltoall or flex dispatcher.
  if (m.moe_shared_expert_overlap && m.moe_shared_expert_intermediate_size == 0)
    a.no_effect.push_back(
        "--moe-shared-expert-overlap: the model has no shared expert "
        "(--moe-shared-expert-intermediate-size)");
  if (m.moe_shared_expert_overlap && m.moe_shared_expert_intermediate_size > 0 &&
      p.moe_token_dispatcher_type == "allgather")
    fail("moe-shared-expert-overlap only works with moe-token-dispatcher-type alltoall or flex");
  // Megatron's TransformerConfig (its expert-parallel and recompute conditions are checked
  // with those flags: parallel_flags.cpp, memory_flags.cpp).
  if (m.overlap_moe_expert_parallel_comm && m.num_experts == 0)
    a.no_effect.push_back("--overlap-moe-expert-parallel-comm: the model has no MoE layer");
  const bool ep_overlap = m.overlap_moe_expert_parallel_comm && m.num_experts > 0;
  if (ep_overlap && p.moe_token_dispatcher_type == "allgather")
    fail(
        "overlap-moe-expert-parallel-comm is supported with the alltoall or flex token "
        "dispatcher");
  // Each chunk would be padded to the layer's capacity (twice the rows).
  if (ep_overlap && m.moe_pad_expert_input_to_capacity)
    fail(
        "overlap-moe-expert-parallel-comm with moe-pad-expert-input-to-capacity is not "
        "supported (each of its two chunks would be padded to the layer's capacity)");
  if (ep_overlap && m.moe_shared_expert_overlap)
    fail(
        "disable moe-shared-expert-overlap when enabling overlap-moe-expert-parallel-comm (the "
        "shared expert then runs beside the exchanges the chunks leave exposed)");
}

}  // namespace

std::vector<OptionSpec> moe_megatron_rules();

ArgGroup moe_flags() {
  ArgGroup g{"moe", "mixture of experts", {}, parse_moe};
  g.flags = {
      flag("num-experts", "experts per MoE layer (0: dense)"),
      flag("moe-ffn-hidden-size", "expert MLP hidden size"),
      flag("moe-router-topk", "experts per token"),
      toggle("moe-router-pre-softmax", "softmax over all experts before top-k"),
      flag("moe-layer-freq", "every n-th layer is MoE, or a pattern like [0]*1+[1]*3"),
      values("moe-router-load-balancing-type",
             "aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none (several allowed)"),
      values("moe-aux-loss-coeff", "coefficient of each load-balancing loss"),
      flag("moe-router-score-function", "softmax, sigmoid or sqrtsoftplus"),
      flag("moe-router-topk-scaling-factor", "multiply the top-k probabilities by this"),
      flag("moe-router-dtype", "fp32 or fp64: the router's gating GEMM and statistics"),
      flag("moe-router-num-groups", "expert groups for group-limited routing"),
      flag("moe-router-group-topk", "groups each token may use"),
      flag("moe-z-loss-coeff", "coefficient of the router z-loss"),
      flag("moe-input-jitter-eps", "multiply router inputs by Uniform(1-eps, 1+eps)"),
      toggle("moe-router-enable-expert-bias", "aux-loss-free balancing with a per-expert bias"),
      flag("moe-router-bias-update-rate", "expert bias update rate"),
      toggle("moe-router-force-load-balancing", "random routing scores (benchmarking)"),
      flag("moe-expert-capacity-factor", "per-expert capacity factor (token dropping)"),
      flag("moe-token-drop-policy", "probs or position: which routed tokens an expert keeps"),
      toggle("moe-pad-expert-input-to-capacity", "pad every expert to its capacity"),
      flag("moe-shared-expert-intermediate-size", "hidden size of the shared expert"),
      toggle("moe-shared-expert-gate", "sigmoid gate on the shared expert output"),
      toggle("moe-shared-expert-overlap",
             "run the shared expert beside the token dispatcher's exchanges"),
      toggle("overlap-moe-expert-parallel-comm",
             "two chunks per MoE layer, each one's exchanges beside the other's experts"),
      toggle("moe-per-layer-logging", "log MoE metrics per layer"),
      flag("moe-token-dispatcher-type",
           "alltoall, allgather, or flex (the all-to-all dispatcher's fastest exchange)"),
      flag("moe-flex-dispatcher-backend",
           "deepep, hybridep or ncclep: accepted; flex runs Megaton's own exchange"),
      toggle("moe-enable-deepep", "deprecated: moe-flex-dispatcher-backend deepep"),
      flag("moe-dispatch-fwd-dtype", "bf16 only (the ncclep dispatcher's wire dtype)"),
      flag("moe-combine-bwd-dtype", "bf16 only (the ncclep dispatcher's wire dtype)"),
  };
  for (OptionSpec& s : moe_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
