// ArgReader: typed, checked reads of raw `megaton train` option values, and the range
// checks the flag groups share.
#pragma once
#include <cstdint>
#include <limits>
#include <string>

#include "train/arguments.h"

namespace megaton {

// Every count and size a flag sets fits in 31 bits: products of a few of them (a tensor's
// elements, tokens per batch) then stay exact in 64-bit arithmetic, and the memory check
// (train/memory_check.h) refuses what cannot fit before anything is allocated.
inline constexpr int64_t kMaxFlagInteger = std::numeric_limits<int32_t>::max();

// Reads the values of `raw` (keys without dashes). Every read names its flag in the
// megaton::Error it throws: a value that is not of the flag's type, an integer beyond
// kMaxFlagInteger (the seed: 63 bits), a float that is not finite, a second value where
// one is expected.
struct ArgReader {
  const RawOptions& raw;
  bool has(const std::string& key) const { return raw.count(key) > 0; }
  const std::string& one(const std::string& key) const;
  int64_t integer(const std::string& key, int64_t max) const;
  void get(const std::string& key, int64_t& out) const;
  void get(const std::string& key, uint64_t& out) const;  // the seed: any 63-bit value
  void get(const std::string& key, double& out) const;
  void get(const std::string& key, float& out) const;
  void get(const std::string& key, bool& out) const;
  void get(const std::string& key, std::string& out) const;
  // Whether switch `key` was given as true (a YAML "false" asks for nothing).
  bool on(const std::string& key) const;
};

// Range checks of values read; `key` names the flag. Bounds are Megatron's or PyTorch's
// where they state one.
void check_at_least(const char* key, double value, double lo);
void check_positive(const char* key, double value);
void check_fraction(const char* key, double value);  // [0, 1)

}  // namespace megaton
