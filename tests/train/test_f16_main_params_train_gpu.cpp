// bf16 GPU training with fp16 main params (--use-precision-aware-optimizer
// --main-params-dtype fp16, Transformer Engine's master_weight_dtype fp16), replicated and
// under the distributed optimizer: the losses follow the fp32-main-param run within a
// fraction of a percent; the checkpoint holds fp32 main params and one scale per param; a
// checkpoint loaded without a step is written back bit for bit (the stored scale gives back
// the fp16 bits), and converts both ways (fp32 main params <-> fp16), written back the same
// where the run keeps fp32.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>

#include "ckpt/safetensors.h"
#include "core/dtype.h"
#include "ops/determinism.h"
#include "train/trainer.h"

namespace megaton {
namespace {

namespace fs = std::filesystem;

RawOptions options(bool distributed, bool f16_main_params) {
  RawOptions raw = {
      {"device", {"cuda"}}, {"bf16", {"true"}}, {"mock-data", {"true"}},
      {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"127"}},
      {"num-layers", {"2"}}, {"hidden-size", {"64"}}, {"num-attention-heads", {"4"}},
      {"seq-length", {"64"}}, {"micro-batch-size", {"4"}}, {"global-batch-size", {"8"}},
      {"position-embedding-type", {"rope"}}, {"normalization", {"RMSNorm"}},
      {"swiglu", {"true"}}, {"disable-bias-linear", {"true"}},
      {"hidden-dropout", {"0"}}, {"attention-dropout", {"0"}},
      {"train-iters", {"6"}}, {"lr", {"1e-3"}}, {"lr-warmup-iters", {"1"}},
      {"eval-iters", {"0"}}, {"log-interval", {"1"}}, {"log-params-norm", {"true"}},
      {"seed", {"1234"}}, {"deterministic-mode", {"true"}},
      {"use-precision-aware-optimizer", {"true"}}, {"no-store-param-remainders", {"true"}}};
  if (f16_main_params) raw["main-params-dtype"] = {"fp16"};
  if (distributed) raw["use-distributed-optimizer"] = {"true"};
  return raw;
}

TrainResult train(const RawOptions& raw) {
  TrainArgs args = parse_train_args(raw);
  return Trainer(args, raw).train();
}

std::map<std::string, Tensor> checkpoint(const fs::path& dir, int iteration) {
  const fs::path iter = dir / fmt::format("iter_{:07d}", iteration);
  std::map<std::string, Tensor> out;
  for (const auto& entry : fs::directory_iterator(iter)) {
    if (entry.path().extension() != ".safetensors") continue;
    for (auto& [name, t] : ckpt::load_safetensors(entry.path().string()).tensors) out[name] = t;
  }
  EXPECT_FALSE(out.empty()) << iter;
  return out;
}

void expect_same_checkpoint(const std::map<std::string, Tensor>& a,
                            const std::map<std::string, Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    ASSERT_EQ(t.dtype(), it->second.dtype()) << name;
    ASSERT_EQ(t.nbytes(), it->second.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw(), it->second.raw(), t.nbytes()), 0) << name << " differs";
  }
}

class F16MainParamsTrainGpu : public ::testing::TestWithParam<bool> {};

TEST_P(F16MainParamsTrainGpu, TrainsLikeFp32MainParamsAndCheckpointsRoundTrip) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  const bool distributed = GetParam();
  const fs::path dir = fs::temp_directory_path() /
                       fmt::format("megaton_f16_main_{}_{}", ::getpid(), int(distributed));
  fs::remove_all(dir);
  struct Restore {  // --deterministic-mode is process-wide
    ~Restore() { ops::set_deterministic(false); }
  } restore;

  RawOptions half = options(distributed, true);
  half["save"] = {(dir / "f16").string()};
  const TrainResult f16 = train(half);
  RawOptions full = options(distributed, false);
  full["save"] = {(dir / "fp32").string()};
  const TrainResult fp32 = train(full);
  ASSERT_EQ(f16.losses.size(), 6u);
  ASSERT_EQ(fp32.losses.size(), 6u);
  // The same initial weights (the first forward is the same), then fp16 rounding of the
  // main params (2^-12 of each param's absmax per step) moves the losses a little.
  EXPECT_EQ(f16.losses[0], fp32.losses[0]);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_TRUE(std::isfinite(f16.losses[i]));
    EXPECT_LT(std::fabs(f16.losses[i] - fp32.losses[i]) / fp32.losses[i], 5e-3) << "iteration " << i + 1;
  }
  const std::map<std::string, Tensor> saved = checkpoint(dir / "f16", 6);
  int scales = 0;
  for (const auto& [name, t] : saved) {
    if (name.starts_with("model.")) {
      EXPECT_EQ(t.dtype(), DType::F32) << name;
      const auto it = saved.find("optimizer." + name.substr(6) + ".main_param.scale");
      ASSERT_NE(it, saved.end()) << name;
      EXPECT_GT(it->second.f32()[0], 0.0f) << name;
      ++scales;
    }
  }
  EXPECT_GT(scales, 0);

  // Loaded and saved without a step (train-iters 6: the loaded iteration): bit for bit.
  RawOptions again = options(distributed, true);
  again["load"] = {(dir / "f16").string()};
  again["save"] = {(dir / "f16_again").string()};
  train(again);
  expect_same_checkpoint(checkpoint(dir / "f16_again", 6), saved);

  // fp16 main params into a run that keeps fp32: the same values, without the scales.
  RawOptions to_fp32 = options(distributed, false);
  to_fp32["load"] = {(dir / "f16").string()};
  to_fp32["save"] = {(dir / "to_fp32").string()};
  train(to_fp32);
  std::map<std::string, Tensor> without_scales = saved;
  std::erase_if(without_scales, [](const auto& e) { return e.first.ends_with(".main_param.scale"); });
  expect_same_checkpoint(checkpoint(dir / "to_fp32", 6), without_scales);

  // fp32 main params into an fp16 run: quantized (within half an fp16 ulp of the absmax
  // scale), with the scales.
  RawOptions to_f16 = options(distributed, true);
  to_f16["load"] = {(dir / "fp32").string()};
  to_f16["save"] = {(dir / "to_f16").string()};
  train(to_f16);
  const std::map<std::string, Tensor> converted = checkpoint(dir / "to_f16", 6);
  const std::map<std::string, Tensor> original = checkpoint(dir / "fp32", 6);
  for (const auto& [name, t] : original) {
    if (!name.starts_with("model.")) continue;
    const Tensor& got = converted.at(name);
    const float scale = converted.at("optimizer." + name.substr(6) + ".main_param.scale").f32()[0];
    for (int64_t k = 0; k < t.numel(); ++k)
      ASSERT_LE(std::fabs(got.f32()[k] - t.f32()[k]),
                std::fabs(t.f32()[k]) * std::ldexp(1.0, -11) + std::ldexp(1.0, -24) * scale)
          << name << " element " << k;
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(ReplicatedAndDistributed, F16MainParamsTrainGpu, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Distributed" : "Replicated"; });

}  // namespace
}  // namespace megaton
