// Document sources for preprocessing and tokenizer training: input expansion, readers
// for JSONL, plain text, one-document-per-line and fortune files, UTF-8 repair.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace megaton::data {

// How an input file is cut into documents (--input-format).
//   Jsonl:   one JSON object per line; the document's text is the value of each
//            --json-keys key (a string, or a list of strings = several sequences).
//            Blank lines are skipped.
//   Text:    the whole file is one document.
//   Lines:   every non-blank line is one document.
//   Fortune: documents separated by lines holding only "%" (the fortune(6) format);
//            blank documents are skipped.
//   Auto:    by extension: .jsonl/.json -> Jsonl, anything else -> Text.
enum class InputFormat { Auto, Jsonl, Text, Lines, Fortune };

// "auto", "jsonl", "text", "lines", "fortune"; throws megaton::Error naming `flag` and
// listing the valid names otherwise.
InputFormat parse_input_format(std::string_view name, std::string_view flag = "--input-format");
std::string_view input_format_name(InputFormat format);
// Resolves Auto for `path` by its extension; other formats are returned unchanged.
InputFormat resolve_input_format(InputFormat format, const std::string& path);

// The document files of a directory, sorted by name: regular files only (symlinks and
// subdirectories are skipped), skipping hidden files and fortune's index (*.dat) and
// UTF-8 alias (*.u8) files. Throws megaton::Error when `dir` cannot be listed.
std::vector<std::string> document_files_in_directory(const std::string& dir);

// Expands --input values in order: a directory becomes its document files (as above);
// a value with glob characters (* ? [) becomes its matches, sorted, filtered by the same
// rules; any other value must name a readable file (symlinks followed). Throws
// megaton::Error naming the value when a file is missing, a glob matches nothing or a
// directory holds no document files.
std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs);

// Replaces every byte that is not part of a well-formed UTF-8 sequence by the Latin-1
// character of the same value (U+0080..U+00FF, encoded as UTF-8), so Latin-1 text comes
// out readable and any input becomes valid UTF-8. Returns the number of bytes replaced.
int64_t repair_utf8(std::string& text);

// One document as read from a file, before parsing: for Jsonl the raw line.
struct SourceDocument {
  std::string text;
  int64_t line = 0;  // 1-based line where the document starts
};

// Streams the documents of one file. Throws megaton::Error naming the file when it
// cannot be opened or read.
class DocumentReader {
 public:
  // format: not Auto (use resolve_input_format).
  DocumentReader(std::string path, InputFormat format);
  // The next document, or false at the end of the file.
  bool next(SourceDocument& doc);
  const std::string& path() const { return path_; }
  InputFormat format() const { return format_; }
  // Bytes consumed from the file so far.
  int64_t bytes_read() const { return bytes_read_; }

 private:
  bool getline(std::string& line);

  std::string path_;
  InputFormat format_;
  std::ifstream in_;
  std::string line_;
  int64_t line_number_ = 0;
  int64_t bytes_read_ = 0;
  bool done_ = false;
};

// The texts of one document, one entry per json key; each entry is a list of sequences
// (a JSON list of strings gives several, anything else exactly one). For formats other
// than Jsonl there is one key and one sequence: the document itself. Invalid UTF-8 is
// repaired first (repair_utf8); the count is added to *replaced_bytes when given.
// Throws megaton::Error naming path:line when a line is not a JSON object, a key is
// missing, or a value is neither a string nor a list of strings.
std::vector<std::vector<std::string>> document_texts(SourceDocument&& doc, InputFormat format,
                                                     const std::vector<std::string>& json_keys,
                                                     const std::string& path,
                                                     int64_t* replaced_bytes = nullptr);

}  // namespace megaton::data
