// decoder_layer_spec and the kinds' constructors: the one place that names them.
#include "model/layer_spec.h"

#include "core/error.h"
#include "model/attention.h"
#include "model/mamba_mixer.h"
#include "model/mla.h"
#include "model/mlp_blocks.h"

namespace megaton {

LayerSpec decoder_layer_spec(const GPTConfig& cfg, int64_t layer) {
  LayerSpec spec;
  if (cfg.is_hybrid()) {
    switch (cfg.hybrid_symbol(layer)) {
      case kHybridMamba:
        return {MixerKind::Mamba, MlpKind::None};
      case kHybridAttention:
        return {MixerKind::SelfAttention, MlpKind::None};
      case kHybridMla:
        return {MixerKind::MLA, MlpKind::None};
      case kHybridMlp:
        return {MixerKind::None, MlpKind::Dense};
      case kHybridMoe:
        return {MixerKind::None, MlpKind::MoE};
    }
    MEGATON_CHECK(false, "decoder_layer_spec: layer {} has symbol '{}'", layer,
                  cfg.hybrid_symbol(layer));
  }
  spec.mixer = cfg.multi_latent_attention ? MixerKind::MLA : MixerKind::SelfAttention;
  spec.mlp = cfg.is_moe_layer(layer) ? MlpKind::MoE : MlpKind::Dense;
  return spec;
}

const char* mixer_kind_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::SelfAttention:
      return "self_attention";
    case MixerKind::MLA:
      return "mla";
    case MixerKind::Mamba:
      return "mamba";
    case MixerKind::None:
      return "none";
  }
  return "?";
}

const char* mlp_kind_name(MlpKind kind) {
  switch (kind) {
    case MlpKind::Dense:
      return "dense";
    case MlpKind::MoE:
      return "moe";
    case MlpKind::None:
      return "none";
  }
  return "?";
}

const char* mixer_norm_name(MixerKind kind) {
  return kind == MixerKind::Mamba ? "norm" : "input_layernorm";
}

std::string final_norm_name(const GPTConfig& cfg) {
  return cfg.is_hybrid() ? "decoder.final_norm" : "decoder.final_layernorm";
}

const char* mixer_module_name(MixerKind kind) {
  return kind == MixerKind::Mamba ? "mixer" : "self_attention";
}

std::unique_ptr<Mixer> make_mixer(MixerKind kind, const std::string& prefix, const GPTConfig& cfg,
                                  int64_t layer, uint64_t seed, const ModelParallel& mp) {
  switch (kind) {
    case MixerKind::SelfAttention:
      return make_self_attention_mixer(prefix, cfg, layer, seed, mp);
    case MixerKind::MLA:
      return make_mla_mixer(prefix, cfg, layer, seed, mp);
    case MixerKind::Mamba:
      return make_mamba_mixer(prefix, cfg, layer, seed, mp);
    case MixerKind::None:
      break;
  }
  MEGATON_CHECK(false, "make_mixer: unknown mixer kind {}", int(kind));
  return nullptr;
}

std::unique_ptr<MlpBlock> make_mlp_block(MlpKind kind, const std::string& prefix,
                                         const GPTConfig& cfg, int64_t layer, uint64_t seed,
                                         const ModelParallel& mp) {
  switch (kind) {
    case MlpKind::Dense:
      return make_dense_mlp_block(prefix, cfg, seed, mp);
    case MlpKind::MoE:
      return make_moe_mlp_block(prefix, cfg, layer, seed, mp);
    case MlpKind::None:
      break;
  }
  MEGATON_CHECK(false, "make_mlp_block: unknown MLP kind {}", int(kind));
  return nullptr;
}

}  // namespace megaton
