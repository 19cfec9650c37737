// Pipeline-parallel layer assignment, step orders, plans and the schedule that runs them.
#include "train/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>

#include "core/error.h"
#include "ops/ops.h"

namespace megaton {

ChunkLayers chunk_layers(const std::vector<int64_t>& layers_per_stage, int64_t vpp, int64_t pp_rank,
                         int64_t chunk) {
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
  const int64_t warmup =
      std::min(total, vpp == 1 ? pp - rank - 1 : 2 * (pp - rank - 1) + (vpp - 1) * pp);
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
                                                     int64_t num_micro_batches, bool forward_only) {
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
    MEGATON_CHECK(progressed,
                  "pipeline_plan: no rank can run at tick {} (pp {}, vpp {}, {} "
                  "micro-batches)",
                  tick, pp, vpp, M);
    for (int64_t r = 0; r < pp; ++r)
      if (steps[r].op || steps[r].recv_prev.defined() || steps[r].recv_next.defined())
        plans[r].push_back(steps[r]);
  }
  return plans;
}

PipelineSchedule::PipelineSchedule(std::vector<GPTModel*> chunks, const dist::Grid& grid,
                                   dist::Comm& comm, bool overlap_p2p_comm)
    : chunks_(std::move(chunks)), grid_(grid), comm_(comm), overlap_p2p_comm_(overlap_p2p_comm) {
  MEGATON_CHECK(!chunks_.empty() && grid_.pp().size() >= 2,
                "PipelineSchedule: {} chunks on a pipeline of {}", chunks_.size(),
                grid_.pp().size());
}

// For each step of a rank's plan: whether its op is a forward whose chunk runs the same
// micro-batch's backward as its next op (the last stage's 1F1B pairs), so the chunk can
// keep that micro-batch's activations in its layers instead of stashing them.
static std::vector<uint8_t> backward_follows(const std::vector<PipelineStep>& plan) {
  std::vector<uint8_t> out(plan.size(), 0);
  std::map<int64_t, size_t> last_forward;  // chunk -> step of its latest op, if a forward
  for (size_t i = 0; i < plan.size(); ++i) {
    if (!plan[i].op) continue;
    const PipelineOp& op = *plan[i].op;
    auto prev = last_forward.find(op.chunk);
    if (prev != last_forward.end()) {
      out[prev->second] = !op.forward && plan[prev->second].op->micro_batch == op.micro_batch;
      last_forward.erase(prev);
    }
    if (op.forward) last_forward[op.chunk] = i;
  }
  return out;
}

PipelineLosses PipelineSchedule::forward_backward(const PipelineMicroBatches& mbs,
                                                  bool forward_only) {
  const dist::Group& group = grid_.pp();
  const int64_t pp = group.size(), vpp = int64_t(chunks_.size());
  check_interleaved_micro_batches(mbs.count, pp, vpp);
  const std::vector<PipelineStep> plan =
      pipeline_plan(pp, vpp, mbs.count, forward_only)[group.rank];
  const std::vector<uint8_t> keep_in_layers = backward_follows(plan);
  const int next = (group.rank + 1) % int(pp), prev = (group.rank + int(pp) - 1) % int(pp);
  const GPTConfig& cfg = chunks_[0]->config();
  const Shape hidden_shape{chunks_[0]->hidden_rows(mbs.batch, mbs.seq), cfg.hidden_size};
  const int64_t tokens_per_micro_batch = mbs.batch * mbs.seq;
  // Megatron-LM d98e8a6 schedules.py forward_step: MoEAuxLossAutoScaler.set_loss_scale(
  // loss_scale / num_microbatches), or loss_scale alone with calculate_per_token_loss, when
  // the router (router.py attach_and_log_load_balancing_loss, apply_z_loss) multiplies each
  // injected loss by its tokens times the TP x CP size: the micro-batch's B x S tokens.
  // Under context parallelism mbs.seq is this rank's S / cp rows, and without per-token loss
  // the scale carries cp (schedules.py: loss_scale * cp_size / num_microbatches), undoing
  // the gradients' mean over DP x CP for a loss that is already a partial sum.
  const double cp = double(grid_.cp().size());
  const float aux_grad_scale =
      mbs.per_token_loss ? float(double(mbs.loss_scale) * double(mbs.batch * mbs.seq) * cp)
                         : float(double(mbs.loss_scale) * cp / double(mbs.count));

  // Per chunk: activations received for micro-batches not yet forwarded, gradients
  // received for their outputs, the saved state (activation stash) of every micro-batch
  // between its forward and its backward but the one the chunk's layers hold, and which
  // micro-batch that is (-1: none). At most pp - rank micro-batches are in flight per
  // chunk in 1F1B (more with interleaving), each keeping all its activations.
  std::vector<std::map<int64_t, Tensor>> inputs(vpp), output_grads(vpp);
  // Under overlap_p2p_comm: the transfer still filling each of them (waited for just before
  // its first use), and the sends of the last exchange (waited for before the next ones).
  using Work = std::shared_ptr<dist::CommWork>;
  std::vector<std::map<int64_t, Work>> input_works(vpp), grad_works(vpp);
  std::vector<Work> sends;
  auto wait_for = [](std::map<int64_t, Work>& works, int64_t micro_batch) {
    auto it = works.find(micro_batch);
    if (it == works.end()) return;
    it->second->wait();
    works.erase(it);
  };
  std::vector<std::map<int64_t, ChunkActivations>> stashes(vpp);
  std::vector<int64_t> holds(vpp, -1);
  // With a loss mask: each micro-batch's per-token loss weights, from its forward on the
  // last stage to its backward there.
  std::map<int64_t, Tensor> loss_weights;
  PipelineLosses losses;

  for (size_t i = 0; i < plan.size(); ++i) {
    const PipelineStep& step = plan[i];
    Tensor produced;  // this step's output activation or input gradient, to send
    if (step.op) {
      const PipelineOp& op = *step.op;
      GPTModel& model = *chunks_[op.chunk];
      const PipelineChunk& part = model.chunk();
      if (op.forward) {
        ChunkInput in;
        in.batch = mbs.batch;
        in.seq = mbs.seq;
        if (part.pre_process || part.post_process) mbs.load(op.micro_batch, in.tokens, in.labels);
        // MTP shifts the loss mask with its labels.
        std::optional<LossMask> mask;
        if (part.post_process && mbs.loss_mask) {
          mask = mbs.loss_mask(op.micro_batch, in.tokens);
          if (cfg.mtp_num_layers > 0) in.loss_mask = mask->mask;
        }
        if (!part.pre_process) {
          auto hidden = inputs[op.chunk].find(op.micro_batch);
          MEGATON_CHECK(hidden != inputs[op.chunk].end(),
                        "pipeline: no activation received for micro-batch {}", op.micro_batch);
          in.hidden = hidden->second;
          inputs[op.chunk].erase(hidden);
          wait_for(input_works[op.chunk], op.micro_batch);
        }
        MEGATON_CHECK(holds[op.chunk] < 0,
                      "pipeline: chunk {} still holds micro-batch {} at the forward of {}",
                      op.chunk, holds[op.chunk], op.micro_batch);
        ChunkOutput out = model.forward_chunk(in, mbs.context(op.micro_batch));
        if (out.loss.aux_losses.defined()) {
          if (!losses.aux_losses.defined())
            losses.aux_losses = Tensor::zeros({1}, DType::F32, out.loss.aux_losses.device());
          ops::add_(losses.aux_losses, out.loss.aux_losses);
        }
        if (out.loss.mtp_losses.defined()) {
          if (!losses.mtp_losses.defined())
            losses.mtp_losses = Tensor::zeros(out.loss.mtp_losses.shape(), DType::F32,
                                              out.loss.mtp_losses.device());
          ops::add_(losses.mtp_losses, out.loss.mtp_losses);
        }
        if (mask) {
          losses.loss_sum += masked_loss_sum(out.loss.losses, mask->mask);
          losses.num_tokens += double(mask->num_tokens);
          // Per-token loss: the mask itself (the sum's gradient; no division by the tokens).
          if (!forward_only)
            loss_weights[op.micro_batch] =
                std::move(mbs.per_token_loss ? mask->mask : mask->weights);
        } else if (part.post_process) {
          losses.loss_sum += ops::sum(out.loss.losses);
          losses.num_tokens += double(out.loss.losses.numel());
        }
        produced = out.hidden;
        if (forward_only)
          model.take_activations();  // evaluation keeps nothing: dropped here
        else if (keep_in_layers[i])
          holds[op.chunk] = op.micro_batch;
        else
          stashes[op.chunk].emplace(op.micro_batch, model.take_activations());
      } else {
        auto stash = stashes[op.chunk].find(op.micro_batch);
        if (stash != stashes[op.chunk].end()) {
          model.restore_activations(std::move(stash->second));
          stashes[op.chunk].erase(stash);
        } else {
          MEGATON_CHECK(holds[op.chunk] == op.micro_batch,
                        "pipeline: no activations kept for micro-batch {} of chunk {}",
                        op.micro_batch, op.chunk);
        }
        Tensor dout;
        if (part.post_process && mbs.loss_mask) {
          // The mean over the micro-batch's unmasked tokens, averaged over micro-batches
          // (fp32 products, as the trainer's scale_ of the weights without a pipeline).
          auto weights = loss_weights.find(op.micro_batch);
          MEGATON_CHECK(weights != loss_weights.end(),
                        "pipeline: no loss weights for micro-batch {}", op.micro_batch);
          // (Per-token loss: mask x loss_scale, Megatron's forward_step not dividing by
          // num_tokens nor num_microbatches.)
          dout = Tensor::empty({tokens_per_micro_batch});
          const float scale = mbs.per_token_loss
                                  ? mbs.loss_scale
                                  : float(double(mbs.loss_scale) / double(mbs.count));
          for (int64_t t = 0; t < tokens_per_micro_batch; ++t)
            dout.f32()[t] = weights->second.f32()[t] * scale;
          loss_weights.erase(weights);
        } else if (part.post_process && mbs.per_token_loss) {
          // Per-token loss without a mask: the sum over the tokens, times the loss scale.
          dout = Tensor::empty({tokens_per_micro_batch});
          dout.fill(mbs.loss_scale);
        } else if (part.post_process) {
          // Megatron's default loss: the token mean per micro-batch, averaged over them.
          dout = Tensor::empty({tokens_per_micro_batch});
          dout.fill(
              float(double(mbs.loss_scale) / (double(tokens_per_micro_batch) * double(mbs.count))));
        } else {
          auto grad = output_grads[op.chunk].find(op.micro_batch);
          MEGATON_CHECK(grad != output_grads[op.chunk].end(),
                        "pipeline: no output gradient for micro-batch {}", op.micro_batch);
          dout = grad->second;
          output_grads[op.chunk].erase(grad);
          wait_for(grad_works[op.chunk], op.micro_batch);
        }
        produced = model.backward_chunk(dout, aux_grad_scale);
        holds[op.chunk] = -1;
      }
    }
    // Forward direction, then backward: every rank exchanges in this order.
    if (step.send_next || step.send_prev) {
      for (Work& w : sends) w->wait();
      sends.clear();
    }
    auto exchange = [&](bool send, int send_peer, const PipelineSlot& slot, int recv_peer,
                        bool activation) {
      if (!send && !slot.defined()) return;
      MEGATON_CHECK(!send || produced.defined(), "pipeline: nothing to send at tick {}", step.tick);
      Tensor received;
      if (slot.defined()) received = Tensor::empty(hidden_shape, cfg.compute_dtype(), cfg.device);
      if (overlap_p2p_comm_) {
        Work work = comm_.send_recv_async(send ? &produced : nullptr, send_peer,
                                          slot.defined() ? &received : nullptr, recv_peer, group);
        if (send) sends.push_back(work);
        if (slot.defined())
          (activation ? input_works : grad_works)[slot.chunk][slot.micro_batch] = work;
      } else if (send && slot.defined())
        comm_.send_recv(produced, send_peer, received, recv_peer, group);
      else if (send)
        comm_.send(produced, send_peer, group);
      else
        comm_.recv(received, recv_peer, group);
      if (!slot.defined()) return;
      (activation ? inputs : output_grads)[slot.chunk][slot.micro_batch] = received;
    };
    exchange(step.send_next, next, step.recv_prev, prev, true);
    exchange(step.send_prev, prev, step.recv_next, next, false);
  }
  for (Work& w : sends) w->wait();
  for (int64_t c = 0; c < vpp; ++c)
    MEGATON_CHECK(
        inputs[c].empty() && output_grads[c].empty() && stashes[c].empty() && holds[c] < 0,
        "pipeline: chunk {} kept {} inputs, {} gradients and {} activation stashes after the step",
        c, inputs[c].size(), output_grads[c].size(), stashes[c].size());
  MEGATON_CHECK(loss_weights.empty(),
                "pipeline: {} micro-batches' loss weights left after the step",
                loss_weights.size());
  return losses;
}

Param* embedding_grad_to_sum(const std::vector<GPTModel*>& chunks, const dist::Grid& grid) {
  const dist::Group& group = grid.embedding();
  // Untied embeddings have a last-stage copy only for multi-token prediction.
  if (grid.pp().size() == 1 || !group.is_member() || chunks.empty() ||
      (chunks[0]->config().untie_embeddings_and_output_weights &&
       chunks[0]->config().mtp_num_layers == 0))
    return nullptr;
  // The first stage's first chunk holds the embedding, the last stage's last chunk the copy.
  GPTModel* holder = grid.is_pipeline_first_stage() ? chunks.front() : chunks.back();
  Param* p = holder->word_embeddings_param();
  MEGATON_CHECK(p, "pipeline stage {} has no word embeddings to synchronise", grid.pp().rank);
  return p;
}

void all_reduce_embedding_grads(const std::vector<GPTModel*>& chunks, const dist::Grid& grid,
                                dist::Comm& comm) {
  if (Param* p = embedding_grad_to_sum(chunks, grid))
    comm.all_reduce(p->main_grad, grid.embedding());
}

}  // namespace megaton
