// parse_hybrid_pattern (Megatron's parse_hybrid_pattern and _validate_pattern).
#include "model/hybrid_pattern.h"

#include "core/error.h"

namespace megaton {

HybridPattern parse_hybrid_pattern(const std::string& pattern) {
  if (pattern.empty()) fail("hybrid-layer-pattern is empty");
  if (pattern.find('/') != std::string::npos)
    fail(
        "hybrid-layer-pattern '{}': multi-token prediction patterns after '/' are not "
        "supported in Megaton yet",
        pattern);
  HybridPattern out;
  int64_t in_segment = 0;
  for (char c : pattern) {
    switch (c) {
      case kHybridMamba:
      case kHybridAttention:
      case kHybridMla:
      case kHybridMlp:
      case kHybridMoe:
        out.layers += c;
        ++in_segment;
        break;
      case '|':
        if (in_segment == 0) fail("hybrid-layer-pattern '{}' has an empty '|' segment", pattern);
        out.segment_layers.push_back(in_segment);
        in_segment = 0;
        break;
      case 'G':
        fail("hybrid-layer-pattern '{}': G (gated delta net) layers are not supported in Megaton",
             pattern);
      case 'D':
        fail(
            "hybrid-layer-pattern '{}': D (DeepSeek sparse attention) layers are not supported "
            "in Megaton",
            pattern);
      default:
        fail(
            "hybrid-layer-pattern '{}': '{}' is not a layer symbol (M Mamba, * attention, + "
            "multi-latent attention, - MLP, E MoE, | pipeline segment)",
            pattern, c);
    }
  }
  if (in_segment == 0) fail("hybrid-layer-pattern '{}' has an empty '|' segment", pattern);
  out.segment_layers.push_back(in_segment);
  if (out.layers.find(kHybridAttention) != std::string::npos &&
      out.layers.find(kHybridMla) != std::string::npos)
    fail(
        "hybrid-layer-pattern '{}' mixes * (attention) and + (multi-latent attention) layers; "
        "Megatron does not allow both in one model",
        pattern);
  return out;
}

}  // namespace megaton
