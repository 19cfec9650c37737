// DistributedAdamW: data-parallel gradient reduction, grad norm, replicated or sharded
// AdamW, and full-tensor checkpoint state.
#include "optim/distrib_optimizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <unordered_map>

#include "core/error.h"
#include "dist/host_reduce.h"
#include "model/layers.h"
#include "ops/adam_f16_main_param.h"
#include "ops/fp8.h"
#include "ops/ops.h"
#include "ops/param_remainder.h"
#include "ops/profiler.h"
#include "optim/clip_grad.h"

namespace megaton::optim {

namespace {
// ops::cast of src into dst (its dtype), also when src is on the host and dst on the device
// (an offloaded moment, --optimizer-cpu-offload): converted on the host, then copied.
// fp8 moments (which the device cast does not take) go through the host too.
void cast_into(const Tensor& src, Tensor& dst) {
  const bool fp8 = src.dtype() == DType::F8E4M3 || dst.dtype() == DType::F8E4M3;
  if (src.device() == dst.device() && !fp8) {
    ops::cast(src, dst);
    return;
  }
  const Tensor host = fp8 ? src.to(Device::CPU) : src;
  dst.copy_from(host.dtype() == dst.dtype() ? host : host.to(dst.dtype()));
}
}  // namespace

const dist::Group& DistributedAdamW::group_of(const ParamAndGradBuffer& b) const {
  return b.is_expert() ? grid_.edp() : grid_.dp_cp();
}

DistributedAdamW::DistributedAdamW(std::vector<ParamAndGradBuffer*> buffers, const dist::Grid& grid,
                                   dist::Comm& comm, AdamWConfig config, bool distributed,
                                   const OptimizerConfig& optimizer)
    : buffers_(std::move(buffers)),
      grid_(grid),
      comm_(comm),
      distributed_(distributed),
      optimizer_(optimizer) {
  std::vector<Param*> targets;
  std::vector<const Param*> models;
  std::vector<int64_t> offsets;
  // --main-params-dtype fp16: each param's scale from its whole absmax (tensor-parallel
  // slices included), for every shard or replica alike.
  std::vector<std::vector<float>> f16_scales(buffers_.size());
  for (size_t bi = 0; bi < buffers_.size(); ++bi)
    f16_scales[bi] = initial_f16_main_param_scales(bi, config);
  if (!distributed_) {
    for (size_t bi = 0; bi < buffers_.size(); ++bi)
      for (size_t k = 0; k < buffers_[bi]->params().size(); ++k) {
        Param* p = buffers_[bi]->params()[k];
        // Made without values (--init-model-with-meta-device): the whole main param now.
        if (p->main_param.storage_released() && !p->main_param.same_data(p->weight))
          p->main_param = main_param_values(*p, 0, p->weight.numel()).view(p->weight.shape());
        if (!stores_f16_main_param(config, *p) || p->main_param_f16.defined()) continue;
        p->main_param_f16 = Tensor::empty(p->weight.shape(), DType::F16, p->weight.device());
        p->main_param_scale = Tensor::zeros({1}, DType::F32, p->weight.device());
        ops::f16_main_param_quantize(p->main_param, f16_scales[bi][k], p->main_param_f16,
                                     p->main_param_scale);
        p->main_param = Tensor();
      }
    for (size_t bi = 0; bi < buffers_.size(); ++bi)
      for (size_t k = 0; k < buffers_[bi]->params().size(); ++k) {
        Param* p = buffers_[bi]->params()[k];
        targets.push_back(p);
        models.push_back(p);
        offsets.push_back(0);
        target_slot_.emplace_back(bi, k);
      }
    make_rules(targets, models, offsets, config);
    plan_moment_absmax();
    return;
  }
  // One AdamW param per piece of a model param inside this rank's shard of each buffer.
  size_t count = 0;
  for (ParamAndGradBuffer& b : each_buffer()) {
    const dist::Group& g = group_of(b);
    MEGATON_CHECK(b.num_shards() == g.size(), "buffer of {} shards for group {}", b.num_shards(),
                  g.describe());
    count += b.shard_pieces(g.rank).size();
    // Remainders (AdamWConfig::store_param_remainders) for a BF16 weight buffer: every rank
    // rounds every weight as the owner of its piece will (ties away from zero, where the
    // model's cast rounded to nearest even), so that all replicas compute alike before the
    // first all-gather.
    const bool remainders =
        config.store_param_remainders && config.main_params_dtype == DType::F32 &&
        b.weight_dtype() == DType::BF16 &&
        std::all_of(b.params().begin(), b.params().end(),
                    [&](const Param* p) { return rule_of(optimizer_, *p) == Rule::Adam; });
    buffer_remainders_.push_back(remainders);
    // (Sharded weights made without values have only the own shard, rounded per piece below.)
    if (remainders && !b.params().front()->weight.storage_released())
      for (Param* p : b.params()) {
        Tensor none;
        ops::split_param_remainders(main_param_values(*p, 0, p->weight.numel()), p->weight, none);
      }
  }
  shard_params_.reserve(count);  // AdamW keeps pointers into it
  for (size_t bi = 0; bi < buffers_.size(); ++bi) {
    ParamAndGradBuffer& b = *buffers_[bi];
    const dist::Group& g = group_of(b);
    for (const BufferPiece& piece : b.shard_pieces(g.rank)) {
      Param* p = piece.param;
      Param sp;
      sp.name =
          fmt::format("{}[{}:{}]", p->name, piece.param_offset, piece.param_offset + piece.numel);
      sp.no_weight_decay = p->no_weight_decay;
      sp.is_expert = p->is_expert;
      sp.weight = b.weight_piece(piece);
      sp.main_grad = b.grad_piece(piece);
      if (rule_of(optimizer_, *p) == Rule::Muon) {
        // Muon orthogonalises whole matrices: its owner's piece is the whole param (the
        // layer-wise layout), seen in the param's 2-D shape.
        MEGATON_CHECK(piece.param_offset == 0 && piece.numel == p->weight.numel(),
                      "Muon param '{}' split over shards ({} of {} elements here): the "
                      "distributed optimizer needs the layer-wise layout",
                      p->name, piece.numel, p->weight.numel());
        sp.weight = sp.weight.view(p->weight.shape());
        sp.main_grad = sp.main_grad.view(p->weight.shape());
        if (p->main_param.same_data(p->weight)) {
          sp.main_param = sp.weight;
        } else {
          sp.main_param = Tensor::empty(p->weight.shape(), DType::F32, p->weight.device());
          sp.main_param.copy_from(main_param_values(*p, 0, piece.numel));
        }
      } else if (b.fp8()) {
        // AdamW updates the fp32 piece only; quantize_fp8_weights writes the FP8 bytes.
        sp.main_param = Tensor::empty({piece.numel}, DType::F32, p->weight.device());
        sp.main_param.copy_from(main_param_values(*p, piece.param_offset, piece.numel));
        sp.weight = sp.main_param;
      } else if (p->main_param.same_data(p->weight)) {
        sp.main_param = sp.weight;  // fp32 run: the weight is the main param
      } else if (stores_f16_main_param(config, *p)) {
        // The piece's fp16 main param, with its whole parameter's scale.
        const std::vector<Param*>& params = b.params();
        const size_t k = size_t(std::find(params.begin(), params.end(), p) - params.begin());
        sp.main_param_f16 = Tensor::empty({piece.numel}, DType::F16, p->weight.device());
        sp.main_param_scale = Tensor::zeros({1}, DType::F32, p->weight.device());
        ops::f16_main_param_quantize(main_param_values(*p, piece.param_offset, piece.numel),
                                     f16_scales[bi][k], sp.main_param_f16, sp.main_param_scale);
      } else if (buffer_remainders_[bi]) {
        // The piece's fp32 main param as its remainder beside the weight (AdamW keeps it).
        sp.main_param_remainder = Tensor::empty({piece.numel}, DType::I16, p->weight.device());
        ops::split_param_remainders(main_param_values(*p, piece.param_offset, piece.numel),
                                    sp.weight, sp.main_param_remainder);
      } else {
        sp.main_param = Tensor::empty({piece.numel}, DType::F32, p->weight.device());
        sp.main_param.copy_from(main_param_values(*p, piece.param_offset, piece.numel));
      }
      shard_params_.push_back(std::move(sp));
      shard_pieces_.push_back(piece);
      shard_buffer_.push_back(bi);
      const std::vector<Param*>& params = b.params();
      target_slot_.emplace_back(
          bi, size_t(std::find(params.begin(), params.end(), p) - params.begin()));
    }
  }
  // The full fp32 main params are not needed any more: only this rank's shard is updated.
  for (ParamAndGradBuffer& b : each_buffer())
    for (Param* p : b.params())
      if (!p->main_param.same_data(p->weight)) p->main_param = Tensor();
  // A shard's piece is elements [param_offset, param_offset + numel) of its param's slice.
  for (size_t i = 0; i < shard_params_.size(); ++i) {
    targets.push_back(&shard_params_[i]);
    models.push_back(shard_pieces_[i].param);
    offsets.push_back(shard_pieces_[i].param_offset);
  }
  make_rules(targets, models, offsets, config);
  plan_moment_absmax();
  plan_fp8_weight_casts();
  quantize_fp8_weights();
}

void DistributedAdamW::plan_fp8_weight_casts() {
  for (size_t bi = 0; bi < buffers_.size(); ++bi) {
    ParamAndGradBuffer& b = *buffers_[bi];
    if (!b.fp8()) continue;
    MEGATON_CHECK(distributed_, "FP8 weight buffers need the distributed optimizer");
    const std::vector<Param*>& params = b.params();
    Fp8WeightCast cast;
    cast.buffer = &b;
    cast.amax = Tensor::zeros({int64_t(params.size())}, DType::F32, b.device());
    std::unordered_map<const Param*, int64_t> index;
    for (size_t k = 0; k < params.size(); ++k) {
      index[params[k]] = int64_t(k);
      cast.all_amax.push_back(cast.amax.rows(int64_t(k), 1));
      cast.scale.push_back(params[k]->fp8_scales.rows(1, 1));
      cast.scale_inv.push_back(params[k]->fp8_scales.rows(0, 1));
    }
    // This rank's piece of a weight is contiguous (a weight lies in one bucket, a shard is
    // a contiguous range of it): its amax is the weight's partial amax here.
    for (size_t i = 0; i < shard_params_.size(); ++i) {
      if (shard_buffer_[i] != bi) continue;
      const BufferPiece& piece = shard_pieces_[i];
      cast.main.push_back(shard_params_[i].main_param.view({1, piece.numel}));
      cast.piece_amax.push_back(cast.amax.rows(index.at(piece.param), 1));
      cast.out.push_back(b.weight_piece(piece).view({1, piece.numel}));
      cast.piece_scale.push_back(piece.param->fp8_scales.rows(1, 1));
    }
    cast.none.resize(cast.main.size());
    fp8_casts_.push_back(std::move(cast));
  }
}

void DistributedAdamW::quantize_fp8_weights() {
  // One launch per step for all pieces and weights of a buffer (the multi-tensor FP8 ops).
  for (Fp8WeightCast& c : fp8_casts_) {
    c.amax.zero();  // weights with no piece here count 0 in the max
    if (!c.main.empty()) ops::fp8_amax_multi(c.main, c.piece_amax);
    comm_.all_reduce(c.amax, group_of(*c.buffer), dist::ReduceOp::Max);
    const dist::Group& tp = c.buffer->is_expert() ? grid_.etp() : grid_.tp();
    if (tp.size() > 1) comm_.all_reduce(c.amax, tp, dist::ReduceOp::Max);
    // e4m3, no margin: current scaling of the weights. An all-zero weight keeps its last
    // scale (1 at first): its FP8 bytes are zeros whatever the scale.
    const ops::Fp8ScaleRule rule;
    ops::fp8_update_scale_multi(c.all_amax, rule, c.scale, c.scale_inv);
    if (!c.main.empty()) ops::fp8_quantize_multi(c.main, c.piece_scale, c.out, c.none, c.none);
  }
}

bool DistributedAdamW::counts_in_norm(const Param& p) const {
  // A param replicated over its tensor-parallel group counts on that group's rank 0 only.
  const dist::Group& tp = p.is_expert ? grid_.etp() : grid_.tp();
  // The last stage's copy of tied embeddings counts on the first stage (its twin).
  return !p.shared && (p.tp_split_dim >= 0 || tp.rank <= 0);
}

std::vector<const Param*> DistributedAdamW::counted_params() const {
  // Each distinct element once: data-parallel replicas on rank 0 of the group (or each
  // shard on its owner), tensor-parallel replicas on TP rank 0.
  std::vector<const Param*> params;
  if (distributed_) {
    for (size_t i = 0; i < shard_params_.size(); ++i)
      if (counts_in_norm(*shard_pieces_[i].param)) params.push_back(&shard_params_[i]);
  } else {
    for (ParamAndGradBuffer& b : each_buffer())
      if (group_of(b).rank == 0)
        for (Param* p : b.params())
          if (counts_in_norm(*p)) params.push_back(p);
  }
  return params;
}

std::vector<Tensor> DistributedAdamW::counted_grads() const {
  std::vector<Tensor> grads;
  for (const Param* p : counted_params()) grads.push_back(p->main_grad);
  return grads;
}

namespace {
// The sum of squares of the fp32 main params of (weight, remainder) pairs, joined through
// a scratch of at most 2^24 elements (64 MiB) at a time rather than a whole fp32 copy.
double remainder_sum_of_squares(const std::vector<const Param*>& params) {
  constexpr int64_t kScratch = int64_t(1) << 24;
  int64_t total = 0;
  for (const Param* p : params) total += p->weight.numel();
  if (total == 0) return 0.0;
  Tensor scratch =
      Tensor::empty({std::min(total, kScratch)}, DType::F32, params[0]->weight.device());
  double sum = 0.0;
  for (const Param* p : params) {
    const int64_t n = p->weight.numel();
    const Tensor weight = p->weight.view({n}), remainder = p->main_param_remainder.view({n});
    for (int64_t at = 0; at < n; at += kScratch) {
      const int64_t len = std::min(kScratch, n - at);
      Tensor out = scratch.rows(0, len);
      ops::join_param_remainders(weight.rows(at, len), remainder.rows(at, len), out);
      sum += ops::sum_of_squares(out);
    }
  }
  return sum;
}
}  // namespace

double DistributedAdamW::norm_over_model(bool main_params) {
  double sum_sq = 0.0;
  if (!main_params) {
    const std::vector<Tensor> grads = counted_grads();
    if (!grads.empty()) sum_sq = ops::multi_tensor_sum_of_squares(grads);
  } else {
    // Remainder pairs are joined a piece at a time; the others are read as they are.
    std::vector<Tensor> plain, host;  // host: main params offloaded to the host
    std::vector<const Param*> joined;
    for (const Param* p : counted_params()) {
      if (p->main_param_f16.defined())  // dequantized a param at a time
        sum_sq += ops::sum_of_squares(main_param_value(*p));
      else if (p->main_param_remainder.defined())
        joined.push_back(p);
      else if (p->main_param.defined() && p->main_param.device() != p->weight.device())
        host.push_back(p->main_param);
      else
        plain.push_back(p->main_param.defined() ? p->main_param : p->weight);
    }
    if (!plain.empty()) sum_sq += ops::multi_tensor_sum_of_squares(plain);
    if (!host.empty()) sum_sq += ops::multi_tensor_sum_of_squares(host);
    sum_sq += remainder_sum_of_squares(joined);
  }
  // Every rank's partial sum, added in rank order: the same fp64 result everywhere.
  const double norm = std::sqrt(dist::sum_over(comm_, grid_.world(), {sum_sq})[0]);
  // The reduced gradients are sums over the data-parallel ranks (DistributedDataParallel).
  return main_params ? norm : norm * double(grad_mean_scale());
}

int64_t DistributedAdamW::num_zeros_in_grad() {
  const std::vector<Tensor> tensors = counted_grads();
  const int64_t zeros = count_zeros_in_grads(tensors);  // F32 or BF16 main grads
  // Exact in fp64 below 2^53 elements.
  return int64_t(dist::sum_over(comm_, grid_.world(), {double(zeros)})[0]);
}

double DistributedAdamW::grad_norm() { return norm_over_model(false); }

double DistributedAdamW::params_norm() { return norm_over_model(true); }

void DistributedAdamW::step(float lr, float grad_scale) {
  adam_->step(lr, grad_scale * grad_mean_scale());
  if (muon_ || elementwise_) {
    const Tensor control = host_control(lr, grad_scale * grad_mean_scale());
    if (muon_) muon_->step(control);
    if (elementwise_) elementwise_->step(control);
  }
  quantize_fp8_weights();
}

DistributedAdamW::DeviceStep DistributedAdamW::step_on_device(
    const Tensor& lr, double max_norm, const Tensor& loss, bool check_nan, float inv_loss_scale,
    std::optional<double> per_token_loss_tokens) {
  const Device device = adam_->device_state().device();
  Tensor mine = Tensor::empty({1}, DType::I64, device);
  ops::multi_tensor_sum_of_squares(counted_grads(), mine);
  Tensor parts = mine;
  if (grid_.world().size() > 1) {
    parts = Tensor::empty({grid_.world().size()}, DType::I64, device);
    comm_.all_gather(mine, parts, grid_.world());
  }
  DeviceStep out;
  out.local_sum_sq = mine;
  out.grad_norm = Tensor::empty({1}, DType::I64, device);
  out.control = Tensor::empty({ops::kAdamControlSize}, DType::F32, device);
  const AdamWConfig& c = adam_->config();
  // Megatron unscales the main grads (x inv_scale) before the norm and the update; here the
  // factor rides with the data-parallel mean (exact for powers of two).
  const float unscale = grad_mean_scale() * inv_loss_scale;
  double norm_scale = double(unscale);
  float grad_scale = unscale;
  if (per_token_loss_tokens) {
    // Megatron-LM d98e8a6 finalize_model_grads: after the data-parallel sum (DDP's
    // gradient_scaling_factor is 1 with calculate_per_token_loss) every gradient is scaled
    // by 1 / clamp(num_tokens, min=1) before the optimizer unscales, clips and steps; here
    // both factors are one, computed in fp64.
    norm_scale = double(inv_loss_scale) / std::max(*per_token_loss_tokens, 1.0);
    grad_scale = float(norm_scale);
  }
  ops::adamw_step_control(parts, norm_scale, max_norm, grad_scale, loss, check_nan, lr,
                          c.adam_beta1, c.adam_beta2, adam_->device_state(), out.control,
                          out.grad_norm);
  {
    // Each rule's whole update under one name in MEGATON_OP_PROFILE's table (the ops and
    // collectives inside count toward it): the optimizer step's time per rule.
    const ops::OpProfileScope time("optimizer_adam");
    adam_->step(out.control);
  }
  if (muon_) {
    const ops::OpProfileScope time("optimizer_muon");
    muon_->step(out.control);
  }
  if (elementwise_) {
    const ops::OpProfileScope time("optimizer_sgd_lion");
    elementwise_->step(out.control);
  }
  out.state = adam_->device_state().clone();
  quantize_fp8_weights();
  return out;
}

std::vector<std::pair<std::string, Tensor>> DistributedAdamW::full_state() {
  std::vector<std::pair<std::string, Tensor>> model_out, optim_out;
  const AdamWConfig& c = adam_->config();
  if (!distributed_) {
    size_t index = 0;  // target index: the buffers' params in order
    for (size_t bi = 0; bi < buffers_.size(); ++bi) {
      ParamAndGradBuffer& b = *buffers_[bi];
      const bool writer = group_of(b).rank == 0;
      for (Param* p : b.params()) {
        if (writer && !p->shared) {
          // A remainder pair is written as the fp32 main param it stands for.
          model_out.emplace_back("model." + p->name, main_param_value(*p));
          for (const auto& [suffix, t] : target_states_[index])
            optim_out.emplace_back("optimizer." + p->name + suffix, *t);
        }
        ++index;
      }
      append_moment_scales(bi, optim_out);
      append_main_param_scales(bi, optim_out);
    }
  } else {
    // Each buffer's full main params and states: every rank writes its pieces into zeroed
    // buffers and a sum over the group assembles them (x + 0 = x exactly).
    for (size_t bi = 0; bi < buffers_.size(); ++bi) {
      ParamAndGradBuffer& b = *buffers_[bi];
      const dist::Group& g = group_of(b);
      // The state suffixes of the buffer's rules (the same on every rank of the group: a
      // param's rule does not depend on the shard), each assembled in fp32 whatever its
      // dtype (bf16, fp16, fp8 -> fp32 -> back is exact; fp16 and fp8 as stored, every piece
      // of a param having its one scale), then written in its dtype.
      std::vector<std::string> suffixes;
      for (const Param* p : b.params())
        for (const char* suffix : state_suffixes(rule_of(optimizer_, *p)))
          if (std::find(suffixes.begin(), suffixes.end(), suffix) == suffixes.end())
            suffixes.push_back(suffix);
      // Adam's and Lion's ".exp_avg" share a column, converted below to Adam's dtype: only
      // fp32 when Lion is there (the precision-aware optimizer is Adam's alone).
      MEGATON_CHECK(optimizer_.kind == OptimizerKind::Adam ||
                        (c.exp_avg_dtype == DType::F32 && c.exp_avg_sq_dtype == DType::F32),
                    "{} moments beside {}'s states", dtype_name(c.exp_avg_dtype),
                    optimizer_kind_name(optimizer_.kind));
      auto column = [&](const std::string& suffix) {
        return size_t(std::find(suffixes.begin(), suffixes.end(), suffix) - suffixes.begin()) + 1;
      };
      std::vector<Tensor> full(suffixes.size() + 1);  // main, then one per suffix
      for (Tensor& t : full) t = Tensor::zeros({b.numel()}, DType::F32, b.device());
      for (size_t i = 0; i < shard_params_.size(); ++i) {
        if (shard_buffer_[i] != bi) continue;
        const BufferPiece& piece = shard_pieces_[i];
        Tensor main = full[0].rows(piece.buffer_offset, piece.numel);
        const Param& sp = shard_params_[i];
        if (sp.main_param_remainder.defined())
          ops::join_param_remainders(sp.weight, sp.main_param_remainder, main);
        else if (sp.main_param_f16.defined())
          ops::f16_main_param_dequantize(sp.main_param_f16, sp.main_param_scale, main);
        else
          main.copy_from(sp.main_param.view({piece.numel}));
        for (const auto& [suffix, t] : target_states_[i]) {
          Tensor into = full[column(suffix)].rows(piece.buffer_offset, piece.numel);
          cast_into(t->view({piece.numel}), into);
        }
      }
      for (Tensor& t : full) comm_.all_reduce(t, g);
      if (g.rank != 0) continue;
      // Adam's moments in their dtypes (fp8 on the host: the device cast does not write it).
      for (size_t col = 1; col < full.size(); ++col) {
        const bool adam_moment =
            suffixes[col - 1] == ".exp_avg" || suffixes[col - 1] == ".exp_avg_sq";
        const DType d = !adam_moment                      ? DType::F32
                        : suffixes[col - 1] == ".exp_avg" ? c.exp_avg_dtype
                                                          : c.exp_avg_sq_dtype;
        if (d == DType::F8E4M3) full[col] = full[col].to(Device::CPU);
        if (d != DType::F32) full[col] = full[col].to(d);
      }
      for (size_t k = 0; k < b.params().size(); ++k) {
        const Param* p = b.params()[k];
        if (p->shared) continue;  // the first pipeline stage writes the tied embeddings
        auto slice = [&](const Tensor& t) {
          return t.rows(b.offset(k), p->weight.numel()).view(p->weight.shape());
        };
        model_out.emplace_back("model." + p->name, slice(full[0]));
        for (const char* suffix : state_suffixes(rule_of(optimizer_, *p)))
          optim_out.emplace_back("optimizer." + p->name + suffix, slice(full[column(suffix)]));
      }
    }
  }
  if (distributed_)  // (replicated, appended per buffer above)
    for (size_t bi = 0; bi < buffers_.size(); ++bi) {
      append_moment_scales(bi, optim_out);
      append_main_param_scales(bi, optim_out);
    }
  for (auto& entry : optim_out) model_out.push_back(std::move(entry));
  return model_out;
}

void DistributedAdamW::load_full_state(const std::function<const Tensor*(const std::string&)>& find,
                                       const std::string& source, bool optimizer_state,
                                       const RangeReads& ranges) {
  auto get = [&](const std::string& name, const Shape& shape) -> const Tensor& {
    const Tensor* t = find(name);
    if (!t) fail("checkpoint '{}' has no tensor '{}'", source, name);
    if (t->shape() != shape || t->dtype() != DType::F32)
      fail("checkpoint '{}': tensor '{}' is {} {}, the model expects F32 {}", source, name,
           dtype_name(t->dtype()), shape_str(t->shape()), shape_str(shape));
    return *t;
  };
  // fp16 main params: each param's scale (the checkpoint's, or from its values).
  std::vector<std::vector<float>> f16_scales(buffers_.size());
  for (size_t bi = 0; bi < buffers_.size(); ++bi)
    f16_scales[bi] = loaded_f16_main_param_scales(bi, find, source);
  // Weights (every rank holds all of them) and, replicated, the main params.
  for (size_t bi = 0; bi < buffers_.size(); ++bi) {
    ParamAndGradBuffer& b = *buffers_[bi];
    for (size_t k = 0; k < b.params().size(); ++k) {
      Param* p = b.params()[k];
      const Tensor& full = get("model." + p->name, p->weight.shape());
      if (b.fp8()) continue;  // quantized from the main params below
      if (p->main_param_f16.defined() || (distributed_ && f16_scales[bi][k] >= 0)) {
        // The weight as an update writes it (the fp32 value to nearest); replicated, the
        // fp16 main param too (distributed: the shard pieces' below).
        Tensor on_device = full.to(p->weight.device());
        ops::cast(on_device, p->weight);
        if (p->main_param_f16.defined())
          ops::f16_main_param_quantize(on_device, f16_scales[bi][k], p->main_param_f16,
                                       p->main_param_scale);
      } else if (p->main_param.defined()) {
        p->main_param.copy_from(full);
        refresh_compute_weight(*p);
      } else if (p->main_param_remainder.defined() || (distributed_ && buffer_remainders_[bi])) {
        // Remainders: the weight rounded as the split rounds it (and, replicated, the
        // remainder itself; distributed, the shard pieces' below).
        Tensor on_device = full.to(p->weight.device());
        ops::split_param_remainders(on_device, p->weight, p->main_param_remainder);
      } else {
        Tensor on_device = full.to(p->weight.device());
        ops::cast(on_device, p->weight);
      }
    }
  }
  if (!distributed_) {
    if (optimizer_state) {
      load_moments(find, source, ranges);
      load_rule_states(find, source, ranges);
    }
    return;
  }
  for (size_t i = 0; i < shard_params_.size(); ++i) {
    const BufferPiece& piece = shard_pieces_[i];
    const Param* p = piece.param;
    auto slice = [&](const Tensor& full) {
      return full.view({full.numel()}).rows(piece.param_offset, piece.numel);
    };
    Param& sp = shard_params_[i];
    // (An fp32 run's weight is its main param, loaded above; an FP8 weight's piece updates
    // its own fp32 main param, sp.weight being that too.)
    if (sp.main_param_remainder.defined()) {
      Tensor piece_main = slice(get("model." + p->name, p->weight.shape())).to(sp.weight.device());
      ops::split_param_remainders(piece_main, sp.weight, sp.main_param_remainder);
    } else if (sp.main_param_f16.defined()) {
      Tensor piece_main = slice(get("model." + p->name, p->weight.shape())).to(sp.weight.device());
      ops::f16_main_param_quantize(piece_main, f16_scales[shard_buffer_[i]][target_slot_[i].second],
                                   sp.main_param_f16, sp.main_param_scale);
    } else if (sp.main_param.raw() != sp.weight.raw() || buffers_[shard_buffer_[i]]->fp8()) {
      sp.main_param.view({piece.numel})
          .copy_from(slice(get("model." + p->name, p->weight.shape())));
    }
  }
  if (optimizer_state) {
    load_moments(find, source, ranges);
    load_rule_states(find, source, ranges);
  }
  quantize_fp8_weights();
}

}  // namespace megaton::optim
