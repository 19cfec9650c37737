// --moe-shared-expert-overlap, --overlap-moe-expert-parallel-comm and
// --moe-token-dispatcher-type flex before anything is built:
// what they set, Megatron's notices, and each refusal a one-line megaton::Error naming the
// flags (the CLI turns it into exit status 2), from parse_train_args and
// check_parallel_layout on a world of 2.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/args_testing.h"

namespace megaton {
namespace {

using Set = std::vector<std::pair<std::string, std::vector<std::string>>>;

RawOptions moe(const Set& set = {}) {
  RawOptions raw = testing::tiny_train_options();
  raw["num-experts"] = {"4"};
  raw["moe-router-topk"] = {"2"};
  raw["expert-model-parallel-size"] = {"2"};
  for (const auto& [k, v] : set) raw[k] = v;
  return raw;
}

std::string error_of(const RawOptions& raw) { return testing::layout_error(raw, 2); }

bool mentions(const std::vector<std::string>& lines, const std::string& what) {
  for (const std::string& l : lines)
    if (l.find(what) != std::string::npos) return true;
  return false;
}

TEST(MoEOverlapArgs, SharedExpertOverlapIsSetWithTheAlltoallDispatcher) {
  const RawOptions raw = moe({{"moe-shared-expert-intermediate-size", {"64"}},
                              {"moe-token-dispatcher-type", {"alltoall"}},
                              {"moe-shared-expert-overlap", {"true"}}});
  const TrainArgs a = parse_train_args(raw);
  EXPECT_TRUE(a.model.moe_shared_expert_overlap);
  EXPECT_FALSE(mentions(a.no_effect, "moe-shared-expert-overlap"));
  EXPECT_EQ(error_of(raw), "");
  // Without a shared expert Megatron ignores it: a no-effect notice here.
  const TrainArgs plain = parse_train_args(
      moe({{"moe-token-dispatcher-type", {"alltoall"}}, {"moe-shared-expert-overlap", {"true"}}}));
  EXPECT_TRUE(
      mentions(plain.no_effect, "moe-shared-expert-overlap: the model has no shared expert"));
}

TEST(MoEOverlapArgs, ExpertParallelOverlapIsSetWithExpertParallelism) {
  const RawOptions raw = moe({{"moe-token-dispatcher-type", {"alltoall"}},
                              {"overlap-moe-expert-parallel-comm", {"true"}}});
  EXPECT_TRUE(parse_train_args(raw).model.overlap_moe_expert_parallel_comm);
  EXPECT_EQ(error_of(raw), "");
  // A dense model: no effect (a notice), whatever the dispatcher.
  RawOptions dense = testing::tiny_train_options();
  dense["overlap-moe-expert-parallel-comm"] = {"true"};
  EXPECT_TRUE(mentions(parse_train_args(dense).no_effect,
                       "overlap-moe-expert-parallel-comm: the model has no MoE layer"));
  EXPECT_EQ(error_of(dense), "");
  // The flags Megatron keeps for its combined 1F1B schedule stay refused.
  RawOptions delay = raw;
  delay["delay-wgrad-compute"] = {"true"};
  EXPECT_NE(error_of(delay).find("delay-wgrad-compute"), std::string::npos);
}

TEST(MoEOverlapArgs, FlexRunsTheAlltoallDispatcher) {
  const TrainArgs a = parse_train_args(moe({{"moe-token-dispatcher-type", {"flex"}}}));
  EXPECT_EQ(a.parallel.moe_token_dispatcher_type, "flex");
  EXPECT_EQ(a.parallel.moe_flex_dispatcher_backend, "deepep");  // Megatron's default
  EXPECT_EQ(error_of(moe({{"moe-token-dispatcher-type", {"flex"}},
                          {"moe-flex-dispatcher-backend", {"hybridep"}},
                          {"moe-hybridep-num-sms", {"16"}}})),
            "");
  // The deprecated switch selects deepep, with a warning.
  const TrainArgs deepep = parse_train_args(moe({{"moe-token-dispatcher-type", {"flex"}},
                                                 {"moe-flex-dispatcher-backend", {"ncclep"}},
                                                 {"moe-enable-deepep", {"true"}}}));
  EXPECT_EQ(deepep.parallel.moe_flex_dispatcher_backend, "deepep");
  EXPECT_TRUE(mentions(deepep.warnings, "moe-enable-deepep is deprecated"));
  // The DeepEP kernels' SM budget has no effect here.
  const TrainArgs sms = parse_train_args(
      moe({{"moe-token-dispatcher-type", {"flex"}}, {"moe-flex-dispatcher-num-sms", {"20"}}}));
  EXPECT_TRUE(mentions(sms.no_effect, "moe-flex-dispatcher-num-sms"));
  // Megatron's DeepEP assertion is TP x EP > 1; hybridep has none.
  const Set one_expert_rank = {{"moe-token-dispatcher-type", {"flex"}},
                               {"expert-model-parallel-size", {"1"}}};
  EXPECT_NE(error_of(moe(one_expert_rank)).find("needs expert-tensor-parallel-size x"),
            std::string::npos);
  Set hybrid = one_expert_rank;
  hybrid.push_back({"moe-flex-dispatcher-backend", {"hybridep"}});
  EXPECT_EQ(error_of(moe(hybrid)), "");
  // Megatron asserts it only when it builds the dispatcher: a dense model is not refused.
  RawOptions dense = moe(one_expert_rank);
  dense["num-experts"] = {"0"};
  dense.erase("moe-router-topk");
  EXPECT_EQ(error_of(dense), "");
  // The ncclep wire dtypes: bf16, the default, is what Megaton moves.
  EXPECT_EQ(
      error_of(moe({{"moe-dispatch-fwd-dtype", {"bf16"}}, {"moe-combine-bwd-dtype", {"bf16"}}})),
      "");
  // Expert tensor parallelism counts (it defaults to tensor-model-parallel-size).
  EXPECT_EQ(error_of(moe({{"moe-token-dispatcher-type", {"flex"}},
                          {"expert-model-parallel-size", {"1"}},
                          {"tensor-model-parallel-size", {"2"}},
                          {"sequence-parallel", {"true"}}})),
            "");
}

TEST(MoEOverlapArgs, RefusalsAreOneLineNamingTheFlags) {
  struct Case {
    Set set;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{{"moe-shared-expert-intermediate-size", {"64"}}, {"moe-shared-expert-overlap", {"true"}}},
       "moe-shared-expert-overlap only works with moe-token-dispatcher-type alltoall or flex"},
      {{{"moe-shared-expert-intermediate-size", {"64"}},
        {"moe-token-dispatcher-type", {"alltoall"}},
        {"moe-shared-expert-overlap", {"true"}},
        {"recompute-granularity", {"selective"}},
        {"recompute-modules", {"shared_experts"}}},
       "shared_experts recompute cannot work with --moe-shared-expert-overlap"},
      {{{"moe-token-dispatcher-type", {"deepep"}}},
       "option 'moe-token-dispatcher-type' must be alltoall, allgather or flex"},
      {{{"moe-token-dispatcher-type", {"flex"}}, {"moe-flex-dispatcher-backend", {"uccl"}}},
       "option 'moe-flex-dispatcher-backend' must be deepep, hybridep or ncclep"},
      {{{"moe-enable-deepep", {"true"}}},
       "moe-enable-deepep (DeepEP) is only supported with moe-token-dispatcher-type flex"},
      {{{"moe-token-dispatcher-type", {"flex"}},
        {"moe-flex-dispatcher-backend", {"hybridep"}},
        {"moe-enable-deepep", {"true"}}},
       "only one backend"},
      {{{"moe-token-dispatcher-type", {"alltoall"}}, {"moe-flex-dispatcher-backend", {"ncclep"}}},
       "moe-flex-dispatcher-backend ncclep needs moe-token-dispatcher-type flex"},
      {{{"moe-token-dispatcher-type", {"flex"}},
        {"moe-flex-dispatcher-backend", {"ncclep"}},
        {"moe-dispatch-fwd-dtype", {"mxfp8"}}},
       "moe-dispatch-fwd-dtype mxfp8 (the ncclep dispatcher's MXFP8 wire format) is not "
       "supported"},
      {{{"moe-token-dispatcher-type", {"flex"}},
        {"moe-expert-capacity-factor", {"1.0"}},
        {"moe-pad-expert-input-to-capacity", {"true"}}},
       "does not support moe-pad-expert-input-to-capacity"},
  };
  const Set ep_overlap = {{"moe-token-dispatcher-type", {"alltoall"}},
                          {"overlap-moe-expert-parallel-comm", {"true"}}};
  auto with = [&](Set more) {
    more.insert(more.begin(), ep_overlap.begin(), ep_overlap.end());
    return more;
  };
  const std::vector<Case> ep_cases = {
      {{{"overlap-moe-expert-parallel-comm", {"true"}}},
       "overlap-moe-expert-parallel-comm is supported with the alltoall or flex token dispatcher"},
      {with({{"expert-model-parallel-size", {"1"}}}),
       "overlap-moe-expert-parallel-comm is only supported with expert model parallelism"},
      {with({{"moe-shared-expert-intermediate-size", {"64"}},
             {"moe-shared-expert-overlap", {"true"}}}),
       "disable moe-shared-expert-overlap when enabling overlap-moe-expert-parallel-comm"},
      {with({{"recompute-granularity", {"full"}},
             {"recompute-method", {"uniform"}},
             {"recompute-num-layers", {"1"}}}),
       "disable full recomputation when enabling overlap-moe-expert-parallel-comm"},
      {with({{"recompute-granularity", {"selective"}}, {"recompute-modules", {"moe"}}}),
       "disable moe in recompute-modules when enabling overlap-moe-expert-parallel-comm"},
      {with({{"moe-expert-capacity-factor", {"1.0"}},
             {"moe-pad-expert-input-to-capacity", {"true"}}}),
       "overlap-moe-expert-parallel-comm with moe-pad-expert-input-to-capacity is not supported"},
      {with({{"fp8-format", {"hybrid"}}, {"fp8-recipe", {"delayed"}}}),
       "overlap-moe-expert-parallel-comm with fp8-recipe delayed is not supported"},
  };
  for (const Case& c : ep_cases) {
    const std::string e = error_of(moe(c.set));
    EXPECT_NE(e.find(c.want), std::string::npos) << "got: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  for (const Case& c : cases) {
    const std::string e = error_of(moe(c.set));
    EXPECT_NE(e.find(c.want), std::string::npos) << "got: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace megaton
