// Muon's step: momentum, tensor-parallel gather or distributed iteration, QKV split,
// Newton-Schulz, scale, decoupled weight decay and the update (optim/muon_optimizer.h).
#include "optim/muon_optimizer.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "ops/muon.h"
#include "ops/ops.h"

namespace megaton::optim {

namespace {

// x in dtype d: x itself, or a cast on x's device (Tensor::to(DType) goes through the host).
Tensor cast_to(const Tensor& x, DType d) {
  if (x.dtype() == d) return x;
  Tensor y = Tensor::empty(x.shape(), d, x.device());
  ops::cast(x, y);
  return y;
}

// Newton-Schulz FLOPs on an [m, n] matrix (the iteration on the min side): per step
// A = X X^T (2 m^2 n), B = A A (2 m^3), X' = B X (2 m^2 n).
double ns_matrix_flops(int64_t rows, int64_t cols, int steps) {
  const double m = double(std::min(rows, cols)), n = double(std::max(rows, cols));
  return double(steps) * (4.0 * m * m * n + 2.0 * m * m * m);
}
}  // namespace

Muon::Muon(std::vector<RuleParam> params, MuonConfig config, float weight_decay,
           const dist::Grid& grid, dist::Comm& comm)
    : params_(std::move(params)),
      config_(config),
      weight_decay_(weight_decay),
      grid_(grid),
      comm_(comm) {
  MEGATON_CHECK(config_.num_ns_steps >= 1, "Muon: {} Newton-Schulz steps", config_.num_ns_steps);
  for (const RuleParam& mp : params_) {
    MEGATON_CHECK(mp.target && mp.model, "Muon: a param without its target or model");
    Param& t = *mp.target;
    const Tensor& main = main_of(t);
    MEGATON_CHECK(main.defined() && main.ndim() == 2 && main.dtype() == DType::F32,
                  "Muon: '{}' needs a 2-D fp32 main param (has {} {})", mp.model->name,
                  main.defined() ? dtype_name(main.dtype()) : "none",
                  main.defined() ? shape_str(main.shape()) : "");
    MEGATON_CHECK(t.main_grad.defined() && t.main_grad.numel() == main.numel(),
                  "Muon: '{}' has no main grad of its {} elements", mp.model->name, main.numel());
    momentum_.push_back(Tensor::zeros(main.shape(), DType::F32, main.device()));
    const Param& m = *mp.model;
    const dist::Group& g = m.is_expert ? grid_.etp() : grid_.tp();
    const bool split =
        m.tp_split_dim >= 0 && g.size() > 1 && config_.tp_mode != MuonTpMode::Blockwise;
    MEGATON_CHECK(!split || m.tp_split_dim <= 1, "Muon: '{}' split along dim {}", m.name,
                  m.tp_split_dim);
    tp_group_.push_back(split ? &g : nullptr);
  }
  // Batches by local shape, in order of first appearance (std::map would order by shape).
  std::vector<std::pair<Shape, std::vector<size_t>>> by_shape;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (momentum_[i].numel() == 0) continue;  // nothing to orthogonalise or update
    const bool qkv = config_.split_qkv && !params_[i].model->qkv_split_rows.empty();
    if (tp_group_[i] || qkv) {
      singles_.push_back(i);
      continue;
    }
    const Shape shape = momentum_[i].shape();
    auto it = std::find_if(by_shape.begin(), by_shape.end(),
                           [&](const auto& entry) { return entry.first == shape; });
    if (it == by_shape.end()) {
      by_shape.emplace_back(shape, std::vector<size_t>{});
      it = by_shape.end() - 1;
    }
    it->second.push_back(i);
  }
  for (auto& [shape, members] : by_shape) {
    // (At most 65535 matrices: the normalisation kernels' grid.y.)
    const int64_t per_batch =
        std::clamp<int64_t>(kBatchBytes / (4 * shape[0] * shape[1]), 1, 65535);
    for (size_t at = 0; at < members.size(); at += size_t(per_batch))
      batches_.emplace_back(
          members.begin() + int64_t(at),
          members.begin() + int64_t(std::min(members.size(), at + size_t(per_batch))));
  }
}

DType Muon::ns_dtype(Device device) const {
  return device != Device::CPU && config_.matmul_precision == MuonMatmulPrecision::Medium
             ? DType::BF16
             : DType::F32;
}

std::vector<std::pair<std::string, Tensor*>> Muon::state_tensors() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (size_t i = 0; i < params_.size(); ++i)
    out.emplace_back(params_[i].model->name + ".momentum_buffer", &momentum_[i]);
  return out;
}

double Muon::ns_flops() const {
  double flops = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& m = *params_[i].model;
    const Shape local = momentum_[i].shape();
    Shape shape = local;
    if (tp_group_[i] && config_.tp_mode == MuonTpMode::Duplicated)
      shape[size_t(m.tp_split_dim)] *= tp_group_[i]->size();
    if (config_.split_qkv && !m.qkv_split_rows.empty()) {
      const int64_t per_group =
          std::accumulate(m.qkv_split_rows.begin(), m.qkv_split_rows.end(), int64_t(0));
      for (int64_t rows : m.qkv_split_rows)
        flops += ns_matrix_flops(shape[0] / per_group * rows, shape[1], config_.num_ns_steps);
    } else {
      flops += ns_matrix_flops(shape[0], shape[1], config_.num_ns_steps);
    }
  }
  return flops;
}

Tensor Muon::orthogonalised(size_t i, const Tensor& update, double& scale) const {
  const Param& m = *params_[i].model;
  const dist::Group* group = tp_group_[i];
  const int64_t r = update.dim(0), c = update.dim(1);
  const bool gpu = update.device() != Device::CPU;
  // --muon-fp32-matmul-prec: medium iterates in bf16 on the GPU, high in TF32.
  const DType iteration_dtype = ns_dtype(update.device());
  ops::NsOptions options;
  options.tf32 = gpu && config_.matmul_precision == MuonMatmulPrecision::High;
  const int dim = m.tp_split_dim;
  const int tp = group ? group->size() : 1;
  // The matrix the iteration runs on: the local update, or (duplicated) the whole one
  // gathered in fp32 as Megatron gathers it. Rank-major row blocks are a row permutation
  // of the full weight when it stacks blocks (SwiGLU, tp_blocks), which NS commutes with,
  // and exactly the full QKV weight (each rank holds whole query groups).
  Tensor whole = update;
  const bool duplicated = group && config_.tp_mode == MuonTpMode::Duplicated;
  if (duplicated) {
    Tensor gathered = Tensor::empty({int64_t(tp) * r * c}, DType::F32, update.device());
    comm_.all_gather(update, gathered, *group);
    if (dim == 0) {
      whole = gathered.view({int64_t(tp) * r, c});
    } else {
      whole = Tensor::empty({r, int64_t(tp) * c}, DType::F32, update.device());
      for (int k = 0; k < tp; ++k)
        ops::copy_columns(gathered.rows(int64_t(k) * r * c, r * c).view({r, c}), 0, whole,
                          int64_t(k) * c, c);
    }
  }
  if (group && config_.tp_mode == MuonTpMode::Distributed) {
    // The slices as column blocks of X: a dim-0 (row) slice iterates transposed.
    options.transpose = dim == 0 ? 1 : 0;
    options.all_reduce = [this, group](Tensor& t) { comm_.all_reduce(t, *group); };
  }
  // The global shape for the scale (local in blockwise and for unsplit params).
  int64_t global_rows = r, global_cols = c;
  if (group) (dim == 0 ? global_rows : global_cols) *= tp;
  auto ns = [&](const Tensor& x) {
    Tensor work = cast_to(x, iteration_dtype);
    ops::newton_schulz(work, work, config_.coefficients, config_.num_ns_steps, options);
    return work;
  };
  Tensor result;
  if (config_.split_qkv && !m.qkv_split_rows.empty()) {
    // Q, K and V orthogonalised apart, each scaled by its own global shape, then joined
    // in fp32 (EO scales the fp32 result of each piece).
    const std::vector<int64_t>& split = m.qkv_split_rows;
    const int64_t per_group = std::accumulate(split.begin(), split.end(), int64_t(0));
    MEGATON_CHECK(whole.dim(0) % per_group == 0 && global_rows % per_group == 0,
                  "Muon: '{}' has {} rows, not whole query groups of {}", m.name, whole.dim(0),
                  per_group);
    std::vector<Tensor> pieces = ops::split_qkv_update(whole, split);
    for (size_t k = 0; k < pieces.size(); ++k) {
      Tensor o = cast_to(ns(pieces[k]), DType::F32);
      ops::scale_(o, float(ops::muon_scale_factor(global_rows / per_group * split[k], global_cols,
                                                  config_.scale_mode)) *
                         config_.extra_scale_factor);
      pieces[k] = o;
    }
    result = Tensor::empty(whole.shape(), DType::F32, whole.device());
    ops::join_qkv_update(pieces, split, result);
    scale = 1.0;
  } else {
    result = ns(whole);
    scale = ops::muon_scale_factor(global_rows, global_cols, config_.scale_mode) *
            double(config_.extra_scale_factor);
  }
  if (!duplicated) return result;
  // This rank's slice of the whole result.
  if (dim == 0) return result.rows(int64_t(group->rank) * r, r);
  Tensor own = Tensor::empty({r, c}, result.dtype(), result.device());
  ops::copy_columns(result, int64_t(group->rank) * c, own, 0, c);
  return own;
}

void Muon::step(const Tensor& control) {
  for (const std::vector<size_t>& batch : batches_) step_batch(batch, control);
  // One param at a time: the scratch of one matrix (its gathered update and NS work) at most.
  for (size_t i : singles_) step_single(i, control);
}

void Muon::step_batch(const std::vector<size_t>& batch, const Tensor& control) {
  const Tensor& first = momentum_[batch.front()];
  const int64_t n = int64_t(batch.size()), rows = first.dim(0), cols = first.dim(1);
  // The momenta write their updates straight into the batch, in the iteration's dtype.
  Tensor updates = Tensor::empty({n, rows, cols}, ns_dtype(first.device()), first.device());
  std::vector<Tensor> mains, slots, copies;
  std::vector<float> wds, scales;
  const float scale = float(ops::muon_scale_factor(rows, cols, config_.scale_mode) *
                            double(config_.extra_scale_factor));
  for (int64_t k = 0; k < n; ++k) {
    const size_t i = batch[size_t(k)];
    Param& t = *params_[i].target;
    Tensor slot = updates.rows(k, 1).view({rows, cols});
    ops::muon_momentum_update(momentum_[i], t.main_grad, config_.momentum, config_.nesterov, slot,
                              control);
    mains.push_back(main_of(t));
    slots.push_back(slot);
    copies.push_back(compute_copy_of(t));
    wds.push_back(params_[i].model->no_weight_decay ? 0.0f : weight_decay_);
    scales.push_back(scale);
  }
  ops::NsOptions options;
  options.tf32 =
      first.device() != Device::CPU && config_.matmul_precision == MuonMatmulPrecision::High;
  ops::newton_schulz(updates, updates, config_.coefficients, config_.num_ns_steps, options);
  ops::muon_apply(mains, slots, copies, wds, scales, control);
}

void Muon::step_single(size_t i, const Tensor& control) {
  Param& t = *params_[i].target;
  Tensor& main = main_of(t);
  Tensor update = Tensor::empty(main.shape(), DType::F32, main.device());
  ops::muon_momentum_update(momentum_[i], t.main_grad, config_.momentum, config_.nesterov, update,
                            control);
  double scale = 1.0;
  Tensor o = orthogonalised(i, update, scale);
  std::vector<Tensor> mains{main}, updates{o}, copies{compute_copy_of(t)};
  const std::vector<float> wd{params_[i].model->no_weight_decay ? 0.0f : weight_decay_};
  const std::vector<float> scales{float(scale)};
  ops::muon_apply(mains, updates, copies, wd, scales, control);
}

}  // namespace megaton::optim
