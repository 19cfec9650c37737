// Pipeline parallelism: the layers of each model chunk (Megatron's
// get_transformer_layer_offset), each pipeline rank's order of forward and backward steps
// (1F1B and interleaved 1F1B), and the schedule that runs them, sending activations and
// gradients between stages.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "dist/comm.h"
#include "dist/grid.h"
#include "model/gpt.h"
#include "train/loss_mask.h"

namespace megaton {

// Global transformer layers [first_layer, first_layer + num_layers) of one model chunk.
struct ChunkLayers {
  int64_t first_layer = 0;
  int64_t num_layers = 0;
  bool operator==(const ChunkLayers&) const = default;
};

// The layers of model chunk `chunk` (of `vpp` chunks per pipeline rank, 1 without
// interleaving) of pipeline rank `pp_rank`. layers_per_stage [pp]: every stage's layer
// count (dist::ValidatedLayout::layers_per_stage, uneven first/last stages included), each
// divisible by vpp. Stage s's chunks hold L_s / vpp layers each, and the chunks are laid
// out chunk-major: chunk c of rank s starts at c * sum_t (L_t / vpp) + sum_{t < s} L_t / vpp
// (Megatron's get_transformer_layer_offset and get_num_layers_to_build). Throws
// InternalError on an argument out of range or a stage not divisible by vpp.
ChunkLayers chunk_layers(const std::vector<int64_t>& layers_per_stage, int64_t vpp, int64_t pp_rank,
                         int64_t chunk);

// The interleaved schedule (vpp > 1) runs micro-batches in groups of pp per model chunk
// (Megatron's microbatch_group_size_per_vp_stage, default pp), so the micro-batches of a
// step on a data-parallel rank must be a multiple of pp. Throws megaton::Error with one
// line naming the numbers otherwise; nothing when vpp == 1.
void check_interleaved_micro_batches(int64_t num_micro_batches, int64_t pp, int64_t vpp);

// A forward or backward step of one micro-batch on one model chunk of a pipeline rank.
struct PipelineOp {
  bool forward = true;
  int64_t micro_batch = 0;
  int64_t chunk = 0;
  bool operator==(const PipelineOp&) const = default;
};

// Pipeline rank `rank`'s steps in Megatron's order, for num_micro_batches (M) micro-batches:
// - vpp == 1 (forward_backward_pipelining_without_interleaving): min(pp - rank - 1, M)
//   warmup forwards, then a forward and a backward in turn (1F1B), then the remaining
//   backwards; micro-batches in order, one chunk.
// - vpp > 1 (forward_backward_pipelining_with_interleaving, micro-batch groups of pp):
//   forward k runs micro-batch and chunk k of get_schedule_table's order (pp micro-batches
//   on chunk 0, the same on chunk 1, ..., then the next group), backward k the same
//   micro-batch on chunk vpp - 1 - chunk; min(2 (pp - rank - 1) + (vpp - 1) pp, M vpp)
//   warmup forwards, then one forward and one backward in turn, then the rest.
// forward_only: the forwards alone, in the same order. Needs pp >= 2, vpp >= 1, M >= 1
// (InternalError otherwise) and, for vpp > 1, check_interleaved_micro_batches.
std::vector<PipelineOp> pipeline_rank_order(int64_t pp, int64_t vpp, int64_t rank,
                                            int64_t num_micro_batches, bool forward_only);

// A (model chunk, micro-batch) of this rank that a received tensor is for; chunk -1: none.
struct PipelineSlot {
  int64_t chunk = -1;
  int64_t micro_batch = -1;
  bool defined() const { return chunk >= 0; }
  bool operator==(const PipelineSlot&) const = default;
};

// One step of a pipeline rank's plan: at most one op, then the transfers of the same tick
// in two exchanges: first the forward direction (send this op's output to the next rank,
// receive an activation from the previous one), then the backward direction (send this
// op's input gradient to the previous rank, receive a gradient from the next one).
// Ranks are pipeline ranks; next and previous wrap around (the last rank's chunk c feeds
// the first rank's chunk c + 1 in the interleaved schedule).
struct PipelineStep {
  int64_t tick = 0;
  std::optional<PipelineOp> op;
  bool send_next = false;  // op is a forward whose output goes to the next rank
  PipelineSlot recv_prev;  // activation arriving from the previous rank
  bool send_prev = false;  // op is a backward whose input gradient goes to the previous rank
  PipelineSlot recv_next;  // gradient arriving from the next rank
};

// The plans of all pipeline ranks [pp][steps]: each rank runs pipeline_rank_order's steps
// in order; at tick t a rank runs its next step if the activation or gradient it needs
// arrived at an earlier tick (else it waits), and what it produces is sent at tick t. Both
// ends of every transfer see it at the same tick and phase, so the blocking exchanges of
// any two ranks match one for one and cannot deadlock (the rank at the earliest pending
// tick can always finish its exchange). Steps without op or transfer are left out.
// InternalError when the orders cannot complete (a bug).
std::vector<std::vector<PipelineStep>> pipeline_plan(int64_t pp, int64_t vpp,
                                                     int64_t num_micro_batches, bool forward_only);

// The micro-batches of one training (or evaluation) step on this data-parallel rank.
struct PipelineMicroBatches {
  int64_t count = 0;  // micro-batches
  int64_t batch = 0;  // micro-batch size B
  int64_t seq = 0;    // sequence length S
  // Fills tokens and labels [B, S] int32 (host) of micro-batch mb (0 <= mb < count).
  // Called only on the ranks whose chunks read them (first and last stage).
  std::function<void(int64_t mb, Tensor& tokens, Tensor& labels)> load;
  // --eod-mask-loss: the loss mask of micro-batch mb from its tokens (as load fills them),
  // called on the last stage only. Empty: every token's loss counts (and the schedule
  // runs no extra op).
  std::function<LossMask(int64_t mb, const Tensor& tokens)> loss_mask;
  // The ForwardContext of micro-batch mb (its dropout masks; the backward uses the keys
  // its forward saved).
  std::function<ForwardContext(int64_t mb)> context;
  // The loss scale (optim::GradScaler::scale): the backward starts from the loss times it,
  // and the MoE aux losses' gradients carry it too. 1: no scaling.
  float loss_scale = 1.0f;
  // --calculate-per-token-loss: the last stage's backward starts from loss_scale times the
  // mask (1 without one), not divided by the micro-batch's tokens nor by count, and the
  // MoE aux losses' gradients carry loss_scale x batch x seq (Megatron's router multiplies
  // them by its tokens); the caller divides the gradients by the step's tokens.
  bool per_token_loss = false;
};

// What this pipeline rank computed in one step.
struct PipelineLosses {
  // Sum of per-token losses (times the loss mask with PipelineMicroBatches::loss_mask)
  // and the tokens they cover (the mask's sum): last stage only, else 0.
  double loss_sum = 0;
  double num_tokens = 0;
  // Sum over micro-batches of this rank's MoE layers' aux losses: [1] fp32 on the model's
  // device (no host synchronization), undefined without MoE layers; aux_loss_sum() reads
  // it (0 when undefined).
  Tensor aux_losses;
  // --mtp-num-layers: the MTP depths' losses summed over micro-batches ([D] fp32 on the
  // device; last stage only, else undefined).
  Tensor mtp_losses;
  double aux_loss_sum() const {
    return aux_losses.defined() ? double(aux_losses.to(Device::CPU).f32()[0]) : 0.0;
  }
};

// Megatron's pipelined forward_backward_func over this rank's model chunks.
//
// Activations: every micro-batch between its forward and its backward keeps all that its
// backward needs, as Megatron keeps each in-flight micro-batch's autograd graph. After a
// forward whose chunk does not run that micro-batch's backward next, the chunk's saved
// state is moved into a per-(chunk, micro-batch) stash (GPTModel::take_activations) and
// moved back right before the backward (restore_activations); the schedule recomputes no
// forward (the layers do, under --recompute-granularity, and then stash only what that
// choice keeps). The price is memory: in 1F1B a stage holds the activations of up to pp - rank
// micro-batches at once (pp on the first stage); interleaved, up to
// 2 (pp - rank - 1) + (vpp - 1) pp + 1 (micro-batch, chunk) pairs, each 1 / vpp of the
// stage's layers. Forward-only steps (evaluation) keep nothing.
class PipelineSchedule {
 public:
  // chunks: this pipeline rank's model chunks in order (chunk c is virtual stage
  // c x pp + pipeline rank), built with chunk_layers; they and grid/comm must outlive the
  // schedule. Transfers run over grid.pp() (pp >= 2). overlap_p2p_comm (Megatron's
  // overlap_p2p_comm, on unless --no-overlap-p2p-communication): each tick's sends and
  // receives start asynchronously (Comm::send_recv_async) and run while the following
  // ticks compute; a received tensor's transfer is waited for just before the op that
  // reads it, a send before the next tick's sends. Off: each exchange finishes in its tick.
  PipelineSchedule(std::vector<GPTModel*> chunks, const dist::Grid& grid, dist::Comm& comm,
                   bool overlap_p2p_comm = false);

  // One step over mbs.count micro-batches: forwards and (unless forward_only) backwards in
  // pipeline_plan's order, activations [hidden_rows, H] and their gradients (compute dtype)
  // sent between stages. The loss is Megatron's: the token mean per micro-batch, averaged
  // over micro-batches (d loss / d per-token loss = 1 / (B S count); with a loss mask,
  // LossMask::weights / count), and the MoE aux-loss gradient is scaled by 1 / count; with
  // PipelineMicroBatches::per_token_loss the sum instead (see there).
  // Accumulates the chunks' main_grads.
  // Collective over the pipeline group. Throws check_interleaved_micro_batches' Error.
  PipelineLosses forward_backward(const PipelineMicroBatches& mbs, bool forward_only);

 private:
  std::vector<GPTModel*> chunks_;
  const dist::Grid& grid_;
  dist::Comm& comm_;
  bool overlap_p2p_comm_ = false;
};

// With tied embeddings and pp > 1 (Megatron's _allreduce_word_embedding_grads): the main
// grad of the word embeddings of the first stage's first chunk and of the last stage's
// copy (Param::shared) summed over the grid's embedding group, so both copies take the
// same update. Call on every rank after the data-parallel reduction (under the
// distributed optimizer the tied embeddings' bucket is sharded alike on both stages, so
// the summed shards match); ranks outside the group, untied models and pp == 1 do nothing.
void all_reduce_embedding_grads(const std::vector<GPTModel*>& chunks, const dist::Grid& grid,
                                dist::Comm& comm);
// The word embeddings param whose gradient all_reduce_embedding_grads sums on this rank
// (over grid.embedding()), or null where it sums none.
Param* embedding_grad_to_sum(const std::vector<GPTModel*>& chunks, const dist::Grid& grid);

}  // namespace megaton
