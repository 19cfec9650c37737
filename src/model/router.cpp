// TopKRouter forward/backward, load-balancing losses and the expert bias.
#include "model/router.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/main_grad.h"

namespace megaton {

namespace {
ops::RouterScoreFunction parse_score_function(const std::string& name) {
  if (name == "sigmoid") return ops::RouterScoreFunction::Sigmoid;
  if (name == "sqrtsoftplus") return ops::RouterScoreFunction::SqrtSoftplus;
  return ops::RouterScoreFunction::Softmax;
}
// Random-stream sites of the router (dropout uses 0-2).
constexpr int kJitterSite = 5;
constexpr int kForceBalanceSite = 6;
}  // namespace

TopKRouter::TopKRouter(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                       const ModelParallel& mp, int64_t layer)
    : weight(make_param(prefix + ".router.weight", {cfg.num_experts, cfg.hidden_size},
                        cfg.init_method_std, seed, Placement::of(cfg))),
      cfg_(cfg),
      mp_(mp),
      layer_(layer),
      num_experts_(cfg.num_experts),
      topk_(int(cfg.moe_router_topk)),
      score_function_(parse_score_function(cfg.moe_router_score_function)) {
  // The router sees only this rank's token rows under TP (see moe.h): its gradient is a
  // partial sum over the tensor-parallel group.
  weight.sequence_parallel = mp.tp_size() > 1;
  if (cfg.moe_router_enable_expert_bias)
    expert_bias = Tensor::zeros({num_experts_}, DType::F32, cfg.device);
  tokens_per_expert_ = Tensor::zeros({num_experts_}, DType::F32, cfg.device);
  metric_sums_ = Tensor::zeros({kMetricSlots}, DType::F32, cfg.device);
}

ops::RouterTopK TopKRouter::topk_options(bool training) const {
  ops::RouterTopK o;
  o.topk = topk_;
  o.score_function = score_function_;
  o.pre_softmax = cfg_.moe_router_pre_softmax;
  o.scaling_factor = cfg_.moe_router_topk_scaling_factor;
  o.num_groups = int(cfg_.moe_router_num_groups);
  o.group_topk = int(cfg_.moe_router_group_topk);
  const auto& types = cfg_.moe_router_load_balancing_type;
  if (std::find(types.begin(), types.end(), "sinkhorn") != types.end()) {
    if (training) {
      o.sinkhorn = true;
    } else if (topk_ == 1) {
      // Megatron's sinkhorn router in evaluation: top-k of sigmoid (k = 1) or of the
      // softmax over all experts, probabilities those activations.
      o.score_function = ops::RouterScoreFunction::Sigmoid;
    } else {
      o.score_function = ops::RouterScoreFunction::Softmax;
      o.pre_softmax = true;
    }
  }
  return o;
}

void TopKRouter::start_step() {
  tokens_per_expert_.zero();
  global_tokens_per_expert_ = Tensor();
  global_micro_batches_ = 0;
  metric_sums_.zero();
  routed_ = 0;
}

double TopKRouter::last_loss() const {
  if (!last_loss_.defined()) return 0.0;
  return double(last_loss_.to(Device::CPU).f32()[0]);
}

TopKRouter::Metrics TopKRouter::metrics() const {
  const Tensor sums = metric_sums_.to(Device::CPU);
  Metrics m;
  m.aux_loss = sums.f32()[kAuxSlot];
  m.seq_aux_loss = sums.f32()[kSeqAuxSlot];
  m.global_aux_loss = sums.f32()[kGlobalAuxSlot];
  m.z_loss = sums.f32()[kZSlot];
  m.routed = routed_;
  return m;
}

void TopKRouter::add_loss(const Tensor& value, double loss_scale, int metric_slot,
                          double metric_scale) {
  ops::add_(last_loss_, value, float(loss_scale));
  Tensor slot = metric_sums_.rows(metric_slot, 1);
  ops::add_(slot, value, float(metric_scale));
}

void TopKRouter::aux_loss_forward(const std::string& type, float coeff, int64_t first_row) {
  const Tensor& logits = saved_.logits;
  const int64_t rows = logits.dim(0), E = num_experts_;
  const Device dev = logits.device();
  AuxTerm term;
  term.scores = Tensor::empty({rows, E}, DType::F32, dev);
  // Groups: sequences for seq_aux_loss (the rows of every sequence of the micro-batch,
  // wherever this rank's rows fall), else one group of all rows.
  const int64_t group_rows = type == "seq_aux_loss" ? cfg_.seq_length : first_row + rows;
  const int64_t total_rows = rows * mp_.tp_cp().size();  // the TP x CP group's rows
  const int64_t groups = type == "seq_aux_loss" ? total_rows / cfg_.seq_length : 1;
  MEGATON_CHECK(type != "seq_aux_loss" || total_rows % cfg_.seq_length == 0,
                "seq_aux_loss: {} token rows are not whole sequences of {}", total_rows,
                cfg_.seq_length);
  Tensor score_sums = Tensor::empty({groups, E}, DType::F32, dev);
  Tensor counts = Tensor::empty({groups, E}, DType::F32, dev);
  ops::moe_aux_loss_statistics(logits, score_function_, topk_, first_row, group_rows, term.scores,
                               score_sums, counts);
  // Token counts and T over the loss's group (Megatron's get_tokens_per_expert_and_token_count).
  const dist::Group& group = type == "global_aux_loss" ? mp_.group(dist::GroupKind::TP_DP_CP)
                                                       : mp_.tp_cp();
  if (group.size() > 1) mp_.comm->all_reduce(counts, group);
  double tokens = type == "seq_aux_loss" ? double(cfg_.seq_length)
                                         : double(rows) * double(group.size());
  if (type == "global_aux_loss") {
    // Running mean of the counts over the step's micro-batches (Megatron's
    // global_tokens_per_expert / ga_steps).
    if (!global_tokens_per_expert_.defined())
      global_tokens_per_expert_ = Tensor::zeros({1, E}, DType::F32, dev);
    ops::add_(global_tokens_per_expert_, counts);
    ++global_micro_batches_;
    counts = global_tokens_per_expert_.clone();
    ops::scale_(counts, 1.0f / float(global_micro_batches_));
    term.extra_scale = float(mp_.group(dist::GroupKind::TP_DP_CP).size() / mp_.tp_cp().size());
  }
  // loss = coeff E / (k T^2) sum_g sum_e score_sums[g, e] counts[g, e] / groups
  // (switch_load_balancing_loss_func; seq_aux_loss averages over the sequences).
  const double factor = double(coeff) * double(E) / (double(topk_) * tokens * tokens) /
                        double(type == "seq_aux_loss" ? groups : 1);
  // The loss stays on the device (no host synchronization): loss = factor x dot, logged
  // divided by its coefficient.
  Tensor dot = Tensor::empty({1}, DType::F32, dev);
  ops::dot(score_sums, counts, dot);
  const int slot = type == "aux_loss" ? kAuxSlot : type == "seq_aux_loss" ? kSeqAuxSlot
                                                                           : kGlobalAuxSlot;
  add_loss(dot, factor, slot, factor / double(coeff));
  term.coeffs = counts;
  ops::scale_(term.coeffs, float(factor));
  term.rows_per_group = group_rows;
  saved_.aux.push_back(std::move(term));
}

TopKRouter::Output TopKRouter::forward(const Tensor& x_in, const ForwardContext& ctx,
                                       int64_t first_row) {
  if (ctx.recompute) return replay(x_in, ctx);
  const int64_t rows = x_in.dim(0), E = num_experts_;
  const Device dev = x_in.device();
  saved_ = Saved();
  saved_.training = ctx.training;
  saved_.first_row = first_row;
  Tensor x = apply_jitter(x_in, ctx);
  Tensor logits = Tensor::empty({rows, E}, DType::F32, dev);
  ops::gemm(x, false, weight.weight, true, logits);
  if (ctx.training && cfg_.moe_router_force_load_balancing) {
    // RandomSTE: routing on standard-normal scores; backward passes their gradient on.
    ops::fill_normal(logits, ctx.seed, ctx.stream(layer_, kForceBalanceSite) + uint64_t(first_row));
  }
  saved_.logits = logits;
  Output out;
  out.probs = Tensor::empty({rows, topk_}, DType::F32, dev);
  out.indices = Tensor::empty({rows, topk_}, DType::I32, dev);
  ops::moe_router_topk_forward(logits, expert_bias, topk_options(ctx.training), out.probs,
                               out.indices);
  saved_.probs = out.probs;
  saved_.indices = out.indices;
  if (cfg_.moe_expert_capacity_factor > 0) {
    // Megatron's get_capacity: ceil(T k / E cf), in double.
    const int64_t capacity = int64_t(std::ceil(double(rows) * double(topk_) / double(E) *
                                               double(cfg_.moe_expert_capacity_factor)));
    saved_.keep = Tensor::empty({rows, topk_}, DType::F32, dev);
    Tensor kept = Tensor::zeros({E}, DType::F32, dev);
    ops::moe_capacity_drop(out.probs, out.indices, E, capacity,
                           cfg_.moe_token_drop_policy == "position", saved_.keep, kept);
    out.probs = out.probs.clone();
    ops::mul_(out.probs, saved_.keep);
    // The dispatchers skip the dropped copies (index E); backward keeps the real indices.
    out.indices = Tensor::empty({rows, topk_}, DType::I32, dev);
    ops::moe_mark_dropped(saved_.indices, saved_.keep, E, out.indices);
    out.capacity = saved_.capacity = capacity;
    if (ctx.training) ops::add_(tokens_per_expert_, kept);
  } else if (ctx.training) {
    ops::moe_tokens_per_expert(out.indices, E, tokens_per_expert_);
  }
  last_loss_ = Tensor::zeros({1}, DType::F32, dev);
  if (!ctx.training) return out;
  routed_ += double(rows * topk_);
  const auto& types = cfg_.moe_router_load_balancing_type;
  for (size_t i = 0; i < types.size(); ++i) {
    const float coeff = cfg_.moe_loss_coeff(types[i]);  // also for configs not finalize()d
    if (coeff == 0.0f || types[i] == "none" || types[i] == "sinkhorn") continue;
    aux_loss_forward(types[i], coeff, first_row);
  }
  if (cfg_.moe_z_loss_coeff > 0) {
    // z_loss_func: coeff / (TP x CP) x mean over rows of logsumexp(logits)^2, logged
    // divided by coeff / (TP x CP).
    saved_.lse = Tensor::empty({rows}, DType::F32, dev);
    ops::moe_router_logsumexp(logits, saved_.lse);
    const double tp_cp = double(mp_.tp_cp().size());
    Tensor sum_sq = Tensor::empty({1}, DType::F32, dev);
    ops::dot(saved_.lse, saved_.lse, sum_sq);
    add_loss(sum_sq, double(cfg_.moe_z_loss_coeff) / tp_cp / double(rows), kZSlot,
             1.0 / double(rows));
    saved_.z_scale = float(2.0 * double(cfg_.moe_z_loss_coeff) / (tp_cp * double(rows)));
  }
  return out;
}

Tensor TopKRouter::apply_jitter(const Tensor& x_in, const ForwardContext& ctx) {
  Tensor x = x_in;
  if (ctx.training && cfg_.moe_input_jitter_eps > 0) {
    const float eps = cfg_.moe_input_jitter_eps;
    saved_.jitter = Tensor::empty(x_in.shape(), DType::F32, x_in.device());
    ops::fill_uniform(saved_.jitter, 1.0f - eps, 1.0f + eps, ctx.seed,
                      ctx.stream(layer_, kJitterSite) + uint64_t(saved_.first_row));
    x = x_in.clone();
    ops::mul_(x, saved_.jitter);
  }
  saved_.x = x;
  return x;
}

TopKRouter::Output TopKRouter::replay(const Tensor& x_in, const ForwardContext& ctx) {
  MEGATON_CHECK(saved_.probs.defined(), "router '{}': replay without a kept routing",
                weight.name);
  apply_jitter(x_in, ctx);  // the first forward's noise: the same keys
  const Tensor& x = saved_.x;
  Output out;
  out.probs = saved_.probs;
  out.indices = saved_.indices;
  out.capacity = saved_.capacity;
  if (saved_.keep.defined()) {  // as forward: dropped copies weigh 0 and go to index E
    out.probs = saved_.probs.clone();
    ops::mul_(out.probs, saved_.keep);
    out.indices = Tensor::empty(saved_.indices.shape(), DType::I32, x.device());
    ops::moe_mark_dropped(saved_.indices, saved_.keep, num_experts_, out.indices);
  }
  return out;
}

void TopKRouter::backward(const Tensor& dprobs, float aux_grad_scale, Tensor& dx) {
  const Tensor& logits = saved_.logits;
  Tensor dlogits = Tensor::empty(logits.shape(), DType::F32, logits.device());
  Tensor dkept = dprobs;
  if (saved_.keep.defined()) {  // a dropped copy's probability is the constant 0
    dkept = dprobs.clone();
    ops::mul_(dkept, saved_.keep);
  }
  ops::moe_router_topk_backward(dkept, logits, saved_.probs, saved_.indices,
                                topk_options(saved_.training), dlogits);
  for (AuxTerm& term : saved_.aux) {
    ops::scale_(term.coeffs, aux_grad_scale * term.extra_scale);
    ops::moe_aux_loss_statistics_backward(term.coeffs, logits, term.scores, score_function_,
                                          saved_.first_row, term.rows_per_group, dlogits);
  }
  if (saved_.lse.defined())
    ops::moe_z_loss_backward(saved_.z_scale * aux_grad_scale, logits, saved_.lse, dlogits);
  Tensor dlogits_compute = dlogits;
  if (dx.dtype() != DType::F32) {
    dlogits_compute = empty_like(dx, dlogits.shape());
    ops::cast(dlogits, dlogits_compute);
  }
  if (saved_.jitter.defined()) {
    Tensor dx_jittered = empty_like(dx, dx.shape());
    ops::gemm(dlogits_compute, false, weight.weight, false, dx_jittered);
    ops::mul_(dx_jittered, saved_.jitter);
    ops::add_(dx, dx_jittered);
  } else {
    ops::gemm(dlogits_compute, false, weight.weight, false, dx, 1.0f, 1.0f);
  }
  gemm_main_grad(dlogits_compute, true, saved_.x, false, weight.main_grad);
  saved_ = Saved();
}

void TopKRouter::update_expert_bias(const Tensor& counts) {
  if (!expert_bias.defined()) return;
  MEGATON_CHECK(counts.numel() == num_experts_ && counts.dtype() == DType::F32,
                "update_expert_bias: counts must be [{}] fp32", num_experts_);
  const Tensor c = counts.device() == expert_bias.device() ? counts : counts.to(expert_bias.device());
  ops::moe_expert_bias_update(c.view({num_experts_}), cfg_.moe_router_bias_update_rate,
                              expert_bias);
}

}  // namespace megaton
