// Memory check: a lower bound of the bytes the busiest rank of a training run needs,
// compared with what the machine has, before anything large is allocated.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/grid.h"
#include "train/arguments.h"

namespace megaton {

// The terms of the bound, in bytes, for the busiest rank of the layout. Doubles, so that
// absurd flags (a hidden size of 10^7, a micro-batch of 10^9) give huge values instead of
// wrapping. Every term counts only memory that the run certainly holds at one time, so
// the sum is a LOWER bound: a run the check refuses cannot fit; a run it lets through may
// still not. The formulas (docs in memory_check.cpp, where they are computed):
//
//   cb = compute bytes: 2 under --bf16 on CUDA, else 4 (the CPU computes fp32)
//   per parameter element: cb (weight) + 4 (fp32 main grad) + (e1 + e2) / s (Adam's two
//     moments, e = 4 bytes for fp32, 2 for --exp-avg-dtype / --exp-avg-sq-dtype bf16) +
//     [cb == 2] 4 / s (fp32 main param), with s = dp (dense) or edp (experts) under
//     --use-distributed-optimizer, else 1; for the elements of a param that takes Muon,
//     SGD or Lion (--optimizer; the layers' matrices and the learned position embeddings,
//     and under SGD or Muon's scalar Lion the word embeddings and output layer too) 4 / s (one fp32
//     state) + [cb == 2] 4 / s (fp32 main param) instead of the moments and main param
//   parameters of a rank: its layers' matrices (attention QKV and projection, dense MLP
//     fc1/fc2 or MoE router + its ep share of the experts split over etp + shared
//     expert), split over tp; the word embeddings (padded vocabulary / tp) and learned
//     position embeddings on the first stage; the output layer (untied) or the tied
//     embeddings' copy (pp > 1) on the last. Biases, norms and gates are left out.
//   activations of one micro-batch, T = micro-batch-size x seq-length tokens, per layer
//     of the rank: cb x (4 x T_local x hidden [layer input, the two norm outputs, the
//     attention residual] + T x (2 heads + 2 query-groups) / tp x kv-channels [q, k, v
//     and the attention output]) + dense layers cb x T x fc1-width / tp [fc1 output];
//     on the last stage the logits cb x T x padded-vocab / tp. T_local = T / tp under
//     sequence parallelism. MoE expert activations depend on routing: left out.
//   dataset indices (real data): building the train split's indices holds its sample
//     index (16 bytes per sample + 16) and shuffle index (8 bytes per sample) at once,
//     24 x train-iters x global-batch-size bytes at least; a blend holds its dataset
//     index (2 + 8 bytes per sample).
struct MemoryLowerBound {
  Device device = Device::CPU;       // where parameters and activations live
  int64_t busiest_stage = 0;         // pipeline rank of the bound, -1: the stages' average
  double parameters = 0;             // parameter elements on that rank
  double parameter_state_bytes = 0;  // weights, main params, main grads, Adam moments
  double activation_bytes = 0;       // one micro-batch's activations (+ logits)
  double dataset_index_bytes = 0;    // host memory, for CPU and CUDA runs alike
  // The flags behind each term, for messages: "num-layers 2 x hidden-size 10000000",
  // "micro-batch-size 100000 x seq-length 4096", "train-iters 1000 x global-batch-size 8".
  std::string parameter_flags;
  std::string activation_flags;
  std::string dataset_flags;

  // Parameter state + activations: what must fit the model's device.
  double model_bytes() const { return parameter_state_bytes + activation_bytes; }
};

// The bound for `args` (args.model finalized: padded_vocab_size known) on the resolved
// layout `sizes` (check_parallel_layout(...).sizes). Throws megaton::Error only as
// check_parallel_layout does (it is called for the layers of each stage).
MemoryLowerBound memory_lower_bound(const TrainArgs& args, const dist::ParallelSizes& sizes);

// Memory the run can have, in bytes; +infinity where unknown or unlimited.
struct MemoryAvailable {
  double host_physical = 0;  // min(MemAvailable, cgroup) + SwapFree
  std::string host_physical_source;
  double host_address_space = 0;  // RLIMIT_AS - VmSize (ulimit -v)
  double device_free = 0;         // cudaMemGetInfo (CUDA runs)
};
// Reads the host's limits (host_memory_available) and, for a CUDA device in a CUDA build,
// the current device's free memory.
MemoryAvailable memory_available(Device device);

// Throws megaton::OutOfMemoryError (a megaton::Error: one line, exit 2) when the bound
// cannot fit:
//   CPU run:  max(dataset, model) > host_physical   (the index is freed before the model
//             is built), or dataset + model > host_address_space (its cache stays mapped);
//             the tighter of the two limits is checked first, so the message names it;
//   CUDA run: model > device_free, or dataset > host_physical or host_address_space.
// The message names the dominant term's flags and both byte counts, e.g.
// "micro-batch-size 100000 x seq-length 4096: one micro-batch's activations need at least
// 3.3 TB (3276800000000 bytes); 21.4 GB (21400000000 bytes) of host memory is available
// (MemAvailable)".
void check_memory_fits(const MemoryLowerBound& bound, const MemoryAvailable& available);

// The two together, for the trainer: memory_lower_bound then check_memory_fits against
// memory_available(args.model.device).
void check_memory_fits(const TrainArgs& args, const dist::ParallelSizes& sizes);

}  // namespace megaton
