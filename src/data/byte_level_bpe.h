// Byte-level BPE (GPT-2's scheme, as Hugging Face tokenizers runs it): the byte-to-symbol
// map, regex pre-tokenization and the BPE merge loop, shared by GPT2BPETokenizer and
// HuggingFaceTokenizer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace megaton::data {

// GPT-2's bytes_to_unicode (openai/gpt-2 encoder.py; Hugging Face tokenizers'
// pre_tokenizers/byte_level.rs): each byte is one printable code point, so a BPE symbol
// never holds a space or a control character. The printable Latin-1 bytes ('!'..'~',
// 0xA1..0xAC, 0xAE..0xFF) map to themselves; the other 68 bytes to U+0100 + n in byte
// order. Returns the UTF-8 text of the code point of `byte`.
const std::string& byte_symbol(uint8_t byte);
// The UTF-8 bytes of `text` as byte symbols, concatenated.
std::string bytes_to_symbols(std::string_view text);
// The inverse: symbols (UTF-8, each one of the 256 code points above) back to bytes.
// Returns false (and leaves `out` partial) when a code point is not a byte symbol.
bool symbols_to_bytes(std::string_view symbols, std::string& out);

// The pre-tokenizer patterns of the byte-level BPE families (Hugging Face tokenizer.json
// "Split" patterns; the GPT-2 one is also what a ByteLevel pre-tokenizer with
// use_regex = true applies).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// A compiled Unicode regex (PCRE2, UTF and Unicode-property mode, so \s, \p{L} and \p{N}
// follow Unicode as the Oniguruma regexes of Hugging Face tokenizers do).
class Regex {
 public:
  // Throws megaton::Error naming `what` and PCRE2's message when `pattern` does not compile.
  Regex(std::string_view pattern, std::string_view what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // [begin, end) byte offsets of the successive non-overlapping, non-empty matches in
  // `text` (valid UTF-8; megaton::Error otherwise). Thread-safe.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8
};

// Splits `text` as Hugging Face's Split pre-tokenizer with behavior "Isolated" (invert
// false): every match is one piece and every stretch between matches is another.
std::vector<std::string_view> split_isolated(const Regex& regex, std::string_view text);

// The BPE model of byte-level tokenizers: a vocabulary of symbol strings and ranked merges.
class BpeModel {
 public:
  // vocab: symbol string -> id (ids >= 0, unique); merges: pairs in rank order (rank =
  // index), each of two vocabulary symbols whose concatenation is in the vocabulary.
  // ignore_merges: a pre-token that is itself a vocabulary symbol is that one id (Hugging
  // Face BPE's ignore_merges, set by Llama-3's tokenizer.json). `source` names the file for
  // errors. Throws megaton::Error naming the source and the merge when a merge's parts or
  // result are not in the vocabulary.
  BpeModel(std::unordered_map<std::string, int32_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges,
           const std::string& source);

  // Appends the ids of one pre-token given as byte symbols (bytes_to_symbols). Merges the
  // adjacent pair of lowest rank, the leftmost on ties, until no pair has a rank: the
  // order in which Hugging Face's BPE (word.rs merge_all) and GPT-2's encoder.py apply
  // merges. Throws megaton::Error when a symbol is not in the vocabulary.
  void encode(std::string_view symbols, std::vector<int32_t>& out) const;

  // The symbol string of `id`, or nullptr when no vocabulary entry has that id.
  const std::string* symbol(int32_t id) const;
  // The id of `symbol`, or -1.
  int32_t id(const std::string& symbol) const;
  // One more than the largest id.
  int64_t size() const { return int64_t(symbols_.size()); }

 private:
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> symbols_;  // by id; "" for an unused id
  std::vector<uint8_t> has_symbol_;
  // (left id, right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  bool ignore_merges_;
};

// Reads a GPT-2 merges.txt ("#version" comment line, then one "left right" pair a line).
// Throws megaton::Error naming the file and line.
std::vector<std::pair<std::string, std::string>> read_merges_txt(const std::string& path);
// Reads a vocab.json ({"symbol": id, ...}). Throws megaton::Error naming the file.
std::unordered_map<std::string, int32_t> read_vocab_json(const std::string& path);

}  // namespace megaton::data
