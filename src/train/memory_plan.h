// Memory plan: the bytes the busiest rank of a training run holds at its peak, term by
// term, from the flags alone (`megaton train ... --dry-run`; docs/memory.md "Memory plan").
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/grid.h"
#include "train/arguments.h"

namespace megaton {

// Every term in bytes (doubles: absurd flags give huge values, not wrapped integers),
// counted tensor by tensor from what Megaton allocates, each tensor rounded up to its
// allocator's block (memory_plan_block_bytes), for the busiest rank: the pipeline stage
// whose peak is highest (tensor-, expert- and data-parallel ranks of one stage hold the
// same amounts, MoE routing assumed balanced).
struct MemoryPlan {
  Device device = Device::CPU;
  DType compute_dtype = DType::F32;
  DType main_grads_dtype = DType::F32;  // GPTConfig::main_grads_dtype
  // --use-megatron-fsdp's strategy ("" without): what the weights and main grads terms hold.
  std::string fsdp;
  DType main_params_dtype = DType::F32;  // AdamWConfig::main_params_dtype
  dist::ParallelSizes sizes;             // resolved: tp, cp, ep, etp, pp, vpp, dp, edp, world
  bool sequence_parallel = false;        // in effect (tp > 1)
  int64_t stage = 0;                     // the busiest pipeline stage
  int64_t stage_layers = 0, stage_moe_layers = 0;  // transformer layers on it, MoE among them
  int64_t micro_batches = 1;                       // per step on one data-parallel rank
  // (micro-batch, model chunk) pairs whose activations are held at the peak, the peak's
  // own included (1 without a pipeline; 1F1B: up to pp - stage micro-batches).
  int64_t in_flight = 1;
  std::string schedule;   // "no pipeline", "1F1B", "interleaved 1F1B, 2 chunks per stage"
  std::string recompute;  // "none", "selective: core_attn, mlp", "full, uniform, 2 layers"
  std::string peak_at;    // the step of the peak ("the output layer's backward", ...)

  // Parameter counts in elements. total, active: the whole model once (every stage, the
  // padded vocabulary, no replica counted twice; active: top-k of each MoE layer's experts,
  // as train/flops.cpp counts them). rank: held by the busiest rank (its tensor- and
  // expert-parallel shards; a tied embedding's copy on the last stage counted).
  double total_parameters = 0, active_parameters = 0;
  double rank_parameters = 0, rank_expert_parameters = 0;

  // Persistent bytes of the rank (model/param_buffer.h, optim/adamw.h,
  // optim/distrib_optimizer.h): the compute weights (one buffer per dtype and kind:
  // dense, expert, FP8 under --fp8-param-gather), the main grads (whole on every
  // rank, in main_grads_dtype; BF16 ones with model/main_grad.h's fp32 scratch), the fp32 main
  // params where the weight is not fp32, or their 16-bit remainders beside bf16 weights
  // (store_param_remainders) (one tensor per parameter, or per piece of this rank's shard under
  // --use-distributed-optimizer) and the Adam moments in their dtypes (same tensors as the main
  // params); other_state: router statistics, the optimizer's step state, FP8 scales, the trainer's
  // batch buffers.
  // Under --optimizer muon, sgd or lion (optim/distrib_optimizer.h rule_of) Adam's params keep
  // the terms above; the others have an fp32 main param (beside weights that are not fp32)
  // and one fp32 state in `momentum` (Muon's and SGD's momentum_buffer, Lion's exp_avg). With
  // the distributed optimizer Muon's params lie whole in their own buffers
  // (BufferLayout::WholeParams): the weights and main grads terms count those buffers, and
  // main_params and momentum the state of the shard that holds the most.
  double weights = 0, main_params = 0, main_grads = 0, exp_avg = 0, exp_avg_sq = 0;
  double momentum = 0;
  double other_state = 0;
  std::string optimizer = "adam";  // --optimizer
  // The layer-wise distributed optimizer (Muon's matrices whole in their own buffers): the
  // busiest shard of the dense and expert groups and their state (one line, "" without);
  // bounded: a Muon buffer laid out by the bound (sizes past 64-bit integers, or more than
  // 65536 shards).
  std::string muon_layout;
  bool muon_bounded = false;
  // Candidate peaks after the backward, when the activations are gone (train/memory_plan.cpp):
  // the most bytes Muon's step holds beside the persistent state, for a batch of matrices of
  // one shape or one matrix alone (optim/muon_optimizer.cpp), and which ("batch of 2
  // [1024, 256]"); on the CPU under the distributed optimizer, the copies of the gradient
  // buckets its MPI reduce-scatter reads (dist/comm_mpi.cpp; NCCL reduces in place).
  double muon_step_scratch = 0;
  std::string muon_step_what;
  double grad_sync_scratch = 0;
  // --optimizer-cpu-offload: the main params and moments held in pinned host memory
  // instead (left out of the terms above).
  double offloaded_optimizer_bytes = 0;

  // The peak beyond the persistent bytes, split at its moment:
  double activations = 0;            // what the peak's micro-batch saved on its chunk
  double in_flight_activations = 0;  // what the other in-flight micro-batches saved
  double logits_and_loss = 0;        // logits [T, V/tp] and the loss vectors (last stage)
  double working_set = 0;            // transient tensors of the step at the peak
  double workspaces = 0;             // CUDA: cuBLASLt workspace + cuDNN attention estimate
  // One micro-batch's saved activations on the busiest stage (all its chunks), with the
  // recompute choice, for the table; and each stage's planned peak [pp].
  double activations_per_micro_batch = 0;
  std::vector<double> stage_totals;
  // What the plan assumes (one line each), printed under the table.
  std::vector<std::string> assumptions;

  double optimizer_state() const { return main_params + exp_avg + exp_avg_sq + momentum; }
  double persistent() const {
    return weights + main_params + main_grads + exp_avg + exp_avg_sq + momentum + other_state;
  }
  double peak_activations() const {
    return activations + in_flight_activations + logits_and_loss + working_set;
  }
  double total() const { return persistent() + peak_activations() + workspaces; }
};

// The plan of `args` (args.model finalized: padded_vocab_size known; args.model.device
// the device planned for) on `layout` (check_parallel_layout(args, world)). Allocates no
// tensor. Throws megaton::Error only where the flags do not divide (as the layout checks).
MemoryPlan plan_memory(const TrainArgs& args, const dist::ValidatedLayout& layout);

// The bytes the allocator of `device` holds for a request of `bytes` (its block):
// host (core/tensor.cpp rounded_bytes): 64-byte multiples up to 4 KiB, then 8 classes per
// power of two; CUDA (core/cuda/allocator.cpp size_class): 512-byte multiples up to
// 1 MiB, then 8 classes per power of two. A request of 0 bytes takes none.
double memory_plan_block_bytes(double bytes, Device device);

// The plan as a table, one line per term (bytes, GiB, MB), the layout's shares and the
// total, then the assumptions, for `megaton train --dry-run`.
std::string format_memory_plan(const MemoryPlan& plan);

// `megaton train ... --dry-run`: finishes args as the trainer does (the tokenizer's
// vocabulary, padded for tp), validates the layout and the batch split on `world` ranks
// as a run would (megaton::Error, exit 2, on bad flags), prints the plan to `out` and,
// when its total exceeds what memory_available() reports for the device, one warning
// line to `err`. Builds no model and allocates nothing on the device; returns 0.
int run_dry_run(TrainArgs args, int64_t world, std::FILE* out, std::FILE* err);

// The world size a dry run plans for: the launcher's (mpirun/srun) when there is one,
// else the WORLD_SIZE environment variable (as Megatron reads it under torchrun), else 1.
// Throws megaton::Error naming WORLD_SIZE when it is not a positive integer.
int64_t dry_run_world_size();

}  // namespace megaton
