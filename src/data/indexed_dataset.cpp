// Megatron's indexed dataset (MMIDIDX .bin/.idx): writer and memory-mapped reader.
#include "data/indexed_dataset.h"

#include <sys/stat.h>

#include <bit>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/error.h"

namespace megaton::data {

size_t token_dtype_size(TokenDType t) {
  switch (t) {
    case TokenDType::U8:
      return 1;
    case TokenDType::I8:
      return 1;
    case TokenDType::I16:
      return 2;
    case TokenDType::I32:
      return 4;
    case TokenDType::I64:
      return 8;
    case TokenDType::F64:
      return 8;
    case TokenDType::F32:
      return 4;
    case TokenDType::U16:
      return 2;
  }
  return 0;
}

std::string_view token_dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::U8:
      return "uint8";
    case TokenDType::I8:
      return "int8";
    case TokenDType::I16:
      return "int16";
    case TokenDType::I32:
      return "int32";
    case TokenDType::I64:
      return "int64";
    case TokenDType::F64:
      return "float64";
    case TokenDType::F32:
      return "float32";
    case TokenDType::U16:
      return "uint16";
  }
  return "unknown";
}

TokenDType token_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? TokenDType::U16 : TokenDType::I32;
}

std::string data_file_path(const std::string& path_prefix) { return path_prefix + ".bin"; }
std::string index_file_path(const std::string& path_prefix) { return path_prefix + ".idx"; }

bool indexed_dataset_exists(const std::string& path_prefix) {
  struct stat st {};
  return ::stat(data_file_path(path_prefix).c_str(), &st) == 0 &&
         ::stat(index_file_path(path_prefix).c_str(), &st) == 0;
}

namespace {

bool is_integer_dtype(TokenDType t) { return t != TokenDType::F32 && t != TokenDType::F64; }

template <typename T>
void put_le(std::vector<std::byte>& out, T v) {
  static_assert(std::endian::native == std::endian::little, "big-endian hosts not supported");
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Narrows int32 tokens to T into out; returns the index of the first token that does
// not fit, or -1.
template <typename T>
int64_t convert_tokens(std::span<const int32_t> tokens, std::byte* out) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    int32_t t = tokens[i];
    if constexpr (!std::is_same_v<T, int32_t> && !std::is_same_v<T, int64_t>) {
      if (t < std::numeric_limits<T>::min() || t > std::numeric_limits<T>::max())
        return static_cast<int64_t>(i);
    }
    T v = static_cast<T>(t);
    std::memcpy(out + i * sizeof(T), &v, sizeof(T));
  }
  return -1;
}

// Decimal digits of v (fmt has no portable 128-bit formatting).
std::string uint128_string(unsigned __int128 v) {
  std::string digits;
  do {
    digits.insert(digits.begin(), char('0' + int(v % 10)));
    v /= 10;
  } while (v != 0);
  return digits;
}

template <typename T>
void read_tokens(const std::byte* src, int64_t n, int32_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(load<T>(src + i * sizeof(T)));
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Builder

IndexedDatasetBuilder::IndexedDatasetBuilder(std::string path_prefix, TokenDType dtype)
    : path_prefix_(std::move(path_prefix)), dtype_(dtype) {
  if (token_dtype_size(dtype) == 0 || !is_integer_dtype(dtype))
    fail("{}: token dtype {} is not an integer type", data_file_path(path_prefix_),
         token_dtype_name(dtype));
  bin_ = std::make_unique<AtomicFile>(data_file_path(path_prefix_));
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() = default;  // AtomicFile removes the temp

void IndexedDatasetBuilder::write_tokens(std::span<const int32_t> tokens) {
  size_t item = token_dtype_size(dtype_);
  buffer_.resize(tokens.size() * item);
  int64_t bad = -1;
  switch (dtype_) {
    case TokenDType::U8:
      bad = convert_tokens<uint8_t>(tokens, buffer_.data());
      break;
    case TokenDType::I8:
      bad = convert_tokens<int8_t>(tokens, buffer_.data());
      break;
    case TokenDType::I16:
      bad = convert_tokens<int16_t>(tokens, buffer_.data());
      break;
    case TokenDType::U16:
      bad = convert_tokens<uint16_t>(tokens, buffer_.data());
      break;
    case TokenDType::I32:
      bad = convert_tokens<int32_t>(tokens, buffer_.data());
      break;
    case TokenDType::I64:
      bad = convert_tokens<int64_t>(tokens, buffer_.data());
      break;
    default:
      MEGATON_CHECK(false, "float dtype in builder");
  }
  if (bad >= 0)
    fail("{}: token {} does not fit dtype {} (tokenizer vocabulary larger than the dtype?)",
         data_file_path(path_prefix_), tokens[bad], token_dtype_name(dtype_));
  bin_->write(buffer_.data(), buffer_.size());
}

void IndexedDatasetBuilder::add_document(std::span<const int32_t> tokens) {
  if (tokens.empty()) {
    add_document(tokens, {});
  } else {
    int32_t len = static_cast<int32_t>(tokens.size());
    MEGATON_CHECK(static_cast<size_t>(len) == tokens.size(), "sequence of {} tokens",
                  tokens.size());
    add_document(tokens, std::span<const int32_t>(&len, 1));
  }
}

void IndexedDatasetBuilder::add_document(std::span<const int32_t> tokens,
                                         std::span<const int32_t> sequence_lengths) {
  MEGATON_CHECK(!finalized_, "add_document after finalize on {}", path_prefix_);
  int64_t total = 0;
  for (int32_t len : sequence_lengths) {
    MEGATON_CHECK(len >= 0, "negative sequence length {}", len);
    total += len;
  }
  MEGATON_CHECK(total == static_cast<int64_t>(tokens.size()),
                "sequence lengths sum to {} but the document has {} tokens", total, tokens.size());
  write_tokens(tokens);
  sequence_lengths_.insert(sequence_lengths_.end(), sequence_lengths.begin(),
                           sequence_lengths.end());
  document_indices_.push_back(static_cast<int64_t>(sequence_lengths_.size()));
  num_tokens_ += total;
}

void IndexedDatasetBuilder::finalize() {
  finish_writing();
  publish();
}

void IndexedDatasetBuilder::finish_writing() {
  MEGATON_CHECK(!finalized_ && !idx_, "finalize twice on {}", path_prefix_);
  const uint64_t num_seq = sequence_lengths_.size();
  std::vector<std::byte> idx;
  idx.reserve(kIndexHeaderBytes + num_seq * 12 + document_indices_.size() * 8);
  const auto* magic = reinterpret_cast<const std::byte*>(kIndexMagic);
  idx.insert(idx.end(), magic, magic + sizeof(kIndexMagic));
  put_le<uint64_t>(idx, kIndexVersion);
  put_le<uint8_t>(idx, static_cast<uint8_t>(dtype_));
  put_le<uint64_t>(idx, num_seq);
  put_le<uint64_t>(idx, document_indices_.size());
  for (int32_t len : sequence_lengths_) put_le<int32_t>(idx, len);
  // Pointers are the running byte offsets of the sequences, as Megatron computes them.
  int64_t pointer = 0;
  const int64_t item = static_cast<int64_t>(token_dtype_size(dtype_));
  for (int32_t len : sequence_lengths_) {
    put_le<int64_t>(idx, pointer);
    pointer += int64_t(len) * item;
  }
  for (int64_t d : document_indices_) put_le<int64_t>(idx, d);
  MEGATON_CHECK(static_cast<uint64_t>(pointer) == bin_->offset(), "bin holds {} bytes, index {}",
                bin_->offset(), pointer);

  auto idx_file = std::make_unique<AtomicFile>(index_file_path(path_prefix_));
  idx_file->write(idx.data(), idx.size());
  idx_file->close();
  bin_->close();  // on failure both temporaries go: bin_ here, idx_file with its destructor
  idx_ = std::move(idx_file);
}

void IndexedDatasetBuilder::publish() {
  MEGATON_CHECK(idx_ && !finalized_, "publish of {} before finish_writing, or twice",
                path_prefix_);
  // The .bin goes first: a reader that finds the new .idx also finds the new .bin.
  bin_->commit();
  try {
    idx_->commit();
  } catch (...) {
    std::remove(data_file_path(path_prefix_).c_str());
    throw;
  }
  finalized_ = true;
}

void IndexedDatasetBuilder::unpublish() noexcept {
  if (!finalized_) return;
  std::remove(data_file_path(path_prefix_).c_str());
  std::remove(index_file_path(path_prefix_).c_str());
  finalized_ = false;
}

// ---------------------------------------------------------------------------------------
// Reader

IndexedDataset::IndexedDataset(const std::string& path_prefix) : path_prefix_(path_prefix) {
  const std::string idx_path = index_file_path(path_prefix);
  idx_ = MappedFile(idx_path);
  const std::byte* p = idx_.data();
  const uint64_t size = idx_.size();
  if (size < kIndexHeaderBytes)
    fail("{}: truncated index: {} bytes, expected at least the {}-byte MMIDIDX header", idx_path,
         size, kIndexHeaderBytes);
  if (std::memcmp(p, kIndexMagic, sizeof(kIndexMagic)) != 0)
    fail("{}: bad magic: expected \"MMIDIDX\\x00\\x00\" (a Megatron indexed dataset)", idx_path);
  uint64_t version = load<uint64_t>(p + 9);
  if (version != kIndexVersion)
    fail("{}: index version {}, expected {}", idx_path, version, kIndexVersion);
  uint8_t code = load<uint8_t>(p + 17);
  dtype_ = static_cast<TokenDType>(code);
  if (code < 1 || code > 8) fail("{}: unknown dtype code {}, expected 1..8", idx_path, code);
  if (!is_integer_dtype(dtype_))
    fail("{}: dtype {} is not an integer token type", idx_path, token_dtype_name(dtype_));
  uint64_t num_seq = load<uint64_t>(p + 18);
  uint64_t num_doc = load<uint64_t>(p + 26);
  // In 128 bits: 12 x 2^64 + 8 x 2^64 cannot wrap, so the message names the true size.
  const unsigned __int128 expected = kIndexHeaderBytes + (unsigned __int128)num_seq * 12 +
                                     (unsigned __int128)num_doc * 8;
  if (expected != size)
    fail(
        "{}: {} sequences and {} document-index entries need {} bytes, file has {} "
        "(truncated or not an index)",
        idx_path, num_seq, num_doc, uint128_string(expected), size);
  if (num_doc < 1) fail("{}: document index is empty, expected at least the leading 0", idx_path);
  num_sequences_ = static_cast<int64_t>(num_seq);
  num_doc_indices_ = static_cast<int64_t>(num_doc);
  lengths_ = p + kIndexHeaderBytes;
  pointers_ = lengths_ + num_seq * 4;
  doc_idx_ = pointers_ + num_seq * 8;

  const std::string bin_path = data_file_path(path_prefix);
  bin_ = MappedFile(bin_path);
  const int64_t item = static_cast<int64_t>(token_dtype_size(dtype_));
  const int64_t bin_size = static_cast<int64_t>(bin_.size());
  for (int64_t i = 0; i < num_sequences_; ++i) {
    int64_t len = sequence_length(i), ptr = sequence_pointer(i);
    if (len < 0) fail("{}: sequence {} has negative length {}", idx_path, i, len);
    if (ptr < 0 || ptr % item != 0 || ptr > bin_size || len > (bin_size - ptr) / item)
      fail("{}: sequence {} ({} tokens at byte {}) lies outside {} ({} bytes; truncated?)",
           idx_path, i, len, ptr, bin_path, bin_size);
    num_tokens_ += len;
  }
  int64_t prev = document_index(0);
  if (prev != 0) fail("{}: document index starts at {}, expected 0", idx_path, prev);
  for (int64_t d = 1; d < num_doc_indices_; ++d) {
    int64_t cur = document_index(d);
    if (cur < prev || cur > num_sequences_)
      fail("{}: document index entry {} is {}, expected non-decreasing values in [0, {}]", idx_path,
           d, cur, num_sequences_);
    prev = cur;
  }
  if (prev != num_sequences_)
    fail("{}: document index ends at {}, expected the sequence count {}", idx_path, prev,
         num_sequences_);
}

int32_t IndexedDataset::sequence_length(int64_t i) const {
  MEGATON_CHECK(i >= 0 && i < num_sequences_, "sequence {} of {}", i, num_sequences_);
  return load<int32_t>(lengths_ + i * 4);
}

int64_t IndexedDataset::sequence_pointer(int64_t i) const {
  MEGATON_CHECK(i >= 0 && i < num_sequences_, "sequence {} of {}", i, num_sequences_);
  return load<int64_t>(pointers_ + i * 8);
}

int64_t IndexedDataset::document_index(int64_t i) const {
  MEGATON_CHECK(i >= 0 && i < num_doc_indices_, "document index {} of {}", i, num_doc_indices_);
  return load<int64_t>(doc_idx_ + i * 8);
}

std::vector<int32_t> IndexedDataset::sequence_lengths() const {
  std::vector<int32_t> out(static_cast<size_t>(num_sequences_));
  if (num_sequences_ > 0) std::memcpy(out.data(), lengths_, out.size() * 4);
  return out;
}

void IndexedDataset::get(int64_t seq, int64_t offset, int64_t length, int32_t* out) const {
  const int64_t seq_len = sequence_length(seq);
  if (length < 0) length = seq_len - offset;
  MEGATON_CHECK(offset >= 0 && length >= 0 && offset + length <= seq_len,
                "tokens [{}, {}) of sequence {} with {} tokens in {}", offset, offset + length, seq,
                seq_len, path_prefix_);
  const size_t item = token_dtype_size(dtype_);
  const std::byte* src = bin_.data() + sequence_pointer(seq) + offset * item;
  if (length == 0) return;
  switch (dtype_) {
    case TokenDType::U8:
      read_tokens<uint8_t>(src, length, out);
      break;
    case TokenDType::I8:
      read_tokens<int8_t>(src, length, out);
      break;
    case TokenDType::I16:
      read_tokens<int16_t>(src, length, out);
      break;
    case TokenDType::U16:
      read_tokens<uint16_t>(src, length, out);
      break;
    case TokenDType::I32:
      read_tokens<int32_t>(src, length, out);
      break;
    case TokenDType::I64:
      read_tokens<int64_t>(src, length, out);
      break;
    default:
      MEGATON_CHECK(false, "float dtype in reader");
  }
}

std::vector<int32_t> IndexedDataset::get(int64_t seq, int64_t offset, int64_t length) const {
  if (length < 0) length = sequence_length(seq) - offset;
  std::vector<int32_t> out(static_cast<size_t>(std::max<int64_t>(length, 0)));
  get(seq, offset, length, out.data());
  return out;
}

}  // namespace megaton::data
