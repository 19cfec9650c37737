// Muon: the momentum of each weight matrix orthogonalised by Newton-Schulz iterations, as
// Megatron-LM's TensorParallelMuon runs NVIDIA Emerging-Optimizers v0.3.0's
// OrthogonalizedOptimizer (docs/research/muon.md sections 2-4). One of the update rules
// DistributedAdamW hosts (optim/distrib_optimizer.h): the matrices muon_param selects, the
// other params taking Adam or Lion.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "dist/comm.h"
#include "dist/grid.h"
#include "optim/optimizer_config.h"
#include "optim/rule_param.h"

namespace megaton::optim {

// Muon's params (optim/rule_param.h) are 2-D matrices: the target's main param has the
// model's local weight shape.
class Muon {
 public:
  // The params are not owned and must outlive the optimizer. Tensor-parallel collectives
  // (--muon-tp-mode duplicated and distributed) run over grid.tp() (experts: grid.etp())
  // for a param split along tp_split_dim; every rank of such a group must hold the same
  // params in the same order (true of replicated updates and of the layer-wise layout,
  // whose shards are the same on TP peers). weight_decay: decoupled, applied as
  // p *= 1 - lr * wd before the update (EO's weight_decay_method "decoupled"), 0 for
  // Param::no_weight_decay. InternalError (a bug in the caller) on a param that is not 2-D,
  // without an fp32 main param or with a main grad of another numel.
  Muon(std::vector<RuleParam> params, MuonConfig config, float weight_decay, const dist::Grid& grid,
       dist::Comm& comm);

  // One step, decided on the device by ops::adamw_step_control's control (F32
  // [kAdamControlSize] on the params' device: learning rate, gradient scale (clipping x
  // 1/dp x 1/loss scale), skip). For each param (docs/research/muon.md 2.2):
  //   momentum = beta momentum + (1 - beta) g        (nesterov: u = (1 - beta) g + beta m)
  //   u gathered over TP (duplicated), split into Q, K, V per query group (split_qkv),
  //   O = NS(u) (the coefficient set, steps and matmul precision of the config; distributed:
  //   Gram and norm summed over TP), scale = muon_scale_factor(global rows, cols) x extra,
  //   main = main (1 - lr wd) - lr scale O, and the compute weight rewritten.
  // Nothing changes when control skips. Collective over the TP groups above.
  void step(const Tensor& control);

  // The momentum of each param, "<model name>.momentum_buffer", F32, the target's shape.
  // The pointers stay valid for the optimizer's life; a checkpoint load copies into them.
  std::vector<std::pair<std::string, Tensor*>> state_tensors();
  void set_weight_decay(float weight_decay) { weight_decay_ = weight_decay; }
  const std::vector<RuleParam>& params() const { return params_; }
  const MuonConfig& config() const { return config_; }

  // Newton-Schulz FLOPs of one step on this rank (4 m^2 n + 2 m^3 per iteration on an
  // [m, n] matrix with m <= n, summed over the matrices it orthogonalises): the cost the
  // layer-wise layout balances, and a number for the benchmark.
  double ns_flops() const;

 private:
  std::vector<RuleParam> params_;
  MuonConfig config_;
  float weight_decay_;
  const dist::Grid& grid_;
  dist::Comm& comm_;
  std::vector<Tensor> momentum_;
  // The tensor-parallel group of params_[i] when its update is gathered or distributed
  // over one (nullptr: the update is local: not split, group of 1, or blockwise).
  std::vector<const dist::Group*> tp_group_;
  // The update for params_[i]: orthogonalised, in the local shape, with its scale.
  Tensor orthogonalised(size_t i, const Tensor& update, double& scale) const;
  // The step's order: batches of params of one local shape whose update needs neither a
  // tensor-parallel collective nor the QKV split, each orthogonalised by one batched
  // Newton-Schulz call ([n, rows, cols], at most kBatchBytes of fp32 per batch); then each
  // other param alone (orthogonalised()), in params_ order. Fixed at construction, so TP
  // peers (same params) issue their collectives in one order.
  static constexpr int64_t kBatchBytes = int64_t(256) << 20;
  std::vector<std::vector<size_t>> batches_;
  std::vector<size_t> singles_;
  void step_batch(const std::vector<size_t>& batch, const Tensor& control);
  void step_single(size_t i, const Tensor& control);
  // --muon-fp32-matmul-prec's iteration dtype on `device` (the CPU's reference takes F32).
  DType ns_dtype(Device device) const;
};

}  // namespace megaton::optim
