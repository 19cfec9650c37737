// Tokenizers: byte tokenizer, SentencePiece training and encode/decode round trips.
#include <gtest/gtest.h>

#include <random>

#include "common/testing.h"
#include "data/tokenizer.h"
#include "data_testing.h"

namespace megaton::data {
namespace {

using testing::TempDir;
using testing::throws_error_with;
using testing::write_text;

TEST(ByteTokenizer, RoundTripAndSpecials) {
  auto tok = make_tokenizer("ByteTokenizer", "");
  EXPECT_EQ(tok->vocab_size(), 257);
  EXPECT_EQ(tok->eod(), 256);
  std::string text = "héllo\n\tworld \xF0\x9F\x98\x80";
  auto ids = tok->encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[1], 0xC3);  // first byte of é
  EXPECT_EQ(tok->decode(ids), text);
  ids.push_back(tok->eod());
  EXPECT_EQ(tok->decode(ids), text) << "eod decodes to nothing";
  std::vector<int32_t> bad = {65, 257};
  EXPECT_TRUE(throws_error_with([&] { tok->decode(bad); }, {"257"}));
}

TEST(MakeTokenizer, UnknownTypeListsValidOnes) {
  EXPECT_TRUE(throws_error_with([] { make_tokenizer("BertWordPieceCase", ""); },
                                {"BertWordPieceCase", "SentencePieceTokenizer", "HuggingFaceTokenizer",
                                 "GPT2BPETokenizer", "ByteTokenizer"}));
}

TEST(MakeTokenizer, MissingSentencePieceModel) {
  EXPECT_TRUE(
      throws_error_with([] { make_tokenizer("SentencePieceTokenizer", "/nonexistent/tok.model"); },
                        {"/nonexistent/tok.model"}));
}

// A small corpus in the fortune format: documents of 1-3 lines.
std::string make_corpus(uint64_t seed, int documents) {
  auto sentences = testing::random_sentences(3 * documents, seed);
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> lines(1, 3);
  std::string corpus;
  size_t next = 0;
  for (int d = 0; d < documents; ++d) {
    for (int l = lines(gen); l > 0; --l) corpus += sentences[next++] + "\n";
    corpus += "%\n";
  }
  return corpus;
}

TEST(SentencePiece, TrainEncodeDecodeRoundTrip) {
  const uint64_t seed = megaton::testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TempDir dir;
  write_text(dir.file("corpus"), make_corpus(seed, 600));
  SentencePieceTrainOptions options;
  options.input_format = InputFormat::Fortune;
  options.num_threads = 1;
  train_sentencepiece({dir.file("corpus")}, 300, dir.file("spm"), options);
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"corpus", "spm.model", "spm.vocab"}));

  auto tok = make_tokenizer("SentencePieceTokenizer", dir.file("spm.model"));
  EXPECT_EQ(tok->vocab_size(), 300);
  EXPECT_EQ(tok->eod(), 2);  // the model's eos
  // In-domain text takes fewer tokens than characters: pieces longer than one byte.
  std::string text = "the quick brown fox jumps over the lazy dog";
  auto ids = tok->encode(text);
  EXPECT_LT(ids.size(), text.size());
  EXPECT_EQ(tok->decode(ids), text);
  // Byte fallback: characters never seen in training, newlines, repeated spaces.
  for (std::string s : {"Zürich  \u2603 \xF0\x9F\x98\x80", "line one\nline two\n\n  indented",
                        "  leading and trailing  ", "12345 digits 3.14"}) {
    auto t = tok->encode(s);
    for (int32_t id : t) ASSERT_TRUE(id >= 0 && id < tok->vocab_size());
    EXPECT_EQ(tok->decode(t), s);
  }
  // The GPT alias loads the same model.
  auto alias = make_tokenizer("GPTSentencePieceTokenizer", dir.file("spm.model"));
  EXPECT_EQ(alias->encode(text), ids);
}

TEST(SentencePiece, TrainingErrors) {
  TempDir dir;
  write_text(dir.file("corpus.txt"), "a b c\n");
  EXPECT_TRUE(
      throws_error_with([&] { train_sentencepiece({dir.file("corpus.txt")}, 100, dir.file("m")); },
                        {"--vocab-size", "100"}));
  EXPECT_TRUE(throws_error_with(
      [&] { train_sentencepiece({dir.file("nope.txt")}, 300, dir.file("m")); }, {"nope.txt"}));
  SentencePieceTrainOptions bpe_typo;
  bpe_typo.model_type = "bpee";
  EXPECT_TRUE(throws_error_with(
      [&] { train_sentencepiece({dir.file("corpus.txt")}, 300, dir.file("m"), bpe_typo); },
      {"--model-type", "bpee"}));
  write_text(dir.file("blank.txt"), "\n  \n");
  EXPECT_TRUE(
      throws_error_with([&] { train_sentencepiece({dir.file("blank.txt")}, 300, dir.file("m")); },
                        {"no non-blank text"}));
  EXPECT_TRUE(throws_error_with(
      [&] { train_sentencepiece({dir.file("corpus.txt")}, 300, dir.file("nodir/m")); }, {"nodir"}));
  // A vocabulary the corpus cannot fill: SentencePiece's message, nothing written.
  EXPECT_TRUE(
      throws_error_with([&] { train_sentencepiece({dir.file("corpus.txt")}, 5000, dir.file("m")); },
                        {"SentencePiece training failed"}));
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"blank.txt", "corpus.txt"}));
}

}  // namespace
}  // namespace megaton::data
