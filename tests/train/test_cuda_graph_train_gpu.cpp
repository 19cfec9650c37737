// --cuda-graph-impl full_iteration on the demo configs: 50 iterations, with evaluations and
// a checkpoint between the replays, give the losses, gradient norms and checkpointed
// tensors of the run without CUDA graphs, bit for bit (both under --deterministic-mode,
// so that the two runs can be compared bitwise at all); dense, MoE (with the expert bias),
// dense FP8, dense with --eod-mask-loss (the loss masks staged like the tokens) and dense
// with --reset-position-ids (the position ids likewise), and MoE with --optimizer muon. The
// replayed steps make no host
// synchronization. Needs data/ from
// tools/prepare_fortunes.sh, run from the repository root.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "ckpt/checkpoint.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/host_sync.h"
#endif
#include "core/dtype.h"
#include "ops/determinism.h"
#include "train/trainer.h"

namespace megaton {
namespace {

namespace fs = std::filesystem;

#ifdef MEGATON_WITH_CUDA
struct Restore {  // --deterministic-mode is process-wide: leave the other tests as they were
  ~Restore() { ops::set_deterministic(false); }
};

RawOptions demo(const std::string& config, int iterations) {
  RawOptions raw = read_yaml_options(config);
  raw["train-iters"] = {std::to_string(iterations)};
  raw["lr-warmup-iters"] = {"10"};
  raw["eval-interval"] = {"20"};
  raw["eval-iters"] = {"2"};
  raw["log-interval"] = {"10"};
  raw.erase("save-interval");
  raw["device"] = {"cuda"};
  raw["bf16"] = {"true"};
  raw["deterministic-mode"] = {"true"};
  return raw;
}

void expect_same_checkpoints(const fs::path& a, const fs::path& b) {
  const auto load = [](const fs::path& dir) { return ckpt::load_checkpoint(dir.string(), 50); };
  const ckpt::LoadedCheckpoint fa = load(a), fb = load(b);
  ASSERT_EQ(fa.tensors.size(), fb.tensors.size());
  for (const auto& [name, t] : fa.tensors) {
    auto it = fb.tensors.find(name);
    ASSERT_NE(it, fb.tensors.end()) << name;
    const size_t bytes = size_t(t.numel()) * dtype_size(t.dtype());
    ASSERT_EQ(bytes, size_t(it->second.numel()) * dtype_size(it->second.dtype())) << name;
    EXPECT_EQ(std::memcmp(t.raw(), it->second.raw(), bytes), 0) << name << " differs";
  }
}

TEST(TrainCudaGraph, FullIterationEqualsTheGraphFreeRun) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  if (!fs::exists("data/fortunes_text_document.idx"))
    GTEST_SKIP() << "data/ missing: run tools/prepare_fortunes.sh from the repository root";
  Restore restore;
  const fs::path dir = fs::temp_directory_path() / ("megaton_graph_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  struct Variant {
    const char* name;
    const char* config;
    RawOptions extra;
  };
  const Variant variants[] = {
      {"dense", "configs/demo-dense.yaml", {}},
      {"moe",
       "configs/demo-moe.yaml",
       {{"moe-router-enable-expert-bias", {"true"}}, {"moe-router-score-function", {"sigmoid"}}}},
      {"fp8", "configs/demo-dense.yaml", {{"fp8-format", {"hybrid"}}}},
      {"eod-mask-loss", "configs/demo-dense.yaml", {{"eod-mask-loss", {"true"}}}},
      // Packed documents' RoPE positions, staged per micro-batch in fixed buffers.
      {"reset-position-ids", "configs/demo-dense.yaml", {{"reset-position-ids", {"true"}}}},
      // Muon's step (momentum, bf16 Newton-Schulz, its scratch allocated in the captured
      // step) and the MoE experts orthogonalised one by one.
      {"muon-moe", "configs/demo-moe.yaml", {{"optimizer", {"muon"}}}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    auto run = [&](bool graph) {
      RawOptions raw = demo(v.config, 50);
      for (const auto& [k, value] : v.extra) raw[k] = value;
      if (graph) raw["cuda-graph-impl"] = {"full_iteration"};
      const fs::path save = dir / (std::string(v.name) + (graph ? "_graph" : "_eager"));
      raw["save"] = {save.string()};
      TrainArgs args = parse_train_args(raw);
      return Trainer(args, raw).train();
    };
    const TrainResult eager = run(false), graph = run(true);
    ASSERT_EQ(graph.losses.size(), 50u);
    EXPECT_EQ(eager.cuda_graph_nodes, 0);
    EXPECT_EQ(graph.cuda_graph_iteration, 4);  // after Megatron's 3 warmup steps
    EXPECT_GT(graph.cuda_graph_nodes, 50);
    EXPECT_EQ(graph.losses, eager.losses);
    EXPECT_EQ(graph.grad_norms, eager.grad_norms);
    EXPECT_EQ(graph.last_valid_loss, eager.last_valid_loss);
    expect_same_checkpoints(dir / (std::string(v.name) + "_eager"),
                            dir / (std::string(v.name) + "_graph"));
    std::printf("%s: %lld graph nodes; loss iteration 1 %.6f, 50 %.6f\n", v.name,
                (long long)graph.cuda_graph_nodes, graph.losses[0], graph.losses[49]);
  }
  fs::remove_all(dir);
}

// Two graph runs of the MoE demo that differ only by four replayed steps make the same
// number of host synchronizations.
TEST(TrainCudaGraph, ReplayedStepsMakeNoHostSynchronization) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  if (!fs::exists("data/fortunes_text_document.idx"))
    GTEST_SKIP() << "data/ missing: run tools/prepare_fortunes.sh from the repository root";
  auto synchronizations = [](int iterations) {
    RawOptions raw = demo("configs/demo-moe.yaml", iterations);
    raw["lr-warmup-iters"] = {"2"};
    raw["eval-iters"] = {"0"};
    raw["log-interval"] = {"1000"};
    raw.erase("deterministic-mode");
    raw["cuda-graph-impl"] = {"full_iteration"};
    TrainArgs args = parse_train_args(raw);
    Trainer trainer(args, raw);
    const uint64_t before = cuda::host_synchronizations();
    const TrainResult result = trainer.train();
    EXPECT_EQ(result.cuda_graph_iteration, 4);
    return cuda::host_synchronizations() - before;
  };
  const uint64_t six = synchronizations(6), ten = synchronizations(10);
  std::printf("host synchronizations with a CUDA graph: 6 iterations %llu, 10 iterations %llu\n",
              (unsigned long long)six, (unsigned long long)ten);
  EXPECT_EQ(ten, six);
}
#else
TEST(TrainCudaGraph, NeedsCudaBuild) { GTEST_SKIP() << "built without CUDA"; }
#endif

}  // namespace
}  // namespace megaton
