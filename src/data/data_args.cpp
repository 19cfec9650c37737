// --data-args-path and --per-split-data-args-path readers.
#include "data/data_args.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/printable.h"

namespace megaton::data {

namespace {
std::vector<std::string> whitespace_tokens(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> tokens;
  for (std::string t; in >> t;) tokens.push_back(t);
  return tokens;
}
}  // namespace

std::vector<std::string> read_data_args_path(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("--data-args-path {}: cannot open", printable(path));
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::string> tokens = whitespace_tokens(text.str());
  if (tokens.empty()) fail("--data-args-path {}: the file holds no dataset", printable(path));
  return tokens;
}

std::array<std::optional<std::vector<std::string>>, 3> read_per_split_data_args_path(
    const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("--per-split-data-args-path {}: cannot open", printable(path));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("--per-split-data-args-path {}: not JSON: {}", printable(path), e.what());
  }
  if (!j.is_object())
    fail("--per-split-data-args-path {}: expected an object with keys train, valid and test",
         printable(path));
  std::array<std::optional<std::vector<std::string>>, 3> out;
  const char* keys[] = {"train", "valid", "test"};
  for (int s = 0; s < 3; ++s) {
    if (!j.contains(keys[s]))
      fail("--per-split-data-args-path {}: no key '{}' (Megatron reads train, valid and test)",
           printable(path), keys[s]);
    const nlohmann::json& v = j.at(keys[s]);
    if (v.is_null()) continue;
    std::vector<std::string> tokens;
    if (v.is_string()) {
      tokens = whitespace_tokens(v.get<std::string>());
    } else if (v.is_array()) {
      for (const nlohmann::json& t : v) {
        if (!t.is_string())
          fail("--per-split-data-args-path {}: '{}' must list strings (weights and prefixes)",
               printable(path), keys[s]);
        tokens.push_back(t.get<std::string>());
      }
    } else {
      fail("--per-split-data-args-path {}: '{}' must be a string, a list of strings or null",
           printable(path), keys[s]);
    }
    if (!tokens.empty()) out[s] = std::move(tokens);
  }
  return out;
}

}  // namespace megaton::data
