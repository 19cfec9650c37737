// Megatron-LM's tokenizer flags that Megaton accepts without effect or refuses, each with
// its reason or the feature it names (issue 19: one rule for every Megatron flag;
// docs/megatron-flags.md lists them all). The implemented ones are in tokenizer_flags.cpp.
#include "train/args/flag_table.h"

namespace megaton {

std::vector<OptionSpec> tokenizer_megatron_rules() {
  return {
      unsupported("padded-vocab-size", "1",
                  "a given padded vocabulary size (use --make-vocab-size-divisible-by)"),
      unsupported("no-pad-vocab-size", "0",
                  "an unpadded vocabulary (use --make-vocab-size-divisible-by)"),
      unsupported("disable-pad-vocab-size", "0",
                  "an unpadded vocabulary (use --make-vocab-size-divisible-by)"),
      unsupported("vocab-extra-ids", "1", "BERT/T5 models"),
      unsupported("tokenizer-metadata", "1", "tokenizer metadata files"),
      unsupported("tokenizer-special-tokens", "+", "extra special tokens (TikTokenizer)"),
      unsupported("tiktoken-pattern", "1", "TikTokenizer"),
      unsupported("tiktoken-num-special-tokens", "1", "TikTokenizer"),
      unsupported("tokenizer-sentencepiece-legacy", "0",
                  "SentencePiece legacy special-token handling"),
      unsupported("no-tokenizer-sentencepiece-ignore-extra-whitespaces", "0",
                  "SentencePiece encoding that keeps extra whitespace"),
      unsupported("disable-tokenizer-sentencepiece-ignore-extra-whitespaces", "0",
                  "SentencePiece encoding that keeps extra whitespace"),
      no_effect("tokenizer-hf-no-use-fast", "0",
                "Megaton's Hugging Face tokenizer is its own; its ids are the fast tokenizer's"),
      no_effect("trust-remote-code", "0", "Megaton reads tokenizer.json and runs no remote code"),
      unsupported("null-tokenizer-eod-id", "1", "a chosen NullTokenizer eod id"),
      unsupported("null-tokenizer-pad-id", "1", "NullTokenizer pad tokens"),
      unsupported("chat-template", "1", "chat templates (SFT)"),
      no_effect("use-gigatoken", "0", "a tokenizer speed option; Megaton's tokenizers are its own"),
  };
}

}  // namespace megaton
