// GPU training runs: the demo config trains on the GPU (bf16 compute, fp32 main params and
// grads) and its loss curve over 50 iterations matches the CPU (fp32) run within bf16
// tolerance (needs data/ from tools/prepare_fortunes.sh, run from the repository root);
// the MoE expert bias stays fp32 through a bf16 run and a checkpoint round trip;
// --deterministic-mode repeats a run bit for bit; the steady-state step makes no host
// synchronization.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/host_sync.h"
#endif
#include "core/dtype.h"
#include "ops/determinism.h"
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

// --fp16 (issue 18): the demo config in fp16 compute with a static-enough dynamic scale
// (4096: no step overflows) follows the CPU's fp32 curve as the bf16 run does (fp16 keeps
// more mantissa than bf16, so the bf16 test's bounds hold); from Megatron's default initial
// scale 2^32 the first steps overflow in fp16 (a finite loss, a non-finite gradient norm:
// skipped), the scale falls, and the run then trains.
TEST(TrainGpu, Fp16DemoLossCurveMatchesCpuAndOverflowsAreSkipped) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  if (!std::filesystem::exists("data/fortunes_text_document.idx"))
    GTEST_SKIP() << "data/ missing: run tools/prepare_fortunes.sh from the repository root";
  auto run = [](const std::string& device, const char* initial_scale) {
    RawOptions raw = read_yaml_options("configs/demo-moe.yaml");
    raw["train-iters"] = {"50"};
    raw["lr-warmup-iters"] = {"10"};
    raw["eval-iters"] = {"0"};
    raw["log-interval"] = {"10"};
    raw.erase("save-interval");
    raw["device"] = {device};
    raw["fp16"] = {"true"};  // the CPU computes fp32 and scales the loss alike
    raw["initial-loss-scale"] = {initial_scale};
    TrainArgs args = parse_train_args(raw);
    return Trainer(args, raw).train();
  };
  TrainResult gpu = run("cuda", "4096");
  TrainResult cpu = run("cpu", "4096");
  ASSERT_EQ(gpu.losses.size(), 50u);
  double worst = 0;
  for (size_t i = 0; i < 50; ++i) {
    EXPECT_TRUE(std::isfinite(gpu.grad_norms[i])) << "iteration " << i + 1 << " overflowed";
    const double rel = std::fabs(gpu.losses[i] - cpu.losses[i]) / cpu.losses[i];
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 5e-2) << "iteration " << i + 1;
  }
  EXPECT_LT(std::fabs(gpu.losses[49] - cpu.losses[49]) / cpu.losses[49], 2e-2);
  std::printf("fp16 loss iteration 1: gpu %.5f cpu %.5f; iteration 50: gpu %.5f cpu %.5f; "
              "worst relative difference %.2e\n",
              gpu.losses[0], cpu.losses[0], gpu.losses[49], cpu.losses[49], worst);

  TrainResult high = run("cuda", "4294967296");
  ASSERT_EQ(high.losses.size(), 50u);
  EXPECT_TRUE(std::isfinite(high.losses[0]));
  EXPECT_FALSE(std::isfinite(high.grad_norms[0])) << "2^32 did not overflow fp16";
  int skipped = 0;
  for (size_t i = 0; i < 50; ++i) skipped += std::isfinite(high.grad_norms[i]) ? 0 : 1;
  for (size_t i = 40; i < 50; ++i) EXPECT_TRUE(std::isfinite(high.grad_norms[i])) << i + 1;
  std::printf("fp16 from 2^32: %d steps skipped; loss iteration 50: %.5f\n", skipped,
              high.losses[49]);
  EXPECT_LT(high.losses[49], high.losses[0] - 1.0);
}

// The steady-state step on one GPU makes no host synchronization: the MoE layers' token
// counts (the grouped GEMMs read them on the device), the router's losses and the expert
// bias update, the loss sums, the gradient norm, the clipping and the skip of a
// non-finite step all stay on the device, and the trainer reads each step's values
// after it has queued the next (core/readback.h). Two runs of the demo MoE config (with
// the expert bias on) that differ only by four steady-state iterations make the same
// number of synchronizations: start-up, the first step, the one log line at the end and
// the end itself are common to both.
#ifdef MEGATON_WITH_CUDA
TEST(TrainGpu, SteadyStateStepHasNoHostSynchronization) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  if (!std::filesystem::exists("data/fortunes_text_document.idx"))
    GTEST_SKIP() << "data/ missing: run tools/prepare_fortunes.sh from the repository root";
  auto synchronizations = [](int iterations) {
    RawOptions raw = read_yaml_options("configs/demo-moe.yaml");
    raw["train-iters"] = {std::to_string(iterations)};
    raw["lr-warmup-iters"] = {"2"};
    raw["eval-iters"] = {"0"};
    raw["log-interval"] = {"1000"};  // one log line, at the last iteration
    raw["moe-router-enable-expert-bias"] = {"true"};
    raw["moe-router-score-function"] = {"sigmoid"};
    raw.erase("save-interval");
    raw["device"] = {"cuda"};
    raw["bf16"] = {"true"};
    TrainArgs args = parse_train_args(raw);
    Trainer trainer(args, raw);
    const uint64_t before = cuda::host_synchronizations();
    TrainResult result = trainer.train();
    EXPECT_EQ(result.losses.size(), size_t(iterations));
    return cuda::host_synchronizations() - before;
  };
  const uint64_t six = synchronizations(6), ten = synchronizations(10);
  std::printf("host synchronizations: 6 iterations %llu, 10 iterations %llu\n",
              (unsigned long long)six, (unsigned long long)ten);
  EXPECT_EQ(ten, six) << "the four extra steady-state steps synchronized with the host";
}
#else
TEST(TrainGpu, SteadyStateStepHasNoHostSynchronization) { GTEST_SKIP() << "built without CUDA"; }
#endif

// Megatron's --deterministic-mode: two GPU runs of the demo MoE config (embedding and
// attention backward included, 20 iterations with a checkpoint at the end) give the same
// losses, gradient norms and checkpointed tensors, bit for bit.
TEST(TrainGpu, DeterministicModeRepeatsBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  if (!std::filesystem::exists("data/fortunes_text_document.idx"))
    GTEST_SKIP() << "data/ missing: run tools/prepare_fortunes.sh from the repository root";
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("megaton_det_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto run = [&](const std::string& name) {
    RawOptions raw = read_yaml_options("configs/demo-moe.yaml");
    raw["train-iters"] = {"20"};
    raw["lr-warmup-iters"] = {"5"};
    raw["eval-iters"] = {"0"};
    raw["log-interval"] = {"10"};
    raw.erase("save-interval");
    raw["save"] = {(dir / name).string()};
    raw["device"] = {"cuda"};
    raw["bf16"] = {"true"};
    raw["deterministic-mode"] = {"true"};
    TrainArgs args = parse_train_args(raw);
    return Trainer(args, raw).train();
  };
  struct Restore {  // process-wide: leave the other tests as they were, also on a throw
    ~Restore() { ops::set_deterministic(false); }
  } restore;
  const TrainResult a = run("a"), b = run("b");
  ASSERT_EQ(a.losses.size(), 20u);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.grad_norms, b.grad_norms);
  const auto file = [&](const char* name) {
    return ckpt::load_checkpoint((dir / name).string(), 20);
  };
  const ckpt::LoadedCheckpoint fa = file("a"), fb = file("b");
  ASSERT_EQ(fa.tensors.size(), fb.tensors.size());
  int differing = 0;
  for (const auto& [name, t] : fa.tensors) {
    auto it = fb.tensors.find(name);
    ASSERT_NE(it, fb.tensors.end()) << name;
    const size_t bytes = size_t(t.numel()) * dtype_size(t.dtype());
    ASSERT_EQ(bytes, size_t(it->second.numel()) * dtype_size(it->second.dtype())) << name;
    if (std::memcmp(t.raw(), it->second.raw(), bytes) != 0) {
      ++differing;
      ADD_FAILURE() << name << " differs between the two runs";
    }
  }
  EXPECT_EQ(differing, 0);
  fs::remove_all(dir);
}

// The expert bias of every MoE layer (host copies, in layer order); each must be an fp32
// tensor on the GPU.
std::vector<std::vector<float>> expert_biases(GPTModel& model) {
  std::vector<std::vector<float>> out;
  for (auto& layer : model.layers()) {
    if (!layer->moe()) continue;
    const Tensor& bias = layer->moe()->router.expert_bias;
    EXPECT_EQ(bias.dtype(), DType::F32);
    EXPECT_EQ(bias.device(), Device::CUDA);
    out.push_back(bias.to(Device::CPU).to_vector());
  }
  return out;
}

// Megatron keeps the expert bias in fp32 whatever the model dtype
// (_maintain_float32_expert_bias): its updates of rate * sign(...) are far below a bf16
// ulp once the bias has grown, so a bf16 bias would stop moving. Six bf16 iterations with
// bias updates, against three, a checkpoint, and three more after loading it.
TEST(TrainGpu, ExpertBiasStaysFp32ThroughBf16RunAndCheckpoint) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("megaton_bias_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto options = [] {
    return RawOptions{
        {"device", {"cuda"}}, {"bf16", {"true"}}, {"mock-data", {"true"}},
        {"tokenizer-type", {"NullTokenizer"}}, {"vocab-size", {"127"}},
        {"num-layers", {"2"}}, {"hidden-size", {"64"}}, {"num-attention-heads", {"4"}},
        {"seq-length", {"64"}}, {"micro-batch-size", {"4"}}, {"global-batch-size", {"8"}},
        {"position-embedding-type", {"rope"}}, {"normalization", {"RMSNorm"}},
        {"swiglu", {"true"}}, {"disable-bias-linear", {"true"}},
        {"num-experts", {"8"}}, {"moe-ffn-hidden-size", {"64"}}, {"moe-router-topk", {"2"}},
        {"moe-router-score-function", {"sigmoid"}}, {"moe-router-enable-expert-bias", {"true"}},
        // 1e-3 + 1e-3 + ... is not exact in bf16 (8 significant bits) but is in fp32 to
        // well below 1e-7 here.
        {"moe-router-bias-update-rate", {"1e-3"}},
        {"moe-router-load-balancing-type", {"none"}}, {"moe-aux-loss-coeff", {"0"}},
        {"hidden-dropout", {"0"}}, {"attention-dropout", {"0"}},
        {"train-iters", {"6"}}, {"lr", {"1e-3"}}, {"lr-warmup-iters", {"1"}},
        {"eval-iters", {"0"}}, {"log-interval", {"1"}}, {"seed", {"1234"}}};
  };
  auto run = [](RawOptions raw, TrainResult& result) {
    TrainArgs args = parse_train_args(raw);
    Trainer trainer(args, raw);
    result = trainer.train();
    return expert_biases(trainer.model());
  };
  TrainResult full, first, second;
  const auto bias_full = run(options(), full);
  ASSERT_EQ(bias_full.size(), 2u);
  // The bias moved, and holds values a bf16 tensor could not: after six updates of
  // +-1e-3 each entry is a sum like 4e-3 or 2e-3, none a bf16 number.
  int not_bf16 = 0;
  for (const auto& layer : bias_full)
    for (float b : layer) {
      EXPECT_LE(std::fabs(b), 6e-3f + 1e-7f);
      not_bf16 += bf16_to_float(float_to_bf16(b)) != b;
    }
  EXPECT_GT(not_bf16, 0);

  RawOptions a = options();
  a["save"] = {(dir / "ckpt").string()};
  a["exit-interval"] = {"3"};
  run(a, first);
  ASSERT_TRUE(fs::exists(dir / "ckpt" / "iter_0000003" / "metadata.json"));
  // The checkpoint stores the bias as F32.
  int stored = 0;
  for (const auto& entry : fs::directory_iterator(dir / "ckpt" / "iter_0000003")) {
    if (entry.path().extension() != ".safetensors") continue;
    ckpt::SafetensorsFile file = ckpt::load_safetensors(entry.path().string());
    for (const auto& [name, tensor] : file.tensors) {
      if (name.find("router.expert_bias") == std::string::npos) continue;
      EXPECT_EQ(tensor.dtype(), DType::F32) << name;
      ++stored;
    }
  }
  EXPECT_EQ(stored, 2);

  RawOptions b = options();
  b["load"] = {(dir / "ckpt").string()};
  const auto bias_resumed = run(b, second);
  ASSERT_EQ(second.losses.size(), 3u);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(second.losses[i], full.losses[i + 3]) << "iteration " << i + 4;
  EXPECT_EQ(bias_resumed, bias_full);  // bit-identical after the round trip
  fs::remove_all(dir);
}

}  // namespace
}  // namespace megaton
