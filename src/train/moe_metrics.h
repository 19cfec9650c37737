// MoE router bookkeeping of a training step: the expert-bias update and the logged
// load-balancing metrics (Megatron's MoEMetricsTracker and get_updated_expert_bias).
#pragma once
#include <string>
#include <vector>

#include "dist/comm.h"
#include "dist/grid.h"
#include "model/gpt.h"

namespace megaton {

// One MoE layer's logged values for a step.
struct MoELayerMetrics {
  int64_t layer = 0;  // global layer number
  // Each enabled loss divided by its coefficient, averaged over the step's micro-batches,
  // reduced as Megatron reduces it: aux_loss and seq_aux_loss summed over TP x CP and
  // averaged over DP, global_aux_loss summed over TP x DP x CP, z_loss averaged over
  // TP x DP x CP. -1: not enabled.
  double load_balancing_loss = -1, seq_load_balancing_loss = -1,
         global_load_balancing_loss = -1, z_loss = -1;
  // Tokens routed to each expert in the step (summed over TP x DP x CP): min, max, and
  // max / mean (1: perfectly balanced).
  double tokens_min = 0, tokens_max = 0, imbalance = 0;
  // Share of routed copies dropped by expert capacity (0 when dropless).
  double dropped_fraction = 0;
};

struct MoEStepMetrics {
  std::vector<MoELayerMetrics> layers;  // every MoE layer of the model, in order
  MoELayerMetrics mean;                 // averaged over the MoE layers (imbalance: mean too)
};

// A step's MoE metrics as the device holds them until a log line reads them
// (MoEStepBookkeeping::read): values [L * 5 + L * E] fp32 on the Comm's device (or a host
// copy of them), per layer
// the sums of the four losses divided by their coefficients and the routed copies, then
// the tokens per expert; summed over the world. Undefined without MoE layers.
struct PendingMoEMetrics {
  Tensor values;
  int64_t num_micro_batches = 0;
};

class MoEStepBookkeeping {
 public:
  // chunks: this rank's model chunks (their MoE layers' routers).
  MoEStepBookkeeping(std::vector<GPTModel*> chunks, const GPTConfig& cfg, const dist::Grid& grid,
                     dist::Comm& comm);
  bool active() const { return cfg_.num_experts > 0; }
  // Before a step's first forward: clears each router's step state.
  void start_step();
  // After the step's backwards (and its optimizer step): sums tokens per expert over
  // TP x DP x CP, updates the expert biases (when enabled), and returns the step's
  // metrics, reduced over the world, still on the device: all of it runs in stream order
  // with no host synchronization. num_micro_batches: this rank's micro-batches per step.
  // Collective over the world.
  PendingMoEMetrics finish_step(int64_t num_micro_batches);
  // The step's metrics on the host (values on the device: read, a synchronization; on
  // the host, as the trainer's Readback leaves them: none). Any rank.
  MoEStepMetrics read(const PendingMoEMetrics& pending) const;

  // Expert-bias checkpoint entries ("model.<prefix>.router.expert_bias", fp32) of the layers
  // this rank writes (data- and tensor-parallel rank 0 of each stage); none without bias.
  std::vector<std::pair<std::string, Tensor>> expert_bias_state() const;
  // Loads every router's expert bias from `find` (checkpoint `source`); megaton::Error when
  // one is missing or misshapen.
  void load_expert_bias(const std::function<const Tensor*(const std::string&)>& find,
                        const std::string& source);

 private:
  struct Entry {
    int64_t layer;
    TopKRouter* router;
  };
  const GPTConfig& cfg_;
  const dist::Grid& grid_;
  dist::Comm& comm_;
  std::vector<Entry> routers_;
};

}  // namespace megaton
