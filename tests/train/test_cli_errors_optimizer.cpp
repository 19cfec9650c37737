// Bad optimizer, precision and offload flags given to the `megaton` binary (Adam's
// precision-aware optimizer, main-grad dtypes, loss scaling, optimizer offload, and issue
// 24's --optimizer with Muon, SGD and Lion): one line naming the culprit, exit status 2, and
// nothing written; and the offload and scaled-moment runs that must train.
#include <gtest/gtest.h>

#include <string>

#include "common/cli_testing.h"

namespace megaton {
namespace {

// The precision-aware optimizer's dtype flags: Megatron's choices and its rule that a
// dtype other than fp32 needs the switch; what Megaton does not have yet is named.
TEST_F(CliErrors, PrecisionAwareOptimizerFlags) {
  const std::pair<const char*, const char*> cases[] = {
      {"--exp-avg-dtype bf16", "option 'exp-avg-dtype' bf16 needs --use-precision-aware-optimizer"},
      {"--main-params-dtype fp16",
       "option 'main-params-dtype' fp16 needs --use-precision-aware-optimizer"},
      {"--use-precision-aware-optimizer --exp-avg-sq-dtype int8",
       "option 'exp-avg-sq-dtype' must be one of fp32, fp16, bf16, fp8 (got 'int8')"},
      {"--use-precision-aware-optimizer --main-grads-dtype fp16",
       "option 'main-grads-dtype' must be one of fp32, bf16 (got 'fp16')"},
      // fp16 main params need bf16/fp16 weights apart from them: the CPU computes fp32.
      {"--use-precision-aware-optimizer --main-params-dtype fp16",
       "option 'main-params-dtype' fp16 needs bf16 or fp16 weights"},
      {"--bf16 --use-precision-aware-optimizer --main-params-dtype fp16",
       "option 'main-params-dtype' fp16 needs bf16 or fp16 weights"},
      {"--use-precision-aware-optimizer --main-params-dtype fp16 --optimizer-cpu-offload",
       "option 'main-params-dtype' fp16 with --optimizer-cpu-offload is not supported"},
      {"--exp-avg-dtype fp8", "option 'exp-avg-dtype' fp8 needs --use-precision-aware-optimizer"},
  };
  for (const auto& [flags, needle] : cases)
    expect_user_error("train --config " + config(kModel) + " " + flags, needle);
}

// BF16 main gradients: the precision-aware switch for --main-grads-dtype bf16
// (OptimizerConfig), and Megatron's refusal of it beside
// --accumulate-allreduce-grads-in-fp32 under --bf16 (arguments.py, its message).
TEST_F(CliErrors, MainGradsDtypeFlags) {
  const std::pair<const char*, const char*> cases[] = {
      {"--bf16 --main-grads-dtype bf16",
       "option 'main-grads-dtype' bf16 needs --use-precision-aware-optimizer"},
      {"--bf16 --use-precision-aware-optimizer --main-grads-dtype bf16 "
       "--accumulate-allreduce-grads-in-fp32",
       "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set"},
      {"--bf16 --use-precision-aware-optimizer --main-grads-dtype bf16 --grad-reduce-in-bf16 "
       "--accumulate-allreduce-grads-in-fp32",
       "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set"},
  };
  for (const auto& [flags, needle] : cases)
    expect_user_error("train --config " + config(kModel) + " " + flags, needle);
}

// --fp16 and the loss scaler's flags: Megatron's exclusions and DynamicGradScaler's
// assertions, one line and exit 2 each.
TEST_F(CliErrors, LossScalingFlags) {
  const std::pair<const char*, const char*> cases[] = {
      {"--fp16 --bf16", "fp16 and bf16 exclude each other: give one"},
      {"--fp16 --hysteresis 0", "hysteresis must be at least 1 (got 0)"},
      {"--fp16 --loss-scale-window 0", "loss-scale-window must be at least 1 (got 0)"},
      {"--fp16 --initial-loss-scale 4 --min-loss-scale 8",
       "min-loss-scale (8) must not exceed initial-loss-scale (4)"},
      {"--fp16 --initial-loss-scale 0", "initial-loss-scale must be a positive fp32 number"},
      {"--fp16 --loss-scale -2", "loss-scale must be positive (got -2)"},
      {"--fp16 --fp8-format hybrid", "fp16 with fp8-format is not supported in Megaton yet"},
      {"--fp16 --cuda-graph-impl full_iteration",
       "cuda-graph-impl full_iteration with --fp16 dynamic loss scaling is not supported"},
  };
  for (const auto& [flags, needle] : cases)
    expect_user_error("train --config " + config(kModel) + " " + flags, needle);
}

// --optimizer-cpu-offload: Megatron's requirement of the precision-aware optimizer, the
// fraction's range, and what Megaton does not offload yet; one line and exit 2 each.
TEST_F(CliErrors, OptimizerOffloadFlags) {
  const std::pair<const char*, const char*> cases[] = {
      {"--optimizer-cpu-offload",
       "The optimizer cpu offload must be used in conjunction with "
       "`--use-precision-aware-optimizer`"},
      {"--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 1.5",
       "optimizer-offload-fraction must be in [0, 1] (got 1.5)"},
      {"--use-precision-aware-optimizer --optimizer-cpu-offload --cuda-graph-impl full_iteration",
       "optimizer-cpu-offload with cuda-graph-impl full_iteration is not supported in Megaton yet"},
  };
  for (const auto& [flags, needle] : cases)
    expect_user_error("train --config " + config(kModel) + " " + flags, needle);
}

// --optimizer and the Muon, SGD and Lion flags (issue 24): bad names and values, and the
// optimizer refused beside --fp16, the precision-aware optimizer (and so CPU offload),
// Megatron-FSDP and FP8 param gather; one line and exit 2 each (what the flags set:
// test_optimizer_args).
TEST_F(CliErrors, OptimizerFlags) {
  const std::string run = kMock + " --train-iters 1 ";
  const std::pair<std::string, std::string> cases[] = {
      {"--optimizer adamw",
       "option 'optimizer' must be one of adam, sgd, muon, lion, dist_muon (got 'adamw')"},
      {"--optimizer soap", "--optimizer soap is not supported in Megaton"},
      {"--optimizer adaptive_muon", "--optimizer adaptive_muon is not supported in Megaton"},
      {"--optimizer muon --muon-num-ns-steps 0", "option 'muon-num-ns-steps' must be >= 1 (got 0)"},
      {"--optimizer muon --muon-coefficient-type cubic5",
       "--muon-coefficient-type cubic5 needs Emerging-Optimizers >= 0.4.0"},
      {"--optimizer muon --muon-scale-mode rms", "--muon-scale-mode 'rms' is not one of"},
      {"--optimizer muon --muon-tp-mode sharded", "option 'muon-tp-mode' must be one of"},
      {"--optimizer muon --muon-fp32-matmul-prec highest",
       "option 'muon-fp32-matmul-prec' must be one of low, medium, high"},
      {"--optimizer muon --muon-scalar-optimizer sgd",
       "option 'muon-scalar-optimizer' must be one of adam, lion (got 'sgd')"},
      {"--optimizer muon --muon-momentum 1", "option 'muon-momentum' must be in [0, 1)"},
      {"--optimizer muon --muon-use-syrk", "--muon-use-syrk is not supported in Megaton"},
      {"--optimizer muon --fp16", "fp16 with optimizer muon is not supported"},
      {"--optimizer lion --fp16", "fp16 with optimizer lion is not supported"},
      {"--optimizer sgd --use-precision-aware-optimizer",
       "use-precision-aware-optimizer needs optimizer adam (got sgd)"},
      {"--optimizer muon --use-precision-aware-optimizer --optimizer-cpu-offload",
       "use-precision-aware-optimizer (and with it optimizer-cpu-offload) needs optimizer adam"},
      {"--optimizer lion --use-megatron-fsdp",
       "use-megatron-fsdp with optimizer lion is not supported"},
      {"--optimizer dist_muon --fp8-format hybrid --fp8-param-gather",
       "fp8-param-gather with optimizer muon is not supported in Megaton yet"},
  };
  for (const auto& [flags, message] : cases) {
    SCOPED_TRACE(flags);
    expect_user_error(run + flags, message);
  }
}

// Offloading all of the optimizer's elements trains (the host update on the CPU backend is
// the same update: tests/optim/test_optimizer_offload.cpp).
TEST_F(CliErrors, OptimizerOffloadTrains) {
  EXPECT_EQ(run(kMock + " --train-iters 2 --lr 1e-3 --use-precision-aware-optimizer "
                        "--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d"),
            0)
      << (stderr_lines.empty() ? "" : stderr_lines.back());
}

// fp16 and fp8 Adam moments (scaled states) train; beside --optimizer-cpu-offload (whose
// host update has no absmax reduction) they are refused with one line naming both flags.
TEST_F(CliErrors, ScaledMomentFlags) {
  const std::string pao = kMock + " --train-iters 2 --lr 1e-3 --use-precision-aware-optimizer";
  EXPECT_EQ(run(pao + " --exp-avg-dtype fp16 --exp-avg-sq-dtype fp8"), 0)
      << (stderr_lines.empty() ? "" : stderr_lines.back());
  expect_user_error(pao + " --exp-avg-dtype fp16 --optimizer-cpu-offload",
                    "option 'optimizer-cpu-offload' with --exp-avg-dtype fp16 --exp-avg-sq-dtype "
                    "fp32 is not supported in Megaton yet");
  expect_user_error(pao + " --exp-avg-sq-dtype fp8 --optimizer-cpu-offload",
                    "option 'optimizer-cpu-offload' with --exp-avg-dtype fp32 --exp-avg-sq-dtype "
                    "fp8 is not supported in Megaton yet");
}

}  // namespace
}  // namespace megaton
