// The memory check before launch (train/memory_check.h): its bound is below what a real
// run holds, and sizes that cannot fit are refused with the flags and byte counts named.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/tensor.h"
#include "train/arguments.h"
#include "train/memory_check.h"
#include "train/trainer.h"

namespace megaton {
namespace {

constexpr double kUnlimited = std::numeric_limits<double>::infinity();

RawOptions tiny(bool moe) {
  RawOptions raw = {{"device", {"cpu"}},
                    {"mock-data", {"true"}},
                    {"tokenizer-type", {"NullTokenizer"}},
                    {"vocab-size", {"1000"}},
                    {"num-layers", {"2"}},
                    {"hidden-size", {"64"}},
                    {"num-attention-heads", {"4"}},
                    {"seq-length", {"16"}},
                    {"micro-batch-size", {"2"}},
                    {"train-iters", {"1"}},
                    {"eval-iters", {"0"}},
                    {"log-interval", {"1000"}}};
  if (moe) {
    raw["num-experts"] = {"4"};
    raw["moe-router-topk"] = {"2"};
    raw["swiglu"] = {"true"};
    raw["normalization"] = {"RMSNorm"};
    raw["position-embedding-type"] = {"rope"};
  }
  return raw;
}

// args as the Trainer finishes them (the tokenizer's vocabulary, padded).
TrainArgs finished_args(const RawOptions& raw, int64_t vocab_size) {
  TrainArgs args = parse_train_args(raw);
  args.model.vocab_size = vocab_size;
  args.model.tensor_model_parallel_size = args.parallel.tensor_model_parallel_size;
  args.model.finalize();
  return args;
}

class MemoryBound : public ::testing::TestWithParam<bool> {};

// The bound counts the matrices and leaves out biases and norms: it is at most the built
// model's parameter count and close to it; its parameter-state bytes are at most what the
// trainer's host allocator holds once a step has run (weights, main grads, Adam moments).
TEST_P(MemoryBound, IsBelowWhatARunHolds) {
  const RawOptions raw = tiny(GetParam());
  const int64_t held_before = host_allocator_stats().allocated_bytes;
  Trainer trainer(parse_train_args(raw), raw);
  trainer.train();
  const int64_t held = host_allocator_stats().allocated_bytes - held_before;
  const int64_t actual = trainer.model().num_parameters();

  const TrainArgs args = finished_args(raw, trainer.model().config().vocab_size);
  const MemoryLowerBound bound = memory_lower_bound(args, check_parallel_layout(args, 1).sizes);
  EXPECT_EQ(bound.device, Device::CPU);
  EXPECT_LE(bound.parameters, double(actual));
  EXPECT_GE(bound.parameters, 0.95 * double(actual));
  EXPECT_GT(bound.parameter_state_bytes, 0);
  EXPECT_LE(bound.parameter_state_bytes, double(held));
  EXPECT_GT(bound.activation_bytes, 0);
  EXPECT_EQ(bound.dataset_index_bytes, 0);  // mock data builds no index
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoE, MemoryBound, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "MoE" : "Dense"; });

// A hybrid model's layers are one part each: the bound leaves them out, so it stays below
// what a run holds (with MoE flags, every layer would otherwise be priced as attention +
// MoE; measured 5x above the plan before that).
TEST(MemoryBound, HybridStaysBelowWhatARunHolds) {
  RawOptions raw = tiny(true);
  raw.erase("num-layers");
  raw["hybrid-layer-pattern"] = {"MMME"};
  raw["mamba-head-dim"] = {"16"};
  raw["mamba-num-groups"] = {"2"};
  raw["mamba-state-dim"] = {"16"};
  raw["pipeline-model-parallel-size"] = {"1"};
  const int64_t held_before = host_allocator_stats().allocated_bytes;
  Trainer trainer(parse_train_args(raw), raw);
  trainer.train();
  const int64_t held = host_allocator_stats().allocated_bytes - held_before;
  const TrainArgs args = finished_args(raw, trainer.model().config().vocab_size);
  const MemoryLowerBound bound = memory_lower_bound(args, check_parallel_layout(args, 1).sizes);
  EXPECT_LE(bound.parameters, double(trainer.model().num_parameters()));
  EXPECT_LE(bound.parameter_state_bytes, double(held));
}

// Sharding the optimizer state, splitting the layers or the tensors lowers the bound of
// the busiest rank; a longer micro-batch raises its activations in proportion.
TEST(MemoryBound, FollowsTheLayout) {
  RawOptions raw = tiny(true);
  raw["num-layers"] = {"4"};
  const TrainArgs one = finished_args(raw, 1001);
  const MemoryLowerBound base = memory_lower_bound(one, check_parallel_layout(one, 1).sizes);

  RawOptions dist_raw = raw;
  dist_raw["use-distributed-optimizer"] = {"true"};
  const TrainArgs dist = finished_args(dist_raw, 1001);
  EXPECT_LT(memory_lower_bound(dist, check_parallel_layout(dist, 4).sizes).parameter_state_bytes,
            base.parameter_state_bytes);

  RawOptions pp_raw = raw;
  pp_raw["pipeline-model-parallel-size"] = {"2"};
  const TrainArgs pp = finished_args(pp_raw, 1001);
  EXPECT_LT(memory_lower_bound(pp, check_parallel_layout(pp, 2).sizes).parameter_state_bytes,
            base.parameter_state_bytes);

  RawOptions tp_raw = raw;
  tp_raw["tensor-model-parallel-size"] = {"2"};
  const TrainArgs tp = finished_args(tp_raw, 1001);
  EXPECT_LT(memory_lower_bound(tp, check_parallel_layout(tp, 2).sizes).parameters, base.parameters);

  RawOptions long_raw = raw;
  long_raw["micro-batch-size"] = {"8"};
  const TrainArgs longer = finished_args(long_raw, 1001);
  EXPECT_NEAR(memory_lower_bound(longer, check_parallel_layout(longer, 1).sizes).activation_bytes,
              4 * base.activation_bytes, 1e-6 * base.activation_bytes);
}

// A bf16 GPU run keeps 16 bytes per parameter (weight 2, main grad 4, moments 8, main param
// remainder 2: store_param_remainders), 18 with --no-store-param-remainders.
TEST(MemoryBound, Bf16MainParamsAreTwoByteRemainders) {
  auto gpu_bound = [](RawOptions raw) {
    TrainArgs args = parse_train_args(raw);  // parsed for the CPU: this machine has no GPU
    args.model.device = Device::CUDA;
    args.model.bf16 = true;
    args.model.vocab_size = 1001;
    args.model.tensor_model_parallel_size = args.parallel.tensor_model_parallel_size;
    args.model.finalize();
    return memory_lower_bound(args, check_parallel_layout(args, 1).sizes);
  };
  const RawOptions raw = tiny(false);
  RawOptions off = raw;
  off["no-store-param-remainders"] = {"true"};
  const MemoryLowerBound with = gpu_bound(raw), without = gpu_bound(off);
  ASSERT_GT(with.parameters, 0);
  EXPECT_NEAR(with.parameter_state_bytes, 16 * with.parameters, 1e-9 * with.parameters);
  EXPECT_NEAR(without.parameter_state_bytes, 18 * with.parameters, 1e-9 * with.parameters);
}

// --optimizer muon, sgd and lion: their params keep one fp32 state and an fp32 main param
// (never remainders) in place of Adam's two moments and main param. A bf16 GPU run, bytes
// per element (weight 2, main grad 4, then the optimizer's): SGD 2 + 4 + 4 + 4 = 14
// everywhere; Muon 14 on the layers' matrices and the learned position embeddings, 16 on the
// word embeddings (Adam, with remainders); Lion 14 on those, 18 on the word embeddings
// (Adam, remainders off for Lion: 2 + 4 + 8 + 4); Muon with the scalar Lion 14 everywhere.
// The word embeddings here: the padded vocabulary 1024 x hidden 64 = 65536 elements.
TEST(MemoryBound, MuonSgdLionKeepOneFp32StatePerElement) {
  auto gpu_bound = [](RawOptions raw) {
    TrainArgs args = parse_train_args(raw);  // parsed for the CPU: this machine has no GPU
    args.model.device = Device::CUDA;
    args.model.bf16 = true;
    args.model.vocab_size = 1001;
    args.model.tensor_model_parallel_size = args.parallel.tensor_model_parallel_size;
    args.model.finalize();
    return memory_lower_bound(args, check_parallel_layout(args, 1).sizes);
  };
  const double vocab = 1024 * 64;
  struct Case {
    std::vector<std::pair<std::string, std::string>> flags;
    double vocab_bytes, other_bytes;
  };
  const Case cases[] = {{{{"optimizer", "sgd"}}, 14, 14},
                        {{{"optimizer", "muon"}}, 16, 14},
                        {{{"optimizer", "lion"}}, 18, 14},
                        {{{"optimizer", "muon"}, {"muon-scalar-optimizer", "lion"}}, 14, 14}};
  for (const Case& c : cases) {
    RawOptions raw = tiny(false);
    for (const auto& [k, v] : c.flags) raw[k] = {v};
    SCOPED_TRACE(raw["optimizer"][0]);
    const MemoryLowerBound b = gpu_bound(raw);
    ASSERT_GT(b.parameters, vocab);
    EXPECT_NEAR(b.parameter_state_bytes,
                c.vocab_bytes * vocab + c.other_bytes * (b.parameters - vocab),
                1e-9 * b.parameter_state_bytes);
  }
  // On the CPU (fp32 weights, no main params) the bound stays below what a run holds (Adam's
  // 16 bytes per element counted for SGD's 12 would not).
  for (const char* optimizer : {"sgd", "muon", "lion"}) {
    SCOPED_TRACE(optimizer);
    RawOptions raw = tiny(true);
    raw["optimizer"] = {optimizer};
    const int64_t held_before = host_allocator_stats().allocated_bytes;
    Trainer trainer(parse_train_args(raw), raw);
    trainer.train();
    const double held = double(host_allocator_stats().allocated_bytes - held_before);
    const TrainArgs args = finished_args(raw, trainer.model().config().vocab_size);
    const MemoryLowerBound bound = memory_lower_bound(args, check_parallel_layout(args, 1).sizes);
    EXPECT_LE(bound.parameter_state_bytes, held);
    EXPECT_GT(bound.parameter_state_bytes, 0.8 * held);
  }
}

// Absurd flags give huge finite bounds, not wrapped integers.
TEST(MemoryBound, AbsurdSizesDoNotWrap) {
  RawOptions raw = tiny(false);
  raw["hidden-size"] = {"2000000000"};
  raw["num-attention-heads"] = {"2"};
  raw["micro-batch-size"] = {"2000000000"};
  raw["seq-length"] = {"2000000000"};
  raw["max-position-embeddings"] = {"2000000000"};
  const TrainArgs args = finished_args(raw, 1001);
  const MemoryLowerBound b = memory_lower_bound(args, check_parallel_layout(args, 1).sizes);
  EXPECT_TRUE(std::isfinite(b.model_bytes()));
  EXPECT_GT(b.parameter_state_bytes, 1e19);
  EXPECT_GT(b.activation_bytes, 1e27);
}

MemoryAvailable available(double host, double address_space = kUnlimited,
                          double device = kUnlimited) {
  MemoryAvailable a;
  a.host_physical = host;
  a.host_physical_source = "MemAvailable";
  a.host_address_space = address_space;
  a.device_free = device;
  return a;
}

// Returns the OutOfMemoryError's message, or "" when nothing was thrown.
std::string refusal(const MemoryLowerBound& b, const MemoryAvailable& a) {
  try {
    check_memory_fits(b, a);
  } catch (const OutOfMemoryError& e) {
    return e.what();
  }
  return "";
}

TEST(MemoryCheck, RefusesWhatCannotFitAndNamesTheFlagsAndBytes) {
  MemoryLowerBound b;
  b.device = Device::CPU;
  b.parameter_state_bytes = 3e9;
  b.activation_bytes = 5e12;
  b.parameter_flags = "num-layers 2 x hidden-size 64";
  b.activation_flags = "micro-batch-size 100000 x seq-length 4096";
  // Enough memory: nothing thrown.
  EXPECT_EQ(refusal(b, available(1e13)), "");
  // Activations dominate: their flags and both byte counts are named, on one line.
  const std::string host = refusal(b, available(2e10));
  EXPECT_NE(host.find("micro-batch-size 100000 x seq-length 4096"), std::string::npos) << host;
  EXPECT_NE(host.find("(5000000000000 bytes)"), std::string::npos) << host;
  EXPECT_NE(host.find("(20000000000 bytes) of host memory is available (MemAvailable)"),
            std::string::npos)
      << host;
  EXPECT_EQ(host.find('\n'), std::string::npos);
  // ulimit -v: the address space is the binding limit.
  const std::string as = refusal(b, available(1e13, 1e9));
  EXPECT_NE(as.find("of address space is available (ulimit -v"), std::string::npos) << as;
  // Parameters dominate.
  b.activation_bytes = 1e6;
  const std::string params = refusal(b, available(1e9));
  EXPECT_NE(params.find("num-layers 2 x hidden-size 64: the parameters and optimizer state"),
            std::string::npos)
      << params;
}

TEST(MemoryCheck, CudaRunsCompareTheModelWithDeviceMemoryAndTheIndexWithHostMemory) {
  MemoryLowerBound b;
  b.device = Device::CUDA;
  b.parameter_state_bytes = 9e10;
  b.activation_bytes = 1e10;
  b.dataset_index_bytes = 2e9;
  b.parameter_flags = "num-layers 80 x hidden-size 8192";
  b.activation_flags = "micro-batch-size 1 x seq-length 4096";
  b.dataset_flags = "train-iters 1000000 x global-batch-size 1024";
  // The model exceeds the device though the host has room.
  const std::string device = refusal(b, available(1e12, kUnlimited, 8e10));
  EXPECT_NE(device.find("of device memory is available (cudaMemGetInfo)"), std::string::npos)
      << device;
  // The device has room; the index does not fit the host.
  const std::string host = refusal(b, available(1e9, kUnlimited, 2e11));
  EXPECT_NE(host.find("train-iters 1000000 x global-batch-size 1024"), std::string::npos) << host;
  EXPECT_EQ(refusal(b, available(1e12, kUnlimited, 2e11)), "");
}

// Through the trainer: the check runs before the model is built, so a model of terabytes
// is refused at once rather than allocated and killed.
TEST(MemoryCheck, TrainerRefusesBeforeBuilding) {
  if (host_memory_available().available() == std::numeric_limits<int64_t>::max())
    GTEST_SKIP() << "this machine reports no memory limit";
  RawOptions raw = tiny(false);
  raw["hidden-size"] = {"400000"};
  raw["num-attention-heads"] = {"4"};
  raw["num-layers"] = {"64"};
  const int64_t held_before = host_allocator_stats().allocated_bytes;
  try {
    Trainer trainer(parse_train_args(raw), raw);
    ADD_FAILURE() << "a model of ~2e14 bytes was built";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("num-layers 64 x hidden-size 400000"), std::string::npos) << what;
    EXPECT_NE(what.find("of host memory is available"), std::string::npos) << what;
  }
  EXPECT_EQ(host_allocator_stats().allocated_bytes, held_before);
}

}  // namespace
}  // namespace megaton
