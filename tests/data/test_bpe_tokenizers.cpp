// Byte-level BPE tokenizers against Hugging Face tokenizers: the golden files of
// tools/make_tokenizer_golden.py (GPT-2, Llama-3 and Qwen2 pre-tokenizers), GPT-2's
// vocab.json + merges.txt, the byte symbols, and bad files.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/testing.h"
#include "data/bpe_tokenizers.h"
#include "data/byte_level_bpe.h"
#include "data/tokenizer.h"
#include "data_testing.h"

namespace megaton::data {
namespace {

using testing::TempDir;
using testing::throws_error_with;
using testing::write_text;

const std::string kGoldenDir = std::string(MEGATON_SOURCE_DIR) + "/tests/golden/tokenizers/";

nlohmann::json read_golden(const std::string& file) {
  std::ifstream in(kGoldenDir + file);
  EXPECT_TRUE(in.good()) << kGoldenDir + file;
  return nlohmann::json::parse(in);
}

// Whether `text` decodes back from its ids unchanged: no special token in it to drop and
// no character NFC would change.
bool round_trips(const std::string& text) {
  return text.find("<|") == std::string::npos && text.find("decomposed") == std::string::npos;
}

void check_family(const std::string& family) {
  SCOPED_TRACE(family);
  const nlohmann::json golden = read_golden(family + "/golden.json");
  TokenizerOptions options;
  options.type = "HuggingFaceTokenizer";
  options.model = kGoldenDir + family;
  auto tok = make_tokenizer(options);
  auto plain = make_huggingface_tokenizer(kGoldenDir + family + "/tokenizer.json", false);
  EXPECT_EQ(tok->eod(), golden.at("eos_id").get<int32_t>());
  EXPECT_EQ(tok->vocab_size(), golden.at("vocab_size").get<int64_t>());
  ASSERT_GE(golden.at("cases").size(), 10u);
  for (const auto& c : golden.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    SCOPED_TRACE(text);
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    const auto want_plain = c.at("ids_no_special").get<std::vector<int32_t>>();
    EXPECT_EQ(tok->encode(text), want);
    const auto ids = plain->encode(text);
    EXPECT_EQ(ids, want_plain);
    if (round_trips(text)) {
      EXPECT_EQ(plain->decode(ids), text);
    }
  }
}

TEST(HuggingFaceTokenizer, Gpt2MatchesTokenizers) { check_family("gpt2"); }
TEST(HuggingFaceTokenizer, Llama3MatchesTokenizers) { check_family("llama3"); }
TEST(HuggingFaceTokenizer, Qwen2MatchesTokenizers) { check_family("qwen2"); }

TEST(HuggingFaceTokenizer, Llama3TemplateAddsBeginOfText) {
  auto tok = make_huggingface_tokenizer(kGoldenDir + "llama3");
  auto plain = make_huggingface_tokenizer(kGoldenDir + "llama3", false);
  const auto with = tok->encode("Hello world"), without = plain->encode("Hello world");
  ASSERT_EQ(with.size(), without.size() + 1);
  EXPECT_EQ(std::vector<int32_t>(with.begin() + 1, with.end()), without);
  EXPECT_EQ(tok->decode({with.data(), 1}), "") << "<|begin_of_text|> is special";
}

TEST(Gpt2BpeTokenizer, VocabAndMergesMatchTokenizers) {
  TokenizerOptions options;
  options.type = "GPT2BPETokenizer";
  options.vocab_file = kGoldenDir + "gpt2/vocab.json";
  options.merge_file = kGoldenDir + "gpt2/merges.txt";
  auto tok = make_tokenizer(options);
  const nlohmann::json golden = read_golden("gpt2/golden_vocab_merges.json");
  const nlohmann::json vocab = read_golden("gpt2/vocab.json");
  EXPECT_EQ(tok->vocab_size(), int64_t(vocab.size()));
  EXPECT_EQ(tok->eod(), vocab.at("<|endoftext|>").get<int32_t>());
  for (const auto& c : golden.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    SCOPED_TRACE(text);
    const auto ids = tok->encode(text);
    EXPECT_EQ(ids, c.at("ids").get<std::vector<int32_t>>());
    EXPECT_EQ(tok->decode(ids), text) << "GPT-2's encoder does not look for special tokens";
  }
}

TEST(ByteLevelBpe, ByteSymbolsAreGpt2s) {
  // GPT-2's bytes_to_unicode: printable Latin-1 maps to itself, space to U+0120 'Ġ',
  // newline to U+010A 'Ċ', 0x00 to U+0100 'Ā', 0xAD (soft hyphen) to U+0143 'Ń'.
  EXPECT_EQ(byte_symbol('a'), "a");
  EXPECT_EQ(byte_symbol(0xE9), "\u00e9");
  EXPECT_EQ(byte_symbol(' '), "\u0120");
  EXPECT_EQ(byte_symbol('\n'), "\u010a");
  EXPECT_EQ(byte_symbol(0x00), "\u0100");
  EXPECT_EQ(byte_symbol(0xAD), "\u0143");
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(char(b));
  std::string back;
  ASSERT_TRUE(symbols_to_bytes(bytes_to_symbols(all), back));
  EXPECT_EQ(back, all);
  std::string junk;
  EXPECT_FALSE(symbols_to_bytes("\u4e2d", junk)) << "not a byte symbol";
}

TEST(ByteLevelBpe, MergesLowestRankFirst) {
  // Ranks: "b c" before "a b", so "abc" -> a + bc, never ab + c.
  BpeModel bpe({{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}},
               {{"b", "c"}, {"a", "b"}, {"a", "bc"}}, false, "test");
  std::vector<int32_t> ids;
  bpe.encode("abc", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{5}));
  ids.clear();
  bpe.encode("abab", ids);  // leftmost on ties
  EXPECT_EQ(ids, (std::vector<int32_t>{3, 3}));
  ids.clear();
  bpe.encode("cba", ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{2, 1, 0}));
  EXPECT_TRUE(throws_error_with([&] { bpe.encode("abd", ids); }, {"'d'", "not in the vocabulary"}));
  EXPECT_TRUE(throws_error_with(
      [] { BpeModel({{"a", 0}}, {{"a", "z"}}, false, "vocab.json"); }, {"vocab.json", "merge 0"}));
}

TEST(HuggingFaceTokenizer, BadFilesNameTheProblem) {
  TempDir dir;
  EXPECT_TRUE(throws_error_with([&] { make_huggingface_tokenizer(dir.file("none")); },
                                {"cannot open"}));
  // An unsupported component: a Lowercase normalizer.
  std::ifstream in(kGoldenDir + "gpt2/tokenizer.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["normalizer"] = {{"type", "Lowercase"}};
  write_text(dir.file("tokenizer.json"), j.dump());
  EXPECT_TRUE(throws_error_with([&] { make_huggingface_tokenizer(dir.path().string()); },
                                {"normalizer", "Lowercase"}));
  j["normalizer"] = nullptr;
  j["model"]["type"] = "WordPiece";
  write_text(dir.file("tokenizer.json"), j.dump());
  EXPECT_TRUE(throws_error_with([&] { make_huggingface_tokenizer(dir.path().string()); },
                                {"model", "WordPiece"}));
  j["model"]["type"] = "BPE";
  write_text(dir.file("tokenizer.json"), j.dump());
  EXPECT_TRUE(throws_error_with([&] { make_huggingface_tokenizer(dir.path().string()); },
                                {"tokenizer_config.json", "eos_token"}));
  write_text(dir.file("tokenizer_config.json"), R"({"eos_token": "<|nope|>"})");
  EXPECT_TRUE(throws_error_with([&] { make_huggingface_tokenizer(dir.path().string()); }, {"<|nope|>"}));
  EXPECT_TRUE(throws_error_with([] { make_gpt2_bpe_tokenizer("", ""); }, {"--vocab-file", "--merge-file"}));
  write_text(dir.file("merges.txt"), "#version: 0.2\na b c\n");
  EXPECT_TRUE(throws_error_with(
      [&] { make_gpt2_bpe_tokenizer(kGoldenDir + "gpt2/vocab.json", dir.file("merges.txt")); },
      {"line 2"}));
}

}  // namespace
}  // namespace megaton::data
