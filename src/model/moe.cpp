// MoELayer forward/backward.
#include "model/moe.h"

#include <cmath>
#include <utility>

#include "core/error.h"
#include "model/main_grad.h"
#include "model/saved_tensors.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace megaton {

MoELayer::MoELayer(const std::string& prefix, const GPTConfig& cfg, uint64_t seed,
                   const ModelParallel& mp, int64_t layer)
    : router(prefix, cfg, seed, mp, layer),
      cfg_(cfg),
      mp_(mp),
      layer_(layer),
      chunks_per_layer_(chunks_per_layer(cfg, mp)),
      dispatcher_(make_token_dispatcher(cfg.num_experts, dispatcher_parallel(cfg, mp))) {
  Placement where = Placement::of(cfg);
  float output_std = cfg.scaled_init_method_std();
  int64_t h = cfg.hidden_size, f = cfg.moe_ffn_hidden_size, f1 = cfg.swiglu ? 2 * f : f;
  const int etp = mp.etp_size(), etp_rank = mp.etp_rank();
  if (f % etp != 0)
    fail("moe-ffn-hidden-size ({}) is not divisible by expert-tensor-parallel-size ({})", f, etp);
  if (cfg.moe_shared_expert_intermediate_size > 0)
    shared_expert = std::make_unique<SharedExpertMLP>(prefix + ".shared_experts", cfg, seed, mp);
  first_local_expert_ = dispatcher_->first_local_expert();
  for (int64_t l = 0; l < dispatcher_->num_local_experts(); ++l) {
    // Megatron's checkpoints name experts by their global index.
    std::string name = prefix + ".experts.local_experts." + std::to_string(first_local_expert_ + l);
    Expert ex;
    // Column-parallel fc1 (each SwiGLU half split), row-parallel fc2 over etp; the values
    // are the one-rank expert's slices.
    ex.fc1_weight = make_param_sharded(name + ".linear_fc1.weight", {f1, h}, cfg.init_method_std,
                                       seed, where, 0, etp_rank, etp,
                                       cfg.swiglu ? swiglu_blocks(f1) : std::vector<int64_t>{});
    ex.fc2_weight = make_param_sharded(name + ".linear_fc2.weight", {h, f}, output_std, seed, where,
                                       1, etp_rank, etp);
    if (!cfg.disable_bias_linear) {
      ex.fc1_bias = make_constant_param(name + ".linear_fc1.bias", {f1 / etp}, 0.0f, true, where);
      if (etp > 1) {  // zeros: the slice is zeros too
        ex.fc1_bias.tp_split_dim = 0;
        if (cfg.swiglu) ex.fc1_bias.tp_blocks = swiglu_blocks(f1);
        ex.fc1_bias.full_shape = {f1};
      }
      ex.fc2_bias = make_constant_param(name + ".linear_fc2.bias", {h}, 0.0f, true, where);
    }
    for (Param* param : {&ex.fc1_weight, &ex.fc2_weight, &ex.fc1_bias, &ex.fc2_bias})
      param->is_expert = true;
    experts.push_back(std::move(ex));
  }
  // The per-expert counts stay on the device where nothing needs them on the host: one
  // expert rank, no capacity (no dropped copies, no padding to capacity) and no expert
  // biases (added per expert's rows); enable_fp8 turns it off (FP8 pads each expert).
  dispatcher_->set_device_counts(mp.group(dist::GroupKind::ExpertMP).size() == 1 &&
                                 cfg.moe_expert_capacity_factor <= 0 &&
                                 !cfg.moe_pad_expert_input_to_capacity && cfg.disable_bias_linear);
}

int MoELayer::chunks_per_layer(const GPTConfig& cfg, const ModelParallel& mp) {
  return cfg.overlap_moe_expert_parallel_comm && mp.dispatcher == TokenDispatcher::AllToAll &&
                 mp.ep_size() > 1
             ? 2
             : 1;
}

std::vector<int64_t> MoELayer::last_tokens_per_local_expert() const {
  if (!saved_.expert_counts.defined()) return saved_.tokens_per_local_expert;
  const Tensor host = saved_.expert_counts.to(Device::CPU);
  return std::vector<int64_t>(host.i64(), host.i64() + host.numel());
}

ModelParallel MoELayer::dispatcher_parallel(const GPTConfig& cfg, const ModelParallel& mp) {
  ModelParallel out = mp;
  // Two chunks' exchanges overlap the experts: the peer-memory pull's two slots would be
  // reused while a peer may still read them (peer_memory.h), so the chunks regroup.
  if (chunks_per_layer(cfg, mp) > 1) out.alltoall_exchange = AlltoAllExchange::Regroup;
  return out;
}

bool MoELayer::splits_rows() const { return mp_.tp_size() > 1 && !mp_.sequence_parallel; }

std::vector<Tensor> MoELayer::expert_weights(Param Expert::*w) const {
  std::vector<Tensor> out;
  for (const Expert& e : experts) out.push_back((e.*w).weight);
  return out;
}

std::vector<Tensor*> MoELayer::expert_grads(Param Expert::*w) {
  std::vector<Tensor*> out;
  for (Expert& e : experts) out.push_back(&(e.*w).main_grad);
  return out;
}

void MoELayer::expert_bias_forward(Tensor& y, Param Expert::*bias, const Tensor& probs) {
  if (cfg_.disable_bias_linear) return;
  int64_t start = 0;
  for (size_t e = 0; e < experts.size(); ++e) {
    int64_t n = saved_.expert_rows[e];
    if (n > 0) {
      Tensor rows = y.rows(start, n);
      const Tensor& b = (experts[e].*bias).weight;
      if (probs.defined())
        ops::weighted_bias_add_(rows, b, probs.rows(start, n));
      else
        ops::bias_add_(rows, b);
    }
    start += n;
  }
}

void MoELayer::expert_bias_backward(const Tensor& dy, Param Expert::*bias, const Tensor& probs,
                                    Tensor* dprobs) {
  if (cfg_.disable_bias_linear) return;
  int64_t start = 0;
  for (size_t e = 0; e < experts.size(); ++e) {
    int64_t n = saved_.expert_rows[e];
    if (n > 0) {
      Param& b = experts[e].*bias;
      accumulate_main_grad(b.main_grad, [&](Tensor& g) {
        if (!probs.defined()) {
          ops::bias_backward(dy.rows(start, n), g);
        } else {
          Tensor dprobs_rows;
          if (dprobs) dprobs_rows = dprobs->rows(start, n);
          ops::weighted_bias_backward(dy.rows(start, n), b.weight, probs.rows(start, n), g,
                                      dprobs ? &dprobs_rows : nullptr);
        }
      });
    }
    start += n;
  }
}

Tensor MoELayer::pad_expert_rows(const Tensor& rows) const {
  const Saved& s = saved_;
  if (!s.padded) return rows;
  int64_t total = 0;
  for (int64_t n : s.expert_rows) total += n;
  Tensor padded = empty_like(rows, {total, rows.dim(1)});
  ops::moe_pad_rows(rows, s.tokens_per_local_expert, s.expert_rows, padded);
  return padded;
}

Tensor MoELayer::unpad_expert_rows(const Tensor& padded) const {
  const Saved& s = saved_;
  if (!s.padded) return padded;
  int64_t routed = 0;
  for (int64_t n : s.tokens_per_local_expert) routed += n;
  Tensor rows = empty_like(padded, {routed, padded.dim(1)});
  ops::moe_unpad_rows(padded, s.tokens_per_local_expert, s.expert_rows, rows);
  return rows;
}

void MoELayer::enable_fp8(const Fp8Config& config) {
  MEGATON_CHECK(config.enabled, "MoE layer {}: enable_fp8 without an FP8 format", layer_);
  const Device device = experts[0].fc1_weight.weight.device();
  const int64_t n = int64_t(experts.size());
  fc1_fp8_ = Fp8GroupedLinearGemms(config, device, n);
  fc2_fp8_ = Fp8GroupedLinearGemms(config, device, n);
  std::vector<Param*> fc1, fc2;
  for (Expert& e : experts) {
    fc1.push_back(&e.fc1_weight);
    fc2.push_back(&e.fc2_weight);
  }
  fc1_fp8_.adopt_weights(fc1);
  fc2_fp8_.adopt_weights(fc2);
  fp8_rows_ = config.dimension_multiple();
  dispatcher_->set_device_counts(false);  // the FP8 padding is sized on the host
}

std::vector<std::pair<std::string, Tensor*>> MoELayer::fp8_state() {
  std::vector<std::pair<std::string, Tensor*>> out;
  if (!fc1_fp8_.enabled()) return out;
  const auto layer_prefix = [](const Param& weight) {
    return weight.name.substr(0, weight.name.size() - std::string(".weight").size());
  };
  for (size_t e = 0; e < experts.size(); ++e) {
    for (auto& entry : fc1_fp8_.state(e, layer_prefix(experts[e].fc1_weight))) out.push_back(entry);
    for (auto& entry : fc2_fp8_.state(e, layer_prefix(experts[e].fc2_weight))) out.push_back(entry);
  }
  return out;
}

// The expert weights' shards over ETP, fc1's output gradient and fc2's input (features
// split) over ETP. (FP8 experts under context parallelism are refused: arguments.cpp.)
Fp8LinearGemms::Sharding MoELayer::fp8_sharding(Param Expert::*fc) const {
  Fp8LinearGemms::Sharding s;
  if (mp_.etp_size() <= 1) return s;
  const Fp8AmaxGroup etp{mp_.comm, &mp_.etp()};
  s.weight = etp;
  if (fc == &Expert::fc1_weight) s.grad_output = etp;
  if (fc == &Expert::fc2_weight) s.input = etp;
  return s;
}

void MoELayer::experts_forward(Param Expert::*fc, const Tensor& in, bool keep_input, Tensor& out) {
  Saved& s = saved_;
  if (s.expert_counts.defined()) {
    ops::grouped_gemm(in, expert_weights(fc), true, out, s.expert_counts);
    return;
  }
  if (!fc1_fp8_.enabled()) {
    ops::grouped_gemm(in, expert_weights(fc), true, out, s.expert_rows);
    return;
  }
  const bool fc1 = fc == &Expert::fc1_weight;
  std::vector<const Param*> weights;
  for (const Expert& e : experts) weights.push_back(&(e.*fc));
  (fc1 ? s.fc1_fp8 : s.fc2_fp8) =
      (fc1 ? fc1_fp8_ : fc2_fp8_)
          .forward(in, s.expert_rows, weights, keep_input, fp8_sharding(fc), out);
}

void MoELayer::experts_backward(Param Expert::*fc, const Tensor& dout,
                                const std::function<Tensor()>& in, Tensor& din) {
  const Saved& s = saved_;
  if (s.expert_counts.defined()) {
    ops::grouped_gemm(dout, expert_weights(fc), false, din, s.expert_counts);
    const Tensor x = in();
    accumulate_main_grads(expert_grads(fc), [&](std::vector<Tensor>& grads) {
      ops::grouped_gemm_wgrad(dout, x, grads, s.expert_counts);
    });
    return;
  }
  if (!fc1_fp8_.enabled()) {
    ops::grouped_gemm(dout, expert_weights(fc), false, din, s.expert_rows);
    const Tensor x = in();
    accumulate_main_grads(expert_grads(fc), [&](std::vector<Tensor>& grads) {
      ops::grouped_gemm_wgrad(dout, x, grads, s.expert_rows);
    });
    return;
  }
  const bool fc1 = fc == &Expert::fc1_weight;
  std::vector<Param*> weights;
  for (Expert& e : experts) weights.push_back(&(e.*fc));
  (fc1 ? fc1_fp8_ : fc2_fp8_)
      .backward(dout, s.expert_rows, weights, fc1 ? s.fc1_fp8 : s.fc2_fp8, in, fp8_sharding(fc),
                din);
}

Tensor MoELayer::forward(const Tensor& x_in, const ForwardContext& ctx) {
  Tensor x = x_in;
  if (splits_rows()) {
    const int64_t tp = mp_.tp_size();
    MEGATON_CHECK(x_in.dim(0) % tp == 0,
                  "MoE layer: {} token rows are not divisible by tensor-parallel size {}",
                  x_in.dim(0), tp);
    x = x_in.rows(mp_.tp_rank() * (x_in.dim(0) / tp), x_in.dim(0) / tp);
  }
  const int64_t tokens = x.dim(0);
  saved_.x = x;
  // This rank's rows are block tp_rank of the tensor-parallel group's token rows (under
  // sequence parallelism, or split here without it).
  const TopKRouter::Output routing =
      router.forward(x, ctx, mp_.tp_size() > 1 ? int64_t(mp_.tp_rank()) * tokens : 0);
  if (!ctx.recompute) saved_.aux_loss = router.last_loss_tensor();  // a re-run keeps the first
  // The padded size of an expert's input: each rank of the expert-model-parallel group sends
  // an expert at most `capacity` copies (all ranks have the same token count, hence
  // capacity).
  int64_t expert_capacity = 0;
  if (cfg_.moe_pad_expert_input_to_capacity) {
    MEGATON_CHECK(cfg_.moe_expert_capacity_factor > 0,
                  "moe-pad-expert-input-to-capacity needs moe-expert-capacity-factor");
    expert_capacity = routing.capacity * mp_.group(dist::GroupKind::ExpertMP).size();
  }

  // The shared expert's halves beside the exchanges (shared_expert_beside), otherwise
  // after the combine.
  const bool shared_beside = shared_expert_beside();
  Tensor shared_out;
  MoETokenDispatcher::Beside shared_fc1, shared_fc2;
  if (shared_beside) {
    shared_fc1 = [&] { shared_expert->forward_begin(x_in); };
    shared_fc2 = [&] { shared_out = shared_expert->forward_end(); };
  }
  Tensor out;
  if (chunks_per_layer_ == 1) {
    dispatch_phase(x, routing.probs, routing.indices, expert_capacity, shared_fc1);
    out = combine_phase(experts_phase(x), shared_fc2);
  } else {
    // --overlap-moe-expert-parallel-comm: the rows in two chunks, each dispatched and
    // combined on its own, so that one chunk's exchange runs beside the other's experts:
    // dispatch 0 | dispatch 1 beside experts 0 | combine 0 beside experts 1 | combine 1.
    const int64_t first = tokens / 2;
    auto part = [&](const Tensor& t, int c) {
      return c == 0 ? t.rows(0, first) : t.rows(first, tokens - first);
    };
    // Held here while the chunks run: in_chunk swaps saved_ (which keeps them after).
    std::vector<Chunk> ch(2);
    Tensor expert_out[2];
    auto dispatch = [&](int c, const MoETokenDispatcher::Beside& beside) {
      in_chunk(ch[c], [&] {
        dispatch_phase(part(x, c), part(routing.probs, c), part(routing.indices, c),
                       expert_capacity, beside);
      });
    };
    auto experts = [&](int c) { in_chunk(ch[c], [&] { expert_out[c] = experts_phase(x); }); };
    out = empty_like(x, x.shape());
    auto combine = [&](int c, const MoETokenDispatcher::Beside& beside) {
      in_chunk(ch[c], [&] { part(out, c).copy_from(combine_phase(expert_out[c], beside)); });
      expert_out[c] = Tensor();
    };
    dispatch(0, shared_fc1);
    dispatch(1, [&] { experts(0); });
    combine(0, [&] { experts(1); });
    combine(1, shared_fc2);
    // The layer's counts (logs, tests): both chunks' rows.
    saved_.tokens_per_local_expert = ch[0].moe.tokens_per_local_expert;
    for (size_t l = 0; l < saved_.tokens_per_local_expert.size(); ++l)
      saved_.tokens_per_local_expert[l] += ch[1].moe.tokens_per_local_expert[l];
    saved_.chunks = std::move(ch);
  }
  if (splits_rows()) out = gather_sequence(out, mp_);
  if (shared_expert) ops::add_(out, shared_beside ? shared_out : shared_expert->forward(x_in));
  if (ctx.training && !ctx.recompute && cfg_.recompute.selective(kRecomputeMoe)) {
    keep_routing(take_saved());
    saved_.recompute_input = x_in;
    saved_.recompute_ctx = ctx;
  }
  return out;
}

void MoELayer::in_chunk(Chunk& chunk, const std::function<void()>& fn) {
  // The chunk's state in, the layer's (or another chunk's, when nested) out, and back.
  Saved outer = std::exchange(saved_, std::move(chunk.moe));
  std::any outer_dispatcher = dispatcher_->take_saved();
  if (chunk.dispatcher.has_value()) dispatcher_->restore_saved(std::move(chunk.dispatcher));
  fn();
  chunk.moe = std::exchange(saved_, std::move(outer));
  chunk.dispatcher = dispatcher_->take_saved();
  dispatcher_->restore_saved(std::move(outer_dispatcher));
}

void MoELayer::dispatch_phase(const Tensor& x, const Tensor& probs, const Tensor& indices,
                              int64_t expert_capacity, const MoETokenDispatcher::Beside& beside) {
  // The kept copies routed to this rank's experts, grouped by local expert, with their
  // probabilities; padded to expert_capacity rows per expert when given.
  Saved& s = saved_;
  Tensor expert_probs;
  s.expert_in = dispatcher_->dispatch(x, probs, indices, expert_probs, beside);
  s.expert_counts = dispatcher_->tokens_per_local_expert_device();
  s.tokens_per_local_expert = dispatcher_->tokens_per_local_expert();
  s.expert_rows = s.tokens_per_local_expert;
  s.expert_capacity = expert_capacity;
  if (expert_capacity > 0) s.expert_rows.assign(s.tokens_per_local_expert.size(), expert_capacity);
  if (fp8_rows_ > 0)  // FP8 GEMMs take row counts in multiples of fp8_rows_
    for (int64_t& n : s.expert_rows) n = (n + fp8_rows_ - 1) / fp8_rows_ * fp8_rows_;
  s.padded = s.expert_rows != s.tokens_per_local_expert;
  s.expert_in = pad_expert_rows(s.expert_in);
  const int64_t rows = s.expert_in.dim(0);
  // A padding row's probability is 0: its activation, output and gradients are zeros.
  s.expert_probs = pad_expert_rows(expert_probs.view({expert_probs.numel(), 1})).view({rows});
}

Tensor MoELayer::experts_phase(const Tensor& like) {
  Saved& s = saved_;
  const int64_t rows = s.expert_in.dim(0), hidden = like.dim(1);
  s.fc1_out = empty_like(like, {rows, experts[0].fc1_weight.weight.dim(0)});
  // FP8 weight gradients read each expert's FP8 x^T kept here, not expert_in.
  const bool fp8_keeps_input = fc1_fp8_.enabled() && cfg_.fp8.wgrad;
  experts_forward(&Expert::fc1_weight, s.expert_in, fp8_keeps_input, s.fc1_out);
  if (fp8_keeps_input) s.expert_in = Tensor();
  expert_bias_forward(s.fc1_out, &Expert::fc1_bias);
  // Unpadded, the expert output is handed to combine as it is: the dispatcher's buffer.
  Tensor expert_out =
      !s.padded ? dispatcher_->new_exchanged_rows({rows, hidden}, like.dtype(), like.device())
                : empty_like(like, {rows, hidden});
  // fc2's input, the activation weighted by the rows' probabilities (Megatron's
  // TEGroupedMLP: weighted_bias_swiglu_impl, weighted_squared_relu_impl; the combine then adds
  // the outputs unweighted, keeping no copy of them), is recomputed in backward: FP8 keeps only
  // its scales.
  experts_forward(&Expert::fc2_weight,
                  mlp_activation_weighted(s.fc1_out, s.expert_probs, mlp_activation_of(cfg_)),
                  false, expert_out);
  // Row-parallel fc2: the partial outputs are summed over etp, the bias (weighted by the
  // probabilities, Megatron's _apply_bias) counted once.
  if (mp_.etp_rank() == 0) expert_bias_forward(expert_out, &Expert::fc2_bias, s.expert_probs);
  return expert_out;
}

Tensor MoELayer::combine_phase(const Tensor& expert_out, const MoETokenDispatcher::Beside& beside) {
  return dispatcher_->combine(unpad_expert_rows(expert_out), beside);
}

void MoELayer::keep_routing(Activations&& saved) {
  router.restore_saved(std::move(saved.router));
  router.keep_routing_only();
  saved_ = {};
  saved_.aux_loss = std::move(saved.moe.aux_loss);
  saved_.tokens_per_local_expert = std::move(saved.moe.tokens_per_local_expert);
  saved_.expert_counts = std::move(saved.moe.expert_counts);
}

Tensor MoELayer::backward(const Tensor& dy_in) {
  if (saved_.recompute_input.defined()) {  // the moe recompute: the forward again first
    ForwardContext ctx = saved_.recompute_ctx;
    ctx.recompute = true;
    const Tensor x = std::exchange(saved_.recompute_input, Tensor());
    forward(x, ctx);
  }
  MEGATON_CHECK(saved_.x.defined(), "MoE layer '{}': backward without a forward",
                router.weight.name);
  Tensor dy = dy_in;
  if (splits_rows()) {  // dy is whole on every TP rank: this rank's block of it
    const int64_t tp = mp_.tp_size();
    dy = dy_in.rows(mp_.tp_rank() * (dy_in.dim(0) / tp), dy_in.dim(0) / tp);
  }
  // The shared expert's fc2 backward beside the combine's backward exchange, its fc1
  // backward beside the dispatch's (as in forward; shared_expert_beside).
  const bool shared_beside = shared_expert_beside();
  Tensor shared_dx;
  MoETokenDispatcher::Beside shared_fc2, shared_fc1;
  if (shared_beside) {
    shared_fc2 = [&] { shared_expert->backward_begin(dy_in); };
    shared_fc1 = [&] { shared_dx = shared_expert->backward_end(); };
  }
  Tensor dx, dprobs;
  if (saved_.chunks.empty()) {
    ExpertsBackward eb = experts_backward_phase(combine_backward_phase(dy, shared_fc2), dy);
    dprobs = std::move(eb.dprobs);
    dx = dispatch_backward_phase(eb.dexpert_in, shared_fc1);
  } else {
    // The forward's chunks in reverse: combine 1 | combine 0 beside experts 1 | dispatch 1
    // beside experts 0 | dispatch 0.
    // Held here while the chunks run: in_chunk swaps saved_.
    std::vector<Chunk> ch = std::move(saved_.chunks);
    const int64_t tokens = dy.dim(0), first = tokens / 2;
    auto part = [&](const Tensor& t, int c) {
      return c == 0 ? t.rows(0, first) : t.rows(first, tokens - first);
    };
    Tensor dexpert_out[2];
    ExpertsBackward eb[2];
    dx = empty_like(dy, dy.shape());
    dprobs = Tensor::empty({tokens, cfg_.moe_router_topk}, DType::F32, dy.device());
    auto combine = [&](int c, const MoETokenDispatcher::Beside& beside) {
      in_chunk(ch[c], [&] { dexpert_out[c] = combine_backward_phase(part(dy, c), beside); });
    };
    auto experts = [&](int c) {
      in_chunk(ch[c], [&] {
        eb[c] = experts_backward_phase(dexpert_out[c], dy);
        dexpert_out[c] = Tensor();
        part(dprobs, c).copy_from(eb[c].dprobs);
      });
    };
    auto dispatch = [&](int c, const MoETokenDispatcher::Beside& beside) {
      in_chunk(ch[c],
               [&] { part(dx, c).copy_from(dispatch_backward_phase(eb[c].dexpert_in, beside)); });
      eb[c] = {};
    };
    combine(1, shared_fc2);
    combine(0, [&] { experts(1); });
    dispatch(1, [&] { experts(0); });
    dispatch(0, shared_fc1);
  }

  // Router: the probabilities' and the injected losses' gradients, then the gating linear.
  router.backward(dprobs, aux_grad_scale, dx);
  // The tensors are used up; last_aux_loss() and last_tokens_per_local_expert() stay
  // readable until the next forward (or take_saved).
  Saved reported;
  reported.aux_loss = saved_.aux_loss;
  reported.tokens_per_local_expert = std::move(saved_.tokens_per_local_expert);
  reported.expert_counts = std::move(saved_.expert_counts);
  saved_ = std::move(reported);
  if (splits_rows()) dx = gather_sequence(dx, mp_);
  if (shared_expert) ops::add_(dx, shared_beside ? shared_dx : shared_expert->backward(dy_in));
  return dx;
}

Tensor MoELayer::combine_backward_phase(const Tensor& dy,
                                        const MoETokenDispatcher::Beside& beside) {
  // The padding rows' output gradient is zero (a padding row is no copy's).
  return pad_expert_rows(dispatcher_->combine_backward(dy, beside));
}

MoELayer::ExpertsBackward MoELayer::experts_backward_phase(const Tensor& dexpert_out,
                                                           const Tensor& like) {
  const Saved& s = saved_;
  // linear_fc2 of every local expert; its input, the weighted activation, is recomputed (not
  // kept). Where the weight-gradient GEMMs ask for it after every expert's input gradient
  // (all but the blockwise FP8 recipe, which runs expert by expert), the activation's
  // backward writes it in the same pass; otherwise it is recomputed on its own.
  const int64_t rows = dexpert_out.dim(0);
  Tensor dact = empty_like(like, {rows, experts[0].fc2_weight.weight.dim(1)});
  Tensor dfc1;           // the activation's backward, inside fc2's backward or after it
  Tensor dexpert_probs;  // [rows] F32: the probabilities' gradient, this rank's f slice
  const bool input_after_dgrad = !fc1_fp8_.enabled() || cfg_.fp8.recipe != Fp8Recipe::Blockwise;
  experts_backward(
      &Expert::fc2_weight, dexpert_out,
      [&] {
        if (!input_after_dgrad)
          return mlp_activation_weighted(s.fc1_out, s.expert_probs, mlp_activation_of(cfg_));
        Tensor act = empty_like(dact, dact.shape());
        dfc1 = mlp_activation_weighted_backward(dact, s.fc1_out, s.expert_probs,
                                                mlp_activation_of(cfg_), dexpert_probs, &act);
        return act;
      },
      dact);
  // activation (unless done above): dfc1 and the probabilities' gradient,
  // dprobs[r] = <dact[r], act(fc1_out[r])> (Megatron's weighted_swiglu_back,
  // weighted_squared_relu_back).
  if (!dfc1.defined())
    dfc1 = mlp_activation_weighted_backward(dact, s.fc1_out, s.expert_probs,
                                            mlp_activation_of(cfg_), dexpert_probs);
  // The weighted fc2 bias: dexpert_out is whole on every ETP rank, so each computes the same
  // bias gradient; the probabilities' part <dy[r], b2> is added once, on ETP rank 0 (the
  // rank that added the bias), before the dispatcher sums the partial dprobs over ETP.
  expert_bias_backward(dexpert_out, &Expert::fc2_bias, s.expert_probs,
                       mp_.etp_rank() == 0 ? &dexpert_probs : nullptr);
  ExpertsBackward out;
  // Back to [T, k] for the router (the padding rows' entries dropped).
  out.dprobs = dispatcher_->probs_backward(unpad_expert_rows(dexpert_probs.view({rows, 1})));
  dexpert_probs = Tensor();
  const Shape in_shape = {rows, like.dim(1)};
  Tensor dexpert_in = !s.padded
                          ? dispatcher_->new_exchanged_rows(in_shape, like.dtype(), like.device())
                          : empty_like(like, in_shape);
  experts_backward(
      &Expert::fc1_weight, dfc1, [&] { return s.expert_in; }, dexpert_in);
  expert_bias_backward(dfc1, &Expert::fc1_bias);
  out.dexpert_in = std::move(dexpert_in);
  return out;
}

Tensor MoELayer::dispatch_backward_phase(const Tensor& dexpert_in,
                                         const MoETokenDispatcher::Beside& beside) {
  return dispatcher_->dispatch_backward(unpad_expert_rows(dexpert_in), beside);
}

MoELayer::Activations MoELayer::take_saved() {
  Activations out{std::exchange(saved_, {}), router.take_saved(), dispatcher_->take_saved(), {}};
  if (shared_expert) out.shared_expert = shared_expert->take_saved();
  return out;
}

void MoELayer::restore_saved(Activations&& saved) {
  saved_ = std::move(saved.moe);
  router.restore_saved(std::move(saved.router));
  dispatcher_->restore_saved(std::move(saved.dispatcher));
  if (shared_expert) shared_expert->restore_saved(std::move(saved.shared_expert));
}

void MoELayer::for_each_saved_tensor(Saved& s, const std::function<void(Tensor&)>& fn) const {
  for (Tensor* slot :
       {&s.x, &s.expert_in, &s.fc1_out, &s.expert_probs, &s.expert_counts, &s.recompute_input})
    fn(*slot);
  for_each_tensor(s.fc1_fp8, fn);
  for_each_tensor(s.fc2_fp8, fn);
  for (Chunk& chunk : s.chunks) {
    for_each_saved_tensor(chunk.moe, fn);
    if (chunk.dispatcher.has_value()) dispatcher_->for_each_saved_tensor(chunk.dispatcher, fn);
  }
}

void MoELayer::for_each_saved_tensor(Activations& saved,
                                     const std::function<void(Tensor&)>& fn) const {
  for_each_saved_tensor(saved.moe, fn);
  for_each_tensor(saved.router, fn);
  dispatcher_->for_each_saved_tensor(saved.dispatcher, fn);
  for_each_tensor(saved.shared_expert, fn);
}

void MoELayer::collect_params(std::vector<Param*>& out) {
  router.collect_params(out);
  if (shared_expert) shared_expert->collect_params(out);
  for (Expert& e : experts) {
    out.push_back(&e.fc1_weight);
    if (e.fc1_bias.weight.defined()) out.push_back(&e.fc1_bias);
    out.push_back(&e.fc2_weight);
    if (e.fc2_bias.weight.defined()) out.push_back(&e.fc2_bias);
  }
}

}  // namespace megaton
