// --cuda-graph-impl and its options (train/arguments.cpp, train/step_graph.h): Megatron's
// flag rules, and what a captured step cannot hold, refused with megaton::Error (one line,
// exit status 2) before anything is built. No GPU needed: the checks read the arguments.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "train/arguments.h"
#include "train/step_graph.h"

namespace megaton {
namespace {

RawOptions base() {
  return {{"device", {"cpu"}},            {"mock-data", {"true"}},
          {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"60"}},
          {"num-layers", {"2"}},          {"hidden-size", {"16"}},
          {"num-attention-heads", {"2"}}, {"seq-length", {"8"}},
          {"micro-batch-size", {"2"}},    {"train-iters", {"2"}},
          {"hidden-dropout", {"0"}},      {"attention-dropout", {"0"}}};
}

// The message of the megaton::Error that `f` throws ("" when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_refused(RawOptions raw, const std::string& needle) {
  const std::string message = error_of([&] { (void)parse_train_args(raw); });
  EXPECT_NE(message.find(needle), std::string::npos)
      << "'" << message << "' does not mention '" << needle << "'";
}

TEST(StepGraphArgs, MegatronsRules) {
  RawOptions raw = base();
  raw["cuda-graph-impl"] = {"full"};
  expect_refused(raw, "cuda-graph-impl must be none, local, transformer_engine or full_iteration");
  raw["cuda-graph-impl"] = {"transformer_engine"};
  expect_refused(raw, "Transformer Engine");
  raw["cuda-graph-impl"] = {"local"};
  expect_refused(raw, "per-layer CUDA graphs");
  raw["cuda-graph-impl"] = {"full_iteration"};
  raw["cuda-graph-modules"] = {"attn", "mlp"};
  expect_refused(raw, "cuda-graph-modules must be empty with cuda-graph-impl full_iteration");
  raw["cuda-graph-modules"] = {"attention"};
  expect_refused(raw, "'attention' is not one of attn, mlp, moe");
  raw.erase("cuda-graph-modules");
  raw["cuda-graph-warmup-steps"] = {"0"};
  expect_refused(raw, "cuda-graph-warmup-steps must be positive");
  raw.erase("cuda-graph-warmup-steps");
  raw["cuda-graph-scope"] = {"attn"};
  raw["cuda-graph-modules"] = {"attn"};
  expect_refused(raw, "cannot be used together");
}

TEST(StepGraphArgs, DeprecatedScopeFullIterationSelectsTheImplementation) {
  RawOptions raw = base();
  raw["cuda-graph-scope"] = {"full_iteration"};
  const TrainArgs a = parse_train_args(raw);
  EXPECT_EQ(a.cuda_graph_impl, "full_iteration");
  EXPECT_TRUE(a.cuda_graph_modules.empty());
  EXPECT_EQ(a.cuda_graph_warmup_steps, 3);  // Megatron's default
  // Modules without an implementation change nothing, as in Megatron, and are listed.
  RawOptions none = base();
  none["cuda-graph-modules"] = {"attn"};
  const TrainArgs b = parse_train_args(none);
  EXPECT_EQ(b.cuda_graph_impl, "none");
  ASSERT_EQ(b.no_effect.size(), 1u);
  EXPECT_NE(b.no_effect[0].find("cuda-graph-modules"), std::string::npos);
}

// What a replayed graph cannot hold, each refused with a line naming it. The model is put
// on the GPU by hand: the check reads the arguments only.
TEST(StepGraphArgs, WhatAGraphCannotHoldIsRefused) {
  RawOptions raw = base();
  raw["cuda-graph-impl"] = {"full_iteration"};
  const TrainArgs cpu = parse_train_args(raw);
  EXPECT_NE(error_of([&] { check_full_iteration_graph(cpu, 1); }).find("needs a GPU"),
            std::string::npos);
  TrainArgs gpu = cpu;
  gpu.model.device = Device::CUDA;
  EXPECT_EQ(error_of([&] { check_full_iteration_graph(gpu, 1); }), "");
  EXPECT_NE(error_of([&] { check_full_iteration_graph(gpu, 2); }).find("runs on one GPU"),
            std::string::npos);
  struct Case {
    void (*set)(TrainArgs&);
    const char* needle;
  };
  const Case cases[] = {
      {[](TrainArgs& a) { a.model.hidden_dropout = 0.1f; }, "hidden-dropout 0"},
      {[](TrainArgs& a) { a.model.attention_dropout = 0.1f; }, "attention-dropout 0"},
      {[](TrainArgs& a) {
         a.model.num_experts = 4;
         a.model.moe_input_jitter_eps = 0.01f;
       },
       "moe-input-jitter-eps"},
      {[](TrainArgs& a) {
         a.model.num_experts = 4;
         a.model.fp8.enabled = true;
       },
       "FP8 experts"},
      {[](TrainArgs& a) {
         a.model.num_experts = 4;
         a.model.moe_expert_capacity_factor = 1.0f;
       },
       "moe-expert-capacity-factor"},
      {[](TrainArgs& a) { a.log_num_zeros_in_grad = true; }, "log-num-zeros-in-grad"},
      {[](TrainArgs& a) { a.reset_attention_mask = true; }, "reset-attention-mask"},
  };
  for (const Case& c : cases) {
    TrainArgs a = gpu;
    c.set(a);
    const std::string message = error_of([&] { check_full_iteration_graph(a, 1); });
    EXPECT_NE(message.find(c.needle), std::string::npos) << "'" << message << "'";
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: '" << message << "'";
  }
  // Packed documents' position ids live in staged buffers: accepted.
  TrainArgs positions = gpu;
  positions.reset_position_ids = true;
  EXPECT_EQ(error_of([&] { check_full_iteration_graph(positions, 1); }), "");
  // Without the flag nothing is checked.
  TrainArgs off = gpu;
  off.cuda_graph_impl = "none";
  off.model.hidden_dropout = 0.1f;
  EXPECT_EQ(error_of([&] { check_full_iteration_graph(off, 8); }), "");
}

}  // namespace
}  // namespace megaton
