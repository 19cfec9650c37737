// The memory plan (train/memory_plan.h) under --optimizer muon, sgd and lion (issue 24): the
// optimizer state of each param by its rule (Adam two moments, Muon / SGD / Lion one fp32
// state, their main params fp32), Muon's whole-matrix buffers under the distributed
// optimizer (the busiest shard), and Muon's step scratch, with numbers derived by hand;
// a run whose peak is Muon's step, against the host allocator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/main_grad.h"
#include "train/arguments.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

namespace megaton {
namespace {

// One dense layer without biases, RoPE, tied embeddings, so that every tensor is a power
// of two or three times one (hidden 256, 4 heads of 64, ffn 1024, vocab 1000 padded to
// 1024). Elements of each param, in GPTModel's order:
//   word embeddings [1024, 256]    262144  (vocab: Adam under muon and lion, SGD under sgd)
//   input_layernorm [256]             256  (Adam, or the scalar optimizer)
//   linear_qkv [768, 256]          196608  (a matrix: Muon, SGD or Lion)
//   linear_proj [256, 256]          65536
//   pre_mlp_layernorm [256]           256
//   linear_fc1 [1024, 256]         262144
//   linear_fc2 [256, 1024]         262144
//   final_layernorm [256]             256
// so 786432 matrix elements and 262912 others.
RawOptions one_layer() {
  return {{"device", {"cpu"}},
          {"mock-data", {"true"}},
          {"tokenizer-type", {"NullTokenizer"}},
          {"vocab-size", {"1000"}},
          {"num-layers", {"1"}},
          {"hidden-size", {"256"}},
          {"num-attention-heads", {"4"}},
          {"ffn-hidden-size", {"1024"}},
          {"seq-length", {"16"}},
          {"micro-batch-size", {"1"}},
          {"global-batch-size", {"1"}},
          {"train-iters", {"1"}},
          {"eval-iters", {"0"}},
          {"log-interval", {"1000"}},
          {"normalization", {"RMSNorm"}},
          {"disable-bias-linear", {"true"}},
          {"position-embedding-type", {"rope"}},
          {"hidden-dropout", {"0"}},
          {"attention-dropout", {"0"}}};
}

RawOptions with(RawOptions raw, const std::vector<std::pair<std::string, std::string>>& flags) {
  for (const auto& [k, v] : flags) raw[k] = {v};
  return raw;
}

// The plan on `world` ranks; `gpu`: for --device cuda --bf16 (made on this machine, which
// has no GPU), where the main params are apart from the bf16 weights.
MemoryPlan plan_of(const RawOptions& raw, int64_t world = 1, bool gpu = false) {
  TrainArgs args = parse_train_args(raw);
  if (gpu) {
    args.model.device = Device::CUDA;
    args.model.bf16 = true;
  }
  args.model.vocab_size = args.vocab_size + 1;
  args.model.tensor_model_parallel_size = args.parallel.tensor_model_parallel_size;
  args.model.finalize();
  return plan_memory(args, check_parallel_layout(args, world));
}

double cuda_block(double bytes) { return memory_plan_block_bytes(bytes, Device::CUDA); }
double cpu_block(double bytes) { return memory_plan_block_bytes(bytes, Device::CPU); }

// A bf16 GPU plan, per element (every tensor here a multiple of 512 bytes and at most
// 1 MiB: the CUDA cache's block is the tensor): Adam 2 (remainder) + 4 + 4 (moments); Muon,
// SGD, Lion 4 (fp32 main param) + 4 (state). So, with M = 786432 matrix and A = 262912
// other elements:
//   adam:  main 2 (M + A), exp_avg = exp_avg_sq = 4 (M + A), momentum 0
//   muon:  main 4 M + 2 A, exp_avg 4 A, momentum 4 M
//   muon, scalar lion: main 4 (M + A) (finish_args turns remainders off), momentum 4 (M + A)
//   sgd:   main 4 (M + A), momentum 4 (M + A), no moments
//   lion:  the vocab and norms take Adam with fp32 main params (remainders off): main
//          4 (M + A), exp_avg 4 A, momentum 4 M
TEST(MemoryPlanOptimizers, StateBytesPerElementByRule) {
  const double M = 786432, A = 262912;
  struct Expect {
    std::vector<std::pair<std::string, std::string>> flags;
    double main, exp_avg, momentum;
  };
  const Expect cases[] = {
      {{}, 2 * (M + A), 4 * (M + A), 0},
      {{{"optimizer", "muon"}}, 4 * M + 2 * A, 4 * A, 4 * M},
      {{{"optimizer", "muon"}, {"muon-scalar-optimizer", "lion"}}, 4 * (M + A), 0, 4 * (M + A)},
      {{{"optimizer", "sgd"}}, 4 * (M + A), 0, 4 * (M + A)},
      {{{"optimizer", "lion"}}, 4 * (M + A), 4 * A, 4 * M},
  };
  const MemoryPlan adam = plan_of(one_layer(), 1, true);
  for (const Expect& e : cases) {
    const MemoryPlan p = plan_of(with(one_layer(), e.flags), 1, true);
    SCOPED_TRACE(p.optimizer);
    EXPECT_EQ(p.main_params, e.main);
    EXPECT_EQ(p.exp_avg, e.exp_avg);
    EXPECT_EQ(p.exp_avg_sq, e.exp_avg);
    EXPECT_EQ(p.momentum, e.momentum);
    // Replicated: the buffers are Adam's.
    EXPECT_EQ(p.weights, adam.weights);
    EXPECT_EQ(p.main_grads, adam.main_grads);
    EXPECT_EQ(p.optimizer_state(), e.main + 2 * e.exp_avg + e.momentum);
  }
  // The report names the one state when there is one.
  EXPECT_NE(format_memory_plan(plan_of(with(one_layer(), {{"optimizer", "sgd"}}), 1, true))
                .find("Muon / SGD momentum_buffer, Lion exp_avg (fp32)"),
            std::string::npos);
}

// Muon with the distributed optimizer on DP2: the four matrices in a WholeParams buffer of
// their own, walked fc2, fc1, proj, qkv and placed by Newton-Schulz cost max(m,n) min(m,n)^2:
// fc2 and fc1 (2^26 each) first, fc2 on shard 0, fc1 on shard 1; qkv (768 x 256^2) on the
// tie, shard 0 (262144 + 196608 = 458752 elements, within 1.3 x 393216); proj (2^24) on the
// lighter shard 1. Shards of 458752 elements, the buffer 917504. Shard 0, the busiest, keeps
// fc2's and qkv's momentum (and on the GPU their fp32 main params): 4 x 458752 bytes each.
// The other params (embeddings and norms, 262912 elements) in the flat buffer of two
// shards of 131456, whose shard 0 holds the three norms (256 each) and 130688 elements of
// the embeddings: Adam's moments of those pieces.
TEST(MemoryPlanOptimizers, LayerWiseMuonKeepsTheBusiestShardsWholeMatrices) {
  const RawOptions raw =
      with(one_layer(), {{"optimizer", "muon"}, {"use-distributed-optimizer", "true"}});
  for (const bool gpu : {false, true}) {
    SCOPED_TRACE(gpu ? "bf16 GPU plan" : "CPU plan");
    const MemoryPlan p = plan_of(raw, 2, gpu);
    auto block = [&](double bytes) { return gpu ? cuda_block(bytes) : cpu_block(bytes); };
    const double cb = gpu ? 2 : 4;
    EXPECT_EQ(p.weights, block(262912 * cb) + block(917504 * cb));
    EXPECT_EQ(p.momentum, block(4 * 262144) + block(4 * 196608));
    EXPECT_EQ(p.exp_avg, 3 * block(4 * 256) + block(4 * 130688));
    // Beside bf16 weights: the Muon params' fp32 main params, the Adam pieces' remainders
    // (their buffer holds Adam's params only).
    EXPECT_EQ(p.main_params, gpu ? p.momentum + 3 * block(2 * 256) + block(2 * 130688) : 0.0);
    EXPECT_NE(p.assumptions.end(),
              std::find_if(p.assumptions.begin(), p.assumptions.end(), [](const std::string& a) {
                return a.find("dense shard 0 of 2") != std::string::npos;
              }));
  }
}

// Muon's step scratch (CPU: fp32 in place, the fp64 iteration outside the allocator):
// - QKV split: the update [768, 256] (786432 bytes), its three pieces [256, 256] (786432
//   in all), the joined result (786432): 2359296 bytes; the other matrices, each its own
//   shape, are batches of one: at most fc1's update, 1048576.
// - --muon-no-split-qkv: every matrix batched: fc1's (or fc2's) 1048576.
// - TP2, duplicated: QKV [384, 256] local: update 393216 + gathered whole 786432 + pieces
//   786432 + result 786432 = 2752512 (fc2 [256, 512] row-parallel: update 524288 + gathered
//   + its column copy 2 x 1048576 = 2621440, less).
// - TP2, distributed: QKV: update 393216 + pieces 393216 + a piece's Gram batch F32
//   [1, 256, 256] for the all-reduce (262144) = 1048576, then the joined result: 3 x 393216
//   = 1179648.
// - A bf16 GPU plan (medium precision: BF16 copies): QKV: update and pieces 786432 each,
//   per piece its BF16 copy, Newton-Schulz's scratch copy, Gram and polynomial [256, 256]
//   (131072 each): 2097152; the join 2359296 again. fc1 alone: its BF16 batch of one and
//   scratch (524288 each) + Gram and polynomial = 1310720.
TEST(MemoryPlanOptimizers, MuonStepScratchByHand) {
  const RawOptions muon = with(one_layer(), {{"optimizer", "muon"}});
  EXPECT_EQ(plan_of(muon).muon_step_scratch, 2359296);
  EXPECT_EQ(plan_of(with(muon, {{"muon-no-split-qkv", "true"}})).muon_step_scratch, 1048576);
  const RawOptions tp2 = with(muon, {{"tensor-model-parallel-size", "2"}});
  EXPECT_EQ(plan_of(tp2, 2).muon_step_scratch, 2752512);
  EXPECT_EQ(plan_of(with(tp2, {{"muon-tp-mode", "distributed"}}), 2).muon_step_scratch, 1179648);
  EXPECT_EQ(plan_of(muon, 1, true).muon_step_scratch, 2359296);
  EXPECT_EQ(plan_of(with(muon, {{"muon-no-split-qkv", "true"}}), 1, true).muon_step_scratch,
            1310720);
  // Without Muon there is none.
  EXPECT_EQ(plan_of(one_layer()).muon_step_scratch, 0);
  EXPECT_EQ(plan_of(with(one_layer(), {{"optimizer", "lion"}})).muon_step_scratch, 0);
}

// 16 tokens: the activations are far below Muon's step scratch, which is the peak: the
// persistent state and the peak against a real run's host allocator.
TEST(MemoryPlanOptimizers, MuonStepPeakAgainstARun) {
  for (const bool split : {true, false}) {
    SCOPED_TRACE(split ? "QKV split" : "--muon-no-split-qkv");
    RawOptions raw = with(one_layer(), {{"optimizer", "muon"}});
    if (!split) raw["muon-no-split-qkv"] = {"true"};
    const MemoryPlan plan = plan_of(raw);
    ASSERT_EQ(plan.peak_at.rfind("the optimizer step", 0), 0u) << plan.peak_at;
    release_main_grad_scratch();
    const int64_t before = host_allocator_stats().allocated_bytes;
    reset_peak_host_memory();
    Trainer trainer(parse_train_args(raw), raw);
    const double persistent = double(host_allocator_stats().allocated_bytes - before);
    trainer.train();
    const double peak = double(host_allocator_stats().peak_allocated_bytes - before);
    std::printf(" plan: persistent %.0f (measured %.0f), peak %.0f (measured %.0f) at %s\n",
                plan.persistent(), persistent, plan.total(), peak, plan.peak_at.c_str());
    EXPECT_NEAR(plan.persistent(), persistent, 4096.0);
    // The step's scratch is counted tensor by tensor: the peak to a few small tensors.
    EXPECT_NEAR(plan.total(), peak, 16384.0) << "scratch " << plan.muon_step_scratch;
  }
}

}  // namespace
}  // namespace megaton
