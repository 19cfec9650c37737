// MambaMixer forward, backward and generation (model/mamba_mixer.h) on the ops of
// ops/ssm.h.
#include "model/mamba_mixer.h"

#include <cmath>
#include <utility>

#include "core/error.h"
#include "model/main_grad.h"
#include "model/packed_seq_params.h"
#include "model/saved_tensors.h"
#include "ops/mla.h"
#include "ops/ops.h"
#include "ops/ssm.h"

namespace megaton {

namespace {

// RMSNormGated's epsilon in Megatron's MambaMixer (ExtendedRMSNorm(eps=1e-5)).
constexpr float kGatedNormEps = 1e-5f;
// MambaMixer's dt initialisation range and A's (dt_min, dt_max, A_init_range).
constexpr float kDtMin = 1e-3f, kDtMax = 1e-1f, kAMin = 1.0f, kAMax = 16.0f;

// A constant parameter split over tensor parallelism along dim 0 (its slice is constant
// too), as Linear's column-parallel bias.
Param constant_sharded(const std::string& name, int64_t full, float value, Placement where,
                       const ModelParallel& mp) {
  const int tp = mp.tp_size();
  Param p = make_constant_param(name, {full / tp}, value, true, where);
  if (tp > 1) {
    p.tp_split_dim = 0;
    p.full_shape = {full};
  }
  return p;
}

// The micro-batch's rows' positions within their packed documents (made once per
// micro-batch, train/packed_batch.h), or undefined when it is not packed.
Tensor document_positions(const ForwardContext& ctx, int64_t rows) {
  const PackedSeqParams* packed = ctx.packed_seq_params.get();
  if (!packed || !packed->reset_attention_mask()) return Tensor();
  MEGATON_CHECK(packed->document_positions.defined() && packed->document_positions.numel() == rows,
                "MambaMixer: the packed micro-batch has no document positions for its {} rows",
                rows);
  return packed->document_positions;
}

}  // namespace

MambaMixer::MambaMixer(const std::string& prefix, const GPTConfig& cfg, int64_t layer,
                       uint64_t seed, const ModelParallel& mp)
    : in_proj(prefix + ".in_proj", cfg.hidden_size, cfg.mamba_in_proj_size(), false,
              cfg.init_method_std, seed, Placement::of(cfg), TensorParallelMode::Column, mp,
              {cfg.mamba_d_inner(), cfg.mamba_d_inner(), cfg.mamba_num_groups * cfg.mamba_state_dim,
               cfg.mamba_num_groups * cfg.mamba_state_dim, cfg.mamba_num_heads}),
      out_proj(prefix + ".out_proj", cfg.mamba_d_inner(), cfg.hidden_size, false,
               cfg.scaled_init_method_std(), seed, Placement::of(cfg), TensorParallelMode::Row,
               mp) {
  (void)layer;
  // Megatron's MambaMixer sets use_muon = False on in_proj: its five blocks take the scalar
  // optimizer (docs/research/muon.md 3.1).
  in_proj.weight.use_muon = false;
  const int tp = mp.tp_size(), rank = mp.tp_rank();
  const Placement where = Placement::of(cfg);
  heads_ = cfg.mamba_num_heads / tp;
  head_dim_ = cfg.mamba_head_dim;
  groups_ = cfg.mamba_num_groups / tp;
  state_ = cfg.mamba_state_dim;
  d_inner_ = heads_ * head_dim_;
  conv_dim_ = d_inner_ + 2 * groups_ * state_;
  kernel_ = cfg.mamba_conv_kernel;
  chunk_ = cfg.mamba_chunk_size;
  const int64_t gn = cfg.mamba_num_groups * cfg.mamba_state_dim;
  const std::vector<int64_t> conv_blocks = {cfg.mamba_d_inner(), gn, gn};
  // nn.Conv1d's default: kaiming_uniform(a = sqrt(5)) on the weight and U(+-1/sqrt(fan_in))
  // on the bias, fan_in = K (one input channel per group).
  const float bound = 1.0f / std::sqrt(float(kernel_));
  conv1d_weight = make_uniform_param(prefix + ".conv1d.weight", {cfg.mamba_conv_dim(), 1, kernel_},
                                     -bound, bound, ParamInit::Map::Identity, false, seed, where, 0,
                                     rank, tp, conv_blocks);
  conv1d_bias =
      make_uniform_param(prefix + ".conv1d.bias", {cfg.mamba_conv_dim()}, -bound, bound,
                         ParamInit::Map::Identity, true, seed, where, 0, rank, tp, conv_blocks);
  dt_bias =
      make_uniform_param(prefix + ".dt_bias", {cfg.mamba_num_heads}, std::log(kDtMin),
                         std::log(kDtMax), ParamInit::Map::MambaDt, true, seed, where, 0, rank, tp);
  A_log = make_uniform_param(prefix + ".A_log", {cfg.mamba_num_heads}, kAMin, kAMax,
                             ParamInit::Map::Log, true, seed, where, 0, rank, tp);
  D = constant_sharded(prefix + ".D", cfg.mamba_num_heads, 1.0f, where, mp);
  norm_weight = constant_sharded(prefix + ".norm.weight", cfg.mamba_d_inner(), 1.0f, where, mp);
}

void MambaMixer::set_recompute(const RecomputeConfig& rc) {
  keep_input_ = !rc.selective(kRecomputeLayernorm);
}

Tensor MambaMixer::forward(const Tensor& x, int64_t batch, int64_t seq, const ForwardContext& ctx) {
  Saved& s = saved_;
  s = {};
  s.held = true;
  s.batch = batch;
  s.seq = seq;
  const Tensor zxbcdt = in_proj.forward(x, keep_input_);
  const int64_t T = zxbcdt.dim(0);
  MEGATON_CHECK(T == batch * seq, "MambaMixer: in_proj gave {} rows for a {} x {} micro-batch", T,
                batch, seq);
  s.z = empty_like(zxbcdt, {T, d_inner_});
  s.xbc_raw = empty_like(zxbcdt, {T, conv_dim_});
  s.dt = empty_like(zxbcdt, {T, heads_});
  std::vector<Tensor> parts = {s.z, s.xbc_raw, s.dt};
  ops::split_columns(zxbcdt, parts);
  s.doc_positions = document_positions(ctx, T);
  Tensor xbc = empty_like(zxbcdt, {T, conv_dim_});
  ops::causal_conv1d_forward(s.xbc_raw, conv1d_weight.weight.view({conv_dim_, kernel_}),
                             conv1d_bias.weight, batch, true, xbc, s.doc_positions);
  s.x = empty_like(xbc, {T, d_inner_});
  s.B = empty_like(xbc, {T, groups_ * state_});
  s.C = empty_like(xbc, {T, groups_ * state_});
  std::vector<Tensor> xbc_parts = {s.x, s.B, s.C};
  ops::split_columns(xbc, xbc_parts);
  const ops::SsdDims dims{batch, seq, heads_, head_dim_, groups_, state_, chunk_};
  s.y = empty_like(xbc, {T, d_inner_});
  ops::ssd_forward(s.x, s.dt, A_log.weight, s.B, s.C, D.weight, dt_bias.weight, dims, s.y,
                   s.doc_positions);
  Tensor normed = empty_like(s.y, {T, d_inner_});
  s.rstd = Tensor::empty({T * groups_}, DType::F32, s.y.device());
  ops::gated_rmsnorm_forward(s.y, s.z, norm_weight.weight, d_inner_ / groups_, kGatedNormEps,
                             normed, s.rstd);
  return out_proj.forward(normed);
}

Tensor MambaMixer::backward(const Tensor& dout, const std::function<Tensor()>& input) {
  Saved& s = saved_;
  MEGATON_CHECK(s.held, "MambaMixer::backward without a forward");
  const int64_t T = s.y.dim(0);
  const Tensor dnormed = out_proj.backward(dout);
  Tensor dy = empty_like(s.y, {T, d_inner_}), dz = empty_like(s.z, {T, d_inner_});
  accumulate_main_grad(norm_weight.main_grad, [&](Tensor& g) {
    ops::gated_rmsnorm_backward(dnormed, s.y, s.z, norm_weight.weight, s.rstd, d_inner_ / groups_,
                                dy, dz, g);
  });
  const ops::SsdDims dims{s.batch, s.seq, heads_, head_dim_, groups_, state_, chunk_};
  Tensor dx = empty_like(s.x, s.x.shape()), ddt = empty_like(s.dt, s.dt.shape());
  Tensor dB = empty_like(s.B, s.B.shape()), dC = empty_like(s.C, s.C.shape());
  accumulate_main_grads(
      {&A_log.main_grad, &D.main_grad, &dt_bias.main_grad}, [&](std::vector<Tensor>& g) {
        ops::ssd_backward(dy, s.x, s.dt, A_log.weight, s.B, s.C, D.weight, dt_bias.weight, dims, dx,
                          ddt, dB, dC, g[0], g[1], g[2], s.doc_positions);
      });
  Tensor dxbc = empty_like(dx, {T, conv_dim_});
  ops::concat_columns({dx, dB, dC}, dxbc);
  Tensor dxbc_raw = empty_like(dxbc, {T, conv_dim_});
  accumulate_main_grads(
      {&conv1d_weight.main_grad, &conv1d_bias.main_grad}, [&](std::vector<Tensor>& g) {
        Tensor dw = g[0].view({conv_dim_, kernel_});
        ops::causal_conv1d_backward(
            dxbc, s.xbc_raw, conv1d_weight.weight.view({conv_dim_, kernel_}), conv1d_bias.weight,
            s.batch, true, dxbc_raw, dw, g[1], s.doc_positions);
      });
  Tensor dzxbcdt = empty_like(dz, {T, d_inner_ + conv_dim_ + heads_});
  ops::concat_columns({dz, dxbc_raw, ddt}, dzxbcdt);
  Tensor dxin = keep_input_ ? in_proj.backward(dzxbcdt) : in_proj.backward(dzxbcdt, input());
  saved_ = {};
  return dxin;
}

Tensor MambaMixer::forward_inference(const Tensor& x, int64_t first_position, Tensor& conv_state,
                                     Tensor& ssm_state) const {
  MEGATON_CHECK(heads_ * head_dim_ == d_inner_ && conv_state.defined() && ssm_state.defined(),
                "MambaMixer::forward_inference: no generation state");
  const Tensor zxbcdt = in_proj.forward_inference(x);
  const int64_t n = zxbcdt.dim(0);
  Tensor z = empty_like(zxbcdt, {n, d_inner_}), xbc_raw = empty_like(zxbcdt, {n, conv_dim_});
  Tensor dt = empty_like(zxbcdt, {n, heads_});
  std::vector<Tensor> parts = {z, xbc_raw, dt};
  ops::split_columns(zxbcdt, parts);
  Tensor xbc = empty_like(zxbcdt, {n, conv_dim_});
  const Tensor w = conv1d_weight.weight.view({conv_dim_, kernel_});
  const ops::SsdDims dims{1, n, heads_, head_dim_, groups_, state_, chunk_};
  Tensor xs = empty_like(xbc, {n, d_inner_}), B = empty_like(xbc, {n, groups_ * state_});
  Tensor C = empty_like(xbc, {n, groups_ * state_});
  Tensor y = empty_like(xbc, {n, d_inner_});
  // The prefix runs the chunked forward and records the states; later tokens step them.
  if (first_position == 0) {
    ops::causal_conv1d_forward(xbc_raw, w, conv1d_bias.weight, 1, true, xbc);
    ops::causal_conv1d_final_state(xbc_raw, 1, conv_state);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      Tensor row = xbc.rows(i, 1);
      ops::causal_conv1d_step(xbc_raw.rows(i, 1), w, conv1d_bias.weight, true, conv_state, row);
    }
  }
  std::vector<Tensor> xbc_parts = {xs, B, C};
  ops::split_columns(xbc, xbc_parts);
  if (first_position == 0) {
    ops::ssd_forward(xs, dt, A_log.weight, B, C, D.weight, dt_bias.weight, dims, y, Tensor(),
                     &ssm_state);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      Tensor yi = y.rows(i, 1);
      ops::ssd_step(xs.rows(i, 1), dt.rows(i, 1), A_log.weight, B.rows(i, 1), C.rows(i, 1),
                    D.weight, dt_bias.weight, dims, ssm_state, yi);
    }
  }
  Tensor normed = empty_like(y, {n, d_inner_});
  Tensor rstd = Tensor::empty({n * groups_}, DType::F32, y.device());
  ops::gated_rmsnorm_forward(y, z, norm_weight.weight, d_inner_ / groups_, kGatedNormEps, normed,
                             rstd);
  return out_proj.forward_inference(normed);
}

void MambaMixer::collect_params(std::vector<Param*>& out) {
  in_proj.collect_params(out);
  for (Param* p : {&conv1d_weight, &conv1d_bias, &dt_bias, &A_log, &D, &norm_weight})
    out.push_back(p);
  out_proj.collect_params(out);
}

std::any MambaMixer::take_saved() {
  Saved s = std::exchange(saved_, {});
  s.in_proj = in_proj.take_saved();
  s.out_proj = out_proj.take_saved();
  return s;
}

void MambaMixer::restore_saved(std::any&& saved) {
  Saved s = std::any_cast<Saved&&>(std::move(saved));
  in_proj.restore_saved(std::move(s.in_proj));
  out_proj.restore_saved(std::move(s.out_proj));
  saved_ = std::move(s);
}

void MambaMixer::for_each_saved_tensor(std::any& saved, const std::function<void(Tensor&)>& fn) {
  Saved& s = std::any_cast<Saved&>(saved);
  for (Tensor* t : {&s.z, &s.xbc_raw, &s.dt, &s.x, &s.B, &s.C, &s.y, &s.rstd, &s.doc_positions})
    fn(*t);
  for_each_tensor(s.in_proj, fn);
  for_each_tensor(s.out_proj, fn);
}

std::unique_ptr<Mixer> make_mamba_mixer(const std::string& prefix, const GPTConfig& cfg,
                                        int64_t layer, uint64_t seed, const ModelParallel& mp) {
  return std::make_unique<MambaMixer>(prefix, cfg, layer, seed, mp);
}

Shape mamba_conv_state_shape(const GPTConfig& cfg) {
  return {1, cfg.mamba_conv_kernel - 1, cfg.mamba_conv_dim()};
}

Shape mamba_ssm_state_shape(const GPTConfig& cfg) {
  return {1, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_dim};
}

}  // namespace megaton
