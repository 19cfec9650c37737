// Document sources: UTF-8 repair, readers per format, input expansion, JSONL fields.
#include <gtest/gtest.h>

#include "data/documents.h"
#include "data_testing.h"

namespace megaton::data {
namespace {

using testing::TempDir;
using testing::throws_error_with;
using testing::write_text;

std::vector<SourceDocument> read_all(const std::string& path, InputFormat format) {
  DocumentReader reader(path, format);
  std::vector<SourceDocument> docs;
  SourceDocument doc;
  while (reader.next(doc)) docs.push_back(doc);
  return docs;
}

std::vector<std::string> texts_of(const std::vector<SourceDocument>& docs) {
  std::vector<std::string> out;
  for (const auto& d : docs) out.push_back(d.text);
  return out;
}

TEST(RepairUtf8, ValidTextUnchanged) {
  std::string s = "plain ascii, é, \u2603, \xF0\x9F\x98\x80";
  std::string copy = s;
  EXPECT_EQ(repair_utf8(s), 0);
  EXPECT_EQ(s, copy);
}

TEST(RepairUtf8, InvalidBytesReadAsLatin1) {
  std::string s = "caf\xE9 ok";  // Latin-1 é
  EXPECT_EQ(repair_utf8(s), 1);
  EXPECT_EQ(s, "caf\xC3\xA9 ok");
  std::string overlong = "\xC0\x80";  // overlong NUL: both bytes invalid
  EXPECT_EQ(repair_utf8(overlong), 2);
  EXPECT_EQ(overlong, "\xC3\x80\xC2\x80");
  std::string surrogate = "\xED\xA0\x80";  // UTF-16 surrogate half
  EXPECT_EQ(repair_utf8(surrogate), 3);
  std::string cut = "ab\xE2\x98";  // truncated 3-byte sequence at the end
  EXPECT_EQ(repair_utf8(cut), 2);
  EXPECT_EQ(cut, "ab\xC3\xA2\xC2\x98");
  std::string again = cut;
  EXPECT_EQ(repair_utf8(again), 0) << "repaired text is valid UTF-8";
}

TEST(DocumentReader, FortuneFormat) {
  TempDir dir;
  write_text(dir.file("f"),
             "first line\nsecond line\n%\n\n%\n  \n%\r\nthird\r\n%\nlast, no trailing %\n");
  auto docs = read_all(dir.file("f"), InputFormat::Fortune);
  EXPECT_EQ(texts_of(docs),
            (std::vector<std::string>{"first line\nsecond line", "third", "last, no trailing %"}));
  EXPECT_EQ(docs[0].line, 1);
  EXPECT_EQ(docs[1].line, 8);
  EXPECT_EQ(docs[2].line, 10);
}

TEST(DocumentReader, TextLinesAndJsonl) {
  TempDir dir;
  write_text(dir.file("a.txt"), "one\n\ntwo\n");
  EXPECT_EQ(texts_of(read_all(dir.file("a.txt"), InputFormat::Text)),
            (std::vector<std::string>{"one\n\ntwo\n"}));
  EXPECT_EQ(texts_of(read_all(dir.file("a.txt"), InputFormat::Lines)),
            (std::vector<std::string>{"one", "two"}));
  write_text(dir.file("empty.txt"), "");
  EXPECT_TRUE(read_all(dir.file("empty.txt"), InputFormat::Text).empty());
  write_text(dir.file("d.jsonl"), "{\"text\": \"a\"}\n\n{\"text\": \"b\"}");
  auto docs = read_all(dir.file("d.jsonl"), InputFormat::Jsonl);
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[1].line, 3);
}

TEST(InputFormat, ParseAndResolve) {
  EXPECT_EQ(parse_input_format("fortune"), InputFormat::Fortune);
  EXPECT_TRUE(
      throws_error_with([] { parse_input_format("csv"); }, {"--input-format", "csv", "jsonl"}));
  EXPECT_EQ(resolve_input_format(InputFormat::Auto, "x/data.jsonl"), InputFormat::Jsonl);
  EXPECT_EQ(resolve_input_format(InputFormat::Auto, "x/data.JSON"), InputFormat::Jsonl);
  EXPECT_EQ(resolve_input_format(InputFormat::Auto, "x/cookie"), InputFormat::Text);
  EXPECT_EQ(resolve_input_format(InputFormat::Fortune, "x/a.jsonl"), InputFormat::Fortune);
}

TEST(ExpandInputs, DirectoryRulesGlobsAndErrors) {
  TempDir dir;
  std::filesystem::create_directories(dir.path() / "fortunes" / "off");
  auto f = [&](const std::string& name) { return (dir.path() / "fortunes" / name).string(); };
  write_text(f("zen"), "a\n%\n");
  write_text(f("art"), "b\n%\n");
  write_text(f("art.dat"), "index");
  write_text(f(".hidden"), "x");
  write_text(f("off/rude"), "c\n%\n");
  std::filesystem::create_symlink("art", f("art.u8"));
  std::filesystem::create_symlink("zen", f("zen-link"));
  EXPECT_EQ(document_files_in_directory(f("")), (std::vector<std::string>{f("art"), f("zen")}));
  EXPECT_EQ(expand_inputs({f(""), f("off/rude")}),
            (std::vector<std::string>{f("art"), f("zen"), f("off/rude")}));
  EXPECT_EQ(expand_inputs({f("*")}), (std::vector<std::string>{f("art"), f("zen")}));
  EXPECT_EQ(expand_inputs({f("art.u8")}), (std::vector<std::string>{f("art.u8")}))
      << "a file named explicitly is taken as given";
  EXPECT_TRUE(throws_error_with([&] { expand_inputs({f("missing")}); }, {"--input", "missing"}));
  EXPECT_TRUE(throws_error_with([&] { expand_inputs({f("*.jsonl")}); }, {"*.jsonl", "matches no"}));
  std::filesystem::create_directories(dir.path() / "empty");
  EXPECT_TRUE(throws_error_with([&] { expand_inputs({(dir.path() / "empty").string()}); },
                                {"empty", "no document files"}));
}

TEST(DocumentTexts, JsonlKeysListsAndErrors) {
  SourceDocument doc{R"({"text": "hello", "title": ["a", "b"], "n": 3})", 7};
  auto texts =
      document_texts(SourceDocument(doc), InputFormat::Jsonl, {"text", "title"}, "in.jsonl");
  EXPECT_EQ(texts, (std::vector<std::vector<std::string>>{{"hello"}, {"a", "b"}}));
  EXPECT_TRUE(throws_error_with(
      [&] { document_texts(SourceDocument(doc), InputFormat::Jsonl, {"body"}, "in.jsonl"); },
      {"in.jsonl:7", "'body'", "missing"}));
  EXPECT_TRUE(throws_error_with(
      [&] { document_texts(SourceDocument(doc), InputFormat::Jsonl, {"n"}, "in.jsonl"); },
      {"in.jsonl:7", "'n'", "number"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        document_texts(SourceDocument{"{\"text\": ", 2}, InputFormat::Jsonl, {"text"}, "in.jsonl");
      },
      {"in.jsonl:2", "not a JSON line"}));
  EXPECT_TRUE(throws_error_with(
      [&] {
        document_texts(SourceDocument{"[1, 2]", 4}, InputFormat::Jsonl, {"text"}, "in.jsonl");
      },
      {"in.jsonl:4", "JSON object"}));
  // Raw Latin-1 inside a JSON string is repaired before parsing.
  int64_t replaced = 0;
  auto latin = document_texts(SourceDocument{"{\"text\": \"caf\xE9\"}", 1}, InputFormat::Jsonl,
                              {"text"}, "in.jsonl", &replaced);
  EXPECT_EQ(latin[0][0], "caf\xC3\xA9");
  EXPECT_EQ(replaced, 1);
  auto plain = document_texts(SourceDocument{"a\nb", 1}, InputFormat::Fortune, {"text"}, "f");
  EXPECT_EQ(plain, (std::vector<std::vector<std::string>>{{"a\nb"}}));
}

}  // namespace
}  // namespace megaton::data
