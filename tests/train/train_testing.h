// Helpers of the training tests (tests/train): a small learnable corpus.
#pragma once
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

namespace megaton::testing {

// Writes `documents` JSON lines {"text": ...} to `path`, each 3-7 sentences of a small
// grammar (subject verb object) drawn from mt19937_64(seed): a corpus with learnable
// structure for the training tests.
inline void write_grammar_corpus(const std::filesystem::path& path, int documents,
                                 uint64_t seed) {
  const char* subjects[] = {"the cat", "a dog", "my friend", "the old man", "our teacher"};
  const char* verbs[] = {"likes", "sees", "eats", "finds", "wants"};
  const char* objects[] = {"the red apple.", "a small house.", "fresh bread.", "the blue sea.",
                           "a good book."};
  std::mt19937_64 gen(seed);
  std::ofstream out(path);
  for (int d = 0; d < documents; ++d) {
    std::string text;
    const int sentences = 3 + int(gen() % 5);
    for (int s = 0; s < sentences; ++s)
      text += std::string(subjects[gen() % 5]) + " " + verbs[gen() % 5] + " " +
              objects[gen() % 5] + " ";
    out << "{\"text\": \"" << text << "\"}\n";
  }
}

}  // namespace megaton::testing
