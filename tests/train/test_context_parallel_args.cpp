// --context-parallel-size / --cp-comm-type checks before anything is built: each a one-line
// megaton::Error naming the flags (the CLI turns it into exit status 2), from
// parse_train_args and check_parallel_layout on a world of 4 (8 for TP 4).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/args_testing.h"

namespace megaton {
namespace {

RawOptions base(int64_t cp) {
  RawOptions raw = testing::tiny_train_options();
  raw["attention-dropout"] = {"0"};
  raw["context-parallel-size"] = {std::to_string(cp)};
  return raw;
}

// The error a layout check on `world` ranks gives, or "" when it passes.
std::string error_of(const RawOptions& raw, int64_t world = 4) {
  return testing::layout_error(raw, world);
}

TEST(ContextParallelArgs, AcceptsEachCommType) {
  for (const char* type : {"p2p", "all_gather", "allgather", "a2a"}) {
    RawOptions raw = base(2);
    raw["cp-comm-type"] = {type};
    EXPECT_EQ(error_of(raw), "") << type;
    EXPECT_EQ(parse_train_args(raw).parallel.cp_comm_type,
              std::string(type) == "allgather" ? "all_gather" : type);
  }
  RawOptions per_layer = base(2);
  per_layer["cp-comm-type"] = {"p2p", "p2p"};  // Megatron's per-layer list, all alike
  EXPECT_EQ(error_of(per_layer), "");
}

TEST(ContextParallelArgs, AcceptsPackedSequences) {
  RawOptions raw = base(2);
  raw["reset-attention-mask"] = {"true"};
  raw["reset-position-ids"] = {"true"};
  EXPECT_EQ(error_of(raw), "");
  raw["mtp-num-layers"] = {"1"};  // multi-token prediction too
  EXPECT_EQ(error_of(raw), "");
}

TEST(ContextParallelArgs, AcceptsFp8OnADenseModel) {
  RawOptions raw = base(2);
  raw["fp8-format"] = {"hybrid"};
  raw["kv-channels"] = {"16"};
  EXPECT_EQ(error_of(raw), "");
}

TEST(ContextParallelArgs, RefusalsAreOneLineNamingTheFlags) {
  struct Case {
    std::vector<std::pair<std::string, std::vector<std::string>>> set;
    int64_t cp;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{{"seq-length", {"12"}}},
       4,
       "seq-length (12) is not divisible by 2 x context-parallel-size (8)"},
      // (on 8 ranks)
      {{{"tensor-model-parallel-size", {"4"}},
        {"sequence-parallel", {"true"}},
        {"seq-length", {"12"}}},
       2,
       "seq-length / context-parallel-size (6) is not divisible by tensor-model-parallel-size "
       "(4) (sequence-parallel)"},
      {{{"cp-comm-type", {"ring"}}}, 2, "cp-comm-type 'ring' is not one of p2p, all_gather, a2a"},
      {{{"cp-comm-type", {"a2a+p2p"}}},
       2,
       "cp-comm-type a2a+p2p (hierarchical context parallelism) is not supported; use p2p, "
       "all_gather or a2a"},
      {{{"cp-comm-type", {"p2p", "a2a"}}},
       2,
       "cp-comm-type: per-layer lists of different types (p2p and a2a) are not supported"},
      {{{"cp-comm-type", {"a2a"}}, {"num-attention-heads", {"2"}}},
       4,
       "cp-comm-type a2a needs the attention heads (2) and query groups (2) per "
       "tensor-parallel rank divisible by context-parallel-size (4)"},
      {{{"attention-dropout", {"0.1"}}},
       2,
       "context-parallel-size 2 with --attention-dropout 0.1 (give 0: the context-parallel "
       "attention has no dropout) is not supported yet"},
      {{{"reset-attention-mask", {"true"}}, {"cuda-graph-impl", {"full_iteration"}}},
       2,
       "context-parallel-size 2 with --reset-attention-mask / --reset-position-ids (packed "
       "sequences) and --cuda-graph-impl full_iteration is not supported yet"},
      {{{"mtp-num-layers", {"1"}}, {"calculate-per-token-loss", {"true"}}},
       2,
       "context-parallel-size 2 with --mtp-num-layers and --calculate-per-token-loss is not "
       "supported yet"},
      {{{"fp8-format", {"hybrid"}},
        {"num-experts", {"4"}},
        {"moe-router-topk", {"2"}},
        {"kv-channels", {"16"}}},
       2,
       "context-parallel-size 2 with --fp8-format on a model with experts (--num-experts) is "
       "not supported yet"},
  };
  for (const Case& c : cases) {
    RawOptions raw = base(c.cp);
    for (const auto& [k, v] : c.set) raw[k] = v;
    const std::string got = error_of(raw, raw.count("tensor-model-parallel-size") ? 8 : 4);
    EXPECT_EQ(got, c.want);
    EXPECT_EQ(got.find('\n'), std::string::npos) << got;
  }
}

}  // namespace
}  // namespace megaton
