// SelfAttention behind the Mixer interface (model/attention_mixer.h).
#include "model/attention.h"
#include "model/attention_mixer.h"
#include "model/saved_tensors.h"

namespace megaton {

static std::vector<Linear*> mixer_linears(SelfAttention& a) { return {&a.linear_qkv, &a.linear_proj}; }

// The layernorm recompute remakes linear_qkv's input; core_attn the attention output.
static void apply_recompute(SelfAttention& a, const RecomputeConfig& rc) {
  a.set_recompute(!rc.selective(kRecomputeLayernorm), !rc.selective(kRecomputeCoreAttn));
}

std::unique_ptr<Mixer> make_self_attention_mixer(const std::string& prefix, const GPTConfig& cfg,
                                                 int64_t layer, uint64_t seed,
                                                 const ModelParallel& mp) {
  return std::make_unique<AttentionMixer<SelfAttention>>(prefix, cfg, layer, seed, mp);
}

}  // namespace megaton
