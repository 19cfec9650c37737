// DistributedAdamW's fp16 and fp8 moments (AdamW's scaled moments): the per-parameter absmax
// reduced over the ranks that hold pieces of a parameter, the scales in checkpoints, and the
// checkpoint moments converted between dtypes. docs/memory.md "Scaled optimizer states".
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "model/layers.h"
#include "ops/adam_f16_main_param.h"
#include "ops/adam_scaled_state_math.h"
#include "optim/distrib_optimizer.h"

namespace megaton::optim {

const dist::Group& DistributedAdamW::tp_group_of(const ParamAndGradBuffer& b) const {
  return b.is_expert() ? grid_.etp() : grid_.tp();
}

void DistributedAdamW::plan_moment_absmax() {
  adam_param_slot_.clear();
  for (size_t target : adam_target_) adam_param_slot_.push_back(target_slot_[target]);
  if (!adam_->scaled_states()) return;
  AdamW::MomentAbsmaxSlots slots;
  // Columns: exp_avg, exp_avg_sq, the fp16 main param (AdamW::MomentAbsmaxSlots).
  for (ParamAndGradBuffer& b : each_buffer())
    moment_absmax_.push_back(Tensor::zeros({std::max<int64_t>(int64_t(b.params().size()), 1), 3},
                                           DType::F32, b.device()));
  for (auto [bi, k] : adam_param_slot_)
    slots.rows.push_back(moment_absmax_[bi].rows(int64_t(k), 1).view({3}));
  slots.storage = moment_absmax_;
  // Megaton's deviation from Transformer Engine (whose "tensor" is whatever the optimizer
  // holds): one scale per model parameter, whatever layout holds it. A buffer's params are
  // the same, in the same order, on every rank of its data- and tensor-parallel groups, so
  // one max all-reduce of [params, 3] per group and buffer.
  slots.reduce = [this] {
    for (size_t bi = 0; bi < buffers_.size(); ++bi) {
      const ParamAndGradBuffer& b = *buffers_[bi];
      if (distributed_ && group_of(b).size() > 1)
        comm_.all_reduce(moment_absmax_[bi], group_of(b), dist::ReduceOp::Max);
      if (tp_group_of(b).size() > 1)
        comm_.all_reduce(moment_absmax_[bi], tp_group_of(b), dist::ReduceOp::Max);
    }
  };
  adam_->set_moment_absmax_slots(std::move(slots));
}

void DistributedAdamW::append_moment_scales(size_t bi,
                                            std::vector<std::pair<std::string, Tensor>>& out) {
  if (!adam_->scaled_moments()) return;
  ParamAndGradBuffer& b = *buffers_[bi];
  const dist::Group& g = group_of(b);
  const int64_t n = int64_t(b.params().size());
  Tensor scales;
  if (!distributed_) {
    if (g.rank != 0) return;
    scales = Tensor::zeros({std::max<int64_t>(n, 1), 2}, DType::F32, b.device());
    for (size_t j = 0; j < adam_param_slot_.size(); ++j)
      if (adam_param_slot_[j].first == bi)
        scales.rows(int64_t(adam_param_slot_[j].second), 1)
            .copy_from(adam_->moment_scales(j).view({1, 2}));
  } else {
    // Every piece of a parameter has its scale: the max over the group gathers them.
    scales = Tensor::zeros({std::max<int64_t>(n, 1), 2}, DType::F32, b.device());
    for (size_t j = 0; j < adam_param_slot_.size(); ++j)
      if (adam_param_slot_[j].first == bi)
        scales.rows(int64_t(adam_param_slot_[j].second), 1)
            .copy_from(adam_->moment_scales(j).view({1, 2}));
    comm_.all_reduce(scales, g, dist::ReduceOp::Max);
    if (g.rank != 0) return;
  }
  const AdamWConfig& c = adam_->config();
  const bool scaled[2] = {scaled_moment_dtype(c.exp_avg_dtype),
                          scaled_moment_dtype(c.exp_avg_sq_dtype)};
  const char* suffix[2] = {".exp_avg.scale", ".exp_avg_sq.scale"};
  for (int64_t k = 0; k < n; ++k) {
    const Param* p = b.params()[size_t(k)];
    if (p->shared) continue;  // the first pipeline stage writes the tied embeddings
    for (int col = 0; col < 2; ++col)
      if (scaled[col])
        out.emplace_back("optimizer." + p->name + suffix[col],
                         scales.rows(k, 1).view({2}).rows(col, 1));
  }
}

namespace {

// max |x| over a tensor's values (F32, any device).
float absmax_of(const Tensor& values) { return ops::f16_main_param_absmax(values); }

}  // namespace

std::vector<float> DistributedAdamW::initial_f16_main_param_scales(size_t bi,
                                                                   const AdamWConfig& config) {
  const ParamAndGradBuffer& b = *buffers_[bi];
  const size_t n = b.params().size();
  std::vector<float> scales(n, -1.0f);
  if (config.main_params_dtype != DType::F16) return scales;
  Tensor absmax = Tensor::zeros({std::max<int64_t>(int64_t(n), 1)});
  for (size_t k = 0; k < n; ++k) {
    const Param* p = b.params()[k];
    if (b.fp8() || !stores_f16_main_param(config, *p)) continue;
    absmax.f32()[k] = p->main_param_f16.defined()
                          ? absmax_of(main_param_value(*p))
                          : absmax_of(main_param_values(*p, 0, p->weight.numel()));
  }
  // Every rank of the tensor-parallel group decides alike which params are fp16.
  const dist::Group& tp = tp_group_of(b);
  if (tp.size() > 1) {
    Tensor on_device = absmax.to(comm_.device());
    comm_.all_reduce(on_device, tp, dist::ReduceOp::Max);
    absmax = on_device.to(Device::CPU);
  }
  for (size_t k = 0; k < n; ++k)
    if (!b.fp8() && stores_f16_main_param(config, *b.params()[k]))
      scales[k] = ops::f16_main_param_scale(absmax.f32()[k]);
  return scales;
}

std::vector<float> DistributedAdamW::loaded_f16_main_param_scales(
    size_t bi, const std::function<const Tensor*(const std::string&)>& find,
    const std::string& source) {
  const ParamAndGradBuffer& b = *buffers_[bi];
  const size_t n = b.params().size();
  std::vector<float> scales(n, -1.0f);
  // Which of this buffer's params keep fp16 main params: the replicated params themselves,
  // or (distributed) those with an fp16 shard piece on some rank of the group (a max over
  // it: a rank whose shard misses a param learns it from the others).
  std::vector<uint8_t> f16(n, 0);
  bool any = false;
  if (adam_->config().main_params_dtype != DType::F16) {
    // (No fp16 main params: only the notice below, for a checkpoint that had them.)
  } else if (!distributed_) {
    for (size_t k = 0; k < n; ++k) f16[k] = b.params()[k]->main_param_f16.defined();
  } else {
    for (size_t j = 0; j < shard_params_.size(); ++j)
      if (shard_buffer_[j] == bi && shard_params_[j].main_param_f16.defined())
        f16[target_slot_[j].second] = 1;
    Tensor flags = Tensor::zeros({std::max<int64_t>(int64_t(n), 1)});
    for (size_t k = 0; k < n; ++k) flags.f32()[k] = f16[k];
    if (group_of(b).size() > 1) {
      Tensor on_device = flags.to(comm_.device());
      comm_.all_reduce(on_device, group_of(b), dist::ReduceOp::Max);
      flags = on_device.to(Device::CPU);
    }
    for (size_t k = 0; k < n; ++k) f16[k] = flags.f32()[k] != 0.0f;
  }
  Tensor absmax = Tensor::zeros({std::max<int64_t>(int64_t(n), 1)});
  bool from_values = false;
  for (size_t k = 0; k < n; ++k) {
    const Param* p = b.params()[k];
    const std::string name = "optimizer." + p->name + ".main_param.scale";
    const Tensor* s = find(name);
    if (s && (s->numel() != 1 || s->dtype() != DType::F32))
      fail("checkpoint '{}': tensor '{}' is {} {}, expected F32 [1]", source, name,
           dtype_name(s->dtype()), shape_str(s->shape()));
    const bool stored_f16 = s != nullptr;
    if (!main_params_noticed_ && bool(f16[k]) != stored_f16 && grid_.world().rank == 0) {
      fmt::print(
          " checkpoint '{}' holds the main params in {} ('{}'), this run keeps them in {}: "
          "converting\n",
          source, stored_f16 ? "F16" : "F32", "model." + p->name, f16[k] ? "F16" : "F32");
      main_params_noticed_ = true;
    }
    any = any || f16[k];
    if (!f16[k]) continue;
    if (stored_f16) {
      scales[k] = s->to(Device::CPU).f32()[0];
    } else {
      const Tensor* values = find("model." + p->name);
      if (values) absmax.f32()[k] = absmax_of(*values);  // (a missing one fails the load)
      from_values = true;
    }
  }
  if (!any) return scales;
  // New scales from the values: the whole parameter's absmax, as at construction.
  const dist::Group& tp = tp_group_of(b);
  bool reduce = from_values;
  if (tp.size() > 1) {
    // Every rank of the group reads the same checkpoint: they agree on from_values.
    Tensor on_device = absmax.to(comm_.device());
    if (reduce) comm_.all_reduce(on_device, tp, dist::ReduceOp::Max);
    absmax = on_device.to(Device::CPU);
  }
  for (size_t k = 0; k < n; ++k)
    if (f16[k] && scales[k] < 0) scales[k] = ops::f16_main_param_scale(absmax.f32()[k]);
  return scales;
}

void DistributedAdamW::append_main_param_scales(size_t bi,
                                                std::vector<std::pair<std::string, Tensor>>& out) {
  if (adam_->config().main_params_dtype != DType::F16) return;
  ParamAndGradBuffer& b = *buffers_[bi];
  const dist::Group& g = group_of(b);
  const int64_t n = int64_t(b.params().size());
  // -1 marks a param without an fp16 main param; every piece of a param has its scale, so
  // a max over the group gathers them (distributed).
  Tensor scales = Tensor::empty({std::max<int64_t>(n, 1)});
  scales.fill(-1.0f);
  for (size_t j = 0; j < adam_param_slot_.size(); ++j) {
    if (adam_param_slot_[j].first != bi) continue;
    const Param* p = adam_->params()[j];
    if (p->main_param_f16.defined())
      scales.f32()[adam_param_slot_[j].second] = p->main_param_scale.to(Device::CPU).f32()[0];
  }
  if (distributed_ && g.size() > 1) {
    Tensor on_device = scales.to(comm_.device());
    comm_.all_reduce(on_device, g, dist::ReduceOp::Max);
    scales = on_device.to(Device::CPU);
  }
  if (g.rank != 0) return;
  for (int64_t k = 0; k < n; ++k) {
    const Param* p = b.params()[size_t(k)];
    if (p->shared || scales.f32()[k] < 0) continue;
    out.emplace_back("optimizer." + p->name + ".main_param.scale", scales.rows(k, 1).clone());
  }
}

namespace {

// A checkpoint moment's values in fp32 on the host: the stored value times its scale.
Tensor unscaled_values(const Tensor& stored, float scale) {
  Tensor host = stored.to(Device::CPU);
  Tensor values = host.dtype() == DType::F32 ? host.clone() : host.to(DType::F32);
  if (scaled_moment_dtype(stored.dtype()))
    for (int64_t i = 0; i < values.numel(); ++i) values.f32()[i] *= scale;
  return values;
}

}  // namespace

void DistributedAdamW::load_moments(const std::function<const Tensor*(const std::string&)>& find,
                                    const std::string& source, const RangeReads& ranges) {
  const AdamWConfig& c = adam_->config();
  const DType run[2] = {c.exp_avg_dtype, c.exp_avg_sq_dtype};
  const char* suffix[2] = {".exp_avg", ".exp_avg_sq"};
  // The checkpoint's moments of every buffer param (this rank's tensor-parallel slice), their
  // dtypes and scales.
  // `t` null: read by range (the distributed shard's pieces only).
  struct Stored {
    const Tensor* t = nullptr;
    DType dtype = DType::F32;
    float scale = 1.0f;
  };
  const bool by_range = distributed_ && ranges.dtype_of && ranges.read_range;
  std::vector<std::vector<std::array<Stored, 2>>> stored(buffers_.size());
  bool convert_to_scaled = false;
  for (size_t bi = 0; bi < buffers_.size(); ++bi) {
    for (const Param* p : buffers_[bi]->params()) {
      std::array<Stored, 2> entry;
      if (rule_of(optimizer_, *p) != Rule::Adam) {  // another rule's state: load_rule_states
        stored[bi].push_back(entry);
        continue;
      }
      for (int col = 0; col < 2; ++col) {
        const std::string name = "optimizer." + p->name + suffix[col];
        // By range, the reader checks the shape on each read.
        const std::optional<DType> stored_dtype =
            by_range ? ranges.dtype_of(name) : std::optional<DType>();
        const Tensor* t = by_range ? nullptr : find(name);
        if (by_range ? !stored_dtype : !t) fail("checkpoint '{}' has no tensor '{}'", source, name);
        const DType d = by_range ? *stored_dtype : t->dtype();
        if (d != run[col] && scaled_moment_dtype(run[col]) && !t) t = find(name);  // whole absmax
        if ((t && t->shape() != p->weight.shape()) ||
            (d != DType::F32 && d != DType::BF16 && d != DType::F16 && d != DType::F8E4M3))
          fail(
              "checkpoint '{}': tensor '{}' is {} {}, the optimizer expects F32, BF16, F16 or "
              "F8_E4M3 {}",
              source, name, dtype_name(d), t ? shape_str(t->shape()) : std::string("?"),
              shape_str(p->weight.shape()));
        entry[col].t = t;
        entry[col].dtype = d;
        if (scaled_moment_dtype(d)) {
          const Tensor* s = find(name + ".scale");
          // An F16 moment without a scale is taken as unscaled (scale 1); fp8 needs one.
          if (!s && d == DType::F8E4M3)
            fail("checkpoint '{}' has no tensor '{}' (the scale of an F8_E4M3 moment)", source,
                 name + ".scale");
          if (s) {
            if (s->numel() != 1 || s->dtype() != DType::F32)
              fail("checkpoint '{}': tensor '{}' is {} {}, expected F32 [1]", source,
                   name + ".scale", dtype_name(s->dtype()), shape_str(s->shape()));
            entry[col].scale = float(s->to(Device::CPU).f32()[0]);
          }
        }
        if (d != run[col] && scaled_moment_dtype(run[col])) convert_to_scaled = true;
      }
      stored[bi].push_back(entry);
    }
  }
  // New scales where a moment becomes fp16 or fp8: the whole parameter's absmax (a max over
  // the tensor-parallel group, one all-reduce per buffer), as a training step sets them.
  std::vector<Tensor> new_scales(buffers_.size());
  if (convert_to_scaled) {
    for (size_t bi = 0; bi < buffers_.size(); ++bi) {
      const size_t n = stored[bi].size();
      Tensor absmax = Tensor::zeros({std::max<int64_t>(int64_t(n), 1), 2});
      for (size_t k = 0; k < n; ++k)
        for (int col = 0; col < 2; ++col) {
          const Stored& s = stored[bi][k][col];
          if (s.dtype == run[col] || !scaled_moment_dtype(run[col])) continue;
          const Tensor values = unscaled_values(*s.t, s.scale);
          float m = 0.0f;
          for (int64_t i = 0; i < values.numel(); ++i) m = std::max(m, std::fabs(values.f32()[i]));
          absmax.f32()[2 * k + col] = m;
        }
      const dist::Group& tp = tp_group_of(*buffers_[bi]);
      if (tp.size() > 1) {
        Tensor on_device = absmax.to(comm_.device());
        comm_.all_reduce(on_device, tp, dist::ReduceOp::Max);
        absmax = on_device.to(Device::CPU);
      }
      for (size_t k = 0; k < n; ++k)
        for (int col = 0; col < 2; ++col)
          if (scaled_moment_dtype(run[col]))
            absmax.f32()[2 * k + col] = ops::state_scale_from_absmax(
                absmax.f32()[2 * k + col], ops::adam_state_kind(run[col], "load_full_state"));
      new_scales[bi] = absmax;
    }
  }
  bool noticed = false;
  auto state = adam_->state_tensors();
  for (size_t j = 0; j < adam_param_slot_.size(); ++j) {
    const auto [bi, k] = adam_param_slot_[j];
    int64_t offset = 0, numel = buffers_[bi]->params()[k]->weight.numel();
    if (distributed_) {
      offset = shard_pieces_[adam_target_[j]].param_offset;
      numel = shard_pieces_[adam_target_[j]].numel;
    }
    float scales[2] = {1.0f, 1.0f};
    for (int col = 0; col < 2; ++col) {
      const Stored& s = stored[bi][k][col];
      Tensor& target = *state[2 * j + col].second;
      const std::string name = "optimizer." + buffers_[bi]->params()[k]->name + suffix[col];
      const Tensor stored_piece =
          s.t ? s.t->view({s.t->numel()}).rows(offset, numel).view(target.shape())
              : ranges.read_range(name, offset, numel).view(target.shape());
      if (s.dtype == run[col]) {
        target.copy_from(stored_piece);
        scales[col] = s.scale;
        continue;
      }
      if (!noticed && grid_.world().rank == 0)
        fmt::print(
            " checkpoint '{}' holds the Adam moments in {} ('{}'), this run keeps them in "
            "{}: converting\n",
            source, dtype_name(s.dtype), name, dtype_name(run[col]));
      noticed = true;
      Tensor values = unscaled_values(stored_piece, s.scale);
      if (scaled_moment_dtype(run[col])) {
        scales[col] = new_scales[bi].f32()[2 * k + col];
        const float rscale = ops::state_rscale(scales[col]);
        for (int64_t i = 0; i < values.numel(); ++i) values.f32()[i] *= rscale;
      }
      target.copy_from(values.to(run[col]));  // to nearest (fp8: saturating)
    }
    if (adam_->scaled_moments()) {
      Tensor row = Tensor::from({2}, {scales[0], scales[1]});
      adam_->moment_scales(j).copy_from(row);
    }
  }
}

}  // namespace megaton::optim
