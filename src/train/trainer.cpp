// The training loop.
#include "train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <cstdlib>

#include <bit>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/allocator.h"
#endif
#include "dist/gather.h"
#include "dist/host_reduce.h"
#include "dist/runtime.h"
#include "model/tensor_parallel.h"
#include "model/token_dispatcher.h"
#include "train/tensor_parallel_ckpt.h"
#include "ops/ops.h"
#include "ops/determinism.h"
#include "ops/profiler.h"
#include "optim/clip_grad.h"
#include "optim/lr_schedule.h"
#include "data/mock_dataset.h"
#include "train/flops.h"
#include "train/generate.h"
#include "train/memory_check.h"
#include "train/pipeline_schedule.h"

namespace megaton {

int64_t peak_memory_bytes(Device device) {
#ifdef MEGATON_WITH_CUDA
  if (device == Device::CUDA) return cuda::device_memory_stats().peak_allocated_bytes;
#endif
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return int64_t(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

// Whether `path` can be appended to, without creating it: an existing regular file we may
// write, or a new name in a writable directory. Throws megaton::Error naming `flag`.
static void check_file_writable(const char* flag, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(path, ec)) {
    if (!fs::is_regular_file(path, ec)) fail("{}: '{}' is not a regular file", flag, path);
    if (::access(path.c_str(), W_OK) != 0)
      fail("{}: '{}' is not writable: {}", flag, path, std::strerror(errno));
    return;
  }
  fs::path parent = fs::absolute(path, ec).parent_path();
  if (!fs::is_directory(parent, ec))
    fail("{}: cannot create '{}': directory '{}' does not exist", flag, path, parent.string());
  if (::access(parent.c_str(), W_OK | X_OK) != 0)
    fail("{}: cannot create '{}' in '{}': {}", flag, path, parent.string(), std::strerror(errno));
}

Trainer::Trainer(TrainArgs args, RawOptions raw) : args_(std::move(args)), raw_(std::move(raw)) {
  ops::profile_check_environment();  // before anything is built or written
  // Process-wide, and before any NCCL communicator is made (arguments.h).
  ops::set_deterministic(args_.deterministic_mode);
  if (args_.deterministic_mode) ::setenv("NCCL_ALGO", "Ring", /*overwrite=*/0);
  // Found now rather than at the first save, after the training time is spent. Rank 0
  // writes the checkpoints.
  if (!args_.save.empty() && dist::world_rank() == 0) ckpt::check_save_dir_writable(args_.save);
  if (!args_.log_metrics_file.empty() && dist::world_rank() == 0)
    check_file_writable("log-metrics-file", args_.log_metrics_file);
  tokenizer_ = data::make_tokenizer(args_.tokenizer_type, args_.tokenizer_model, args_.vocab_size);
  args_.model.vocab_size = tokenizer_->vocab_size();
  // The vocabulary padding depends on the tensor-parallel size (Megatron).
  args_.model.tensor_model_parallel_size = args_.parallel.tensor_model_parallel_size;
  args_.model.finalize();
  const int64_t etp = args_.parallel.expert_tensor_parallel_size > 0
                          ? args_.parallel.expert_tensor_parallel_size
                          : args_.parallel.tensor_model_parallel_size;
  args_.model.check_fp8_dimensions(args_.micro_batch_size * args_.model.seq_length, etp);
  int64_t gbs = args_.global_batch_size;
  // The parallel layout (checked again here for callers other than the CLI).
  const int64_t world = dist::world_size();
  const dist::ValidatedLayout layout = check_parallel_layout(args_, world);
  check_memory_fits(args_, layout.sizes);  // before the datasets and the model are built
  check_full_iteration_graph(args_, world);
  std::array<int64_t, 3> num_samples = {args_.train_iters * gbs, args_.eval_iters * gbs,
                                        args_.eval_iters * gbs};
  if (args_.mock_data) {
    for (int split = 0; split < 3; ++split)
      datasets_[split] = std::make_unique<data::MockGPTDataset>(
          std::max<int64_t>(num_samples[split], 1), args_.model.seq_length,
          args_.model.vocab_size, args_.seed, uint64_t(split));
  } else {
    build_datasets(num_samples);
  }
  const dist::ParallelSizes& sizes = layout.sizes;
  if (gbs % (args_.micro_batch_size * sizes.dp) != 0)
    fail("global-batch-size ({}) is not divisible by micro-batch-size ({}) x data-parallel "
         "size ({})", gbs, args_.micro_batch_size, sizes.dp);
  const int64_t vpp = sizes.vpp.value_or(1);  // model chunks per pipeline rank
  check_interleaved_micro_batches(gbs / (args_.micro_batch_size * sizes.dp), sizes.pp, vpp);
  grid_ = std::make_unique<dist::Grid>(sizes, world, dist::world_rank());
  dist::Grid::set_current(*grid_);
  comm_ = dist::make_comm(args_.model.device);
  comm_->prepare(*grid_);

  const bool distributed = args_.parallel.use_distributed_optimizer;
  ModelParallel mp;
  mp.grid = grid_.get();
  mp.comm = comm_.get();
  mp.sequence_parallel = layout.sequence_parallel;
  mp.dispatcher = args_.parallel.moe_token_dispatcher_type == "alltoall"
                      ? TokenDispatcher::AllToAll
                      : TokenDispatcher::AllGather;
  mp.alltoall_exchange = alltoall_exchange_from_env();
  // This pipeline rank's model chunks: the layers Megatron assigns to virtual stage
  // c x pp + rank; the embedding on the first chunk of the pipeline, the loss on the last.
  const int64_t pp_rank = grid_->pp().rank;
  // Megatron's DistributedDataParallel: buckets only when reductions overlap backward.
  const int64_t bucket_size =
      !args_.parallel.overlap_grad_reduce ? 0
      : args_.parallel.ddp_bucket_size > 0
          ? args_.parallel.ddp_bucket_size
          : std::max<int64_t>(40000000, 1000000 * int64_t(grid_->dp_cp().size()));
  std::vector<ParamAndGradBuffer*> buffers;
  for (int64_t c = 0; c < vpp; ++c) {
    const ChunkLayers layers = chunk_layers(layout.layers_per_stage, vpp, pp_rank, c);
    const PipelineChunk chunk{layers.first_layer, layers.num_layers, pp_rank == 0 && c == 0,
                              pp_rank == sizes.pp - 1 && c == vpp - 1};
    chunks_.push_back(std::make_unique<GPTModel>(args_.model, args_.seed, mp,
                                                 distributed ? grid_->dp_cp().size() : 1,
                                                 distributed ? grid_->edp().size() : 1, chunk,
                                                 bucket_size));
    for (ParamAndGradBuffer& b : chunks_.back()->buffers()) buffers.push_back(&b);
  }
  optim::DataParallelConfig ddp_config;
  ddp_config.use_distributed_optimizer = distributed;
  ddp_config.overlap_grad_reduce = args_.parallel.overlap_grad_reduce;
  ddp_config.overlap_param_gather = args_.parallel.overlap_param_gather;
  ddp_config.num_micro_batches = gbs / (args_.micro_batch_size * sizes.dp);
  ddp_ = std::make_unique<optim::DistributedDataParallel>(buffers, *grid_, *comm_, ddp_config);
  for (auto& chunk : chunks_)
    chunk->set_param_hooks(
        {[this](std::span<Param* const> ps) { ddp_->wait_param_sync(ps); },
         [this](std::span<Param* const> ps) { ddp_->grads_ready(ps); }});
  moe_ = std::make_unique<MoEStepBookkeeping>(chunk_pointers(), args_.model, *grid_, *comm_);
  optimizer_ = std::make_unique<optim::DistributedAdamW>(std::move(buffers), *grid_, *comm_,
                                                         args_.adam, distributed);
  if (sizes.pp > 1) schedule_ = std::make_unique<PipelineSchedule>(chunk_pointers(), *grid_, *comm_);
  lr_ = Tensor::zeros({1}, DType::F32, args_.model.device);
  if (args_.cuda_graph_impl == "full_iteration")
    step_graph_ = std::make_unique<FullIterationGraph>(args_.cuda_graph_warmup_steps);
  if (!args_.load.empty()) load();
  // --fp8-param-gather: each rank quantized its shard of the FP8 weights (at construction
  // or load); the all-gather gives every rank all of them before the first forward.
  if (args_.model.fp8.param_gather) {
    ddp_->start_param_sync();
    ddp_->finish_param_sync();
  }
}

std::vector<GPTModel*> Trainer::chunk_pointers() const {
  std::vector<GPTModel*> out;
  for (const auto& chunk : chunks_) out.push_back(chunk.get());
  return out;
}

std::map<std::string, const Param*> Trainer::params_by_name() const {
  // The tied embeddings' copy on the last stage has the first stage's name; never both on
  // one rank (pipeline parallelism puts them on different stages).
  std::map<std::string, const Param*> out;
  for (const auto& chunk : chunks_)
    for (const Param* p : chunk->params()) out[p->name] = p;
  return out;
}

PipelineMicroBatches Trainer::pipeline_micro_batches(
    const data::SampleSource& source, int64_t batch_start,
    std::function<ForwardContext(int64_t)> context) const {
  PipelineMicroBatches out;
  out.count = local_micro_batches();
  out.batch = args_.micro_batch_size;
  out.seq = args_.model.seq_length;
  out.load = [this, &source, batch_start](int64_t mb, Tensor& tokens, Tensor& labels) {
    load_batch(source, micro_batch_start(batch_start, mb), args_.micro_batch_size, tokens, labels);
  };
  out.context = std::move(context);
  return out;
}

int64_t Trainer::local_micro_batches() const {
  return args_.global_batch_size / (args_.micro_batch_size * grid_->dp().size());
}

int64_t Trainer::micro_batch_start(int64_t batch_start, int64_t mb) const {
  const int64_t dp = grid_->dp().size();
  return batch_start + (mb * dp + grid_->dp().rank) * args_.micro_batch_size;
}

void Trainer::build_datasets(const std::array<int64_t, 3>& num_samples) {
  data::GPTDatasetConfig data_cfg;
  data_cfg.blend = data::parse_data_path(args_.data_path);
  data_cfg.split = args_.split;
  data_cfg.seq_length = args_.model.seq_length;
  data_cfg.seed = args_.seed;
  datasets_ = data::build_gpt_datasets(data_cfg, num_samples);
  if (!datasets_[0]) fail("data-path: the train split of '{}' is empty", args_.split);
  for (const auto& ds : datasets_)
    if (ds && ds->size() > 0) {
      // Every token id must fit the model's vocabulary.
      std::vector<int32_t> sample(args_.model.seq_length + 1);
      ds->get(0, sample.data());
      for (int32_t t : sample)
        if (t < 0 || t >= args_.model.vocab_size)
          fail("data-path: token id {} is outside the tokenizer's vocabulary of {} (was the "
               "data preprocessed with another tokenizer?)", t, args_.model.vocab_size);
    }
}

void Trainer::load_batch(const data::SampleSource& source, int64_t first_sample, int64_t count,
                         Tensor& tokens, Tensor& labels) const {
  int64_t seq = args_.model.seq_length;
  tokens = Tensor::empty({count, seq}, DType::I32);
  labels = Tensor::empty({count, seq}, DType::I32);
  std::vector<int32_t> sample(seq + 1);
  for (int64_t i = 0; i < count; ++i) {
    source.get((first_sample + i) % source.size(), sample.data());
    std::copy(sample.begin(), sample.end() - 1, tokens.i32() + i * seq);
    std::copy(sample.begin() + 1, sample.end(), labels.i32() + i * seq);
  }
}

Trainer::StepLoss Trainer::train_step(int64_t iteration) {
  for (auto& chunk : chunks_) chunk->zero_grad();
  ddp_->start_grad_sync_step();
  moe_->start_step();
  const int64_t n_mb = local_micro_batches(), mbs = args_.micro_batch_size;
  const int64_t dp = grid_->dp().size();
  const Device device = args_.model.device;
  // The summed per-token losses stay on the device (one sum per micro-batch added in).
  Tensor loss_sum = Tensor::zeros({1}, DType::F32, device);
  Tensor mb_sum = Tensor::empty({1}, DType::F32, device);
  double tokens_sum = 0;
  if (schedule_) {
    // Dropout masks are keyed by the global micro-batch index: the same on any layout.
    const PipelineLosses stage = schedule_->forward_backward(
        pipeline_micro_batches(*datasets_[0], consumed_samples_,
                               [&](int64_t mb) {
                                 return ForwardContext{true, args_.seed, iteration,
                                                       mb * dp + grid_->dp().rank};
                               }),
        /*forward_only=*/false);
    // The LM loss exists on the last stage (the MoE losses are logged from the routers'
    // metrics, MoEStepBookkeeping).
    // (The schedule sums on the host; its value travels in a small upload.)
    loss_sum = Tensor::from({1}, {float(stage.loss_sum)}).to(device);
    // The last stage's tokens, known on every stage (micro-batches are all alike).
    tokens_sum = double(n_mb * mbs * args_.model.seq_length);
  }
  for (int64_t mb = 0; !schedule_ && mb < n_mb; ++mb) {
    // Dropout masks are keyed by the global micro-batch index: the same on any layout.
    ForwardContext ctx{true, args_.seed, iteration, mb * dp + grid_->dp().rank};
    MicroBatchLoss out = chunks_[0]->forward(batch_tokens_[size_t(mb)], batch_labels_[size_t(mb)], ctx);
    int64_t T = out.losses.numel();
    ops::sum(out.losses, mb_sum);
    ops::add_(loss_sum, mb_sum);
    tokens_sum += double(T);
    // Megatron's default loss: the token mean per micro-batch, averaged over micro-batches.
    Tensor dlosses = Tensor::empty({T}, DType::F32, device);
    dlosses.fill(float(1.0 / (double(T) * double(n_mb))));
    chunks_[0]->backward(dlosses, 1.0f / float(n_mb));
  }
  local_loss_sum_ = loss_sum.clone();
  // The LM loss exists on the last stage; summed over the pipeline there (before the
  // data-parallel sums below), on the device.
  if (schedule_) comm_->all_reduce(loss_sum, grid_->pp());
  // Megatron's finalize_model_grads order: the data-parallel reduction first (under
  // --overlap-grad-reduce mostly done during backward), then the sums over tensor-parallel
  // ranks (sequence-parallel params) and over the stages holding tied embeddings. Sums
  // commute, and under the distributed optimizer the ranks that are summed hold the same
  // reduced shard (the tied embeddings have a bucket of their own).
  // The gradients become the mean over the data-parallel ranks (each rank's are the mean
  // over its micro-batches); the logged losses likewise.
  ddp_->finish_grad_sync();
  for (auto& chunk : chunks_)
    all_reduce_sequence_parallel_grads(chunk->params(), chunk->model_parallel());
  all_reduce_embedding_grads(chunk_pointers(), *grid_, *comm_);
  // The LM losses are whole on every tensor-parallel rank (counted on TP rank 0) and
  // averaged over data parallel.
  // Every data- and context-parallel rank has as many tokens as this one.
  if (grid_->tp().rank != 0) loss_sum.zero();
  comm_->all_reduce(loss_sum, grid_->tp_dp_cp());
  return {loss_sum, tokens_sum * double(grid_->tp_dp_cp().size() / grid_->tp().size())};
}

void Trainer::stage_step_inputs(double lr) {
  lr_.copy_from(Tensor::from({1}, {float(lr)}));
  if (schedule_) return;  // the pipeline schedule loads its micro-batches itself
  const int64_t n_mb = local_micro_batches(), mbs = args_.micro_batch_size;
  if (batch_tokens_.empty()) {
    for (int64_t mb = 0; mb < n_mb; ++mb) {
      batch_tokens_.push_back(Tensor::empty({mbs, args_.model.seq_length}, DType::I32, args_.model.device));
      batch_labels_.push_back(Tensor::empty({mbs, args_.model.seq_length}, DType::I32, args_.model.device));
    }
  }
  for (int64_t mb = 0; mb < n_mb; ++mb) {
    Tensor tokens, labels;
    load_batch(*datasets_[0], micro_batch_start(consumed_samples_, mb), mbs, tokens, labels);
    batch_tokens_[size_t(mb)].copy_from(tokens);
    batch_labels_[size_t(mb)].copy_from(labels);
  }
}

Trainer::StepOutputs Trainer::run_step(int64_t iteration) {
  StepOutputs out;
  out.loss = train_step(iteration);
  // Before the update, as Megatron counts them; -1: not logged (a host synchronization).
  out.num_zeros = args_.log_num_zeros_in_grad ? optimizer_->num_zeros_in_grad() : -1;
  // The norm, the clipping (folded into the update; the gradients are not rescaled in
  // place, and the logged norm is the one before clipping, as in Megatron), the skip of
  // a non-finite step and, under --check-for-nan-in-loss-and-grad, the stop before its
  // update are all decided on the device.
  out.update = optimizer_->step_on_device(lr_, double(args_.clip_grad), out.loss.sum,
                                          args_.check_for_nan_in_loss_and_grad);
  ddp_->start_param_sync();  // the unchanged weights again after a skipped step
  // Expert biases (updated whether or not the step was skipped, as Megatron's
  // finalize_model_grads does) and the routers' metrics.
  out.moe = moe_->finish_step(local_micro_batches());
  return out;
}

double Trainer::evaluate() {
  const auto& valid = datasets_[1];
  if (!valid || args_.eval_iters == 0) return -1;
  ddp_->finish_param_sync();
  const int64_t n_mb = local_micro_batches(), mbs = args_.micro_batch_size;
  double loss_sum = 0, tokens_sum = 0;
  for (int64_t it = 0; it < args_.eval_iters; ++it) {
    if (schedule_) {
      const PipelineLosses stage = schedule_->forward_backward(
          pipeline_micro_batches(*valid, it * args_.global_batch_size,
                                 [&](int64_t) { return ForwardContext{false, args_.seed, 0, 0}; }),
          /*forward_only=*/true);
      loss_sum += stage.loss_sum;
      tokens_sum += stage.num_tokens;
    }
    for (int64_t mb = 0; !schedule_ && mb < n_mb; ++mb) {
      Tensor tokens, labels;
      load_batch(*valid, micro_batch_start(it * args_.global_batch_size, mb), mbs, tokens, labels);
      ForwardContext ctx{false, args_.seed, 0, 0};
      MicroBatchLoss out = chunks_[0]->forward(tokens, labels, ctx);
      loss_sum += ops::sum(out.losses);
      tokens_sum += double(out.losses.numel());
    }
  }
  if (schedule_) {  // the losses are on the last stage
    const std::vector<double> pipeline_sums =
        dist::sum_over(*comm_, grid_->pp(), {loss_sum, tokens_sum});
    loss_sum = pipeline_sums[0];
    tokens_sum = pipeline_sums[1];
  }
  const std::vector<double> sums = dist::sum_over(*comm_, grid_->dp_cp(), {loss_sum, tokens_sum});
  return sums[0] / sums[1];
}

// MEGATON_OP_PROFILE=1: the first iterations of a run (cuBLASLt heuristics, cuDNN plans,
// allocator growth) are timed but not counted.
constexpr int64_t kOpProfileWarmupIterations = 2;

static void print_op_profile(int64_t iterations, double wall_ms) {
  if (iterations == 0) {
    fmt::print(" op profile: no iteration counted (the first {} of a run are warmup)\n",
               kOpProfileWarmupIterations);
  } else {
    fmt::print(
        " op profile (MEGATON_OP_PROFILE=1): GPU time per iteration by op, mean of {} "
        "iterations after {} warmup; elapsed time per iteration (ms): {:.1f}\n{}",
        iterations, kOpProfileWarmupIterations, wall_ms / double(iterations),
        ops::profile_report(iterations));
  }
  std::fflush(stdout);
}

static void print_eval(const std::string& where, double loss) {
  std::string line = fmt::format(" validation loss {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ",
                                 where, loss, std::exp(std::min(loss, 20.0)));
  fmt::print("{}\n{}\n{}\n", std::string(line.size(), '-'), line, std::string(line.size(), '-'));
  std::fflush(stdout);
}

// Megatron's log fields of the MoE losses (each divided by its coefficient, averaged over
// layers) and Megaton's tokens-per-expert balance: min, max, max/mean over experts.
static std::string moe_log_fields(const MoELayerMetrics& m, bool capacity) {
  std::string out;
  if (m.load_balancing_loss >= 0) out += fmt::format("load_balancing_loss: {:.6E} | ", m.load_balancing_loss);
  if (m.seq_load_balancing_loss >= 0)
    out += fmt::format("seq_load_balancing_loss: {:.6E} | ", m.seq_load_balancing_loss);
  if (m.global_load_balancing_loss >= 0)
    out += fmt::format("global_load_balancing_loss: {:.6E} | ", m.global_load_balancing_loss);
  if (m.z_loss >= 0) out += fmt::format("z_loss: {:.6E} | ", m.z_loss);
  out += fmt::format("tokens per expert min/max: {:.0f}/{:.0f} | expert imbalance (max/mean): {:.3f} | ",
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

void Trainer::log_line(int64_t iteration, int64_t consumed_samples, double ms_per_iter, double lr,
                       double loss, const MoEStepMetrics& moe, double grad_norm, int64_t num_zeros,
                       double params_norm) {
  int64_t tokens = args_.global_batch_size * args_.model.seq_length;
  double flops = num_floating_point_operations(args_.model, tokens);
  std::string line = fmt::format(
      " iteration {:>8}/{:>8} | consumed samples: {:>12} | elapsed time per iteration (ms): "
      "{:.1f} | tokens per second: {:.1f} | throughput per GPU (TFLOP/s/GPU): {:.3f} | "
      "learning rate: {:.6E} | global batch size: {:>5} | lm loss: {:.6E} | ",
      iteration, args_.train_iters, consumed_samples, ms_per_iter,
      double(tokens) / (ms_per_iter / 1000.0),
      throughput_per_gpu_tflops(flops, ms_per_iter, grid_->world_size()), lr,
      args_.global_batch_size, loss);
  const bool capacity = args_.model.moe_expert_capacity_factor > 0;
  if (moe_->active()) line += moe_log_fields(moe.mean, capacity);
  line += fmt::format("loss scale: 1.0 | grad norm: {:.3f} | ", grad_norm);
  if (num_zeros >= 0) line += fmt::format("num zeros: {} | ", num_zeros);
  if (params_norm >= 0) line += fmt::format("params norm: {:.3f} | ", params_norm);
  line += fmt::format(
      "number of skipped iterations: {:>3} | number of "
      "nan iterations: {:>3} | peak memory (MB): {:.1f} |",
      skipped_iterations_, nan_iterations_, double(peak_memory_bytes(args_.model.device)) / 1048576.0);
  fmt::print("{}\n", line);
  if (moe_->active() && args_.moe_per_layer_logging)
    for (const MoELayerMetrics& m : moe.layers)
      fmt::print(" moe layer {:>3} | {}\n", m.layer, moe_log_fields(m, capacity));
  std::fflush(stdout);
}

TrainResult Trainer::train() {
  TrainResult result;
  if (iteration_ == 0) {
    result.first_valid_loss = evaluate();
    if (result.first_valid_loss >= 0 && is_logging_rank())
      print_eval("at iteration 0", result.first_valid_loss);
  }
  LogInterval interval;
  interval.last_done = std::chrono::steady_clock::now();
  // The last queued step whose values the host has not read yet. It is read after the
  // next step has been queued (the GPU then still has that step's work), and at once
  // before anything that must see it: an evaluation, a checkpoint, the end.
  std::optional<PendingStep> pending;
  auto read_pending = [&] {
    if (!pending) return;
    finish_step(*pending, interval, result);
    pending.reset();
  };
  bool saved_last = false;
  // Op profile: iterations of this run, those counted after warmup, and their elapsed ms.
  const bool op_profile = ops::profile_enabled();
  int64_t profile_run_iters = 0, profile_counted_iters = 0;
  double profile_wall_ms = 0;
  if (op_profile) ops::profile_discard();  // the evaluation at iteration 0, a checkpoint load
  while (iteration_ < args_.train_iters) {
    auto start = std::chrono::steady_clock::now();
    PendingStep step;
    step.lr = optim::learning_rate(args_.lr, iteration_);
    ++iteration_;
    step.iteration = iteration_;
    stage_step_inputs(step.lr);
    // Eagerly, or (--cuda-graph-impl full_iteration, after its warmup) as the replay of the
    // captured step, which rewrites the step_outputs_ of its capture.
    auto body = [this] { step_outputs_ = run_step(iteration_); };
    if (step_graph_) {
      const bool was_captured = step_graph_->captured();
      step_graph_->run(body);
      if (!was_captured && step_graph_->captured()) {
        result.cuda_graph_iteration = iteration_;
        result.cuda_graph_nodes = step_graph_->num_nodes();
        if (is_logging_rank())
          fmt::print(" cuda graph: the training step captured at iteration {} ({} nodes, {} in "
                     "its memory pool); later steps replay it\n",
                     iteration_, step_graph_->num_nodes(),
                     human_bytes(double(step_graph_->pool_bytes())));
      }
    } else {
      body();
    }
    const StepOutputs& out = step_outputs_;
    const optim::DistributedAdamW::DeviceStep& update = out.update;
    step.tokens = out.loss.tokens;
    step.num_zeros = out.num_zeros;
    step.moe = out.moe;
    std::vector<Tensor> read = {out.loss.sum,        local_loss_sum_, update.grad_norm,
                                update.local_sum_sq, update.control,  update.state};
    if (step.moe.values.defined()) read.push_back(step.moe.values);  // the log line's
    step.values = std::make_unique<Readback>(read);
    // Waits for the step's GPU work, so with the profiler on the elapsed time below covers
    // it (without, the optimizer's kernels may still run when the next iteration starts).
    if (op_profile) ops::profile_flush();
    consumed_samples_ += args_.global_batch_size;
    step.consumed_samples = consumed_samples_;
    floating_point_operations_so_far_ += num_floating_point_operations(
        args_.model, args_.global_batch_size * args_.model.seq_length);
    // After the update, as Megatron logs it; -1: not logged (a host synchronization).
    step.params_norm = args_.log_params_norm ? optimizer_->params_norm() : -1.0;
    // The previous step, now that this one is queued.
    read_pending();
    pending = std::move(step);
    // The profiler has waited for the step (profile_flush): read it now, so the elapsed
    // times stay those of the step they are logged for.
    if (op_profile) read_pending();
    if (op_profile) {
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (++profile_run_iters == kOpProfileWarmupIterations) {
        ops::profile_reset();
      } else if (profile_run_iters > kOpProfileWarmupIterations) {
        ++profile_counted_iters;
        profile_wall_ms += ms;
      }
    }
    const bool evaluate_now = args_.eval_interval > 0 && iteration_ % args_.eval_interval == 0 &&
                              iteration_ < args_.train_iters;
    const bool save_now =
        !args_.save.empty() && args_.save_interval > 0 && iteration_ % args_.save_interval == 0;
    const bool exit_now = args_.exit_interval > 0 && iteration_ % args_.exit_interval == 0;
    if (evaluate_now || save_now || exit_now) read_pending();
    if (evaluate_now) {
      double v = evaluate();
      if (op_profile) ops::profile_discard();  // evaluation is not part of a step
      if (v >= 0 && is_logging_rank()) print_eval(fmt::format("at iteration {}", iteration_), v);
    }
    saved_last = false;
    if (save_now) {
      save(iteration_);
      saved_last = true;
    }
    // The next step's time starts now, not at the read before the evaluation or save.
    if (evaluate_now || save_now) interval.last_done = std::chrono::steady_clock::now();
    if (exit_now) {
      if (!args_.save.empty() && !saved_last) save(iteration_);
      ddp_->finish_param_sync();
      if (op_profile && is_logging_rank()) print_op_profile(profile_counted_iters, profile_wall_ms);
      if (is_logging_rank()) fmt::print("exiting program at iteration {}\n", iteration_);
      result.final_iteration = iteration_;
      return result;
    }
  }
  read_pending();
  if (!args_.save.empty() && !saved_last) save(iteration_);
  ddp_->finish_param_sync();
  if (op_profile && is_logging_rank()) print_op_profile(profile_counted_iters, profile_wall_ms);
  result.last_valid_loss = evaluate();
  if (op_profile) ops::profile_discard();
  if (result.last_valid_loss >= 0 && is_logging_rank())
    print_eval("at the end of training", result.last_valid_loss);
  result.final_iteration = iteration_;
  return result;
}

void Trainer::finish_step(PendingStep& step, LogInterval& interval, TrainResult& result) {
  Readback& values = *step.values;
  values.wait();
  // The step's time: from when the previous step's values were read to when this one's
  // were (the GPU's pace in the steady state, where the host waits for it).
  const auto now = std::chrono::steady_clock::now();
  const double ms = std::chrono::duration<double, std::milli>(now - interval.last_done).count();
  interval.last_done = now;
  const double loss = double(values.tensor(0).f32()[0]) / step.tokens;
  const double local_loss_sum = values.tensor(1).f32()[0];
  const double grad_norm = std::bit_cast<double>(values.tensor(2).i64()[0]);
  const double local_grad_sum_sq = std::bit_cast<double>(values.tensor(3).i64()[0]);
  const bool skipped = values.tensor(4).f32()[ops::kAdamSkip] != 0.0f;
  const bool stopped = values.tensor(5).i64()[1] != 0;
  // The MoE metrics on the host now, so the log line reads them without waiting.
  if (step.moe.values.defined()) step.moe.values = values.tensor(6);
  // The device skipped this step's update (and every later one) when it stopped.
  if (stopped) stop_on_non_finite(step.iteration, loss, grad_norm, local_loss_sum, local_grad_sum_sq);
  if (skipped) {
    ++nan_iterations_;
    ++skipped_iterations_;
  }
  result.losses.push_back(loss);
  result.grad_norms.push_back(grad_norm);
  if (!args_.log_metrics_file.empty() && is_logging_rank()) {
    nlohmann::json line = {{"iteration", step.iteration}, {"lm_loss", loss},
                           {"grad_norm", grad_norm}, {"lr", step.lr}};
    if (moe_->active()) add_moe_metrics(line, moe_->read(step.moe), args_.moe_per_layer_logging);
    if (step.params_norm >= 0) line["params_norm"] = step.params_norm;
    if (step.num_zeros >= 0) line["num_zeros"] = step.num_zeros;
    std::ofstream out(args_.log_metrics_file, std::ios::app);
    out << line.dump() << "\n";
    if (!out) fail("log-metrics-file: cannot write '{}'", args_.log_metrics_file);
  }
  interval.loss += loss;
  if (moe_->active()) interval.moe.push_back(std::move(step.moe));
  interval.ms += ms;
  ++interval.iterations;
  const bool log_now =
      step.iteration % args_.log_interval == 0 || step.iteration == args_.train_iters;
  if (!log_now) return;
  if (is_logging_rank()) {
    MoEStepMetrics moe_mean;
    for (const PendingMoEMetrics& m : interval.moe) accumulate_moe_metrics(moe_mean, moe_->read(m));
    scale_moe_metrics(moe_mean, 1.0 / double(interval.iterations));
    log_line(step.iteration, step.consumed_samples, interval.ms / double(interval.iterations),
             step.lr, interval.loss / double(interval.iterations), moe_mean, grad_norm,
             step.num_zeros, step.params_norm);
  }
  interval.moe.clear();
  interval.loss = interval.ms = 0;
  interval.iterations = 0;
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
    if (flags[size_t(2 * r + (in_loss ? 0 : 1))] > 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  if (ranks.empty()) ranks = "none alone (it arose in the reduction over ranks)";
  fail("iteration {}: found {} in the {} on rank{} {}; stopped before the update by "
       "--check-for-nan-in-loss-and-grad (the parameters and checkpoints are those of the "
       "last finite step; a smaller --lr or --clip-grad may help)",
       iteration, std::isnan(value) ? "NaN" : "Inf", in_loss ? "loss" : "gradient norm",
       ranks.find(',') == std::string::npos ? "" : "s", ranks);
}

}  // namespace megaton
