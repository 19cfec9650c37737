// The memory plan's per-layer activation terms (train/memory_plan.h, docs/memory.md): the
// numbers every term reads and one decoder layer's bytes, by its kinds (attention, MLA,
// Mamba, dense MLP, MoE), as the model code allocates them. Internal to the planner.
#pragma once
#include <cstdint>

#include "train/arguments.h"
#include "train/memory_plan.h"

namespace megaton::memory_plan_detail {

inline constexpr double kF32 = 4, kI32 = 4, kI64 = 8;

// The numbers every term reads. T: tokens of one micro-batch; Tl: this rank's rows of the
// residual stream (T / tp under sequence parallelism); Tm: rows entering an MoE layer
// (T / tp whenever tp > 1, model/moe.h).
struct Dims {
  const TrainArgs& args;
  const GPTConfig& m;
  Device device;
  double cb;              // compute dtype bytes
  double tp, ep, etp, G;  // G: the expert-model-parallel group, ep x etp
  bool sp, ln_norm;       // sequence parallelism; LayerNorm (keeps a mean) or RMSNorm
  double B, S, T, Tl, Tm, H, V, np, ng, d, fc1, ffn;
  double bytes(double numel, double element_bytes) const {
    return memory_plan_block_bytes(numel * element_bytes, device);
  }
  double act(double rows, double cols) const { return bytes(rows * cols, cb); }
  double norm_stats(double rows) const { return bytes(rows, kF32) * (ln_norm ? 2 : 1); }
};

// One transformer layer's activations (model/gpt.cpp TransformerLayer::forward and the
// layers it calls), for one micro-batch.
struct LayerMemory {
  double saved = 0;      // kept from its forward to its backward (no full recompute)
  double kept_full = 0;  // kept when a full-recompute group re-runs it (MoE routing)
  double input = 0;      // its input [Tl, H] (part of saved; a group's first layer keeps it)
  double backward = 0;   // transient bytes during its backward, beyond what it saved
  double rerun = 0;      // recompute moe: what backward's forward re-run adds, then frees
};

// Layer `layer`'s activations for one micro-batch (training: with the loss terms the
// routers keep for backward), by its LayerSpec.
LayerMemory layer_memory(const Dims& x, int64_t layer, bool training);

}  // namespace megaton::memory_plan_detail
