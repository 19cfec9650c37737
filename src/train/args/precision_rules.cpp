// Megatron-LM's precision flags that Megaton accepts without effect or refuses, each with
// its reason or the feature it names (issue 19: one rule for every Megatron flag;
// docs/megatron-flags.md lists them all). The implemented ones are in precision_flags.cpp.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> precision_megatron_rules() {
  return {
      unsupported("fp32-residual-connection", "0", "fp32 residual stream"),
      no_effect("apply-query-key-layer-scaling", "0",
                "attention softmax is always computed in fp32 in Megaton"),
      no_effect("disable-bf16-reduced-precision-matmul", "0",
                "Megaton's bf16 GEMMs never use reduced-precision reductions"),
      unsupported("fp8-quantizer-factory", "1", "custom FP8 quantizers (a Python factory)"),
      no_effect("fp8-interval", "1", "deprecated and ignored by Megatron too"),
      unsupported("fp8-output-proj", "0", "MXFP8 training (Blackwell)"),
      unsupported("use-kitchen-attention", "0", "NVIDIA Kitchen quantized attention"),
      unsupported("kitchen-attention-backend", "1", "NVIDIA Kitchen quantized attention"),
      unsupported("fp4-format", "1", "FP4 training (Blackwell)"),
      unsupported("fp4-recipe", "1", "FP4 training (Blackwell)"),
      unsupported("fp4-quantizer-factory", "1", "FP4 training (Blackwell)"),
      no_effect("attention-softmax-in-fp32", "0",
                "attention softmax is always computed in fp32 in Megaton"),
      unsupported("fp16-lm-cross-entropy", "0", "cross-entropy in fp16"),
      no_effect("output-logit-dtype", "1",
                "the logits are in the compute dtype, Megatron's default", {"bf16"},
                "fp32 logits in a bf16 run are not supported in Megaton"),
      unsupported("reuse-grad-buf-for-mxfp8-param-ag", "0", "MXFP8 training (Blackwell)"),
      unsupported("mamba-training-ssm-states-dtype", "1", "Mamba hybrid models (issue 23)"),
      unsupported("fp4-param-gather", "0", "FP4 training (Blackwell)"),
      unsupported("te-precision-config-file", "1",
                  "per-module precision configs (Transformer Engine)"),
  };
}

}  // namespace megaton
