// Pipeline-parallel layer assignment, step orders, plans and the schedule that runs them.
#include "train/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "core/error.h"
#include "ops/ops.h"

namespace megaton {

ChunkLayers chunk_layers(const std::vector<int64_t>& layers_per_stage, int64_t vpp,
                         int64_t pp_rank, int64_t chunk) {
  const int64_t pp = int64_t(layers_per_stage.size());
  MEGATON_CHECK(pp >= 1 && vpp >= 1 && pp_rank >= 0 && pp_rank < pp && chunk >= 0 && chunk < vpp,
                "chunk_layers: rank {} of {}, chunk {} of {}", pp_rank, pp, chunk, vpp);
  int64_t per_round = 0, before = 0;  // layers of one chunk of every stage; of stages < pp_rank
  for (int64_t s = 0; s < pp; ++s) {
    MEGATON_CHECK(layers_per_stage[s] >= 0 && layers_per_stage[s] % vpp == 0,
                  "chunk_layers: stage {} has {} layers, not divisible by {} chunks", s,
                  layers_per_stage[s], vpp);
    per_round += layers_per_stage[s] / vpp;
    if (s < pp_rank) before += layers_per_stage[s] / vpp;
  }
  return {chunk * per_round + before, layers_per_stage[pp_rank] / vpp};
}

void check_interleaved_micro_batches(int64_t num_micro_batches, int64_t pp, int64_t vpp) {
  if (vpp > 1 && num_micro_batches % pp != 0)
    fail(
        "the interleaved pipeline schedule (num-layers-per-virtual-pipeline-stage) needs the "
        "micro-batches per step, global-batch-size / (micro-batch-size x data-parallel size) = "
        "{}, to be a multiple of pipeline-model-parallel-size ({})",
        num_micro_batches, pp);
}

std::vector<PipelineOp> pipeline_rank_order(int64_t pp, int64_t vpp, int64_t rank,
                                            int64_t num_micro_batches, bool forward_only) {
  const int64_t M = num_micro_batches;
  MEGATON_CHECK(pp >= 2 && vpp >= 1 && rank >= 0 && rank < pp && M >= 1,
                "pipeline_rank_order: pp {}, vpp {}, rank {}, {} micro-batches", pp, vpp, rank, M);
  MEGATON_CHECK(vpp == 1 || M % pp == 0,
                "pipeline_rank_order: {} micro-batches, not a multiple of pp {}", M, pp);
  // Forward k runs (micro-batch, chunk) table[k]; backward k the same micro-batch on the
  // mirrored chunk (Megatron's get_schedule_table with groups of pp micro-batches).
  std::vector<PipelineOp> table;
  if (vpp == 1) {
    for (int64_t mb = 0; mb < M; ++mb) table.push_back({true, mb, 0});
  } else {
    for (int64_t group = 0; group < M; group += pp)
      for (int64_t c = 0; c < vpp; ++c)
        for (int64_t mb = group; mb < std::min(group + pp, M); ++mb) table.push_back({true, mb, c});
  }
  const int64_t total = int64_t(table.size());
  auto forward = [&](int64_t k) { return table[k]; };
  auto backward = [&](int64_t k) {
    return PipelineOp{false, table[k].micro_batch, vpp - 1 - table[k].chunk};
  };
  if (forward_only) return table;
  const int64_t warmup = std::min(
      total, vpp == 1 ? pp - rank - 1 : 2 * (pp - rank - 1) + (vpp - 1) * pp);
  std::vector<PipelineOp> order;
  for (int64_t k = 0; k < warmup; ++k) order.push_back(forward(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    order.push_back(forward(k + warmup));
    order.push_back(backward(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) order.push_back(backward(k));
  return order;
}

std::vector<std::vector<PipelineStep>> pipeline_plan(int64_t pp, int64_t vpp,
                                                     int64_t num_micro_batches,
                                                     bool forward_only) {
  const int64_t M = num_micro_batches, stages = pp * vpp;  // virtual stages
  std::vector<std::vector<PipelineOp>> orders;
  for (int64_t r = 0; r < pp; ++r)
    orders.push_back(pipeline_rank_order(pp, vpp, r, M, forward_only));
  // Tick at which the activation (gradient) into virtual stage v of micro-batch mb was
  // sent, -1 before; index mb * stages + v. It can be used from the next tick on.
  std::vector<int64_t> activation_at(M * stages, -1), gradient_at(M * stages, -1);
  std::vector<uint8_t> forward_done(M * stages, 0);
  std::vector<size_t> next(pp, 0);
  std::vector<std::vector<PipelineStep>> plans(pp);
  for (int64_t tick = 0;; ++tick) {
    std::vector<PipelineStep> steps(pp);
    bool done = true, progressed = false;
    for (int64_t r = 0; r < pp; ++r) {
      steps[r].tick = tick;
      if (next[r] == orders[r].size()) continue;
      done = false;
      const PipelineOp op = orders[r][next[r]];
      const int64_t v = op.chunk * pp + r, at = op.micro_batch * stages + v;
      const int64_t sent = op.forward ? activation_at[at] : gradient_at[at];
      const bool first = op.forward ? v == 0 : v == stages - 1;  // needs nothing from a peer
      if (!first && (sent < 0 || sent >= tick)) continue;
      MEGATON_CHECK(op.forward || forward_done[at], "pipeline_plan: backward before forward");
      steps[r].op = op;
      ++next[r];
      progressed = true;
      if (op.forward) {
        forward_done[at] = 1;
        if (v + 1 < stages) {
          steps[r].send_next = true;
          activation_at[at + 1] = tick;
          steps[(r + 1) % pp].recv_prev = {(v + 1) / pp, op.micro_batch};
        }
      } else if (v > 0) {
        steps[r].send_prev = true;
        gradient_at[at - 1] = tick;
        steps[(r + pp - 1) % pp].recv_next = {(v - 1) / pp, op.micro_batch};
      }
    }
    if (done) break;
    MEGATON_CHECK(progressed, "pipeline_plan: no rank can run at tick {} (pp {}, vpp {}, {} "
                  "micro-batches)", tick, pp, vpp, M);
    for (int64_t r = 0; r < pp; ++r)
      if (steps[r].op || steps[r].recv_prev.defined() || steps[r].recv_next.defined())
        plans[r].push_back(steps[r]);
  }
  return plans;
}

PipelineSchedule::PipelineSchedule(std::vector<GPTModel*> chunks, const dist::Grid& grid,
                                   dist::Comm& comm)
    : chunks_(std::move(chunks)), grid_(grid), comm_(comm) {
  MEGATON_CHECK(!chunks_.empty() && grid_.pp().size() >= 2,
                "PipelineSchedule: {} chunks on a pipeline of {}", chunks_.size(),
                grid_.pp().size());
}

PipelineLosses PipelineSchedule::forward_backward(const PipelineMicroBatches& mbs,
                                                  bool forward_only) {
  const dist::Group& group = grid_.pp();
  const int64_t pp = group.size(), vpp = int64_t(chunks_.size());
  check_interleaved_micro_batches(mbs.count, pp, vpp);
  const std::vector<PipelineStep> plan =
      pipeline_plan(pp, vpp, mbs.count, forward_only)[group.rank];
  const int next = (group.rank + 1) % int(pp), prev = (group.rank + int(pp) - 1) % int(pp);
  const GPTConfig& cfg = chunks_[0]->config();
  const Shape hidden_shape{chunks_[0]->hidden_rows(mbs.batch, mbs.seq), cfg.hidden_size};
  const int64_t tokens_per_micro_batch = mbs.batch * mbs.seq;
  const float aux_grad_scale = 1.0f / float(mbs.count);

  // Per chunk: the input of every micro-batch between its forward and its backward (kept
  // for the recomputation), gradients received for its output, and the micro-batch whose
  // activations its layers hold (-1: none).
  std::vector<std::map<int64_t, ChunkInput>> inputs(vpp);
  std::vector<std::map<int64_t, Tensor>> output_grads(vpp);
  std::vector<int64_t> holds(vpp, -1);
  PipelineLosses losses;

  for (const PipelineStep& step : plan) {
    Tensor produced;  // this step's output activation or input gradient, to send
    if (step.op) {
      const PipelineOp& op = *step.op;
      GPTModel& model = *chunks_[op.chunk];
      const PipelineChunk& part = model.chunk();
      const ForwardContext ctx = mbs.context(op.micro_batch);
      if (op.forward) {
        ChunkInput& in = inputs[op.chunk][op.micro_batch];  // hidden arrived before
        in.batch = mbs.batch;
        in.seq = mbs.seq;
        if (part.pre_process || part.post_process) mbs.load(op.micro_batch, in.tokens, in.labels);
        ChunkOutput out = model.forward_chunk(in, ctx);
        holds[op.chunk] = op.micro_batch;
        losses.aux_loss_sum += out.loss.aux_loss;
        if (part.post_process) {
          losses.loss_sum += ops::sum(out.loss.losses);
          losses.num_tokens += double(out.loss.losses.numel());
        }
        produced = out.hidden;
        if (forward_only) inputs[op.chunk].erase(op.micro_batch);
      } else {
        auto in = inputs[op.chunk].find(op.micro_batch);
        MEGATON_CHECK(in != inputs[op.chunk].end(), "pipeline: no input kept for micro-batch {}",
                      op.micro_batch);
        // Full recomputation: the layers hold another micro-batch's activations.
        if (holds[op.chunk] != op.micro_batch) model.forward_chunk(in->second, ctx);
        Tensor dout;
        if (part.post_process) {
          // Megatron's default loss: the token mean per micro-batch, averaged over them.
          dout = Tensor::empty({tokens_per_micro_batch});
          dout.fill(float(1.0 / (double(tokens_per_micro_batch) * double(mbs.count))));
        } else {
          auto grad = output_grads[op.chunk].find(op.micro_batch);
          MEGATON_CHECK(grad != output_grads[op.chunk].end(),
                        "pipeline: no output gradient for micro-batch {}", op.micro_batch);
          dout = grad->second;
          output_grads[op.chunk].erase(grad);
        }
        produced = model.backward_chunk(dout, aux_grad_scale);
        holds[op.chunk] = -1;
        inputs[op.chunk].erase(in);
      }
    }
    // Forward direction, then backward: every rank exchanges in this order.
    auto exchange = [&](bool send, int send_peer, const PipelineSlot& slot, int recv_peer,
                        bool activation) {
      if (!send && !slot.defined()) return;
      MEGATON_CHECK(!send || produced.defined(), "pipeline: nothing to send at tick {}",
                    step.tick);
      Tensor received;
      if (slot.defined()) received = Tensor::empty(hidden_shape, cfg.compute_dtype(), cfg.device);
      if (send && slot.defined()) comm_.send_recv(produced, send_peer, received, recv_peer, group);
      else if (send) comm_.send(produced, send_peer, group);
      else comm_.recv(received, recv_peer, group);
      if (!slot.defined()) return;
      if (activation) inputs[slot.chunk][slot.micro_batch].hidden = received;
      else output_grads[slot.chunk][slot.micro_batch] = received;
    };
    exchange(step.send_next, next, step.recv_prev, prev, true);
    exchange(step.send_prev, prev, step.recv_next, next, false);
  }
  for (int64_t c = 0; c < vpp; ++c)
    MEGATON_CHECK(inputs[c].empty() && output_grads[c].empty(),
                  "pipeline: chunk {} kept {} inputs and {} gradients after the step", c,
                  inputs[c].size(), output_grads[c].size());
  return losses;
}

void all_reduce_embedding_grads(const std::vector<GPTModel*>& chunks, const dist::Grid& grid,
                                dist::Comm& comm) {
  const dist::Group& group = grid.embedding();
  if (grid.pp().size() == 1 || !group.is_member() || chunks.empty() ||
      chunks[0]->config().untie_embeddings_and_output_weights)
    return;
  // The first stage's first chunk holds the embedding, the last stage's last chunk the copy.
  GPTModel* holder = grid.is_pipeline_first_stage() ? chunks.front() : chunks.back();
  Param* p = holder->word_embeddings_param();
  MEGATON_CHECK(p, "pipeline stage {} has no word embeddings to synchronise", grid.pp().rank);
  comm.all_reduce(p->main_grad, group);
}

}  // namespace megaton
