// Megatron's hybrid layer pattern (--hybrid-layer-pattern; HybridModel's layer allocation,
// megatron/core/models/hybrid/hybrid_layer_allocation.py): one symbol per decoder layer,
//   M  a Mamba-2 layer (norm, mixer)              * an attention layer (self attention)
//   +  a multi-latent attention layer              - an MLP layer (dense MLP)
//   E  an MoE layer (router, experts)
// with '|' between pipeline segments and '/' before each multi-token-prediction depth's
// pattern. Megatron's G (gated delta net) and D (DeepSeek sparse attention) are refused.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace megaton {

struct HybridPattern {
  std::string layers;                   // the decoder layers' symbols, '|' removed
  std::vector<int64_t> segment_layers;  // layers of each '|' segment, in order (one: no '|')
};

// Parses `pattern` as Megatron does. megaton::Error (one line) for an empty pattern, a
// symbol outside M * + - E | (G and D: "not supported"), an empty '|' segment, both * and
// + in one model (Megatron refuses it too), or an MTP part after '/' (not supported).
HybridPattern parse_hybrid_pattern(const std::string& pattern);

// The symbol of each layer kind.
inline constexpr char kHybridMamba = 'M', kHybridAttention = '*', kHybridMla = '+',
                      kHybridMlp = '-', kHybridMoe = 'E';

}  // namespace megaton
