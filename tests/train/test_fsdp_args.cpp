// --use-megatron-fsdp and its flags before anything is built: what they set, and each
// refusal a one-line megaton::Error naming the flags (the CLI turns it into exit status 2),
// from parse_train_args and check_parallel_layout on a world of 2.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/args_testing.h"

namespace megaton {
namespace {

RawOptions base() { return testing::tiny_train_options(); }

std::string error_of(const RawOptions& raw) { return testing::layout_error(raw, 2); }

TEST(FsdpArgs, DefaultsAndTheDistributedOptimizer) {
  RawOptions raw = base();
  raw["use-megatron-fsdp"] = {"true"};
  const TrainArgs a = parse_train_args(raw);
  EXPECT_TRUE(a.parallel.use_megatron_fsdp);
  // Megatron-LM d98e8a6: optim_grads_params by default, the distributed optimizer on.
  EXPECT_EQ(a.parallel.data_parallel_sharding_strategy, "optim_grads_params");
  EXPECT_TRUE(a.parallel.use_distributed_optimizer);
  EXPECT_EQ(a.parallel.megatron_fsdp_grad_comm_dtype, "auto");
  EXPECT_EQ(error_of(raw), "");
  EXPECT_FALSE(a.parallel.fsdp_double_buffer);
  raw["fsdp-double-buffer"] = {"true"};
  EXPECT_TRUE(parse_train_args(raw).parallel.fsdp_double_buffer);
  raw.erase("fsdp-double-buffer");
  raw["data-parallel-sharding-strategy"] = {"no_shard"};  // replicated AdamW
  EXPECT_FALSE(parse_train_args(raw).parallel.use_distributed_optimizer);
  EXPECT_EQ(error_of(raw), "");
}

TEST(FsdpArgs, RefusalsAreOneLineNamingTheFlags) {
  struct Case {
    std::vector<std::pair<std::string, std::vector<std::string>>> set;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{{"data-parallel-sharding-strategy", {"optim"}}},
       "data-parallel-sharding-strategy needs use-megatron-fsdp"},
      {{{"use-megatron-fsdp", {"true"}}, {"data-parallel-sharding-strategy", {"zero3"}}},
       "data-parallel-sharding-strategy 'zero3' is not one of"},
      {{{"use-megatron-fsdp", {"true"}}, {"megatron-fsdp-grad-comm-dtype", {"fp16"}}},
       "megatron-fsdp-grad-comm-dtype 'fp16' is not supported"},
      {{{"use-megatron-fsdp", {"true"}},
        {"data-parallel-sharding-strategy", {"optim_grads"}},
        {"cpu-offloading", {"true"}},
        {"cpu-offloading-num-layers", {"1"}}},
       "optim_grads and --cpu-offloading is not supported yet"},
      {{{"init-model-with-meta-device", {"true"}}},
       "init-model-with-meta-device needs use-megatron-fsdp"},
      {{{"use-megatron-fsdp", {"true"}},
        {"init-model-with-meta-device", {"true"}},
        {"data-parallel-sharding-strategy", {"optim"}},
        {"fp8-format", {"hybrid"}},
        {"fp8-param-gather", {"true"}}},
       "init-model-with-meta-device with --fp8-param-gather is not supported yet"},
      {{{"fsdp-double-buffer", {"true"}}}, "fsdp-double-buffer needs use-megatron-fsdp"},
  };
  for (const Case& c : cases) {
    RawOptions raw = base();
    for (const auto& [k, v] : c.set) raw[k] = v;
    const std::string e = error_of(raw);
    EXPECT_NE(e.find(c.want), std::string::npos) << "got: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace megaton
