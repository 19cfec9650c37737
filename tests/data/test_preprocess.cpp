// Preprocessing end to end: JSONL and fortune inputs, eod, keys, workers, errors.
#include <gtest/gtest.h>

#include <random>

#include "common/testing.h"
#include "data/indexed_dataset.h"
#include "data/preprocess.h"
#include "data_testing.h"

namespace megaton::data {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::throws_error_with;
using testing::write_text;

// Random documents of printable ASCII, some Unicode, newlines, quotes and backslashes.
std::vector<std::string> random_documents(int count, uint64_t seed) {
  const std::vector<std::string> pieces = {
      "a", "b", "xyz", " ", "\n", "\"", "\\", "é", "\u2603", "\xF0\x9F\x98\x80", "\t", "0", "%"};
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<size_t> piece(0, pieces.size() - 1);
  std::uniform_int_distribution<int> length(0, 30);
  std::vector<std::string> docs(count);
  for (auto& d : docs)
    for (int n = length(gen); n > 0; --n) d += pieces[piece(gen)];
  return docs;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"')
      out += "\\\"";
    else if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else
      out += c;
  }
  return out;
}

std::string to_jsonl(const std::vector<std::string>& docs) {
  std::string out;
  for (const auto& d : docs) out += "{\"id\": 1, \"text\": \"" + json_escape(d) + "\"}\n";
  return out;
}

PreprocessOptions byte_options(const TempDir& dir, std::vector<std::string> inputs,
                               const std::string& out = "out") {
  PreprocessOptions o;
  o.inputs = std::move(inputs);
  o.output_prefix = dir.file(out);
  o.tokenizer_type = "ByteTokenizer";
  return o;
}

TEST(Preprocess, JsonlEndToEnd) {
  const uint64_t seed = megaton::testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TempDir dir;
  auto docs = random_documents(300, seed);
  write_text(dir.file("in.jsonl"), to_jsonl(docs));
  auto result = preprocess(byte_options(dir, {dir.file("in.jsonl")}));
  ASSERT_EQ(result.output_prefixes, std::vector<std::string>{dir.file("out_text_document")});
  EXPECT_EQ(result.totals.documents, 300);

  IndexedDataset ds(dir.file("out_text_document"));
  EXPECT_EQ(ds.dtype(), TokenDType::U16);
  ASSERT_EQ(ds.num_documents(), 300);
  ByteTokenizer bytes;
  int64_t seq = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    const int64_t first = ds.document_index(d), last = ds.document_index(d + 1);
    if (docs[d].empty()) {  // Megatron: an empty document has no sequence, not even eod
      EXPECT_EQ(first, last) << "document " << d;
      continue;
    }
    ASSERT_EQ(last - first, 1) << "document " << d;
    auto tokens = ds.get(seq++);
    ASSERT_EQ(tokens.back(), 256) << "eod appended to document " << d;
    EXPECT_EQ(bytes.decode(tokens), docs[d]) << "document " << d;
    EXPECT_EQ(tokens.size(), docs[d].size() + 1);
  }
  EXPECT_EQ(seq, ds.num_sequences());
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"in.jsonl", "out_text_document.bin",
                                                     "out_text_document.idx"}));
}

TEST(Preprocess, OutputIndependentOfWorkers) {
  const uint64_t seed = megaton::testing::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TempDir dir;
  // Several files and more documents than one chunk (1024), so chunks finish out of order.
  write_text(dir.file("a.jsonl"), to_jsonl(random_documents(2500, seed)));
  write_text(dir.file("b.jsonl"), to_jsonl(random_documents(700, seed + 1)));
  std::vector<std::string> outputs;
  for (int workers : {1, 2, 3}) {
    auto o = byte_options(dir, {dir.file("*.jsonl")}, "w" + std::to_string(workers));
    o.workers = workers;
    auto r = preprocess(o);
    EXPECT_EQ(r.totals.documents, 3200);
    outputs.push_back(r.output_prefixes[0]);
  }
  const std::string bin = read_bytes(outputs[0] + ".bin"), idx = read_bytes(outputs[0] + ".idx");
  ASSERT_GT(bin.size(), 0u);
  for (size_t i = 1; i < outputs.size(); ++i) {
    EXPECT_TRUE(read_bytes(outputs[i] + ".bin") == bin) << outputs[i];
    EXPECT_TRUE(read_bytes(outputs[i] + ".idx") == idx) << outputs[i];
  }
}

TEST(Preprocess, NoAppendEodAndSeveralKeys) {
  TempDir dir;
  write_text(dir.file("in.jsonl"),
             "{\"text\": \"abc\", \"title\": [\"T\", \"\", \"UV\"]}\n"
             "{\"text\": \"\", \"title\": \"W\"}\n");
  auto o = byte_options(dir, {dir.file("in.jsonl")});
  o.json_keys = {"text", "title"};
  o.append_eod = false;
  auto r = preprocess(o);
  ASSERT_EQ(r.output_prefixes.size(), 2u);
  IndexedDataset text(dir.file("out_text_document"));
  EXPECT_EQ(text.num_documents(), 2);
  EXPECT_EQ(text.num_sequences(), 1);
  EXPECT_EQ(text.get(0), (std::vector<int32_t>{'a', 'b', 'c'}));
  IndexedDataset title(dir.file("out_title_document"));
  // A list gives one sequence per non-empty string.
  EXPECT_EQ(title.num_documents(), 2);
  EXPECT_EQ(title.num_sequences(), 3);
  EXPECT_EQ(title.document_index(1), 2);
  EXPECT_EQ(title.get(1), (std::vector<int32_t>{'U', 'V'}));

  o.append_eod = true;
  o.output_prefix = dir.file("eod");
  preprocess(o);
  IndexedDataset title_eod(dir.file("eod_title_document"));
  // eod goes at the end of the document's last sequence.
  EXPECT_EQ(title_eod.get(0), (std::vector<int32_t>{'T'}));
  EXPECT_EQ(title_eod.get(1), (std::vector<int32_t>{'U', 'V', 256}));
}

TEST(Preprocess, FortuneDirectory) {
  TempDir dir;
  std::filesystem::create_directories(dir.path() / "fortunes");
  auto f = [&](const std::string& name) { return (dir.path() / "fortunes" / name).string(); };
  write_text(f("wisdom"), "Look before you leap.\n%\nHe who hesitates\n  is lost.\n%\n");
  write_text(f("wisdom.dat"), std::string("\x00\x00\x00\x02 binary index", 18));
  std::filesystem::create_symlink("wisdom", f("wisdom.u8"));
  write_text(f("latin1"), "Caf\xE9 au lait.\n%\n");
  auto o = byte_options(dir, {f("")});
  o.input_format = InputFormat::Fortune;
  o.workers = 2;
  auto r = preprocess(o);
  EXPECT_EQ(r.input_files, (std::vector<std::string>{f("latin1"), f("wisdom")}));
  EXPECT_EQ(r.totals.replaced_bytes, 1);
  IndexedDataset ds(dir.file("out_text_document"));
  ASSERT_EQ(ds.num_documents(), 3);
  ByteTokenizer bytes;
  EXPECT_EQ(bytes.decode(ds.get(0)), "Caf\xC3\xA9 au lait.");
  EXPECT_EQ(bytes.decode(ds.get(1)), "Look before you leap.");
  EXPECT_EQ(bytes.decode(ds.get(2)), "He who hesitates\n  is lost.");
}

TEST(Preprocess, SystemFortunesIfInstalled) {
  const std::string path = "/usr/share/games/fortunes/fortunes";
  if (!std::filesystem::is_regular_file(path)) GTEST_SKIP() << path << " not installed";
  // Count the documents independently: non-blank runs of lines between "%" lines.
  std::string text = read_bytes(path);
  int64_t expected = 0;
  bool content = false;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (line == "%") {
      expected += content;
      content = false;
    } else if (line.find_first_not_of(" \t\r") != std::string::npos) {
      content = true;
    }
    start = end + 1;
  }
  expected += content;
  TempDir dir;
  auto o = byte_options(dir, {path});
  o.input_format = InputFormat::Fortune;
  auto r = preprocess(o);
  EXPECT_EQ(r.totals.documents, expected);
  IndexedDataset ds(dir.file("out_text_document"));
  EXPECT_EQ(ds.num_sequences(), expected);
}

TEST(Preprocess, SentencePieceTokenizer) {
  TempDir dir;
  auto sentences = testing::random_sentences(400, megaton::testing::test_seed());
  std::string corpus;
  for (const auto& sentence : sentences) corpus += "{\"text\": \"" + sentence + "\"}\n";
  write_text(dir.file("c.jsonl"), corpus);
  SentencePieceTrainOptions t;
  t.num_threads = 1;
  train_sentencepiece({dir.file("c.jsonl")}, 300, dir.file("spm"), t);
  auto tok = make_tokenizer("SentencePieceTokenizer", dir.file("spm.model"));
  std::vector<std::string> prefixes;
  for (int workers : {1, 2}) {
    PreprocessOptions o;
    o.inputs = {dir.file("c.jsonl")};
    o.output_prefix = dir.file("sp" + std::to_string(workers));
    o.tokenizer_type = "SentencePieceTokenizer";
    o.tokenizer_model = dir.file("spm.model");
    o.workers = workers;
    prefixes.push_back(preprocess(o).output_prefixes[0]);
  }
  EXPECT_TRUE(read_bytes(prefixes[0] + ".bin") == read_bytes(prefixes[1] + ".bin"));
  EXPECT_TRUE(read_bytes(prefixes[0] + ".idx") == read_bytes(prefixes[1] + ".idx"));
  IndexedDataset ds(prefixes[0]);
  ASSERT_EQ(ds.num_sequences(), 400);
  auto tokens = ds.get(5);
  EXPECT_EQ(tokens.back(), tok->eod());
  EXPECT_EQ(tok->decode(tokens), sentences[5]);
}

TEST(Preprocess, ErrorsLeaveNothingBehind) {
  TempDir dir;
  write_text(dir.file("bad.jsonl"),
             "{\"text\": \"fine\"}\n{\"text\": \"fine\"}\n{\"txt\": \"oops\"}\n");
  EXPECT_TRUE(throws_error_with([&] { preprocess(byte_options(dir, {dir.file("bad.jsonl")})); },
                                {"bad.jsonl:3", "'text'"}));
  write_text(dir.file("broken.jsonl"), "{\"text\": \"fine\"}\n{\"text\": \n");
  auto o = byte_options(dir, {dir.file("broken.jsonl")});
  o.workers = 2;
  EXPECT_TRUE(throws_error_with([&] { preprocess(o); }, {"broken.jsonl:2", "JSON"}));
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"bad.jsonl", "broken.jsonl"}));

  EXPECT_TRUE(throws_error_with([&] { preprocess(byte_options(dir, {dir.file("none.jsonl")})); },
                                {"none.jsonl"}));
  auto bad_workers = byte_options(dir, {dir.file("bad.jsonl")});
  bad_workers.workers = 0;
  EXPECT_TRUE(throws_error_with([&] { preprocess(bad_workers); }, {"--workers", "0"}));
  auto two_keys_text = byte_options(dir, {dir.file("bad.jsonl")});
  two_keys_text.input_format = InputFormat::Text;
  two_keys_text.json_keys = {"a", "b"};
  EXPECT_TRUE(throws_error_with([&] { preprocess(two_keys_text); }, {"--json-keys"}));
  auto bad_tok = byte_options(dir, {dir.file("bad.jsonl")});
  bad_tok.tokenizer_type = "Nope";
  EXPECT_TRUE(throws_error_with([&] { preprocess(bad_tok); }, {"--tokenizer-type", "Nope"}));
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"bad.jsonl", "broken.jsonl"}));
}

// Megatron's HuggingFaceTokenizer in preprocessing: each document is
// tokenizer(text).input_ids (Llama-3's <|begin_of_text|> first) then eod, as
// preprocess_data.py writes it; --tokenizer-hf-no-include-special-tokens drops the prefix.
TEST(Preprocess, HuggingFaceTokenizerDocuments) {
  const std::string model = std::string(MEGATON_SOURCE_DIR) + "/tests/golden/tokenizers/llama3";
  TempDir dir;
  const std::vector<std::string> docs = {"Hello world", "It's 2026; we'll train 1,234 models!",
                                         "caf\u00e9 \u65e5\u672c"};
  write_text(dir.file("in.jsonl"), to_jsonl(docs));
  for (bool include : {true, false}) {
    SCOPED_TRACE(include);
    PreprocessOptions o = byte_options(dir, {dir.file("in.jsonl")}, include ? "with" : "without");
    o.tokenizer_type = "HuggingFaceTokenizer";
    o.tokenizer_model = model;
    o.tokenizer_hf_include_special_tokens = include;
    auto result = preprocess(o);
    IndexedDataset ds(result.output_prefixes.at(0));
    TokenizerOptions t;
    t.type = "HuggingFaceTokenizer";
    t.model = model;
    t.include_special_tokens = include;
    auto tok = make_tokenizer(t);
    ASSERT_EQ(ds.num_sequences(), int64_t(docs.size()));
    for (size_t d = 0; d < docs.size(); ++d) {
      std::vector<int32_t> want = tok->encode(docs[d]);
      want.push_back(tok->eod());
      auto got = ds.get(int64_t(d));
      EXPECT_EQ(std::vector<int32_t>(got.begin(), got.end()), want) << "document " << d;
      EXPECT_EQ(got.front() == 0, include) << "<|begin_of_text|> is id 0 in the golden vocab";
    }
  }
}

}  // namespace
}  // namespace megaton::data
