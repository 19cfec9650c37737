// bf16 GPU training with the main params kept as int16 remainders (the default,
// store_param_remainders), replicated and under the distributed optimizer: a run that
// saves, stops and resumes gives the uninterrupted run's losses and checkpoint bit for bit
// (--deterministic-mode); checkpoints hold fp32 main params that load either way: a
// remainder checkpoint loaded without remainders, and a checkpoint made without them
// loaded with them, are written back unchanged; the first loss matches the run without
// remainders (the weights differ only at rounding ties).
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

RawOptions options(bool distributed) {
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
      {"seed", {"1234"}}, {"deterministic-mode", {"true"}}};
  if (distributed) raw["use-distributed-optimizer"] = {"true"};
  return raw;
}

TrainResult train(const RawOptions& raw) {
  TrainArgs args = parse_train_args(raw);
  return Trainer(args, raw).train();
}

// Every tensor of the checkpoint of `iteration` in `dir`.
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
  int model = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    ASSERT_EQ(t.dtype(), it->second.dtype()) << name;
    ASSERT_EQ(t.nbytes(), it->second.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw(), it->second.raw(), t.nbytes()), 0) << name << " differs";
    if (name.starts_with("model.")) {
      EXPECT_EQ(t.dtype(), DType::F32) << name;
      ++model;
    }
  }
  EXPECT_GT(model, 0);
}

class ParamRemaindersTrainGpu : public ::testing::TestWithParam<bool> {};

TEST_P(ParamRemaindersTrainGpu, ResumeIsBitIdenticalAndCheckpointsLoadEitherWay) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  const bool distributed = GetParam();
  const fs::path dir = fs::temp_directory_path() /
                       fmt::format("megaton_remainders_{}_{}", ::getpid(), int(distributed));
  fs::remove_all(dir);
  struct Restore {  // --deterministic-mode is process-wide
    ~Restore() { ops::set_deterministic(false); }
  } restore;

  RawOptions full = options(distributed);
  full["save"] = {(dir / "full").string()};
  const TrainResult whole = train(full);
  ASSERT_EQ(whole.losses.size(), 6u);

  RawOptions first = options(distributed);
  first["save"] = {(dir / "first").string()};
  first["exit-interval"] = {"3"};
  const TrainResult head = train(first);
  ASSERT_EQ(head.losses.size(), 3u);

  RawOptions resumed = options(distributed);
  resumed["load"] = {(dir / "first").string()};
  resumed["save"] = {(dir / "resumed").string()};
  const TrainResult tail = train(resumed);
  ASSERT_EQ(tail.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(tail.losses[i], whole.losses[i + 3]) << "iteration " << i + 4;
  expect_same_checkpoint(checkpoint(dir / "resumed", 6), checkpoint(dir / "full", 6));

  // The remainder checkpoint into a run without remainders: loaded and written back
  // unchanged (train-iters 3: no step, the save at the end).
  RawOptions fp32_from_remainders = options(distributed);
  fp32_from_remainders["no-store-param-remainders"] = {"true"};
  fp32_from_remainders["train-iters"] = {"3"};
  fp32_from_remainders["load"] = {(dir / "first").string()};
  fp32_from_remainders["save"] = {(dir / "fp32_from_remainders").string()};
  train(fp32_from_remainders);
  expect_same_checkpoint(checkpoint(dir / "fp32_from_remainders", 3), checkpoint(dir / "first", 3));

  // And the other way.
  RawOptions without = options(distributed);
  without["no-store-param-remainders"] = {"true"};
  without["exit-interval"] = {"3"};
  without["save"] = {(dir / "without").string()};
  const TrainResult plain = train(without);
  ASSERT_EQ(plain.losses.size(), 3u);
  // One forward of the same fp32 initial weights, rounded alike but at ties.
  EXPECT_LT(std::fabs(plain.losses[0] - head.losses[0]) / plain.losses[0], 1e-3);
  RawOptions remainders_from_fp32 = options(distributed);
  remainders_from_fp32["train-iters"] = {"3"};
  remainders_from_fp32["load"] = {(dir / "without").string()};
  remainders_from_fp32["save"] = {(dir / "remainders_from_fp32").string()};
  train(remainders_from_fp32);
  expect_same_checkpoint(checkpoint(dir / "remainders_from_fp32", 3), checkpoint(dir / "without", 3));
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(ReplicatedAndDistributed, ParamRemaindersTrainGpu, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Distributed" : "Replicated"; });

}  // namespace
}  // namespace megaton
