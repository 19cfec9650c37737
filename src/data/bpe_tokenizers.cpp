// GPT2BPETokenizer and HuggingFaceTokenizer: byte-level BPE from GPT-2 files or a
// tokenizer.json.
#include "data/bpe_tokenizers.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <span>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"
#include "core/printable.h"
#include "data/byte_level_bpe.h"

namespace megaton::data {

namespace {

using nlohmann::json;

void check_decode_ids(std::span<const int32_t> ids, int64_t vocab_size) {
  for (int32_t id : ids)
    if (id < 0 || id >= vocab_size)
      fail("decode: token id {} outside the vocabulary [0, {})", id, vocab_size);
}

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  Gpt2BpeTokenizer(const std::string& vocab_file, const std::string& merge_file)
      : bpe_(read_vocab_json(vocab_file), read_merges_txt(merge_file), false,
             "--vocab-file " + printable(vocab_file)),
        regex_(kGpt2Pattern, "GPT2BPETokenizer") {
    eod_ = bpe_.id("<|endoftext|>");
    if (eod_ < 0)
      fail("--vocab-file {}: no '<|endoftext|>' entry, needed as the end-of-document token",
           printable(vocab_file));
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    for (std::string_view piece : split_isolated(regex_, text))
      bpe_.encode(bytes_to_symbols(piece), ids);
    return ids;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    check_decode_ids(ids, vocab_size());
    std::string out;
    for (int32_t id : ids) {
      if (id == eod_) continue;
      const std::string* s = bpe_.symbol(id);
      if (s && !symbols_to_bytes(*s, out)) out += *s;  // not byte symbols: the text itself
    }
    return out;
  }

  int64_t vocab_size() const override { return bpe_.size(); }
  int32_t eod() const override { return eod_; }

 private:
  BpeModel bpe_;
  Regex regex_;
  int32_t eod_ = -1;
};

// ---- tokenizer.json ----

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// One step of the pre-tokenizer pipeline.
struct PreTokenizerStep {
  enum Kind { Split, ByteLevel } kind = Split;
  std::shared_ptr<Regex> regex;  // Split; ByteLevel with use_regex (GPT-2 pattern)
  bool remove_matches = false;   // Split behavior "Removed"
  bool add_prefix_space = false; // ByteLevel
};

bool ascii_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
bool ascii_word(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || (static_cast<unsigned char>(c) & 0x80);
}

std::string nfc(std::string_view text) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), utf8proc_ssize_t(text.size()),
                   &out, utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) fail("tokenizer: cannot NFC-normalize the text: {}", utf8proc_errmsg(n));
  std::string result(reinterpret_cast<const char*>(out), size_t(n));
  std::free(out);
  return result;
}

class HuggingFaceTokenizer final : public Tokenizer {
 public:
  HuggingFaceTokenizer(const std::string& path, bool include_special_tokens)
      : include_special_tokens_(include_special_tokens) {
    namespace fs = std::filesystem;
    fs::path file = path;
    if (path.empty()) fail("--tokenizer-model: required for HuggingFaceTokenizer");
    if (fs::is_directory(file)) file /= "tokenizer.json";
    source_ = "--tokenizer-model " + printable(file.string());
    const json j = read_json(file, source_);
    read_added_tokens(j);
    read_normalizer(j.value("normalizer", json()));
    read_pre_tokenizer(j.value("pre_tokenizer", json()));
    if (!byte_level_)
      fail("{}: only byte-level BPE tokenizers are supported (a ByteLevel pre-tokenizer, as in "
           "GPT-2, Llama-3 and Qwen)", source_);
    read_model(j.at("model"));
    read_post_processor(j.value("post_processor", json()));
    vocab_size_ = bpe_->size();
    for (const AddedToken& t : added_) vocab_size_ = std::max<int64_t>(vocab_size_, t.id + 1);
    read_eos(file.parent_path() / "tokenizer_config.json");
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    // 1. Added tokens matched on the raw text, then those matched after normalization.
    for_each_added_split(text, false, [&](std::string_view piece, int32_t token) {
      if (token >= 0) return ids.push_back(token);
      const std::string normalized = normalize_ ? nfc(piece) : std::string(piece);
      for_each_added_split(normalized, true, [&](std::string_view inner, int32_t inner_token) {
        if (inner_token >= 0) return ids.push_back(inner_token);
        for (const std::string& symbols : pre_tokenize(inner)) bpe_->encode(symbols, ids);
      });
    });
    if (!include_special_tokens_) return ids;
    std::vector<int32_t> out(prefix_);
    out.insert(out.end(), ids.begin(), ids.end());
    out.insert(out.end(), suffix_.begin(), suffix_.end());
    return out;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    check_decode_ids(ids, vocab_size_);
    std::string out;
    for (int32_t id : ids) {
      if (auto it = added_by_id_.find(id); it != added_by_id_.end()) {
        if (!added_[it->second].special) out += added_[it->second].content;
        continue;
      }
      const std::string* s = bpe_->symbol(id);
      if (s && !symbols_to_bytes(*s, out)) out += *s;
    }
    return out;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int32_t eod() const override { return eod_; }

 private:
  static json read_json(const std::filesystem::path& file, const std::string& what) {
    std::ifstream in(file);
    if (!in) fail("{}: cannot open {}", what, printable(file.string()));
    try {
      return json::parse(in);
    } catch (const json::exception& e) {
      fail("{}: {} is not JSON: {}", what, printable(file.string()), e.what());
    }
  }

  [[noreturn]] void unsupported(const std::string& component, const json& j) const {
    fail("{}: {} '{}' is not supported (byte-level BPE only: GPT-2, Llama-3, Qwen)", source_,
         component, printable(j.is_object() ? j.value("type", std::string("?")) : j.dump()));
  }

  void read_added_tokens(const json& j) {
    for (const json& t : j.value("added_tokens", json::array())) {
      AddedToken a;
      a.id = t.at("id").get<int32_t>();
      a.content = t.at("content").get<std::string>();
      a.single_word = t.value("single_word", false);
      a.lstrip = t.value("lstrip", false);
      a.rstrip = t.value("rstrip", false);
      a.normalized = t.value("normalized", false);
      a.special = t.value("special", false);
      if (a.content.empty() || a.id < 0)
        fail("{}: an added token has an empty content or a negative id", source_);
      added_by_id_[a.id] = added_.size();
      added_.push_back(std::move(a));
    }
    // Longest first, so the first token that matches at a position is the longest one.
    for (size_t i = 0; i < added_.size(); ++i)
      by_first_byte_[static_cast<unsigned char>(added_[i].content[0])].push_back(i);
    for (auto& list : by_first_byte_)
      std::stable_sort(list.begin(), list.end(), [&](size_t a, size_t b) {
        return added_[a].content.size() > added_[b].content.size();
      });
  }

  void read_normalizer(const json& j) {
    if (j.is_null()) return;
    const std::string type = j.value("type", "");
    if (type == "NFC") normalize_ = true;
    else if (type == "Sequence")
      for (const json& n : j.at("normalizers")) read_normalizer(n);
    else unsupported("normalizer", j);
  }

  void read_pre_tokenizer(const json& j) {
    if (j.is_null()) return;
    const std::string type = j.value("type", "");
    if (type == "Sequence") {
      for (const json& p : j.at("pretokenizers")) read_pre_tokenizer(p);
    } else if (type == "Split") {
      if (j.value("invert", false)) unsupported("Split pre-tokenizer with invert", j);
      const std::string behavior = j.value("behavior", "");
      if (behavior != "Isolated" && behavior != "Removed")
        fail("{}: Split behavior '{}' is not supported (Isolated or Removed)", source_,
             printable(behavior));
      const json& pattern = j.at("pattern");
      std::string regex;
      if (pattern.contains("Regex")) {
        regex = pattern.at("Regex").get<std::string>();
      } else {  // a literal string
        regex = "\\Q" + pattern.at("String").get<std::string>() + "\\E";
      }
      PreTokenizerStep step;
      step.kind = PreTokenizerStep::Split;
      step.regex = std::make_shared<Regex>(regex, source_ + " pre_tokenizer Split");
      step.remove_matches = behavior == "Removed";
      steps_.push_back(std::move(step));
    } else if (type == "ByteLevel") {
      PreTokenizerStep step;
      step.kind = PreTokenizerStep::ByteLevel;
      step.add_prefix_space = j.value("add_prefix_space", false);
      if (j.value("use_regex", true))
        step.regex = std::make_shared<Regex>(kGpt2Pattern, source_ + " pre_tokenizer ByteLevel");
      steps_.push_back(std::move(step));
      byte_level_ = true;
    } else {
      unsupported("pre_tokenizer", j);
    }
  }

  void read_model(const json& m) {
    if (m.value("type", "") != "BPE") unsupported("model", m);
    if (m.value("byte_fallback", false)) unsupported("BPE with byte_fallback", m);
    if (!m.value("continuing_subword_prefix", json()).is_null() ||
        !m.value("end_of_word_suffix", json()).is_null())
      unsupported("BPE with a subword prefix or suffix", m);
    if (const json d = m.value("dropout", json()); !d.is_null() && d.get<double>() > 0)
      unsupported("BPE with dropout", m);
    std::unordered_map<std::string, int32_t> vocab;
    for (const auto& [symbol, id] : m.at("vocab").items()) vocab.emplace(symbol, id.get<int32_t>());
    std::vector<std::pair<std::string, std::string>> merges;
    for (const json& merge : m.at("merges")) {
      if (merge.is_array() && merge.size() == 2) {
        merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
        continue;
      }
      const std::string s = merge.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos) fail("{}: merge '{}' is not 'left right'", source_, printable(s));
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    }
    bpe_.emplace(std::move(vocab), merges, m.value("ignore_merges", false), source_);
  }

  void read_post_processor(const json& j) {
    if (j.is_null()) return;
    const std::string type = j.value("type", "");
    if (type == "ByteLevel") return;  // offsets only
    if (type == "Sequence") {
      for (const json& p : j.at("processors")) read_post_processor(p);
      return;
    }
    if (type != "TemplateProcessing") unsupported("post_processor", j);
    bool before = true;
    for (const json& item : j.at("single")) {
      if (item.contains("Sequence")) {
        before = false;
        continue;
      }
      const std::string name = item.at("SpecialToken").at("id").get<std::string>();
      const json& special = j.at("special_tokens").at(name);
      for (const json& id : special.at("ids")) (before ? prefix_ : suffix_).push_back(id.get<int32_t>());
    }
  }

  void read_eos(const std::filesystem::path& config_file) {
    if (!std::filesystem::exists(config_file))
      fail("{}: no tokenizer_config.json beside it, needed for eos_token (the end-of-document "
           "token)", source_);
    const json c = read_json(config_file, source_);
    const json eos = c.value("eos_token", json());
    std::string content;
    if (eos.is_string()) content = eos.get<std::string>();
    else if (eos.is_object()) content = eos.value("content", "");
    if (content.empty()) fail("{}: tokenizer_config.json has no eos_token", source_);
    for (const AddedToken& t : added_)
      if (t.content == content) eod_ = t.id;
    if (eod_ < 0) eod_ = bpe_->id(bytes_to_symbols(content));
    if (eod_ < 0)
      fail("{}: eos_token '{}' is neither an added token nor in the vocabulary", source_,
           printable(content));
  }

  // Calls emit(piece, -1) for the stretches of `text` between added tokens and
  // emit(token_text, id) for each added token (normalized: those matched after
  // normalization, else those matched on the raw text), leftmost longest first.
  template <class Emit>
  void for_each_added_split(std::string_view text, bool normalized, Emit&& emit) const {
    size_t start = 0;  // of the pending stretch
    for (size_t i = 0; i < text.size(); ++i) {
      for (size_t k : by_first_byte_[static_cast<unsigned char>(text[i])]) {
        const AddedToken& t = added_[k];
        if (t.normalized != normalized || text.compare(i, t.content.size(), t.content) != 0)
          continue;
        size_t begin = i, end = i + t.content.size();
        if (t.single_word && ((begin > 0 && ascii_word(text[begin - 1])) ||
                              (end < text.size() && ascii_word(text[end]))))
          continue;
        if (t.lstrip)
          while (begin > start && ascii_space(text[begin - 1])) --begin;
        if (t.rstrip)
          while (end < text.size() && ascii_space(text[end])) ++end;
        if (begin > start) emit(text.substr(start, begin - start), -1);
        emit(text.substr(begin, end - begin), t.id);
        start = end;
        i = end - 1;
        break;
      }
    }
    if (start < text.size()) emit(text.substr(start), -1);
  }

  // The pre-tokens of `text` (no added tokens in it), as byte symbols.
  std::vector<std::string> pre_tokenize(std::string_view text) const {
    std::vector<std::string> pieces{std::string(text)};
    bool symbols = false;  // whether pieces are byte symbols yet
    for (const PreTokenizerStep& step : steps_) {
      std::vector<std::string> next;
      for (std::string& piece : pieces) {
        if (step.kind == PreTokenizerStep::ByteLevel && step.add_prefix_space && !piece.empty() &&
            piece[0] != ' ')
          piece.insert(piece.begin(), ' ');
        if (!step.regex) {
          next.push_back(std::move(piece));
          continue;
        }
        if (step.remove_matches) {
          size_t at = 0;
          for (auto [b, e] : step.regex->find_all(piece)) {
            if (b > at) next.push_back(piece.substr(at, b - at));
            at = e;
          }
          if (at < piece.size()) next.push_back(piece.substr(at));
        } else {
          for (std::string_view s : split_isolated(*step.regex, piece)) next.emplace_back(s);
        }
      }
      if (step.kind == PreTokenizerStep::ByteLevel && !symbols) {
        for (std::string& p : next) p = bytes_to_symbols(p);
        symbols = true;
      }
      pieces = std::move(next);
    }
    return pieces;
  }

  std::string source_;
  bool include_special_tokens_;
  std::vector<AddedToken> added_;
  std::map<int32_t, size_t> added_by_id_;
  std::array<std::vector<size_t>, 256> by_first_byte_;
  bool normalize_ = false;
  std::vector<PreTokenizerStep> steps_;
  bool byte_level_ = false;
  std::optional<BpeModel> bpe_;
  std::vector<int32_t> prefix_, suffix_;
  int64_t vocab_size_ = 0;
  int32_t eod_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file) {
  if (vocab_file.empty() || merge_file.empty())
    fail("GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)");
  return std::make_unique<Gpt2BpeTokenizer>(vocab_file, merge_file);
}

std::unique_ptr<Tokenizer> make_huggingface_tokenizer(const std::string& path,
                                                      bool include_special_tokens) {
  try {
    return std::make_unique<HuggingFaceTokenizer>(path, include_special_tokens);
  } catch (const nlohmann::json::exception& e) {
    fail("--tokenizer-model {}: unexpected tokenizer.json content: {}", printable(path), e.what());
  }
}

}  // namespace megaton::data
