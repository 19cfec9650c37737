// What the trainer does with a step's values once it has read them (Trainer::finish_step):
// the non-finite stop (stop_on_non_finite), the skipped-iteration counts, the metrics file,
// the log interval and Megatron's log line (log_line) with the MoE fields; the notices on
// the MoE token exchange at start (announce_moe_exchange).
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dist/host_reduce.h"
#include "model/token_dispatcher.h"
#include "train/flops.h"
#include "train/trainer.h"

#ifdef MEGATON_WITH_CUDA
#include "core/cuda/allocator.h"
#endif

namespace megaton {

int64_t peak_memory_bytes(Device device) {
#ifdef MEGATON_WITH_CUDA
  if (device == Device::CUDA) return cuda::device_memory_stats().peak_allocated_bytes;
#endif
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return int64_t(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

// Megatron's log fields of the MoE losses (each divided by its coefficient, averaged over
// layers) and Megaton's tokens-per-expert balance: min, max, max/mean over experts.
static std::string moe_log_fields(const MoELayerMetrics& m, bool capacity) {
  std::string out;
  if (m.load_balancing_loss >= 0)
    out += fmt::format("load_balancing_loss: {:.6E} | ", m.load_balancing_loss);
  if (m.seq_load_balancing_loss >= 0)
    out += fmt::format("seq_load_balancing_loss: {:.6E} | ", m.seq_load_balancing_loss);
  if (m.global_load_balancing_loss >= 0)
    out += fmt::format("global_load_balancing_loss: {:.6E} | ", m.global_load_balancing_loss);
  if (m.z_loss >= 0) out += fmt::format("z_loss: {:.6E} | ", m.z_loss);
  out += fmt::format(
      "tokens per expert min/max: {:.0f}/{:.0f} | expert imbalance (max/mean): {:.3f} | ",
      m.tokens_min, m.tokens_max, m.imbalance);
  if (capacity) out += fmt::format("dropped tokens: {:.4f} | ", m.dropped_fraction);
  return out;
}

static void add_moe_metrics(nlohmann::json& line, const MoEStepMetrics& moe, bool per_layer) {
  auto fill = [](nlohmann::json& j, const MoELayerMetrics& m) {
    if (m.load_balancing_loss >= 0) j["load_balancing_loss"] = m.load_balancing_loss;
    if (m.seq_load_balancing_loss >= 0) j["seq_load_balancing_loss"] = m.seq_load_balancing_loss;
    if (m.global_load_balancing_loss >= 0)
      j["global_load_balancing_loss"] = m.global_load_balancing_loss;
    if (m.z_loss >= 0) j["z_loss"] = m.z_loss;
    j["moe_tokens_per_expert_min"] = m.tokens_min;
    j["moe_tokens_per_expert_max"] = m.tokens_max;
    j["moe_expert_imbalance"] = m.imbalance;
    j["moe_dropped_fraction"] = m.dropped_fraction;
  };
  fill(line, moe.mean);
  if (!per_layer) return;
  nlohmann::json layers = nlohmann::json::array();
  for (const MoELayerMetrics& m : moe.layers) {
    nlohmann::json j = {{"layer", m.layer}};
    fill(j, m);
    layers.push_back(j);
  }
  line["moe_layers"] = layers;
}

// Interval sums of the per-step metrics (fields that are -1, not enabled, stay -1).
static void accumulate_moe_metrics(MoEStepMetrics& sum, const MoEStepMetrics& step) {
  auto add = [](MoELayerMetrics& a, const MoELayerMetrics& b) {
    a.layer = b.layer;
    for (auto f : {&MoELayerMetrics::load_balancing_loss, &MoELayerMetrics::seq_load_balancing_loss,
                   &MoELayerMetrics::global_load_balancing_loss, &MoELayerMetrics::z_loss})
      a.*f = b.*f < 0 ? -1 : (a.*f < 0 ? 0 : a.*f) + b.*f;
    a.tokens_min += b.tokens_min;
    a.tokens_max += b.tokens_max;
    a.imbalance += b.imbalance;
    a.dropped_fraction += b.dropped_fraction;
  };
  if (sum.layers.size() != step.layers.size()) sum.layers.assign(step.layers.size(), {});
  for (size_t i = 0; i < step.layers.size(); ++i) add(sum.layers[i], step.layers[i]);
  add(sum.mean, step.mean);
}

static void scale_moe_metrics(MoEStepMetrics& sum, double s) {
  auto scale = [s](MoELayerMetrics& a) {
    for (auto f : {&MoELayerMetrics::load_balancing_loss, &MoELayerMetrics::seq_load_balancing_loss,
                   &MoELayerMetrics::global_load_balancing_loss, &MoELayerMetrics::z_loss,
                   &MoELayerMetrics::tokens_min, &MoELayerMetrics::tokens_max,
                   &MoELayerMetrics::imbalance, &MoELayerMetrics::dropped_fraction})
      if (a.*f >= 0) a.*f *= s;
  };
  for (MoELayerMetrics& m : sum.layers) scale(m);
  scale(sum.mean);
}

void Trainer::log_line(const std::string& extra_fields, int64_t iteration, int64_t consumed_samples,
                       int64_t global_batch_size, double ms_per_iter, double lr, double loss,
                       const std::vector<double>& mtp_losses, const MoEStepMetrics& moe,
                       double grad_norm, int64_t num_zeros, double params_norm, int64_t skipped,
                       int64_t nan) {
  int64_t tokens = global_batch_size * args_.model.seq_length;
  double flops = num_floating_point_operations(args_.model, tokens);
  std::string line = fmt::format(
      " iteration {:>8}/{:>8} | consumed samples: {:>12} | elapsed time per iteration (ms): "
      "{:.1f} | tokens per second: {:.1f} | throughput per GPU (TFLOP/s/GPU): {:.3f} | "
      "learning rate: {:.6E} | global batch size: {:>5} | lm loss: {:.6E} | ",
      iteration, args_.train_iters, consumed_samples, ms_per_iter,
      double(tokens) / (ms_per_iter / 1000.0),
      throughput_per_gpu_tflops(flops, ms_per_iter, grid_->world_size()), lr, global_batch_size,
      loss);
  // Megatron's MTPLossLoggingHelper keys.
  for (size_t k = 0; k < mtp_losses.size(); ++k)
    line += fmt::format("mtp_{} loss: {:.6E} | ", k + 1, mtp_losses[k]);
  const bool capacity = args_.model.moe_expert_capacity_factor > 0;
  if (moe_->active()) line += moe_log_fields(moe.mean, capacity);
  // The scale after this step's update, as Megatron logs optimizer.get_loss_scale().
  line += extra_fields;  // the energy fields (RunLogger::log_interval)
  line += fmt::format("loss scale: {:.1f} | grad norm: {:.3f} | ", scaler_->scale(), grad_norm);
  if (num_zeros >= 0) line += fmt::format("num zeros: {} | ", num_zeros);
  if (params_norm >= 0) line += fmt::format("params norm: {:.3f} | ", params_norm);
  line += fmt::format(
      "number of skipped iterations: {:>3} | number of "
      "nan iterations: {:>3} | peak memory (MB): {:.1f} |",
      skipped, nan, double(peak_memory_bytes(args_.model.device)) / 1048576.0);
  fmt::print("{}\n", line);
  if (moe_->active() && args_.moe_per_layer_logging)
    for (const MoELayerMetrics& m : moe.layers)
      fmt::print(" moe layer {:>3} | {}\n", m.layer, moe_log_fields(m, capacity));
  std::fflush(stdout);
}

void Trainer::announce_moe_exchange(const ModelParallel& mp) const {
  // The chunks of --overlap-moe-expert-parallel-comm always regroup (MoELayer).
  const bool chunks_regroup = args_.model.overlap_moe_expert_parallel_comm &&
                              args_.model.num_experts > 0 && grid_->ep().size() > 1;
  if (chunks_regroup && mp.alltoall_exchange == AlltoAllExchange::Pull && grid_->world().rank == 0)
    fmt::print(stderr,
               "notice: MEGATON_MOE_ALLTOALL_EXCHANGE=pull is not used: the chunks of "
               "--overlap-moe-expert-parallel-comm regroup\n");
  if (args_.parallel.moe_token_dispatcher_type != "flex" || args_.model.num_experts == 0) return;
  ModelParallel shown = mp;
  if (chunks_regroup) shown.alltoall_exchange = AlltoAllExchange::Regroup;
  // Collective over the expert groups (whether they have peer memory): every rank asks.
  const std::string exchange = describe_alltoall_exchange(shown);
  if (grid_->world().rank == 0)
    fmt::print(stderr,
               "notice: --moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend {}) runs "
               "Megaton's all-to-all dispatcher: {}\n",
               args_.parallel.moe_flex_dispatcher_backend, exchange);
}

void Trainer::finish_step(PendingStep& step, LogInterval& interval, TrainResult& result) {
  Readback& values = *step.values;
  values.wait();
  // The step's time: on the GPU, from the previous step's values being copied to this
  // one's; otherwise (the first step, after an evaluation or a checkpoint, CPU runs) from
  // when the previous step's values were read to when this one's were. The host's clock
  // alone made the last step of a run short: the host is held back by the CUDA launch
  // queue, so it reads a step's values only when the next one is queued
  // (docs/performance.md, "MoE overlaps, flex and step timing").
  const auto now = std::chrono::steady_clock::now();
  double ms = std::chrono::duration<double, std::milli>(now - interval.last_done).count();
  if (interval.last_values) {
    const double gpu_ms = values.gpu_ms_since(*interval.last_values);
    if (gpu_ms >= 0) ms = gpu_ms;
  }
  interval.last_done = now;
  // Kept to time the next step (`values` stays valid: the object is only handed over).
  interval.last_values = std::move(step.values);
  // No token in the loss (--eod-mask-loss on all-eod batches): 0, not Megatron's 0 / 0.
  const double loss = step.tokens > 0 ? double(values.tensor(0).f32()[0]) / step.tokens : 0.0;
  const double local_loss_sum = values.tensor(1).f32()[0];
  const double grad_norm = std::bit_cast<double>(values.tensor(2).i64()[0]);
  const double local_grad_sum_sq = std::bit_cast<double>(values.tensor(3).i64()[0]);
  const bool skipped = values.tensor(4).f32()[ops::kAdamSkip] != 0.0f;
  const bool stopped = values.tensor(5).i64()[1] != 0;
  // The MoE metrics on the host now, so the log line reads them without waiting.
  if (step.moe.values.defined()) step.moe.values = values.tensor(6);
  std::vector<double> mtp_losses;
  if (step.mtp_index >= 0) {
    const Tensor& t = values.tensor(size_t(step.mtp_index));
    for (int64_t k = 0; k < t.numel(); ++k) mtp_losses.push_back(t.f32()[k]);
  }
  // The device skipped this step's update (and every later one) when it stopped.
  if (stopped)
    stop_on_non_finite(step.iteration, loss, grad_norm, local_loss_sum, local_grad_sum_sq);
  // Megatron's counts: a skipped iteration (an overflow under loss scaling, or a non-finite
  // gradient without the check) is a nan iteration when its loss is not finite. The loss
  // scaler and the learning-rate schedule see the outcome.
  const bool nan = skipped && !std::isfinite(loss);
  if (skipped) {
    ++skipped_iterations_;
    ++interval.skipped;
    scheduler_samples_ -= step.global_batch_size;
  } else {
    ++interval.advanced;
    interval.loss += loss;
    interval.mtp_losses.resize(mtp_losses.size(), 0.0);
    for (size_t k = 0; k < mtp_losses.size(); ++k) interval.mtp_losses[k] += mtp_losses[k];
  }
  if (nan) {
    ++nan_iterations_;
    ++interval.nan;
  }
  scaler_->update(skipped);
  result.losses.push_back(loss);
  result.grad_norms.push_back(grad_norm);
  // The step's MoE metrics on the host, read once, and only for what writes them.
  const bool tensorboard_now = is_logging_rank() && run_logger_->writes_step(step.iteration);
  const bool metrics_now = !args_.log_metrics_file.empty() && is_logging_rank();
  MoEStepMetrics moe_step;
  if (moe_->active() && (metrics_now || tensorboard_now)) moe_step = moe_->read(step.moe);
  if (metrics_now) {
    nlohmann::json line = {{"iteration", step.iteration},
                           {"lm_loss", loss},
                           {"grad_norm", grad_norm},
                           {"lr", step.lr},
                           {"global_batch_size", step.global_batch_size},
                           {"consumed_samples", step.consumed_samples}};
    if (args_.lr.weight_decay_incr_style != optim::WeightDecayIncrStyle::Constant)
      line["weight_decay"] = step.weight_decay;
    if (scaler_->active()) line["loss_scale"] = scaler_->scale();  // after this step's update
    if (skipped) line["skipped"] = true;
    if (moe_->active()) add_moe_metrics(line, moe_step, args_.moe_per_layer_logging);
    if (step.params_norm >= 0) line["params_norm"] = step.params_norm;
    if (step.num_zeros >= 0) line["num_zeros"] = step.num_zeros;
    for (size_t k = 0; k < mtp_losses.size(); ++k)
      line[fmt::format("mtp_{}_loss", k + 1)] = mtp_losses[k];
    std::ofstream out(args_.log_metrics_file, std::ios::app);
    out << line.dump() << "\n";
    if (!out) fail("log-metrics-file: cannot write '{}'", args_.log_metrics_file);
  }
  if (tensorboard_now) {
    RunLogStep r;
    r.iteration = step.iteration;
    r.consumed_samples = step.consumed_samples;
    r.global_batch_size = step.global_batch_size;
    r.lr = step.lr;
    r.loss = loss;
    r.grad_norm = grad_norm;
    r.loss_scale = scaler_->active() ? scaler_->scale() : -1.0;
    r.params_norm = step.params_norm;
    r.num_zeros = step.num_zeros;
    r.mtp_losses = mtp_losses;
    if (moe_->active()) r.moe = &moe_step;
    run_logger_->step(r);
  }
  if (moe_->active()) interval.moe.push_back(std::move(step.moe));
  interval.ms += ms;
  ++interval.iterations;
  run_logger_->memory(step.iteration);
  const bool log_now =
      step.iteration % args_.log_interval == 0 || step.iteration == args_.train_iters;
  if (!log_now) return;
  const double ms_per_iter = interval.ms / double(interval.iterations);
  const std::string energy = run_logger_->log_interval(
      step.iteration, interval.iterations, ms_per_iter,
      throughput_per_gpu_tflops(num_floating_point_operations(
                                    args_.model, step.global_batch_size * args_.model.seq_length),
                                ms_per_iter, grid_->world_size()));
  if (is_logging_rank()) {
    MoEStepMetrics moe_mean;
    for (const PendingMoEMetrics& m : interval.moe) accumulate_moe_metrics(moe_mean, moe_->read(m));
    scale_moe_metrics(moe_mean, 1.0 / double(interval.iterations));
    std::vector<double> mtp_mean = interval.mtp_losses;
    for (double& v : mtp_mean) v /= double(std::max<int64_t>(interval.advanced, 1));
    log_line(energy, step.iteration, step.consumed_samples, step.global_batch_size,
             interval.ms / double(interval.iterations), step.lr,
             interval.loss / double(std::max<int64_t>(interval.advanced, 1)), mtp_mean, moe_mean,
             grad_norm, step.num_zeros, step.params_norm, interval.skipped, interval.nan);
  }
  interval.moe.clear();
  interval.mtp_losses.clear();
  interval.loss = interval.ms = 0;
  interval.iterations = interval.advanced = interval.skipped = interval.nan = 0;
}

void Trainer::stop_on_non_finite(int64_t iteration, double loss, double grad_norm,
                                 double local_loss_sum, double local_grad_sum_sq) {
  // Which ranks hold the non-finite values: the local loss (before the sums over ranks)
  // and this rank's counted share of the reduced gradients (the squared sum the norm
  // adds: under the distributed optimizer only the shard's owner names it). Megatron checks
  // each bucket before the data-parallel reduction; here the gradients are checked after
  // it. The step's values are read once the next step is queued: the device has skipped
  // both updates, but the next step's expert-bias update (finish_step) has run.
  const int64_t world = grid_->world_size(), rank = grid_->world_rank();
  std::vector<double> flags(size_t(2 * world), 0.0);
  flags[size_t(2 * rank)] = std::isfinite(local_loss_sum) ? 0.0 : 1.0;
  flags[size_t(2 * rank + 1)] = std::isfinite(local_grad_sum_sq) ? 0.0 : 1.0;
  flags = dist::sum_over(*comm_, grid_->world(), flags);
  const bool in_loss = !std::isfinite(loss);
  const double value = in_loss ? loss : grad_norm;
  std::string ranks;
  for (int64_t r = 0; r < world; ++r)
    if (flags[size_t(2 * r + (in_loss ? 0 : 1))] > 0)
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  if (ranks.empty()) ranks = "none alone (it arose in the reduction over ranks)";
  fail(
      "iteration {}: found {} in the {} on rank{} {}; stopped before the update by "
      "--check-for-nan-in-loss-and-grad (the parameters and checkpoints are those of the "
      "last finite step; a smaller --lr or --clip-grad may help)",
      iteration, std::isnan(value) ? "NaN" : "Inf", in_loss ? "loss" : "gradient norm",
      ranks.find(',') == std::string::npos ? "" : "s", ranks);
}

}  // namespace megaton
