// decoder_layer_spec and the kinds' constructors: the one place that names them.
#include "model/layer_spec.h"

#include "core/error.h"
#include "model/attention.h"
#include "model/mla.h"
#include "model/mlp_blocks.h"

namespace megaton {

LayerSpec decoder_layer_spec(const GPTConfig& cfg, int64_t layer) {
  LayerSpec spec;
  spec.mixer = cfg.multi_latent_attention ? MixerKind::MLA : MixerKind::SelfAttention;
  spec.mlp = cfg.is_moe_layer(layer) ? MlpKind::MoE : MlpKind::Dense;
  return spec;
}

const char* mixer_kind_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::SelfAttention: return "self_attention";
    case MixerKind::MLA: return "mla";
  }
  return "?";
}

const char* mlp_kind_name(MlpKind kind) {
  switch (kind) {
    case MlpKind::Dense: return "dense";
    case MlpKind::MoE: return "moe";
  }
  return "?";
}

std::unique_ptr<Mixer> make_mixer(MixerKind kind, const std::string& prefix,
                                  const GPTConfig& cfg, int64_t layer, uint64_t seed,
                                  const ModelParallel& mp) {
  switch (kind) {
    case MixerKind::SelfAttention: return make_self_attention_mixer(prefix, cfg, layer, seed, mp);
    case MixerKind::MLA: return make_mla_mixer(prefix, cfg, layer, seed, mp);
  }
  MEGATON_CHECK(false, "make_mixer: unknown mixer kind {}", int(kind));
  return nullptr;
}

std::unique_ptr<MlpBlock> make_mlp_block(MlpKind kind, const std::string& prefix,
                                         const GPTConfig& cfg, int64_t layer, uint64_t seed,
                                         const ModelParallel& mp) {
  switch (kind) {
    case MlpKind::Dense: return make_dense_mlp_block(prefix, cfg, seed, mp);
    case MlpKind::MoE: return make_moe_mlp_block(prefix, cfg, layer, seed, mp);
  }
  MEGATON_CHECK(false, "make_mlp_block: unknown MLP kind {}", int(kind));
  return nullptr;
}

}  // namespace megaton
