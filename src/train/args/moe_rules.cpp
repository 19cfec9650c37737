// Megatron-LM's MoE flags that Megaton accepts without effect or refuses, each with
// its reason or the feature it names (issue 19: one rule for every Megatron flag;
// docs/megatron-flags.md lists them all). The implemented ones are in moe_flags.cpp.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> moe_megatron_rules() {
  return {
      unsupported("delay-wgrad-compute", "0",
                  "Megatron's combined 1F1B schedule of the expert-parallel overlap"),
      unsupported("overlap-dispatch-backward-with-experts-wgrad", "0",
                  "Megatron's combined 1F1B schedule of the expert-parallel overlap"),
      unsupported("ep-overlap-early-attn-memory-release", "0",
                  "Megatron's combined 1F1B schedule of the expert-parallel overlap"),
      no_effect("use-fused-weighted-squared-relu", "0",
                "Megaton's weighted activation is always one fused kernel"),
      unsupported("high-priority-a2a-comm-stream", "0",
                  "Megatron's combined 1F1B schedule of the expert-parallel overlap"),
      no_effect("use-grouped-gemm-for-shared-expert", "0",
                "Transformer Engine fusion switch; Megaton's own kernels are used"),
      unsupported("moe-shared-expert-glu-interleave-size", "1", "block-interleaved GLU weights"),
      unsupported("moe-enable-routing-replay", "0", "MoE routing replay"),
      no_effect("moe-router-padding-for-quantization", "0",
                "Megaton's experts always pad their rows to the FP8 GEMM multiple"),
      no_effect("moe-router-padding-for-fp8", "0",
                "Megaton's experts always pad their rows to the FP8 GEMM multiple"),
      unsupported("moe-router-quantile-balancing-ema", "1", "quantile-balancing router"),
      unsupported("moe-router-force-biased", "1", "random router bias (benchmarking)"),
      no_effect("moe-grouped-gemm", "0", "Megaton's grouped GEMM is always used"),
      no_effect("moe-use-grouped-tensor", "0", "Megaton's grouped GEMM is always used"),
      no_effect(
          "moe-single-grouped-weight", "0",
          "Transformer Engine storage option; Megaton's experts always run as one grouped GEMM"),
      no_effect(
          "moe-single-grouped-bias", "0",
          "Transformer Engine storage option; Megaton's experts always run as one grouped GEMM"),
      no_effect("moe-permute-fusion-into-hybridep", "0",
                "HybridEP kernel fusion; Megaton's flex runs its own permute and exchange"),
      no_effect("moe-hybridep-pad-uneven-dispatch-inputs", "0",
                "Megaton's exchange takes uneven inputs per rank as they are"),
      no_effect("moe-permute-fusion", "0", "Megaton's fused kernel is always used"),
      no_effect("moe-router-fusion", "0", "Megaton's fused kernel is always used"),
      unsupported("moe-apply-probs-on-input", "0",
                  "routing probabilities applied to the expert input"),
      unsupported("moe-latent-size", "1", "MoE latent projections"),
      no_effect("moe-flex-dispatcher-num-sms", "1",
                "SM budget of the DeepEP / HybridEP kernels, which Megaton does not use"),
      no_effect("moe-deepep-num-sms", "1",
                "SM budget of the DeepEP / HybridEP kernels, which Megaton does not use"),
      no_effect("moe-hybridep-num-sms", "1",
                "SM budget of the DeepEP / HybridEP kernels, which Megaton does not use"),
      no_effect("moe-hybridep-num-blocks-permute", "1",
                "SM budget of the DeepEP / HybridEP kernels, which Megaton does not use"),
      no_effect("moe-hybridep-num-blocks-unpermute", "1",
                "SM budget of the DeepEP / HybridEP kernels, which Megaton does not use"),
      no_effect("moe-hybridep-num-sms-preprocessing", "1",
                "SM budget of the DeepEP / HybridEP kernels, which Megaton does not use"),
      no_effect("moe-ncclep-zero-copy", "0",
                "NCCL-EP buffer option; Megaton's flex runs its own exchange"),
      unsupported("moe-mlp-glu-interleave-size", "1", "block-interleaved GLU weights"),
      unsupported("moe-expert-rank-capacity-factor", "1",
                  "per-rank capacity of the hybridep / ncclep dispatchers"),
      unsupported("moe-paged-stash", "0", "paged stash of expert activations"),
      unsupported("moe-paged-stash-page-size", "1", "paged stash of expert activations"),
      unsupported("moe-paged-stash-buffer-size-factor-cuda", "1",
                  "paged stash of expert activations"),
      unsupported("moe-paged-stash-buffer-size-factor-cpu", "1",
                  "paged stash of expert activations"),
      unsupported("moe-use-upcycling", "0", "MoE upcycling from a dense checkpoint"),
      unsupported("moe-upcycling-granularity", "1", "MoE upcycling from a dense checkpoint"),
  };
}

}  // namespace megaton
