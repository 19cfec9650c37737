// The memory plan's parameter list (train/memory_plan.h, docs/memory.md): each parameter
// tensor of a model chunk on one rank, with what the optimizers route on, and the state of
// the rules other than Adam's (Muon's whole-matrix buffers and step scratch). Internal to
// the planner.
#pragma once
#include <string>
#include <vector>

#include "train/arguments.h"
#include "train/memory_plan.h"
#include "train/pipeline_schedule.h"

namespace megaton::memory_plan_detail {

// One parameter tensor of a rank: its elements, kind, dtype of its weight, and what
// DistributedAdamW::rule_of reads of it.
struct ParamShape {
  double numel = 0;
  bool expert = false;  // in the expert buffer (reduced over edp)
  bool fp8 = false;     // an FP8 weight (--fp8-param-gather)
  int unit = 0;         // GPTModel::param_units: 0 the embedding, 1 + i layer i, then the tail
  // A 2-D weight: its local (tensor-parallel) shape [rows, cols]; 0 for every other param
  // (norms, biases, Mamba's 3-D conv1d weight and its per-head vectors).
  double rows = 0, cols = 0;
  int tp_split_dim = -1;         // Param::tp_split_dim: 0 column-parallel, 1 row-parallel
  bool vocab = false;            // Param::padded_vocab_rows: the word embeddings, the output layer
  bool use_muon = true;          // Param::use_muon: false for a Mamba in_proj
  bool qkv = false;              // the fused QKV weight (Param::qkv_split_rows)
  bool word_embeddings = false;  // the word embeddings or their last-stage copy
  bool matrix() const { return rows > 0; }
};

// The parameters of model chunk `layers` in GPTModel's constructor order (embedding,
// layers, final norm, MTP depths, the tied embeddings' copy, the output layer), this rank's
// tensor- and expert-parallel slices (tp, etp, ep = 1: the unsharded model).
std::vector<ParamShape> chunk_params(const GPTConfig& m, const ChunkLayers& layers, bool pre,
                                     bool post, double tp, double etp, double ep);

// The update rule of a param: DistributedAdamW::rule_of itself, asked about a stand-in
// Param of the param's dimensions and flags (no tensor allocated).
enum class ParamRule { Adam, Muon, Sgd, Lion };
ParamRule rule_of(const optim::OptimizerConfig& optimizer, const ParamShape& p);

// A flat ParamAndGradBuffer's layout (model/param_buffer.cpp lay_out_flat): `sizes` in buffer
// order (the params reversed), each at a multiple of 64 elements; a bucket closed after the
// param that brings it to bucket_size elements or more (<= 0: one bucket), around a param
// `alone` (the tied word embeddings across pipeline stages), each padded to 64 x shards.
struct FlatLayout {
  std::vector<double> offsets;                     // per param, in buffer order
  std::vector<size_t> bucket;                      // per param, its bucket
  std::vector<std::pair<double, double>> buckets;  // [begin, end) elements
  double numel = 0;
};
FlatLayout flat_layout(const std::vector<double>& sizes, const std::vector<bool>& alone,
                       double bucket_size, double shards);

// The bytes the gradient sync of one bucket of `bucket_numel` elements holds until it is
// waited for, on the CPU under the distributed optimizer (dist/comm_mpi.cpp
// start_reduce_scatter): MPI reads a copy of the bucket (its output, the own shard, lies in
// it), BF16 ones widened to F32 with an F32 shard for the sum. NCCL reduces in place: 0 on
// CUDA.
double grad_sync_copy(double bucket_numel, double shards, double grad_bytes, Device device);

// The layer-wise distributed optimizer's Muon buffer of one kind (dense or expert) of one
// chunk (model/gpt.cpp: BufferLayout::WholeParams, every Muon param whole in one shard):
// its elements, and per shard the bytes of the Muon state its owner keeps (each owned
// param's fp32 momentum and, unless the weights are fp32, its fp32 main param), each tensor
// in its allocator block.
struct MuonBufferPlan {
  double numel = 0;
  std::vector<double> momentum, main_params;  // [shards]
  std::vector<int64_t> owner;                 // per param, the shard that updates it
  std::vector<double> bucket_numels;          // each bucket's elements
  bool bounded = false;  // laid out by the bound below, not by whole_params_layout
};
// params: the buffer's params in constructor order. Lays them out with
// model/param_buffer.h's whole_params_layout (the model's own function); where the sizes
// pass 64-bit integers or the shards 65536 (absurd flags) by the bound instead: every shard
// round_up(1.3 x the even share + the largest param, 64) long, shard 0 holding that much
// state.
MuonBufferPlan plan_muon_buffer(const std::vector<ParamShape>& params, int64_t shards,
                                int64_t bucket_size, bool main_params, Device device);

// The most bytes Muon's step holds beside the persistent state (optim/muon_optimizer.cpp
// Muon::step; ops/cuda/muon.cpp newton_schulz) for `params`, the Muon matrices one rank
// updates: a batch of matrices of one local shape that need no TP collective nor the QKV
// split ([n, rows, cols] in the iteration's dtype, n up to 256 MiB of fp32: Muon's
// kBatchBytes), or one other matrix alone with its TP gather or QKV pieces; and what that is.
struct MuonStepScratch {
  double bytes = 0;
  std::string what;  // "a batch of 2 [1024, 256]", "[768, 256] (QKV, split)", for the report
};
MuonStepScratch muon_step_scratch(const TrainArgs& args, const std::vector<ParamShape>& params,
                                  double tp, double etp);

}  // namespace megaton::memory_plan_detail
