// Megatron-LM's data flags that Megaton accepts without effect or refuses, each with
// its reason or the feature it names (issue 19: one rule for every Megatron flag;
// docs/megatron-flags.md lists them all). The implemented ones are in data_flags.cpp.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> data_megatron_rules() {
  return {
      no_effect("exit-signal-handler-for-dataloader", "0",
                "no dataloader worker processes in Megaton"),
      unsupported("phase-transition-iterations", "1", "data phase transitions"),
      no_effect(
          "per-dataset-sequences-path", "1",
          "a dataset-build speed option; Megaton reads the sequence counts from the .idx files"),
      no_effect("dataloader-fast-cache-load", "0",
                "Megaton always loads the index cache when it exists"),
      no_effect("dataloader-defer-npy-index-mmap", "0",
                "Megaton's index cache is always memory-mapped"),
      unsupported("encoder-seq-length", "1", "BERT/T5 models (use --seq-length)"),
      unsupported("decoder-seq-length", "1", "BERT/T5 models (use --seq-length)"),
      unsupported("sample-rate", "1", "BERT/T5 models"),
      unsupported("mask-prob", "1", "BERT/T5 models"),
      unsupported("short-seq-prob", "1", "BERT/T5 models"),
      no_effect("num-workers", "1", "no dataloader worker processes in Megaton"),
      unsupported("dataloader-inter-document-masking", "0",
                  "document boundaries from the dataset's index (Megaton finds them at eod "
                  "tokens: use --reset-attention-mask)"),
      no_effect("no-create-attention-mask-in-dataloader", "0",
                "Megaton's causal attention takes no attention mask from the data"),
      no_effect("num-dataset-builder-threads", "1",
                "a dataset-build speed option; Megaton builds the indices its own way"),
      unsupported("object-storage-cache-path", "1", "datasets on object storage (S3, MSC)"),
      no_effect("allow-ambiguous-pad-tokens", "0",
                "Megaton never masks pad tokens found in the data"),
      unsupported("fim-data", "0", "fill-in-the-middle (FIM) data"),
      unsupported("fim-rate", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-spm-rate", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-split-sample", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-fragment-rate", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-no-prefix", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-prefix-token", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-middle-token", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-suffix-token", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-pad-token", "1", "fill-in-the-middle (FIM) data"),
      unsupported("fim-eod-token", "1", "fill-in-the-middle (FIM) data"),
      unsupported("enable-msc", "0", "Multi-Storage Client (object storage)"),
      no_effect("disable-msc", "0", "deprecated no-op in Megatron too"),
      no_effect("no-mmap-bin-files", "0",
                "Megaton memory-maps the .bin files; reading them instead gives the same tokens"),
  };
}

}  // namespace megaton
