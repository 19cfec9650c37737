// Byte-level BPE: byte symbols, PCRE2 pre-tokenization, the merge loop, GPT-2 files.
#include "data/byte_level_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/printable.h"

namespace megaton::data {

namespace {

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

// Length in bytes of the UTF-8 sequence starting with lead byte `c` (1 for a stray
// continuation byte, so a scan always advances).
size_t utf8_length(unsigned char c) {
  if (c >= 0xF0) return 4;
  if (c >= 0xE0) return 3;
  if (c >= 0xC0) return 2;
  return 1;
}

struct ByteSymbols {
  std::array<std::string, 256> symbol;
  std::array<uint32_t, 256> code_point{};
  ByteSymbols() {
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      code_point[b] = printable ? uint32_t(b) : uint32_t(256 + next++);
      append_utf8(code_point[b], symbol[b]);
    }
  }
};

const ByteSymbols& byte_symbols() {
  static const ByteSymbols table;
  return table;
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

}  // namespace

const std::string& byte_symbol(uint8_t byte) { return byte_symbols().symbol[byte]; }

std::string bytes_to_symbols(std::string_view text) {
  std::string out;
  out.reserve(text.size() * 2);
  for (unsigned char c : text) out += byte_symbols().symbol[c];
  return out;
}

bool symbols_to_bytes(std::string_view symbols, std::string& out) {
  static const std::array<int, 324> inverse = [] {
    std::array<int, 324> inv;
    inv.fill(-1);
    for (int b = 0; b < 256; ++b) inv[byte_symbols().code_point[b]] = b;
    return inv;
  }();
  for (size_t i = 0; i < symbols.size();) {
    const auto c = static_cast<unsigned char>(symbols[i]);
    uint32_t cp;
    size_t n = utf8_length(c);
    if (i + n > symbols.size()) return false;
    if (n == 1) cp = c;
    else if (n == 2) cp = ((c & 0x1Fu) << 6) | (symbols[i + 1] & 0x3F);
    else return false;  // every byte symbol is below U+0800
    if (cp >= inverse.size() || inverse[cp] < 0) return false;
    out.push_back(char(inverse[cp]));
    i += n;
  }
  return true;
}

Regex::Regex(std::string_view pattern, std::string_view what) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (!code)
    fail("{}: cannot compile the regex '{}' at offset {}: {}", what, printable(pattern), offset,
         pcre2_message(error));
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // a failed JIT leaves the interpreter
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  auto* code = static_cast<pcre2_code*>(code_);
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
      pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
  MEGATON_CHECK(match != nullptr, "pcre2_match_data_create_from_pattern failed");
  std::vector<std::pair<size_t, size_t>> out;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  uint32_t options = 0;
  for (size_t start = 0; start <= text.size();) {
    int rc = pcre2_match(code, subject, text.size(), start, options, match.get(), nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {  // a long run: the interpreter's heap stack
      options |= PCRE2_NO_JIT;
      continue;
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) fail("tokenizer: cannot split the text: {}", pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match.get());
    if (ov[1] > ov[0]) {
      out.emplace_back(ov[0], ov[1]);
      start = ov[1];
    } else {  // an empty match: step over one character
      if (ov[0] >= text.size()) break;
      start = ov[0] + utf8_length(static_cast<unsigned char>(text[ov[0]]));
    }
    options |= PCRE2_NO_UTF_CHECK;  // the whole subject was checked by the first call
  }
  return out;
}

std::vector<std::string_view> split_isolated(const Regex& regex, std::string_view text) {
  std::vector<std::string_view> out;
  size_t at = 0;
  for (auto [begin, end] : regex.find_all(text)) {
    if (begin > at) out.push_back(text.substr(at, begin - at));
    out.push_back(text.substr(begin, end - begin));
    at = end;
  }
  if (at < text.size()) out.push_back(text.substr(at));
  return out;
}

BpeModel::BpeModel(std::unordered_map<std::string, int32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   bool ignore_merges, const std::string& source)
    : vocab_(std::move(vocab)), ignore_merges_(ignore_merges) {
  int32_t max_id = -1;
  for (const auto& [s, id] : vocab_) {
    if (id < 0) fail("{}: vocabulary entry '{}' has a negative id {}", source, printable(s), id);
    max_id = std::max(max_id, id);
  }
  symbols_.resize(size_t(max_id + 1));
  has_symbol_.assign(size_t(max_id + 1), 0);
  for (const auto& [s, id] : vocab_) {
    if (has_symbol_[id])
      fail("{}: vocabulary ids repeat: '{}' and '{}' are both {}", source,
           printable(symbols_[id]), printable(s), id);
    symbols_[id] = s;
    has_symbol_[id] = 1;
  }
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const int32_t l = id(left), r = id(right), m = id(left + right);
    if (l < 0 || r < 0 || m < 0)
      fail("{}: merge {} '{} {}' names a symbol that is not in the vocabulary", source, rank,
           printable(left), printable(right));
    merges_.try_emplace(pair_key(l, r), int32_t(rank), m);  // the first rank of a pair wins
  }
}

int32_t BpeModel::id(const std::string& symbol) const {
  auto it = vocab_.find(symbol);
  return it == vocab_.end() ? -1 : it->second;
}

const std::string* BpeModel::symbol(int32_t id) const {
  if (id < 0 || size_t(id) >= symbols_.size() || !has_symbol_[id]) return nullptr;
  return &symbols_[id];
}

void BpeModel::encode(std::string_view symbols, std::vector<int32_t>& out) const {
  if (symbols.empty()) return;
  if (ignore_merges_) {
    if (int32_t whole = id(std::string(symbols)); whole >= 0) {
      out.push_back(whole);
      return;
    }
  }
  std::vector<int32_t> word;
  std::string one;
  for (size_t i = 0; i < symbols.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(symbols[i])), symbols.size() - i);
    one.assign(symbols.substr(i, n));
    const int32_t sid = id(one);
    if (sid < 0) fail("tokenizer: symbol '{}' is not in the vocabulary", printable(one));
    word.push_back(sid);
    i += n;
  }
  while (word.size() > 1) {
    int32_t best_rank = std::numeric_limits<int32_t>::max(), best_id = -1;
    size_t best_at = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      auto it = merges_.find(pair_key(word[i], word[i + 1]));
      if (it != merges_.end() && it->second.first < best_rank) {
        best_rank = it->second.first;
        best_id = it->second.second;
        best_at = i;
      }
    }
    if (best_id < 0) break;
    word[best_at] = best_id;
    word.erase(word.begin() + std::ptrdiff_t(best_at) + 1);
  }
  out.insert(out.end(), word.begin(), word.end());
}

std::vector<std::pair<std::string, std::string>> read_merges_txt(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("--merge-file {}: cannot open", printable(path));
  std::vector<std::pair<std::string, std::string>> merges;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (n == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 >= line.size() ||
        line.find(' ', space + 1) != std::string::npos)
      fail("--merge-file {}: line {} is not 'left right': '{}'", printable(path), n,
           printable(line));
    merges.emplace_back(line.substr(0, space), line.substr(space + 1));
  }
  return merges;
}

std::unordered_map<std::string, int32_t> read_vocab_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("--vocab-file {}: cannot open", printable(path));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("--vocab-file {}: not JSON: {}", printable(path), e.what());
  }
  if (!j.is_object()) fail("--vocab-file {}: expected a JSON object of symbol: id", printable(path));
  std::unordered_map<std::string, int32_t> vocab;
  for (const auto& [symbol, id] : j.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max())
      fail("--vocab-file {}: the id of '{}' is not a non-negative 32-bit integer",
           printable(path), printable(symbol));
    vocab.emplace(symbol, id.get<int32_t>());
  }
  return vocab;
}

}  // namespace megaton::data
