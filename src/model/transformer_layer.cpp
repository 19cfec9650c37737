// TransformerLayer forward/backward (its declaration is in model/gpt.h).
#include <memory>
#include <string>
#include <utility>

#include "model/gpt.h"
#include "model/saved_tensors.h"
#include "ops/ops.h"

namespace megaton {

TransformerLayer::TransformerLayer(const GPTConfig& cfg, int64_t layer, uint64_t seed,
                                   const ModelParallel& mp)
    : TransformerLayer(cfg, decoder_layer_spec(cfg, layer), layer, seed, mp) {}

TransformerLayer::TransformerLayer(const GPTConfig& cfg, const LayerSpec& spec, int64_t layer,
                                   uint64_t seed, const ModelParallel& mp)
    : TransformerLayer(cfg, spec, "decoder.layers." + std::to_string(layer), layer, seed, mp) {}

TransformerLayer::TransformerLayer(const GPTConfig& cfg, const LayerSpec& spec,
                                   const std::string& prefix, int64_t layer, uint64_t seed,
                                   const ModelParallel& mp)
    : cfg_(cfg), spec_(spec), mp_(mp), layer_(layer) {
  const bool sp = mp.sequence_parallel && mp.tp_size() > 1;
  if (spec.mixer != MixerKind::None) {
    input_layernorm =
        std::make_unique<Norm>(prefix + "." + mixer_norm_name(spec.mixer), cfg.hidden_size,
                               cfg.normalization, cfg.norm_epsilon, Placement::of(cfg), sp);
    mixer =
        make_mixer(spec.mixer, prefix + "." + mixer_module_name(spec.mixer), cfg, layer, seed, mp);
  }
  if (spec.mlp != MlpKind::None) {
    pre_mlp_layernorm =
        std::make_unique<Norm>(prefix + ".pre_mlp_layernorm", cfg.hidden_size, cfg.normalization,
                               cfg.norm_epsilon, Placement::of(cfg), sp);
    mlp = make_mlp_block(spec.mlp, prefix + ".mlp", cfg, layer, seed, mp);
  }
  MEGATON_CHECK(mixer || mlp, "TransformerLayer {}: a layer with neither mixer nor MLP", layer);
  // FP8: the layer's linear GEMMs (the mixer's, the dense MLP's or shared expert's) and
  // its routed experts', unless --first-last-layers-bf16 keeps this layer in bf16.
  if (cfg.fp8.layer_in_fp8(layer, cfg.num_layers)) {
    for (Linear* linear : linears()) linear->enable_fp8(cfg.fp8);
    if (mlp) mlp->enable_expert_fp8(cfg.fp8);
  }
  // The branch outputs' biases join the dropout and the residual add (residual_add).
  // Selective recompute: what the sub-layers keep (docs/memory.md). The layernorm outputs
  // are remade from the norms' kept inputs (backward's callbacks); an MoE layer keeps its
  // input either way (its router and dispatcher read it), so only input_layernorm's
  // output is dropped there.
  if (mixer) {
    mixer->output_linear().set_skip_bias_add(true);
    mixer->set_recompute(cfg.recompute);
  }
  if (mlp) {
    if (Linear* out = mlp->output_linear()) out->set_skip_bias_add(true);
    mlp->set_recompute(cfg.recompute);
  }
}

std::vector<Linear*> TransformerLayer::linears() {
  std::vector<Linear*> out;
  if (mixer) out = mixer->linears();
  if (mlp)
    for (Linear* linear : mlp->linears()) out.push_back(linear);
  return out;
}

std::vector<std::pair<std::string, Tensor*>> TransformerLayer::fp8_state(bool experts) {
  if (experts)
    return mlp ? mlp->expert_fp8_state() : std::vector<std::pair<std::string, Tensor*>>{};
  std::vector<std::pair<std::string, Tensor*>> out;
  for (Linear* linear : linears())
    for (auto& entry : linear->fp8_state()) out.push_back(entry);
  return out;
}

Tensor TransformerLayer::forward(const Tensor& x, int64_t batch, int64_t seq,
                                 const ForwardContext& ctx) {
  saved_.ctx = ctx;
  saved_.dropout_p = ctx.training ? cfg_.hidden_dropout : 0.0f;
  Tensor h, normed;
  if (!mixer) {
    normed = pre_mlp_layernorm->forward(x);
  } else {
    h = mixer->forward(input_layernorm->forward(x), batch, seq, ctx);
    const Tensor& proj_bias = mixer->output_linear().bias.weight;
    if (mlp && saved_.dropout_p == 0.0f && !proj_bias.defined()) {
      normed = pre_mlp_layernorm->forward_add(h, x);  // h += x, then the norm, in one pass
    } else {
      residual_add(h, proj_bias, x, 1);  // h = x + dropout(h + bias), in one pass
      if (!mlp) return h;
      normed = pre_mlp_layernorm->forward(h);
    }
  }
  Tensor y = mlp->forward(normed, ctx);
  const Linear* mlp_out = mlp->output_linear();
  residual_add(y, mlp_out ? mlp_out->bias.weight : Tensor(), mixer ? h : x, 2);
  return y;
}

void TransformerLayer::residual_add(Tensor& branch, const Tensor& bias, const Tensor& residual,
                                    int site) const {
  const Saved& s = saved_;
  if (s.dropout_p == 0.0f && !bias.defined()) {
    ops::add_(branch, residual);
    return;
  }
  ops::bias_dropout_add(branch, bias, residual, branch, s.dropout_p, s.ctx.seed,
                        s.ctx.stream(layer_, site));
}

Tensor TransformerLayer::backward(const Tensor& dy) {
  // dh = dy + d(mlp branch); the residual gradients are added inside the norms' backward
  // passes.
  Tensor dh = dy;
  if (mlp) {
    Tensor dnormed = mlp->backward(dropout_grad(dy, 2), [this] {
      return pre_mlp_layernorm->recompute_output();  // the layernorm recompute
    });
    dh = pre_mlp_layernorm->backward(dnormed, dy);
  }
  if (!mixer) {
    saved_ = {};
    return dh;
  }
  Tensor dattn =
      mixer->backward(dropout_grad(dh, 1), [this] { return input_layernorm->recompute_output(); });
  Tensor dx = input_layernorm->backward(dattn, dh);
  saved_ = {};
  return dx;
}

void TransformerLayer::discard_saved() {
  Activations saved = take_saved();
  if (mlp) mlp->keep_after_discard(std::move(saved.mlp));
}

Tensor TransformerLayer::forward_inference(const Tensor& x, int64_t first_position,
                                           Tensor& key_cache, Tensor& value_cache) {
  Tensor h = x;
  if (mixer) {
    h = mixer->forward_inference(input_layernorm->forward_inference(x), first_position, key_cache,
                                 value_cache);
    ops::add_(h, x);
  }
  if (!mlp) return h;
  Tensor y = mlp->forward_inference(pre_mlp_layernorm->forward_inference(h));
  ops::add_(y, h);
  return y;
}

TransformerLayer::Activations TransformerLayer::take_saved() {
  Activations out;
  out.layer = std::exchange(saved_, {});
  if (mixer) {
    out.input_layernorm = input_layernorm->take_saved();
    out.mixer = mixer->take_saved();
  }
  if (mlp) {
    out.pre_mlp_layernorm = pre_mlp_layernorm->take_saved();
    out.mlp = mlp->take_saved();
  }
  return out;
}

void TransformerLayer::restore_saved(Activations&& saved) {
  saved_ = std::move(saved.layer);
  if (mixer) {
    input_layernorm->restore_saved(std::move(saved.input_layernorm));
    mixer->restore_saved(std::move(saved.mixer));
  }
  if (mlp) {
    pre_mlp_layernorm->restore_saved(std::move(saved.pre_mlp_layernorm));
    mlp->restore_saved(std::move(saved.mlp));
  }
}

void TransformerLayer::for_each_saved_tensor(const std::function<void(Tensor&)>& fn) {
  // The state is moved out (views: nothing is copied), visited and moved back, also when
  // fn throws.
  struct PutBack {
    TransformerLayer& layer;
    Activations saved;
    ~PutBack() { layer.restore_saved(std::move(saved)); }
  } held{*this, take_saved()};
  Activations& a = held.saved;
  if (mixer) {
    for_each_tensor(a.input_layernorm, fn);
    mixer->for_each_saved_tensor(a.mixer, fn);
  }
  if (mlp) {
    for_each_tensor(a.pre_mlp_layernorm, fn);
    mlp->for_each_saved_tensor(a.mlp, fn);
  }
}

Tensor TransformerLayer::dropout_grad(const Tensor& dy, int site) const {
  const Saved& s = saved_;
  if (s.dropout_p == 0.0f) return dy;
  Tensor dx = empty_like(dy, dy.shape());
  ops::dropout_backward(dy, dx, s.dropout_p, s.ctx.seed, s.ctx.stream(layer_, site));
  return dx;
}

void TransformerLayer::collect_params(std::vector<Param*>& out) {
  if (mixer) {
    input_layernorm->collect_params(out);
    mixer->collect_params(out);
  }
  if (mlp) {
    pre_mlp_layernorm->collect_params(out);
    mlp->collect_params(out);
  }
}

}  // namespace megaton
