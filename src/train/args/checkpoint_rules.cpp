// Megatron-LM's checkpoint flags that Megaton accepts without effect or refuses, each with
// its reason or the feature it names (issue 19: one rule for every Megatron flag;
// docs/megatron-flags.md lists them all). The implemented ones are in checkpoint_flags.cpp.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> checkpoint_megatron_rules() {
  return {
      no_effect("load-main-params-from-ckpt", "0",
                "Megaton's main params always come from the checkpoint's fp32 weights"),
      unsupported("non-persistent-save-interval", "1",
                  "non-persistent (local, in-memory) checkpoints"),
      unsupported("non-persistent-ckpt-type", "1", "non-persistent (local, in-memory) checkpoints"),
      unsupported("non-persistent-global-ckpt-dir", "1",
                  "non-persistent (local, in-memory) checkpoints"),
      unsupported("non-persistent-local-ckpt-dir", "1",
                  "non-persistent (local, in-memory) checkpoints"),
      unsupported("non-persistent-local-ckpt-algo", "1",
                  "non-persistent (local, in-memory) checkpoints"),
      unsupported("pretrained-checkpoint", "1", "a fallback pretrained checkpoint for finetuning"),
      no_effect("ckpt-format", "1",
                "Megaton writes its own sharded safetensors checkpoints (each rank its pieces; "
                "docs/checkpoints.md), whatever the format named; megaton convert moves them "
                "to and from Hugging Face"),
      no_effect("auto-detect-ckpt-format", "0",
                "Megaton reads its sharded checkpoints and its earlier single-file ones alike"),
      unsupported("ckpt-convert-format", "1", "conversion to Megatron's torch checkpoint formats"),
      unsupported("ckpt-convert-save", "1", "conversion to Megatron's torch checkpoint formats"),
      unsupported("ckpt-convert-update-legacy-dist-opt-format", "0",
                  "loading Megatron's torch checkpoint formats"),
      no_effect(
          "no-ckpt-fully-parallel-save", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect("async-strategy", "1",
                "Megaton's --async-save writes each rank's file from one background thread"),
      no_effect("use-persistent-ckpt-worker", "0",
                "Megaton's --async-save writes each rank's file from one background thread"),
      no_effect("async-ckpt-cpu-priority", "1",
                "Megaton's --async-save writes each rank's file from one background thread"),
      no_effect("async-ckpt-io-priority", "1",
                "Megaton's --async-save writes each rank's file from one background thread"),
      no_effect("async-ckpt-use-cpu-shm", "0",
                "Megaton's --async-save writes each rank's file from one background thread"),
      no_effect(
          "ckpt-fully-parallel-load", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "ckpt-fully-parallel-load-exchange-algo", "1",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "ckpt-fully-parallel-load-per-rank-objects", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "ckpt-fully-parallel-save-process-group", "1",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "ckpt-fully-parallel-load-process-group", "1",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "ckpt-assume-constant-structure", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "ckpt-pg-tensors-cache-path", "1",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "ckpt-pg-tensors-cache-create", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "no-ckpt-load-validate-sharding-integrity", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "disable-ckpt-load-validate-sharding-integrity", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "no-strict-fsdp-dtensor-load", "0",
          "fsdp_dtensor checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "disable-strict-fsdp-dtensor-load", "0",
          "fsdp_dtensor checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "dist-ckpt-strictness", "1",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "dist-ckpt-save-pre-mcore-014", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect("dist-ckpt-optim-fully-reshardable", "0",
                "Megaton's checkpoints always load under any parallel layout"),
      no_effect(
          "no-save-tokenizer-assets", "0",
          "Megaton records the tokenizer's path and copies no tokenizer files into checkpoints"),
      no_effect(
          "disable-save-tokenizer-assets", "0",
          "Megaton records the tokenizer's path and copies no tokenizer files into checkpoints"),
      unsupported("replication", "0", "non-persistent (local, in-memory) checkpoints"),
      unsupported("replication-jump", "1", "non-persistent (local, in-memory) checkpoints"),
      unsupported("replication-factor", "1", "non-persistent (local, in-memory) checkpoints"),
      no_effect("verify-integrity", "0",
                "Megaton always checks each checkpoint piece's crc32 (and each file's size) on "
                "load"),
      unsupported("no-save-optim", "0", "checkpoints without optimizer state"),
      no_effect("no-save-rng", "0",
                "Megaton's RNG state is the seed, kept in the checkpoint metadata"),
      unsupported("override-ckpt-iteration", "1", "overriding the loaded checkpoint's iteration"),
      no_effect("use-dist-ckpt", "0",
                "deprecated form of --ckpt-format; Megaton always writes its own sharded "
                "safetensors checkpoints"),
      no_effect("dist-ckpt-format", "1",
                "deprecated form of --ckpt-format; Megaton always writes its own sharded "
                "safetensors checkpoints"),
      no_effect("dist-ckpt-workers", "1",
                "Megaton's --async-save writes each rank's file from one background thread"),
      no_effect(
          "ckpt-fully-parallel-save", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
      no_effect(
          "ckpt-drop-redundant-extra-state", "0",
          "torch_dist checkpoint option; Megaton writes its own sharded safetensors checkpoints"),
  };
}

}  // namespace megaton
