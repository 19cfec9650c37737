// The demo config trains on the GPU (bf16 compute, fp32 main params and grads) and its
// loss curve over 50 iterations matches the CPU (fp32) run within bf16 tolerance.
// Needs data/ from tools/prepare_fortunes.sh (run from the repository root).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "train/trainer.h"

namespace megaton {
namespace {

TEST(TrainGpu, DemoLossCurveMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  if (!std::filesystem::exists("data/fortunes_text_document.idx"))
    GTEST_SKIP() << "data/ missing: run tools/prepare_fortunes.sh from the repository root";
  auto run = [](const std::string& device) {
    RawOptions raw = read_yaml_options("configs/demo-moe.yaml");
    raw["train-iters"] = {"50"};
    raw["lr-warmup-iters"] = {"10"};
    raw["eval-iters"] = {"1"};
    raw["log-interval"] = {"10"};
    raw.erase("save-interval");
    raw["device"] = {device};
    raw["bf16"] = {"true"};  // the CPU computes fp32 regardless
    TrainArgs args = parse_train_args(raw);
    return Trainer(args, raw).train();
  };
  TrainResult gpu = run("cuda");
  TrainResult cpu = run("cpu");
  ASSERT_EQ(gpu.losses.size(), 50u);
  ASSERT_EQ(cpu.losses.size(), 50u);
  // The first loss is one forward of identical fp32 initial weights: bf16 compute may
  // move it by rounding only. Later losses drift as two trajectories (bf16 vs fp32) part:
  // measured on an H200 (2026-11-22), within 3.1% while the loss falls fastest
  // (iterations 15-20) and 0.7% by iteration 50, so the curve is held to 5% at every
  // iteration and 2% at the end; a wrong gradient or optimizer step leaves these at once.
  EXPECT_LT(std::fabs(gpu.losses[0] - cpu.losses[0]) / cpu.losses[0], 1e-3);
  double worst = 0;
  for (size_t i = 0; i < 50; ++i) {
    double rel = std::fabs(gpu.losses[i] - cpu.losses[i]) / cpu.losses[i];
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 5e-2) << "iteration " << i + 1 << ": gpu " << gpu.losses[i] << " cpu "
                         << cpu.losses[i];
  }
  EXPECT_LT(std::fabs(gpu.losses[49] - cpu.losses[49]) / cpu.losses[49], 2e-2);
  std::printf("loss iteration 1: gpu %.5f cpu %.5f; iteration 50: gpu %.5f cpu %.5f; worst "
              "relative difference %.2e\n",
              gpu.losses[0], cpu.losses[0], gpu.losses[49], cpu.losses[49], worst);
  EXPECT_LT(gpu.losses[49], gpu.losses[0] - 1.0);
}

}  // namespace
}  // namespace megaton
