// --cuda-graph-impl full_iteration: the training step captured as one CUDA graph and
// replayed (Megatron's FullCudaGraphWrapper and OptimizerCudaGraphWrapper in one graph:
// Megaton's step, optimizer included, makes no host synchronization on one GPU; docs/cuda.md
// "CUDA graphs").
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

#include "train/arguments.h"

namespace megaton {

// Refuses, with megaton::Error naming the flag, what a captured step cannot hold: a CPU
// run, more than one rank, dropout and the router's jitter and forced balance (their
// random streams are keyed by the iteration on the host), MoE layers under FP8 or an
// expert capacity (their per-expert counts come to the host), --log-num-zeros-in-grad
// (read between backward and the update), --reset-attention-mask (each micro-batch's
// document count and longest document are host values of the attention call) and
// MEGATON_OP_PROFILE=1 (it times each op on the host). Nothing when cuda_graph_impl is none.
void check_full_iteration_graph(const TrainArgs& args, int64_t world_size);

// The step's graph. run(body) runs `body` (one whole training step: forward, backward,
// reductions, optimizer) eagerly for the first `warmup_steps` calls (cuBLASLt and cuDNN
// plans, the allocator's blocks and the lazily built state settle); the next call
// captures it (core/cuda/graph.h: its allocations come from the graph's own pool) and
// replays it; every later call only replays it, without running `body`. So `body` must
// (a) read everything that changes from step to step from device memory written before
// run() (the trainer's batch and learning-rate buffers), and (b) leave its outputs in
// objects that outlive the graph: the tensors it stored at the capture are those every
// replay rewrites.
//
// Errors: megaton::Error when the step cannot be captured (a host synchronization inside
// it: the message says the configuration needs the graph-free step); CUDA builds only
// (InternalError otherwise, which check_full_iteration_graph prevents).
class FullIterationGraph {
 public:
  explicit FullIterationGraph(int64_t warmup_steps);
  ~FullIterationGraph();
  FullIterationGraph(const FullIterationGraph&) = delete;
  FullIterationGraph& operator=(const FullIterationGraph&) = delete;

  void run(const std::function<void()>& body);
  bool captured() const;
  // Device bytes held by the graph's memory pool; nodes of the captured graph.
  int64_t pool_bytes() const;
  int64_t num_nodes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megaton
