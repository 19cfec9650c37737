// Tokenizer flags (Megatron's "tokenizer" group): the type and its files.
#include "core/error.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

void parse_tokenizer(const ArgReader& r, TrainArgs& a) {
  r.get("tokenizer-type", a.tokenizer_type);
  r.get("tokenizer-model", a.tokenizer_model);
  r.get("vocab-size", a.vocab_size);
  r.get("vocab-file", a.vocab_file);
  r.get("merge-file", a.merge_file);
  a.tokenizer_hf_include_special_tokens = !r.on("tokenizer-hf-no-include-special-tokens");
  if (r.has("vocab-size")) check_positive("vocab-size", double(a.vocab_size));
}

}  // namespace

std::vector<OptionSpec> tokenizer_megatron_rules();

ArgGroup tokenizer_flags() {
  ArgGroup g{"tokenizer", "tokenizer", {}, parse_tokenizer};
  g.flags = {
      flag("tokenizer-type",
           "SentencePieceTokenizer, GPTSentencePieceTokenizer, "
           "HuggingFaceTokenizer, GPT2BPETokenizer, ByteTokenizer or "
           "NullTokenizer"),
      flag("tokenizer-model",
           "SentencePiece .model file, or a tokenizer.json (or its "
           "directory) for HuggingFaceTokenizer"),
      flag("vocab-size", "vocabulary of the NullTokenizer (ids 0..N-1, eod N)"),
      flag("vocab-file", "GPT2BPETokenizer's vocab.json"),
      flag("merge-file", "GPT2BPETokenizer's merges.txt"),
      toggle("tokenizer-hf-no-include-special-tokens",
             "HuggingFaceTokenizer without the post-processor's special tokens (e.g. "
             "Llama-3's <|begin_of_text|>)"),
  };
  for (OptionSpec& s : tokenizer_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
