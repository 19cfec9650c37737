// Megatron's indexed dataset (MMIDIDX .bin/.idx): a writer and a memory-mapped reader.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/file_util.h"

namespace megaton::data {

// Element type of the tokens in a .bin, with Megatron's .idx dtype codes
// (megatron/core/datasets/indexed_dataset.py DType).
enum class TokenDType : uint8_t {
  U8 = 1,
  I8 = 2,
  I16 = 3,
  I32 = 4,
  I64 = 5,
  F64 = 6,
  F32 = 7,
  U16 = 8
};

// Bytes per token; 0 for a code that is not a TokenDType.
size_t token_dtype_size(TokenDType t);
// numpy name: "uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16".
std::string_view token_dtype_name(TokenDType t);
// Megatron's choice (DType.optimal_dtype): uint16 when vocab_size < 65500, else int32.
TokenDType token_dtype_for_vocab(int64_t vocab_size);

// "<prefix>.bin" and "<prefix>.idx".
std::string data_file_path(const std::string& path_prefix);
std::string index_file_path(const std::string& path_prefix);
// True when both files exist.
bool indexed_dataset_exists(const std::string& path_prefix);

// The .idx layout, little-endian (Megatron-LM _IndexWriter / _IndexReader):
//   char[9] "MMIDIDX\0\0" | u64 version = 1 | u8 dtype code | u64 sequence count S |
//   u64 document-index count D (= documents + 1) | i32[S] sequence lengths (tokens) |
//   i64[S] sequence pointers (byte offsets into .bin) | i64[D] document indices
// (D entries: 0, then after each document the number of sequences so far).
inline constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kIndexVersion = 1;
inline constexpr size_t kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;

// Writes <prefix>.bin and <prefix>.idx. Both are written under temporary names and
// renamed into place by finalize(); destroying the builder without finalize() leaves
// nothing behind. A document is one or more sequences (Megatron's "sentences"); an
// empty document (no sequences) only advances the document index, as in Megatron.
class IndexedDatasetBuilder {
 public:
  // dtype: an integer TokenDType (throws megaton::Error for F32/F64). Throws
  // megaton::Error naming the file when the outputs cannot be created.
  IndexedDatasetBuilder(std::string path_prefix, TokenDType dtype);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  // One document made of one sequence (tokens may be empty: an empty document).
  // Throws megaton::Error when a token does not fit the dtype.
  void add_document(std::span<const int32_t> tokens);
  // One document made of sequence_lengths.size() sequences; the lengths (tokens) must
  // sum to tokens.size().
  void add_document(std::span<const int32_t> tokens, std::span<const int32_t> sequence_lengths);
  // Writes the .idx and renames both files into place (finish_writing, then publish).
  // Call once. On failure nothing is left behind and megaton::Error names the file.
  void finalize();
  // The first half of finalize(): writes the .idx under its temporary name and flushes
  // and closes both temporary files, so that write errors (a full disk) surface before
  // any output is renamed. On failure both temporary files are removed.
  void finish_writing();
  // The second half: renames the .bin, then the .idx, into place. If the .idx cannot be
  // renamed, the new .bin is removed again (no mismatched pair is left) and
  // megaton::Error names the file.
  void publish();
  // Removes the published .bin and .idx: undoes publish() when another output of the same
  // run fails to publish (preprocess writes one dataset per json key, all or none).
  void unpublish() noexcept;

  TokenDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }
  const std::string& path_prefix() const { return path_prefix_; }

 private:
  void write_tokens(std::span<const int32_t> tokens);

  std::string path_prefix_;
  TokenDType dtype_;
  std::unique_ptr<AtomicFile> bin_;
  std::unique_ptr<AtomicFile> idx_;  // from finish_writing() until publish()
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> document_indices_{0};
  std::vector<std::byte> buffer_;
  int64_t num_tokens_ = 0;
  bool finalized_ = false;
};

// Reads <prefix>.idx and memory-maps <prefix>.bin. On open, validates the magic, the
// version, the dtype code, the counts against the .idx length, every sequence length
// and pointer against the .bin length, and the document index; any mismatch throws
// megaton::Error naming the file and what was expected. Read-only and thread-safe.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& path_prefix);

  const std::string& path_prefix() const { return path_prefix_; }
  TokenDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  // Documents = document-index entries - 1.
  int64_t num_documents() const { return num_doc_indices_ - 1; }
  int64_t num_tokens() const { return num_tokens_; }
  // Bytes of the .idx and .bin files (used in cache descriptions).
  uint64_t index_bytes() const { return idx_.size(); }
  uint64_t data_bytes() const { return bin_.size(); }

  // Length in tokens of sequence i, i in [0, num_sequences()).
  int32_t sequence_length(int64_t i) const;
  // Byte offset of sequence i in the .bin.
  int64_t sequence_pointer(int64_t i) const;
  // Document-index entry i, i in [0, num_documents()]: document d spans sequences
  // [document_index(d), document_index(d + 1)).
  int64_t document_index(int64_t i) const;
  // All sequence lengths, copied out of the map (4 bytes per sequence).
  std::vector<int32_t> sequence_lengths() const;

  // Tokens [offset, offset + length) of sequence seq converted to int32 into out[length].
  // length < 0 means to the end of the sequence. Throws InternalError when out of range.
  void get(int64_t seq, int64_t offset, int64_t length, int32_t* out) const;
  std::vector<int32_t> get(int64_t seq, int64_t offset = 0, int64_t length = -1) const;

 private:
  std::string path_prefix_;
  MappedFile idx_;
  MappedFile bin_;
  TokenDType dtype_ = TokenDType::U16;
  int64_t num_sequences_ = 0;
  int64_t num_doc_indices_ = 0;
  int64_t num_tokens_ = 0;
  const std::byte* lengths_ = nullptr;   // i32[S], unaligned in the map
  const std::byte* pointers_ = nullptr;  // i64[S]
  const std::byte* doc_idx_ = nullptr;   // i64[D]
};

}  // namespace megaton::data
