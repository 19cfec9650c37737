// Indexed dataset: byte layout of .idx/.bin, round trips, validation of bad files.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "common/testing.h"
#include "data/indexed_dataset.h"
#include "data_testing.h"

namespace megaton::data {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::throws_error_with;
using testing::write_text;

// Little-endian bytes of v, written out by hand so the test does not share the writer's code.
template <typename T>
void append_le(std::string& out, T v) {
  uint64_t u = static_cast<uint64_t>(v);
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xFF));
}

TEST(IndexedDataset, IdxAndBinBytesMatchMegatronLayout) {
  TempDir dir;
  const std::string prefix = dir.file("ds");
  IndexedDatasetBuilder builder(prefix, TokenDType::U16);
  std::vector<int32_t> doc0 = {7, 300, 65535};
  std::vector<int32_t> doc1 = {1, 2, 513};  // two sequences: 2 + 1 tokens
  std::vector<int32_t> doc1_lengths = {2, 1};
  builder.add_document(doc0);
  builder.add_document(doc1, doc1_lengths);
  builder.add_document(std::span<const int32_t>{});  // empty document: no sequence
  builder.finalize();

  std::string idx;
  idx.append("MMIDIDX\0\0", 9);
  append_le<uint64_t>(idx, 1);  // version
  append_le<uint8_t>(idx, 8);   // uint16
  append_le<uint64_t>(idx, 3);  // sequences
  append_le<uint64_t>(idx, 4);  // document index entries = documents + 1
  for (int32_t len : {3, 2, 1}) append_le<int32_t>(idx, len);
  for (int64_t ptr : {0, 6, 10}) append_le<int64_t>(idx, ptr);  // bytes
  for (int64_t d : {0, 1, 3, 3}) append_le<int64_t>(idx, d);
  EXPECT_EQ(read_bytes(prefix + ".idx"), idx);

  std::string bin;
  for (int32_t t : {7, 300, 65535, 1, 2, 513}) append_le<uint16_t>(bin, static_cast<uint16_t>(t));
  EXPECT_EQ(read_bytes(prefix + ".bin"), bin);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"ds.bin", "ds.idx"}));
}

TEST(IndexedDataset, DtypeFollowsVocabularySize) {
  EXPECT_EQ(token_dtype_for_vocab(257), TokenDType::U16);
  EXPECT_EQ(token_dtype_for_vocab(65499), TokenDType::U16);
  EXPECT_EQ(token_dtype_for_vocab(65500), TokenDType::I32);
  EXPECT_EQ(token_dtype_for_vocab(128256), TokenDType::I32);

  TempDir dir;
  const std::string prefix = dir.file("big");
  IndexedDatasetBuilder builder(prefix, TokenDType::I32);
  std::vector<int32_t> doc = {100000, 0, 128255};
  builder.add_document(doc);
  builder.finalize();
  std::string idx = read_bytes(prefix + ".idx");
  ASSERT_GE(idx.size(), 18u);
  EXPECT_EQ(static_cast<uint8_t>(idx[17]), 4);  // int32 code
  EXPECT_EQ(read_bytes(prefix + ".bin").size(), 12u);
  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.dtype(), TokenDType::I32);
  EXPECT_EQ(ds.get(0), doc);
}

TEST(IndexedDataset, RoundTripRandomDocuments) {
  const uint64_t seed = megaton::testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  for (TokenDType dtype : {TokenDType::U16, TokenDType::I32}) {
    TempDir dir;
    const std::string prefix = dir.file("rt");
    const int32_t vocab = dtype == TokenDType::U16 ? 65500 : 200000;
    std::uniform_int_distribution<int32_t> token(0, vocab - 1);
    std::uniform_int_distribution<int> num_seq(0, 3), seq_len(1, 40);
    std::vector<std::vector<int32_t>> sequences;
    std::vector<int64_t> doc_index = {0};
    {
      IndexedDatasetBuilder builder(prefix, dtype);
      for (int d = 0; d < 200; ++d) {
        std::vector<int32_t> tokens, lengths;
        for (int s = num_seq(gen); s > 0; --s) {
          std::vector<int32_t> seq(seq_len(gen));
          for (auto& t : seq) t = token(gen);
          tokens.insert(tokens.end(), seq.begin(), seq.end());
          lengths.push_back(static_cast<int32_t>(seq.size()));
          sequences.push_back(std::move(seq));
        }
        builder.add_document(tokens, lengths);
        doc_index.push_back(static_cast<int64_t>(sequences.size()));
      }
      EXPECT_EQ(builder.num_documents(), 200);
      builder.finalize();
    }
    IndexedDataset ds(prefix);
    ASSERT_EQ(ds.num_sequences(), static_cast<int64_t>(sequences.size()));
    ASSERT_EQ(ds.num_documents(), 200);
    int64_t pointer = 0, tokens = 0;
    const int64_t item = dtype == TokenDType::U16 ? 2 : 4;
    for (size_t i = 0; i < sequences.size(); ++i) {
      ASSERT_EQ(ds.sequence_length(i), static_cast<int32_t>(sequences[i].size()));
      ASSERT_EQ(ds.sequence_pointer(i), pointer);
      ASSERT_EQ(ds.get(i), sequences[i]) << "sequence " << i;
      pointer += item * sequences[i].size();
      tokens += sequences[i].size();
    }
    for (size_t d = 0; d < doc_index.size(); ++d) ASSERT_EQ(ds.document_index(d), doc_index[d]);
    EXPECT_EQ(ds.num_tokens(), tokens);
    // Partial reads.
    std::uniform_int_distribution<size_t> pick(0, sequences.size() - 1);
    for (int k = 0; k < 100; ++k) {
      size_t i = pick(gen);
      const auto& s = sequences[i];
      int64_t off = std::uniform_int_distribution<int64_t>(0, s.size())(gen);
      int64_t len = std::uniform_int_distribution<int64_t>(0, s.size() - off)(gen);
      std::vector<int32_t> out(len + 1, -7);  // poison, and one guard element
      ds.get(i, off, len, out.data());
      for (int64_t j = 0; j < len; ++j) ASSERT_EQ(out[j], s[off + j]);
      ASSERT_EQ(out[len], -7) << "wrote past the requested length";
    }
  }
}

TEST(IndexedDataset, TokenOutsideDtypeIsAnError) {
  TempDir dir;
  IndexedDatasetBuilder builder(dir.file("x"), TokenDType::U16);
  std::vector<int32_t> doc = {1, 70000};
  EXPECT_TRUE(throws_error_with([&] { builder.add_document(doc); }, {"x.bin", "70000", "uint16"}));
}

TEST(IndexedDataset, UnfinishedBuilderLeavesNothing) {
  TempDir dir;
  {
    IndexedDatasetBuilder builder(dir.file("x"), TokenDType::U16);
    std::vector<int32_t> doc = {1, 2, 3};
    builder.add_document(doc);
  }
  EXPECT_TRUE(dir.entries().empty());
}

class BadIndexedDataset : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_.file("good");
    IndexedDatasetBuilder builder(prefix_, TokenDType::U16);
    std::vector<int32_t> doc = {5, 6, 7, 8};
    builder.add_document(doc);
    builder.add_document(doc);
    builder.finalize();
    idx_ = read_bytes(prefix_ + ".idx");
    bin_ = read_bytes(prefix_ + ".bin");
  }
  // Writes a copy named `name` with the given .idx and .bin contents.
  std::string variant(const std::string& name, const std::string& idx, const std::string& bin) {
    std::string p = dir_.file(name);
    write_text(p + ".idx", idx);
    write_text(p + ".bin", bin);
    return p;
  }
  TempDir dir_;
  std::string prefix_, idx_, bin_;
};

TEST_F(BadIndexedDataset, MissingIdx) {
  std::string p = dir_.file("absent");
  write_text(p + ".bin", bin_);
  EXPECT_TRUE(throws_error_with([&] { IndexedDataset ds(p); }, {"absent.idx"}));
}

TEST_F(BadIndexedDataset, MissingBin) {
  std::string p = dir_.file("nobin");
  write_text(p + ".idx", idx_);
  EXPECT_TRUE(throws_error_with([&] { IndexedDataset ds(p); }, {"nobin.bin"}));
}

TEST_F(BadIndexedDataset, WrongMagic) {
  std::string idx = idx_;
  idx[0] = 'X';
  std::string p = variant("magic", idx, bin_);
  EXPECT_TRUE(throws_error_with([&] { IndexedDataset ds(p); }, {"magic.idx", "magic"}));
}

TEST_F(BadIndexedDataset, WrongVersion) {
  std::string idx = idx_;
  idx[9] = 2;
  std::string p = variant("version", idx, bin_);
  EXPECT_TRUE(throws_error_with([&] { IndexedDataset ds(p); }, {"version.idx", "version 2"}));
}

TEST_F(BadIndexedDataset, UnknownDtypeCode) {
  std::string idx = idx_;
  idx[17] = 42;
  std::string p = variant("dtype", idx, bin_);
  EXPECT_TRUE(throws_error_with([&] { IndexedDataset ds(p); }, {"dtype.idx", "42"}));
}

TEST_F(BadIndexedDataset, TruncatedIdx) {
  std::string p = variant("trunc", idx_.substr(0, idx_.size() - 3), bin_);
  EXPECT_TRUE(throws_error_with([&] { IndexedDataset ds(p); }, {"trunc.idx", "truncated"}));
  std::string q = variant("header", idx_.substr(0, 20), bin_);
  EXPECT_TRUE(throws_error_with([&] { IndexedDataset ds(q); }, {"header.idx", "truncated"}));
}

TEST_F(BadIndexedDataset, TruncatedBin) {
  std::string p = variant("shortbin", idx_, bin_.substr(0, bin_.size() - 2));
  EXPECT_TRUE(throws_error_with([&] { IndexedDataset ds(p); }, {"shortbin", "truncated"}));
}

TEST_F(BadIndexedDataset, GoodOneOpens) {
  IndexedDataset ds(prefix_);
  EXPECT_EQ(ds.num_sequences(), 2);
  EXPECT_EQ(ds.get(1, 1, 2), (std::vector<int32_t>{6, 7}));
}

}  // namespace
}  // namespace megaton::data
