// Hybrid-model flags: the layer pattern and the Mamba-2 mixer's sizes (Megatron's
// --hybrid-layer-pattern and TransformerConfig's mamba_* fields; model/hybrid_pattern.h,
// model/mamba_mixer.h). GPTConfig::finalize parses and checks them.
#include <utility>

#include "core/error.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

void parse_hybrid(const ArgReader& r, TrainArgs& a) {
  GPTConfig& m = a.model;
  if (r.has("hybrid-layer-pattern") && r.has("hybrid-override-pattern"))
    fail(
        "hybrid-override-pattern and hybrid-layer-pattern cannot both be given "
        "(hybrid-override-pattern is Megatron's deprecated name)");
  r.get("hybrid-override-pattern", m.hybrid_layer_pattern);
  r.get("hybrid-layer-pattern", m.hybrid_layer_pattern);
  if (r.has("hybrid-override-pattern"))
    a.no_effect.push_back(
        "--hybrid-override-pattern: Megatron's deprecated name of --hybrid-layer-pattern");
  // The pattern gives the layer count (Megatron derives num_layers from it); a different
  // --num-layers is refused by GPTConfig::finalize. Set here for the later groups' checks.
  if (!m.hybrid_layer_pattern.empty() && !r.has("num-layers"))
    m.num_layers = int64_t(parse_hybrid_pattern(m.hybrid_layer_pattern).layers.size());
  if (r.on("is-hybrid-model") && m.hybrid_layer_pattern.empty())
    fail("is-hybrid-model needs hybrid-layer-pattern (the layers' M * + - E symbols)");
  r.get("mamba-state-dim", m.mamba_state_dim);
  r.get("mamba-head-dim", m.mamba_head_dim);
  r.get("mamba-num-groups", m.mamba_num_groups);
  r.get("mamba-num-heads", m.mamba_num_heads);
  for (const char* key :
       {"mamba-state-dim", "mamba-head-dim", "mamba-num-groups", "mamba-num-heads"})
    if (r.has(key) && m.hybrid_layer_pattern.empty())
      fail("{} applies to hybrid models: give hybrid-layer-pattern", key);
  for (auto [key, value] : {std::pair{"mamba-state-dim", m.mamba_state_dim},
                            {"mamba-head-dim", m.mamba_head_dim},
                            {"mamba-num-groups", m.mamba_num_groups},
                            {"mamba-num-heads", m.mamba_num_heads}})
    if (r.has(key)) check_positive(key, double(value));
}

}  // namespace

ArgGroup hybrid_flags() {
  ArgGroup g{"hybrid", "hybrid models (Mamba)", {}, parse_hybrid};
  g.flags = {
      flag("hybrid-layer-pattern",
           "one symbol per layer: M Mamba-2, * attention, + multi-latent attention, - MLP, E "
           "MoE; | between pipeline stages (its layer count must equal num-layers when given)"),
      flag("hybrid-override-pattern", "Megatron's deprecated name of hybrid-layer-pattern"),
      toggle("is-hybrid-model", "a hybrid model (needs hybrid-layer-pattern, which suffices)"),
      flag("mamba-state-dim", "Mamba: SSM state size N per group (default 128)"),
      flag("mamba-head-dim", "Mamba: channels per head (default 64)"),
      flag("mamba-num-groups", "Mamba: groups of B and C (default 8)"),
      flag("mamba-num-heads",
           "Mamba: heads (default 2 x hidden-size / mamba-head-dim, MambaMixer's expand 2)"),
      no_effect("disable-mamba-mem-eff-path", "0",
                "Megatron's fused conv + scan kernel switch; Megaton's Mamba path is its own"),
  };
  return g;
}

}  // namespace megaton
