// Layer composition by spec (Megatron's ModuleSpec / TransformerLayerSubmodules and
// HybridModel's layer pattern): a decoder layer is
//   h = x + dropout(mixer(input_layernorm(x)))
//   y = h + dropout(mlp(pre_mlp_layernorm(h)))
// with the mixer and the MLP chosen per layer by a LayerSpec; either may be absent (None:
// its norm and residual branch too), as in a hybrid model, whose layers are a Mamba or
// attention mixer alone (M, *) or an MLP alone (-, E). Each kind lives in its own
// files behind the Mixer or MlpBlock interface below; make_mixer / make_mlp_block are the
// one place that names the kinds, so a new family (MLA, Mamba) is its own files plus an
// entry here (docs/design-notes.md, "Layers from specs").
#pragma once
#include <any>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/layers.h"
#include "model/parallel.h"

namespace megaton {

class MoELayer;

// The token mixer of a layer (Megatron's self_attention slot; HybridModel's "*").
enum class MixerKind {
  SelfAttention,  // fused-QKV grouped-query attention with RoPE (model/attention.h)
  MLA,            // multi-latent attention (model/mla.h)
  Mamba,          // Mamba-2 (model/mamba_mixer.h; HybridModel's "M")
  None,           // no mixer: an MLP layer of a hybrid model
};
// The MLP of a layer (Megatron's mlp slot; HybridModel's "-" and "E").
enum class MlpKind {
  Dense,  // MLP (model/layers.h)
  MoE,    // MoELayer: router, token dispatcher, experts, shared expert (model/moe.h)
  None,   // no MLP: a mixer layer of a hybrid model
};

struct LayerSpec {
  MixerKind mixer = MixerKind::SelfAttention;
  MlpKind mlp = MlpKind::Dense;
};

// Megatron's get_gpt_decoder_layer_specs: decoder layer `layer`'s spec from the config
// (MoE where --moe-layer-freq / num_experts say so, GPTConfig::is_moe_layer); in a hybrid
// model, its pattern symbol's (M: Mamba, *: self attention, +: MLA, -: dense, E: MoE).
LayerSpec decoder_layer_spec(const GPTConfig& cfg, int64_t layer);
const char* mixer_kind_name(MixerKind kind);  // "self_attention", "mla", "mamba", "none"
const char* mlp_kind_name(MlpKind kind);      // "dense", "moe", "none"
// Megatron's module names of a layer whose mixer is `kind`: its input norm ("norm" for
// Mamba, MambaLayer's; else "input_layernorm") and the mixer ("mixer" for Mamba, else
// "self_attention").
const char* mixer_norm_name(MixerKind kind);
const char* mixer_module_name(MixerKind kind);
// The final norm's name: "decoder.final_norm" in a hybrid model (HybridStack's), else
// "decoder.final_layernorm" (TransformerBlock's).
std::string final_norm_name(const GPTConfig& cfg);

// A layer's token mixer: [T, H] -> [T, H] rows of one micro-batch (under sequence
// parallelism this rank's rows; batch and seq are always the full micro-batch's). Its
// output projection's bias is not added by the mixer (the layer's residual add does it).
class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual Tensor forward(const Tensor& x, int64_t batch, int64_t seq,
                         const ForwardContext& ctx) = 0;
  // dy [T, H] -> dx [T, H]; accumulates main_grads. input: the forward's input again,
  // called when the mixer did not keep it (the layernorm recompute).
  virtual Tensor backward(const Tensor& dy, const std::function<Tensor()>& input) = 0;
  // Generation with a KV cache (one rank, no dropout, nothing saved): x [n, H] at
  // positions first_position .. first_position + n - 1 (InferenceContext's caches).
  virtual Tensor forward_inference(const Tensor& x, int64_t first_position, Tensor& key_cache,
                                   Tensor& value_cache) const = 0;
  virtual void collect_params(std::vector<Param*>& out) = 0;
  // Its Linear layers (FP8, per-layer GEMM settings), and the one whose output bias the
  // layer's residual add takes.
  virtual std::vector<Linear*> linears() = 0;
  virtual Linear& output_linear() = 0;
  // What the mixer keeps for backward under `rc` (selective recompute; layernorm: the
  // input is remade by backward's `input` callback).
  virtual void set_recompute(const RecomputeConfig& rc) = 0;
  // The forward's saved state, moved out and back (pipeline stashes, offloading); the
  // std::any holds the kind's own Activations type.
  virtual std::any take_saved() = 0;
  virtual void restore_saved(std::any&& saved) = 0;
  // fn on each tensor slot of `saved` (from take_saved), in a fixed order.
  virtual void for_each_saved_tensor(std::any& saved, const std::function<void(Tensor&)>& fn) = 0;
};

// A layer's MLP: [T, H] -> [T, H].
class MlpBlock {
 public:
  virtual ~MlpBlock() = default;
  virtual Tensor forward(const Tensor& x, const ForwardContext& ctx) = 0;
  // input: the forward's input again, when the block did not keep it.
  virtual Tensor backward(const Tensor& dy, const std::function<Tensor()>& input) = 0;
  virtual Tensor forward_inference(const Tensor& x) = 0;
  virtual void collect_params(std::vector<Param*>& out) = 0;
  // Its dense Linear layers (a dense MLP's fc1 and fc2, an MoE layer's shared expert's),
  // and the one whose output bias the residual add takes (null: none).
  virtual std::vector<Linear*> linears() = 0;
  virtual Linear* output_linear() = 0;
  // FP8 of its routed experts (the dense linears are enabled through linears()).
  virtual void enable_expert_fp8(const Fp8Config&) {}
  // The FP8 delayed recipe's state of its routed experts (empty without).
  virtual std::vector<std::pair<std::string, Tensor*>> expert_fp8_state() { return {}; }
  virtual void set_recompute(const RecomputeConfig& rc) = 0;
  virtual std::any take_saved() = 0;
  virtual void restore_saved(std::any&& saved) = 0;
  virtual void for_each_saved_tensor(std::any& saved, const std::function<void(Tensor&)>& fn) = 0;
  // After take_saved of a forward that backward will re-run (full recompute, forward-only
  // passes): keep what must survive (an MoE layer's routing, aux loss and token counts).
  virtual void keep_after_discard(std::any&&) {}
  // The MoE layer, for the model's aux losses, routers and metrics; null for others.
  virtual MoELayer* moe() { return nullptr; }
};

// The kinds' constructors: parameters under `prefix` ("decoder.layers.<i>.self_attention",
// "decoder.layers.<i>.mixer", "decoder.layers.<i>.mlp"), initialised from `seed` by name.
// InternalError for None or a kind this build does not have.
std::unique_ptr<Mixer> make_mixer(MixerKind kind, const std::string& prefix, const GPTConfig& cfg,
                                  int64_t layer, uint64_t seed, const ModelParallel& mp);
std::unique_ptr<MlpBlock> make_mlp_block(MlpKind kind, const std::string& prefix,
                                         const GPTConfig& cfg, int64_t layer, uint64_t seed,
                                         const ModelParallel& mp);

}  // namespace megaton
