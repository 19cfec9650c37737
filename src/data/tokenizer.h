// Tokenizers (SentencePiece, bytes) behind one interface, and SentencePiece training.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/documents.h"

namespace megaton::data {

// Text <-> token ids. Implementations are immutable after construction, so encode and
// decode may be called from several threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of UTF-8 `text`, without any bos/eos added.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Text of `ids`; special (control) tokens such as eod decode to nothing. Throws
  // megaton::Error when an id is outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // Number of ids, specials included.
  virtual int64_t vocab_size() const = 0;
  // The end-of-document id appended by preprocessing (--append-eod).
  virtual int32_t eod() const = 0;
};

// Bytes 0..255 are the ids of the UTF-8 bytes of the text; id 256 is eod. vocab 257.
// For tests and toy runs.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return 257; }
  int32_t eod() const override { return 256; }
};

// --tokenizer-type values accepted by make_tokenizer.
inline constexpr std::string_view kTokenizerTypes[] = {
    "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
    "GPT2BPETokenizer",       "ByteTokenizer",             "NullTokenizer"};

// Megatron's NullTokenizer (--tokenizer-type NullTokenizer --vocab-size N): ids 0..N-1
// written as decimal text, eod = N, vocab_size = N + 1. For --mock-data runs and
// benchmarks, where no text exists.
class NullTokenizer final : public Tokenizer {
 public:
  explicit NullTokenizer(int64_t vocab_size) : vocab_size_(vocab_size) {}
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return vocab_size_ + 1; }
  int32_t eod() const override { return int32_t(vocab_size_); }

 private:
  int64_t vocab_size_;
};

// type "SentencePieceTokenizer" (or Megatron's alias "GPTSentencePieceTokenizer"): the
// SentencePiece model at model_path; ids are the model's, encode adds no bos/eos,
// vocab_size = the model's piece count, eod = the model's eos id (Megatron's
// _GPTSentencePieceTokenizer). type "ByteTokenizer": model_path is ignored.
// Throws megaton::Error for an unknown type (listing the valid ones), an unreadable
// model, or a model without an eos piece.
// type "NullTokenizer" needs vocab_size (--vocab-size).
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& type, const std::string& model_path,
                                          int64_t vocab_size = 0);

// Megatron's tokenizer flags: --tokenizer-type, --tokenizer-model, --vocab-file,
// --merge-file, --vocab-size (NullTokenizer) and --tokenizer-hf-no-include-special-tokens
// (include_special_tokens false).
struct TokenizerOptions {
  std::string type;
  std::string model;
  std::string vocab_file;
  std::string merge_file;
  int64_t vocab_size = 0;
  bool include_special_tokens = true;
};

// make_tokenizer above for every type, with "GPT2BPETokenizer" (vocab_file and merge_file,
// make_gpt2_bpe_tokenizer) and "HuggingFaceTokenizer" (model: a tokenizer.json or its
// directory, make_huggingface_tokenizer; data/bpe_tokenizers.h). Throws as they do.
std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& options);

struct SentencePieceTrainOptions {
  // --input-format and --json-keys, as for preprocessing.
  InputFormat input_format = InputFormat::Auto;
  std::vector<std::string> json_keys = {"text"};
  // "unigram" (SentencePiece's default) or "bpe".
  std::string model_type = "unigram";
  // Fraction of characters covered by the vocabulary; the rest go through bytes.
  double character_coverage = 0.9995;
  // Sentences sampled for training (0 = all). SentencePiece keeps them all in memory.
  int64_t input_sentence_size = 0;
  // Trainer threads (0 = all cores, at most 16).
  int num_threads = 0;
  // Seed of SentencePiece's random generator, so training is reproducible.
  uint32_t seed = 1234;
  // Print SentencePiece's training log on stderr.
  bool verbose = false;
};

// Trains a SentencePiece model on the documents of `inputs` (files, directories or
// globs, expanded by expand_inputs and read exactly as preprocessing reads them) and
// writes <output_prefix>.model and <output_prefix>.vocab atomically. Each line of a
// document is one training sentence (SentencePiece skips sentences longer than its
// max_sentence_length, so whole long documents would be lost); blank lines are skipped.
// Settings: byte_fallback (any text encodes), identity normalisation without
// whitespace collapsing (decode(encode(s)) == s), split_digits, ids unk 0, bos 1,
// eos 2, no pad. vocab_size counts all pieces, including the 256 byte pieces and the
// 3 specials, so it must exceed 259.
// Throws megaton::Error for a bad option, unreadable input or a failed training (with
// SentencePiece's message, e.g. a vocabulary too large for the corpus).
void train_sentencepiece(const std::vector<std::string>& inputs, int64_t vocab_size,
                         const std::string& output_prefix,
                         const SentencePieceTrainOptions& options = {});

}  // namespace megaton::data
