// Helpers for the data tests: temporary directories, files, synthetic indexed datasets.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/indexed_dataset.h"

namespace megaton::data::testing {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("megaton_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }
  // Names of the entries in the directory, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(path_))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path path_;
};

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Asserts that `f` throws megaton::Error whose message contains every one of `parts`.
template <typename F>
::testing::AssertionResult throws_error_with(F&& f, std::vector<std::string> parts) {
  try {
    f();
  } catch (const megaton::Error& e) {
    std::string what = e.what();
    if (what.find('\n') != std::string::npos)
      return ::testing::AssertionFailure() << "message has a newline: " << what;
    for (const auto& p : parts)
      if (what.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message '" << what << "' lacks '" << p << "'";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-megaton::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// Writes an int32 indexed dataset at `prefix` with one document per entry of `lengths`
// whose tokens are consecutive global token numbers 0, 1, 2, ... so every token
// identifies its document and position. Returns the total token count.
inline int64_t write_numbered_dataset(const std::string& prefix,
                                      const std::vector<int32_t>& lengths) {
  IndexedDatasetBuilder builder(prefix, TokenDType::I32);
  int32_t next = 0;
  for (int32_t len : lengths) {
    std::vector<int32_t> tokens(len);
    for (auto& t : tokens) t = next++;
    builder.add_document(tokens);
  }
  builder.finalize();
  return next;
}

// `count` document lengths uniform in [lo, hi] from mt19937_64(seed).
inline std::vector<int32_t> random_lengths(int count, int lo, int hi, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<int32_t> lengths(count);
  for (auto& l : lengths) l = dist(gen);
  return lengths;
}

// `count` lower-case sentences of 3..12 words from a fixed word list, mt19937_64(seed):
// a corpus a small SentencePiece vocabulary (~300 pieces) can be trained on.
inline std::vector<std::string> random_sentences(int count, uint64_t seed) {
  const std::vector<std::string> words = {
      "the",   "quick", "brown", "fox",   "jumps", "over",   "lazy",   "dog",    "data",
      "model", "train", "token", "piece", "layer", "expert", "router", "memory", "tensor",
      "graph", "batch", "learn", "rate",  "loss",  "step",   "sample", "epoch",  "index"};
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<size_t> word(0, words.size() - 1);
  std::uniform_int_distribution<int> length(3, 12);
  std::vector<std::string> sentences(count);
  for (auto& s : sentences)
    for (int w = length(gen); w > 0; --w) s += words[word(gen)] + (w > 1 ? " " : "");
  return sentences;
}

}  // namespace megaton::data::testing
