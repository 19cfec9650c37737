// Document sources: input expansion, per-format readers, UTF-8 repair, JSONL fields.
#include "data/documents.h"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace megaton::data {

namespace fs = std::filesystem;

InputFormat parse_input_format(std::string_view name, std::string_view flag) {
  if (name == "auto") return InputFormat::Auto;
  if (name == "jsonl") return InputFormat::Jsonl;
  if (name == "text") return InputFormat::Text;
  if (name == "lines") return InputFormat::Lines;
  if (name == "fortune") return InputFormat::Fortune;
  fail("{} '{}': expected one of auto, jsonl, text, lines, fortune", flag, name);
}

std::string_view input_format_name(InputFormat format) {
  switch (format) {
    case InputFormat::Auto:
      return "auto";
    case InputFormat::Jsonl:
      return "jsonl";
    case InputFormat::Text:
      return "text";
    case InputFormat::Lines:
      return "lines";
    case InputFormat::Fortune:
      return "fortune";
  }
  return "?";
}

InputFormat resolve_input_format(InputFormat format, const std::string& path) {
  if (format != InputFormat::Auto) return format;
  std::string ext = fs::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return ext == ".jsonl" || ext == ".json" ? InputFormat::Jsonl : InputFormat::Text;
}

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The rule shared by directory listings and glob matches.
bool is_document_file(const std::string& path) {
  std::string name = fs::path(path).filename().string();
  if (name.empty() || name[0] == '.' || ends_with(name, ".dat") || ends_with(name, ".u8"))
    return false;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return false;
  return S_ISREG(st.st_mode);  // lstat: a symlink is not a regular file
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<std::string> document_files_in_directory(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) fail("--input {}: cannot list directory: {}", dir, ec.message());
  for (const auto& entry : it) {
    std::string p = entry.path().string();
    if (is_document_file(p)) files.push_back(p);
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& input : inputs) {
    struct stat st {};
    if (has_glob_chars(input) && ::stat(input.c_str(), &st) != 0) {
      glob_t g{};
      int rc = ::glob(input.c_str(), 0, nullptr, &g);
      std::vector<std::string> matches;
      if (rc == 0)
        for (size_t i = 0; i < g.gl_pathc; ++i)
          if (is_document_file(g.gl_pathv[i])) matches.push_back(g.gl_pathv[i]);
      ::globfree(&g);
      if (matches.empty())
        fail(
            "--input {}: the pattern matches no document files (regular files; symlinks, hidden, "
            "*.dat and *.u8 are skipped)",
            input);
      files.insert(files.end(), matches.begin(), matches.end());
    } else if (::stat(input.c_str(), &st) != 0) {
      fail("--input {}: {}", input, std::strerror(errno));
    } else if (S_ISDIR(st.st_mode)) {
      auto in_dir = document_files_in_directory(input);
      if (in_dir.empty())
        fail(
            "--input {}: the directory holds no document files (regular files; symlinks, hidden, "
            "*.dat and *.u8 are skipped)",
            input);
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else if (S_ISREG(st.st_mode)) {
      files.push_back(input);
    } else {
      fail("--input {}: not a regular file or directory", input);
    }
  }
  return files;
}

int64_t repair_utf8(std::string& text) {
  // Length of the well-formed UTF-8 sequence at s[i] (Unicode Table 3-7), 0 if none.
  auto sequence_length = [](const unsigned char* s, size_t i, size_t n) -> size_t {
    unsigned char c = s[i];
    if (c < 0x80) return 1;
    auto cont = [&](size_t k, unsigned char lo = 0x80, unsigned char hi = 0xBF) {
      return i + k < n && s[i + k] >= lo && s[i + k] <= hi;
    };
    if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
    if (c == 0xE0) return cont(1, 0xA0) && cont(2) ? 3 : 0;
    if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return cont(1) && cont(2) ? 3 : 0;
    if (c == 0xED) return cont(1, 0x80, 0x9F) && cont(2) ? 3 : 0;
    if (c == 0xF0) return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0;
    if (c >= 0xF1 && c <= 0xF3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
    if (c == 0xF4) return cont(1, 0x80, 0x8F) && cont(2) && cont(3) ? 4 : 0;
    return 0;
  };
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {  // fast path: most text is valid
    size_t len = sequence_length(s, i, n);
    if (len == 0) break;
    i += len;
  }
  if (i == n) return 0;
  std::string out;
  out.reserve(n + 16);
  out.append(text, 0, i);
  int64_t replaced = 0;
  while (i < n) {
    size_t len = sequence_length(s, i, n);
    if (len > 0) {
      out.append(text, i, len);
      i += len;
    } else {  // a stray byte >= 0x80: read it as Latin-1
      out.push_back(static_cast<char>(0xC0 | (s[i] >> 6)));
      out.push_back(static_cast<char>(0x80 | (s[i] & 0x3F)));
      ++replaced;
      ++i;
    }
  }
  text = std::move(out);
  return replaced;
}

// ---------------------------------------------------------------------------------------

DocumentReader::DocumentReader(std::string path, InputFormat format)
    : path_(std::move(path)), format_(format) {
  MEGATON_CHECK(format != InputFormat::Auto, "unresolved input format for {}", path_);
  in_.open(path_, std::ios::binary);
  if (!in_) fail("--input {}: cannot open: {}", path_, std::strerror(errno));
}

bool DocumentReader::getline(std::string& line) {
  if (!std::getline(in_, line)) {
    if (in_.bad()) fail("--input {}: read failed after {} bytes", path_, bytes_read_);
    return false;
  }
  ++line_number_;
  bytes_read_ += static_cast<int64_t>(line.size()) + (in_.eof() ? 0 : 1);
  return true;
}

namespace {
bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); });
}
void strip_cr(std::string& line) {
  if (!line.empty() && line.back() == '\r') line.pop_back();
}
}  // namespace

bool DocumentReader::next(SourceDocument& doc) {
  if (done_) return false;
  switch (format_) {
    case InputFormat::Text: {
      done_ = true;
      std::string all((std::istreambuf_iterator<char>(in_)), std::istreambuf_iterator<char>());
      if (in_.bad()) fail("--input {}: read failed", path_);
      bytes_read_ = static_cast<int64_t>(all.size());
      if (all.empty()) return false;
      doc.text = std::move(all);
      doc.line = 1;
      return true;
    }
    case InputFormat::Jsonl:
    case InputFormat::Lines:
      while (getline(line_)) {
        strip_cr(line_);
        if (is_blank(line_)) continue;
        doc.text = std::move(line_);
        doc.line = line_number_;
        return true;
      }
      done_ = true;
      return false;
    case InputFormat::Fortune: {
      doc.text.clear();
      doc.line = 0;
      bool any = false;
      while (getline(line_)) {
        strip_cr(line_);
        if (line_ == "%") {
          if (any && !is_blank(doc.text)) return true;
          doc.text.clear();
          any = false;
          continue;
        }
        if (!any) doc.line = line_number_;
        if (any) doc.text.push_back('\n');
        doc.text += line_;
        any = true;
      }
      done_ = true;
      return any && !is_blank(doc.text);
    }
    case InputFormat::Auto:
      break;
  }
  MEGATON_CHECK(false, "unresolved input format");
}

std::vector<std::vector<std::string>> document_texts(SourceDocument&& doc, InputFormat format,
                                                     const std::vector<std::string>& json_keys,
                                                     const std::string& path,
                                                     int64_t* replaced_bytes) {
  int64_t replaced = repair_utf8(doc.text);
  if (replaced_bytes) *replaced_bytes += replaced;
  std::vector<std::vector<std::string>> texts;
  if (format != InputFormat::Jsonl) {
    texts.emplace_back();
    texts.back().push_back(std::move(doc.text));
    return texts;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(doc.text);
  } catch (const nlohmann::json::exception& e) {
    // nlohmann's message is one line; keep only the part after the "[json.exception...]".
    std::string what = e.what();
    auto pos = what.find("] ");
    fail("{}:{}: not a JSON line: {}", path, doc.line,
         pos == std::string::npos ? what : what.substr(pos + 2));
  }
  if (!j.is_object()) fail("{}:{}: expected a JSON object per line", path, doc.line);
  for (const std::string& key : json_keys) {
    auto it = j.find(key);
    if (it == j.end()) fail("{}:{}: key '{}' missing (--json-keys)", path, doc.line, key);
    std::vector<std::string> sequences;
    if (it->is_string()) {
      sequences.push_back(it->get<std::string>());
    } else if (it->is_array() &&
               std::all_of(it->begin(), it->end(), [](const auto& v) { return v.is_string(); })) {
      for (const auto& v : *it) sequences.push_back(v.get<std::string>());
    } else {
      fail("{}:{}: key '{}' is {}, expected a string or a list of strings", path, doc.line, key,
           it->type_name());
    }
    texts.push_back(std::move(sequences));
  }
  return texts;
}

}  // namespace megaton::data
