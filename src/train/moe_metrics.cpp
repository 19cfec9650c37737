// MoE step bookkeeping: expert-bias updates and load-balancing metrics.
#include "train/moe_metrics.h"

#include <algorithm>

#include "core/error.h"
#include "dist/host_reduce.h"

namespace megaton {

namespace {
std::string bias_name(int64_t layer) {
  return "model.decoder.layers." + std::to_string(layer) + ".mlp.router.expert_bias";
}
}  // namespace

MoEStepBookkeeping::MoEStepBookkeeping(std::vector<GPTModel*> chunks, const GPTConfig& cfg,
                                       const dist::Grid& grid, dist::Comm& comm)
    : cfg_(cfg), grid_(grid), comm_(comm) {
  for (GPTModel* chunk : chunks)
    for (const auto& layer : chunk->layers())
      if (layer->moe) routers_.push_back({layer->moe->layer_number(), &layer->moe->router});
}

void MoEStepBookkeeping::start_step() {
  for (Entry& e : routers_) e.router->start_step();
}

MoEStepMetrics MoEStepBookkeeping::finish_step(int64_t num_micro_batches) {
  MoEStepMetrics out;
  if (!active()) return out;
  const int64_t E = cfg_.num_experts, L = cfg_.num_layers;
  // Tokens per expert of this rank's layers, summed over TP x DP x CP in one collective.
  std::vector<double> counts(size_t(L * E), 0.0);
  if (!routers_.empty()) {
    Tensor all = Tensor::empty({int64_t(routers_.size()), E}, DType::F32,
                               routers_[0].router->tokens_per_expert().device());
    for (size_t i = 0; i < routers_.size(); ++i)
      all.rows(int64_t(i), 1).view({E}).copy_from(routers_[i].router->tokens_per_expert());
    comm_.all_reduce(all, grid_.tp_dp_cp());
    for (size_t i = 0; i < routers_.size(); ++i) routers_[i].router->update_expert_bias(all.rows(int64_t(i), 1).view({E}));
    // Logged from one rank per stage so the world sum below counts each layer once.
    if (grid_.tp_dp_cp().rank == 0) {
      Tensor host = all.to(Device::CPU);
      for (size_t i = 0; i < routers_.size(); ++i)
        for (int64_t e = 0; e < E; ++e)
          counts[size_t(routers_[i].layer * E + e)] = host.f32()[int64_t(i) * E + e];
    }
  }
  // Per layer [aux, seq, global, z, routed copies] summed over the world, then scaled
  // (see MoELayerMetrics).
  constexpr int64_t kValues = 5;
  std::vector<double> losses(size_t(L * kValues), 0.0);
  for (const Entry& e : routers_) {
    const TopKRouter::Metrics& m = e.router->metrics();
    double* v = &losses[size_t(e.layer * kValues)];
    v[0] = m.aux_loss;
    v[1] = m.seq_aux_loss;
    v[2] = m.global_aux_loss;
    v[3] = m.z_loss;
    v[4] = m.routed;
  }
  std::vector<double> both = losses;
  both.insert(both.end(), counts.begin(), counts.end());
  both = dist::sum_over(comm_, grid_.world(), both);
  const double dp = double(grid_.dp().size()), mbs = double(num_micro_batches);
  const double tp_dp_cp = double(grid_.tp_dp_cp().size());
  auto enabled = [&](const char* type) { return cfg_.moe_loss_coeff(type) != 0.0f; };
  for (int64_t l = 0; l < L; ++l) {
    if (!cfg_.is_moe_layer(l)) continue;
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
  for (auto field : {&MoELayerMetrics::load_balancing_loss, &MoELayerMetrics::seq_load_balancing_loss,
                     &MoELayerMetrics::global_load_balancing_loss, &MoELayerMetrics::z_loss,
                     &MoELayerMetrics::tokens_min, &MoELayerMetrics::tokens_max,
                     &MoELayerMetrics::imbalance, &MoELayerMetrics::dropped_fraction}) {
    if (!out.layers.empty() && out.layers[0].*field < 0) continue;  // not enabled
    mean.*field = 0;
    for (const MoELayerMetrics& m : out.layers) mean.*field += m.*field / n;
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> MoEStepBookkeeping::expert_bias_state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  if (grid_.dp().rank != 0 || grid_.tp().rank != 0) return out;
  for (const Entry& e : routers_)
    if (e.router->expert_bias.defined()) out.emplace_back(bias_name(e.layer), e.router->expert_bias);
  return out;
}

void MoEStepBookkeeping::load_expert_bias(
    const std::function<const Tensor*(const std::string&)>& find, const std::string& source) {
  for (Entry& e : routers_) {
    if (!e.router->expert_bias.defined()) continue;
    const std::string name = bias_name(e.layer);
    const Tensor* t = find(name);
    if (!t) fail("checkpoint '{}' has no tensor '{}' (saved without --moe-router-enable-expert-bias?)",
                 source, name);
    if (t->dtype() != DType::F32 || t->numel() != cfg_.num_experts)
      fail("checkpoint '{}': tensor '{}' is {} {}, the model expects F32 [{}]", source, name,
           dtype_name(t->dtype()), shape_str(t->shape()), cfg_.num_experts);
    e.router->expert_bias.copy_from(t->view({cfg_.num_experts}).to(e.router->expert_bias.device()));
  }
}

}  // namespace megaton
