// Megatron's byte-level BPE tokenizer types: GPT2BPETokenizer (vocab.json + merges.txt)
// and HuggingFaceTokenizer (a tokenizer.json of the GPT-2, Llama-3 or Qwen families).
#pragma once
#include <memory>
#include <string>

#include "data/tokenizer.h"

namespace megaton::data {

// Megatron's GPT2BPETokenizer (--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json
// --merge-file merges.txt): GPT-2's encoder (openai/gpt-2 encoder.py): the GPT-2 regex
// (kGpt2Pattern), byte symbols, BPE. Text is not searched for special tokens (a literal
// "<|endoftext|>" in a document encodes as its characters, as in GPT-2's encoder).
// vocab_size = the vocabulary's entries (50257 for GPT-2); eod = the id of
// "<|endoftext|>". Throws megaton::Error naming the file for an unreadable or malformed
// file, a merge outside the vocabulary, or a vocabulary without "<|endoftext|>".
std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file);

// Megatron's HuggingFaceTokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model
// PATH): PATH is a directory holding tokenizer.json and tokenizer_config.json, or the
// tokenizer.json file itself (tokenizer_config.json then sits beside it). encode gives the
// ids Hugging Face tokenizers' Tokenizer.encode(text).ids gives for a byte-level BPE
// tokenizer.json:
//   1. added tokens (tokenizer.json "added_tokens") are cut out of the text first, leftmost
//      longest match, with their lstrip / rstrip / single_word options (whitespace and word
//      characters as ASCII classes);
//   2. the normalizer: none, NFC (utf8proc), or a Sequence of those;
//   3. the pre-tokenizer: Split (regex, behavior Isolated or Removed), ByteLevel
//      (add_prefix_space, use_regex with the GPT-2 pattern) or a Sequence of those;
//   4. the BPE model (ignore_merges as set);
//   5. with include_special_tokens (Megatron's default; off with
//      --tokenizer-hf-no-include-special-tokens), the post-processor's template
//      (TemplateProcessing "single", e.g. Llama-3's <|begin_of_text|>) around the ids, as
//      Megatron's text_to_ids calls tokenizer(text).input_ids.
// decode maps the byte symbols back to bytes; added tokens marked special decode to
// nothing, the others to their content. vocab_size = one more than the largest id of the
// vocabulary and the added tokens; eod = the id of tokenizer_config.json's eos_token
// (Megatron's eod). Other tokenizer.json components (WordPiece or Unigram models,
// Metaspace, byte_fallback, BPE dropout ...) are refused with megaton::Error naming the
// component, as are unreadable files and a missing eos_token.
std::unique_ptr<Tokenizer> make_huggingface_tokenizer(const std::string& path,
                                                      bool include_special_tokens = true);

}  // namespace megaton::data
