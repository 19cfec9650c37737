// MoE step bookkeeping: expert-bias updates and load-balancing metrics.
#include "train/moe_metrics.h"

#include <algorithm>

#include "core/error.h"
#include "dist/host_reduce.h"

namespace megaton {

namespace {
// The checkpoint name of a router's expert bias: "model.<router prefix>.expert_bias"
// ("model.decoder.layers.<i>.mlp.router.expert_bias", or an MTP depth's
// "model.mtp.layers.<k>.transformer_layer.mlp.router.expert_bias").
std::string bias_name(const TopKRouter& router) {
  std::string prefix = router.weight.name;
  if (prefix.ends_with(".weight")) prefix.resize(prefix.size() - 7);
  return "model." + prefix + ".expert_bias";
}
// Layers with a metrics slot: the decoder's, then the MTP depths' (numbered after them, MoE
// when the last decoder layer is: their spec is its).
int64_t metric_layers(const GPTConfig& cfg) { return cfg.num_layers + cfg.mtp_num_layers; }
bool metric_layer_is_moe(const GPTConfig& cfg, int64_t l) {
  return cfg.is_moe_layer(l < cfg.num_layers ? l : cfg.num_layers - 1);
}
}  // namespace

MoEStepBookkeeping::MoEStepBookkeeping(std::vector<GPTModel*> chunks, const GPTConfig& cfg,
                                       const dist::Grid& grid, dist::Comm& comm)
    : cfg_(cfg), grid_(grid), comm_(comm) {
  for (GPTModel* chunk : chunks)
    for (TransformerLayer* layer : chunk->all_layers())
      if (layer->moe()) routers_.push_back({layer->moe()->layer_number(), &layer->moe()->router});
}

void MoEStepBookkeeping::start_step() {
  for (Entry& e : routers_) e.router->start_step();
}

namespace {
// Values per layer in the step's device record: the router's metric slots, then the
// routed copies.
constexpr int64_t kValues = TopKRouter::kMetricSlots + 1;
static_assert(TopKRouter::kAuxSlot == 0 && TopKRouter::kSeqAuxSlot == 1 &&
              TopKRouter::kGlobalAuxSlot == 2 && TopKRouter::kZSlot == 3);
}  // namespace

PendingMoEMetrics MoEStepBookkeeping::finish_step(int64_t num_micro_batches) {
  PendingMoEMetrics pending;
  pending.num_micro_batches = num_micro_batches;
  if (!active()) return pending;
  const int64_t E = cfg_.num_experts, L = metric_layers(cfg_);
  const Device device = comm_.device();
  // Per layer [aux, seq, global, z, routed copies] then the tokens per expert [L, E],
  // summed over the world (the losses divided by their coefficients; scaled by read()).
  // The routed copies are host counts: they travel in the small upload of the zeros.
  Tensor host = Tensor::zeros({L * kValues + L * E}, DType::F32);
  for (const Entry& e : routers_)
    host.f32()[e.layer * kValues + kValues - 1] = float(e.router->routed_copies());
  pending.values = host.to(device);
  if (!routers_.empty()) {
    // Tokens per expert of this rank's layers, summed over TP x DP x CP in one collective.
    Tensor all = Tensor::empty({int64_t(routers_.size()), E}, DType::F32, device);
    for (size_t i = 0; i < routers_.size(); ++i)
      all.rows(int64_t(i), 1).view({E}).copy_from(routers_[i].router->tokens_per_expert());
    comm_.all_reduce(all, grid_.tp_dp_cp());
    for (size_t i = 0; i < routers_.size(); ++i)
      routers_[i].router->update_expert_bias(all.rows(int64_t(i), 1).view({E}));
    for (size_t i = 0; i < routers_.size(); ++i) {
      const int64_t layer = routers_[i].layer;
      pending.values.rows(layer * kValues, TopKRouter::kMetricSlots)
          .copy_from(routers_[i].router->metric_sums());
      // Logged from one rank per stage so the world sum counts each layer once.
      if (grid_.tp_dp_cp().rank == 0)
        pending.values.rows(L * kValues + layer * E, E)
            .copy_from(all.rows(int64_t(i), 1).view({E}));
    }
  }
  comm_.all_reduce(pending.values, grid_.world());
  return pending;
}

MoEStepMetrics MoEStepBookkeeping::read(const PendingMoEMetrics& pending) const {
  MoEStepMetrics out;
  if (!active() || !pending.values.defined()) return out;
  const int64_t E = cfg_.num_experts, L = metric_layers(cfg_);
  const Tensor values = pending.values.to(Device::CPU);
  std::vector<double> both(values.f32(), values.f32() + values.numel());
  const double dp = double(grid_.dp().size()), mbs = double(pending.num_micro_batches);
  const double tp_dp_cp = double(grid_.tp_dp_cp().size());
  auto enabled = [&](const char* type) { return cfg_.moe_loss_coeff(type) != 0.0f; };
  for (int64_t l = 0; l < L; ++l) {
    if (!metric_layer_is_moe(cfg_, l)) continue;
    MoELayerMetrics m;
    m.layer = l;
    const double* v = &both[size_t(l * kValues)];
    if (enabled("aux_loss")) m.load_balancing_loss = v[0] / dp / mbs;
    if (enabled("seq_aux_loss")) m.seq_load_balancing_loss = v[1] / dp / mbs;
    if (enabled("global_aux_loss")) m.global_load_balancing_loss = v[2] / mbs;
    if (cfg_.moe_z_loss_coeff > 0) m.z_loss = v[3] / tp_dp_cp / mbs;
    const double* c = &both[size_t(L * kValues + l * E)];
    double total = 0;
    m.tokens_min = c[0];
    m.tokens_max = c[0];
    for (int64_t e = 0; e < E; ++e) {
      total += c[e];
      m.tokens_min = std::min(m.tokens_min, c[e]);
      m.tokens_max = std::max(m.tokens_max, c[e]);
    }
    m.imbalance = total > 0 ? m.tokens_max / (total / double(E)) : 0.0;
    m.dropped_fraction = v[4] > 0 ? 1.0 - total / v[4] : 0.0;
    out.layers.push_back(m);
  }
  // Averages over the MoE layers (Megatron logs the mean over layers).
  const double n = double(std::max<size_t>(out.layers.size(), 1));
  MoELayerMetrics& mean = out.mean;
  mean.layer = -1;
  for (auto field :
       {&MoELayerMetrics::load_balancing_loss, &MoELayerMetrics::seq_load_balancing_loss,
        &MoELayerMetrics::global_load_balancing_loss, &MoELayerMetrics::z_loss,
        &MoELayerMetrics::tokens_min, &MoELayerMetrics::tokens_max, &MoELayerMetrics::imbalance,
        &MoELayerMetrics::dropped_fraction}) {
    if (!out.layers.empty() && out.layers[0].*field < 0) continue;  // not enabled
    mean.*field = 0;
    for (const MoELayerMetrics& m : out.layers) mean.*field += m.*field / n;
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> MoEStepBookkeeping::expert_bias_state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  // Once: the dense layers' state is replicated over DP x CP and TP.
  if (grid_.dp_cp().rank != 0 || grid_.tp().rank != 0) return out;
  for (const Entry& e : routers_)
    if (e.router->expert_bias.defined())
      out.emplace_back(bias_name(*e.router), e.router->expert_bias);
  return out;
}

void MoEStepBookkeeping::load_expert_bias(
    const std::function<const Tensor*(const std::string&)>& find, const std::string& source) {
  for (Entry& e : routers_) {
    if (!e.router->expert_bias.defined()) continue;
    const std::string name = bias_name(*e.router);
    const Tensor* t = find(name);
    if (!t)
      fail("checkpoint '{}' has no tensor '{}' (saved without --moe-router-enable-expert-bias?)",
           source, name);
    if (t->dtype() != DType::F32 || t->numel() != cfg_.num_experts)
      fail("checkpoint '{}': tensor '{}' is {} {}, the model expects F32 [{}]", source, name,
           dtype_name(t->dtype()), shape_str(t->shape()), cfg_.num_experts);
    e.router->expert_bias.copy_from(t->view({cfg_.num_experts}).to(e.router->expert_bias.device()));
  }
}

}  // namespace megaton
