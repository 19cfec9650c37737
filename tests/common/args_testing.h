// Helpers for tests of the train flags' checks (tests/train/test_*_args.cpp): a tiny CPU
// run's options, and the one-line error the parse and layout checks give.
#pragma once
#include <cstdint>
#include <string>

#include "core/error.h"
#include "train/arguments.h"

namespace megaton::testing {

// A 2-layer model (hidden 32, 4 heads, sequence 16) on mock data, one iteration on the CPU.
inline RawOptions tiny_train_options() {
  return {{"device", {"cpu"}},
          {"mock-data", {"true"}},
          {"tokenizer-type", {"NullTokenizer"}},
          {"vocab-size", {"63"}},
          {"num-layers", {"2"}},
          {"hidden-size", {"32"}},
          {"num-attention-heads", {"4"}},
          {"seq-length", {"16"}},
          {"micro-batch-size", {"1"}},
          {"train-iters", {"1"}}};
}

// The megaton::Error of parse_train_args then check_parallel_layout on `world` ranks, or ""
// when both pass.
inline std::string layout_error(const RawOptions& raw, int64_t world) {
  try {
    check_parallel_layout(parse_train_args(raw), world);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace megaton::testing
