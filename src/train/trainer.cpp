// The training loop.
#include "train/trainer.h"

#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "ckpt/checkpoint.h"
#include "model/context_parallel.h"
#ifdef MEGATON_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#endif
#include "data/mock_dataset.h"
#include "dist/gather.h"
#include "dist/host_reduce.h"
#include "dist/runtime.h"
#include "model/tensor_parallel.h"
#include "model/token_dispatcher.h"
#include "ops/determinism.h"
#include "ops/ops.h"
#include "ops/profiler.h"
#include "optim/clip_grad.h"
#include "optim/lr_schedule.h"
#include "train/data_parallel_setup.h"
#include "train/flops.h"
#include "train/generate.h"
#include "train/loss_mask.h"
#include "train/memory_check.h"
#include "train/packed_batch.h"
#include "train/pipeline_schedule.h"
#include "train/run_control.h"
#include "train/tensor_parallel_ckpt.h"

namespace megaton {

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

std::unique_ptr<data::Tokenizer> finish_train_args(TrainArgs& args, int64_t world,
                                                   dist::ValidatedLayout& layout) {
  auto tokenizer = data::make_tokenizer(tokenizer_options(args));
  args.model.vocab_size = tokenizer->vocab_size();
  // The vocabulary padding depends on the tensor-parallel size (Megatron).
  args.model.tensor_model_parallel_size = args.parallel.tensor_model_parallel_size;
  args.model.finalize();
  const int64_t etp = args.parallel.expert_tensor_parallel_size > 0
                          ? args.parallel.expert_tensor_parallel_size
                          : args.parallel.tensor_model_parallel_size;
  // The GEMMs see this rank's rows: seq-length / context-parallel-size of each sample.
  args.model.check_fp8_dimensions(args.micro_batch_size * args.model.seq_length /
                                      std::max<int64_t>(args.parallel.context_parallel_size, 1),
                                  etp);
  layout = check_parallel_layout(args, world);
  return tokenizer;
}

// Every batch size of the schedule splits into whole micro-batches on each data-parallel
// rank (BatchSchedule checks; its message names the flag), and into groups of the pipeline
// size under the interleaved schedule.
std::unique_ptr<BatchSchedule> check_micro_batch_split(const TrainArgs& args,
                                                       const dist::ParallelSizes& sizes) {
  const int64_t gbs = args.global_batch_size;
  if (gbs % (args.micro_batch_size * sizes.dp) != 0)
    fail(
        "global-batch-size ({}) is not divisible by micro-batch-size ({}) x data-parallel "
        "size ({})",
        gbs, args.micro_batch_size, sizes.dp);
  auto schedule = std::make_unique<BatchSchedule>(batch_schedule_config(args, sizes.dp));
  for (auto [threshold, batch] : schedule->steps())
    check_interleaved_micro_batches(batch / (args.micro_batch_size * sizes.dp), sizes.pp,
                                    sizes.vpp.value_or(1));
  return schedule;
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
  // The parallel layout (checked again here for callers other than the CLI).
  const int64_t world = dist::world_size();
  dist::ValidatedLayout layout;
  tokenizer_ = finish_train_args(args_, world, layout);
  const int64_t gbs = args_.global_batch_size;
  check_memory_fits(args_, layout.sizes);  // before the datasets and the model are built
  check_full_iteration_graph(args_, world);
  // The batch-size schedule (checked against the layout below, before anything is built).
  const int64_t train_samples =
      BatchSchedule(batch_schedule_config(args_, 1)).consumed_samples_after(args_.train_iters);
  std::array<int64_t, 3> num_samples = {train_samples, args_.eval_iters * gbs,
                                        args_.eval_iters * gbs};
  if (args_.mock_data) {
    for (int split = 0; split < 3; ++split)
      datasets_[split] = std::make_unique<data::MockGPTDataset>(
          std::max<int64_t>(num_samples[split], 1), args_.model.seq_length, args_.model.vocab_size,
          args_.seed, uint64_t(split));
  } else {
    build_datasets(num_samples);
  }
  const dist::ParallelSizes& sizes = layout.sizes;
  batch_schedule_ = check_micro_batch_split(args_, sizes);
  const int64_t vpp = sizes.vpp.value_or(1);  // model chunks per pipeline rank
  grid_ = std::make_unique<dist::Grid>(sizes, world, dist::world_rank());
  dist::Grid::set_current(*grid_);
  comm_ = dist::make_comm(args_.model.device);
  comm_->prepare(*grid_);
  // Every micro-batch's rows: this rank's two chunks of each sample, at their global
  // positions (RoPE's, or the learned position embedding's rows).
  if (grid_->cp().size() > 1)
    cp_params_ = context_parallel_seq_params(
        args_.micro_batch_size, args_.model.seq_length,
        {comm_.get(), &grid_->cp(), parse_cp_comm_type(args_.parallel.cp_comm_type)},
        args_.model.device);
  std::string bus_id;  // the GPU's PCI bus id: NVML's handle for --log-energy
#ifdef MEGATON_WITH_CUDA
  if (args_.model.device == Device::CUDA && args_.logging.log_energy) {
    int device = 0;
    char id[64] = {};
    MEGATON_CUDA_CHECK(cudaGetDevice(&device));
    MEGATON_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof(id), device));
    bus_id = id;
  }
#endif
  run_logger_ = std::make_unique<RunLogger>(args_, *grid_, *comm_, bus_id);

  const bool distributed = args_.parallel.use_distributed_optimizer;
  ModelParallel mp;
  mp.grid = grid_.get();
  mp.comm = comm_.get();
  mp.sequence_parallel = layout.sequence_parallel;
  mp.tp_comm_overlap = layout.sequence_parallel && args_.parallel.tp_comm_overlap;
  mp.dispatcher = args_.parallel.moe_token_dispatcher_type == "allgather"
                      ? TokenDispatcher::AllGather
                      : TokenDispatcher::AllToAll;  // alltoall, flex
  mp.alltoall_exchange = alltoall_exchange_from_env();
  announce_moe_exchange(mp);
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
                                                 bucket_size, chunk_sharding(args_, grid_.get())));
    for (ParamAndGradBuffer& b : chunks_.back()->buffers()) buffers.push_back(&b);
  }
  ddp_ = std::make_unique<optim::DistributedDataParallel>(
      buffers, *grid_, *comm_, data_parallel_config(args_, local_micro_batches()));
  std::vector<std::vector<std::span<Param* const>>> units;
  for (auto& chunk : chunks_) {
    chunk->set_param_hooks(data_parallel_hooks(*ddp_));
    units.push_back(chunk->param_units());
  }
  ddp_->set_units(units);
  moe_ = std::make_unique<MoEStepBookkeeping>(chunk_pointers(), args_.model, *grid_, *comm_);
  optimizer_ = std::make_unique<optim::DistributedAdamW>(std::move(buffers), *grid_, *comm_,
                                                         args_.adam, distributed,
                                                         args_.optimizer);
  ddp_->release_all_weights();  // FSDP's sharded weights: each rank keeps its shard
  // Megatron's get_megatron_optimizer: a static --loss-scale in fp16 and bf16 runs, dynamic
  // scaling in fp16 runs without it, no scaler in fp32 runs.
  optim::GradScalerConfig scaler_config = args_.loss_scaler;
  if (!args_.model.fp16 && !args_.model.bf16) scaler_config.loss_scale = 0;
  scaler_ = std::make_unique<optim::GradScaler>(scaler_config,
                                                args_.model.fp16 && scaler_config.loss_scale == 0);
  if (sizes.pp > 1)
    schedule_ = std::make_unique<PipelineSchedule>(chunk_pointers(), *grid_, *comm_,
                                                   args_.parallel.overlap_p2p_comm);
  lr_ = Tensor::zeros({1}, DType::F32, args_.model.device);
  // The pipeline schedule loads its micro-batches itself.
  const int64_t most_micro_batches =
      batch_schedule_->max_global_batch_size() / (args_.micro_batch_size * sizes.dp);
  for (int64_t mb = 0; !schedule_ && mb < most_micro_batches; ++mb)
    for (auto* buffers : {&batch_tokens_, &batch_labels_})
      buffers->push_back(Tensor::empty({args_.micro_batch_size, local_seq_length()}, DType::I32,
                                       args_.model.device));
  for (int64_t mb = 0; !schedule_ && args_.eod_mask_loss && mb < most_micro_batches; ++mb)
    for (auto* buffers : {&batch_loss_masks_, &batch_loss_weights_})
      buffers->push_back(Tensor::empty({args_.micro_batch_size * local_seq_length()}, DType::F32,
                                       args_.model.device));
  for (int64_t mb = 0; !schedule_ && mb < most_micro_batches; ++mb) {
    batch_packing_.emplace_back();
    if (args_.reset_position_ids)
      batch_position_ids_.push_back(Tensor::empty({args_.micro_batch_size * args_.model.seq_length},
                                                  DType::I32, args_.model.device));
  }
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

Trainer::StepLoss Trainer::train_step(int64_t iteration) {
  for (auto& chunk : chunks_) chunk->zero_grad();
  ddp_->start_grad_sync_step(local_micro_batches());
  moe_->start_step();
  const int64_t n_mb = local_micro_batches(), mbs = args_.micro_batch_size;
  const int64_t dp = grid_->dp().size();
  const Device device = args_.model.device;
  // The summed per-token losses stay on the device (one sum per micro-batch added in).
  Tensor loss_sum = Tensor::zeros({1}, DType::F32, device);
  Tensor mb_sum = Tensor::empty({1}, DType::F32, device);
  double tokens_sum = 0;
  // Multi-token prediction: each depth's loss summed over the micro-batches (last stage).
  const int64_t mtp_depths = args_.model.mtp_num_layers;
  Tensor mtp_sum = mtp_depths > 0 ? Tensor::zeros({mtp_depths}, DType::F32, device) : Tensor();
  // The backward starts from the loss times the loss scale (1 without one).
  const float loss_scale = scaler_->scale();
  if (schedule_) {
    // Dropout masks are keyed by the global micro-batch index: the same on any layout.
    PipelineMicroBatches batches =
        pipeline_micro_batches(*datasets_[0], consumed_samples_, n_mb, [&](int64_t mb) {
          return ForwardContext{true, args_.seed, iteration, mb * dp + grid_->dp().rank};
        });
    batches.loss_scale = loss_scale;
    batches.per_token_loss = args_.calculate_per_token_loss;
    const PipelineLosses stage = schedule_->forward_backward(batches, /*forward_only=*/false);
    if (stage.mtp_losses.defined()) ops::add_(mtp_sum, stage.mtp_losses);
    // The LM loss exists on the last stage (the MoE losses are logged from the routers'
    // metrics, MoEStepBookkeeping).
    // (The schedule sums on the host; its value travels in a small upload.)
    loss_sum = Tensor::from({1}, {float(stage.loss_sum)}).to(device);
    // The last stage's tokens, known on every stage (micro-batches are all alike).
    tokens_sum = double(n_mb * mbs * local_seq_length());
    // With the loss mask the counts are the last stage's, and differ between data-parallel
    // ranks: summed over both here (host collectives), as evaluate() does.
    if (args_.eod_mask_loss) {
      const double stages = dist::sum_over(*comm_, grid_->pp(), {stage.num_tokens})[0];
      tokens_sum = dist::sum_over(*comm_, grid_->dp_cp(), {stages})[0];
    }
  }
  for (int64_t mb = 0; !schedule_ && mb < n_mb; ++mb) {
    // Dropout masks are keyed by the global micro-batch index: the same on any layout.
    ForwardContext ctx{true, args_.seed, iteration, mb * dp + grid_->dp().rank};
    // Null unless documents are packed or the sequence is split over CP ranks.
    ctx.packed_seq_params = batch_packing_[size_t(mb)];
    ChunkInput in{
        mbs,     local_seq_length(), batch_tokens_[size_t(mb)], batch_labels_[size_t(mb)], Tensor(),
        Tensor()};
    if (args_.eod_mask_loss && mtp_depths > 0) in.loss_mask = batch_loss_masks_[size_t(mb)];
    MicroBatchLoss out = chunks_[0]->forward_chunk(in, ctx).loss;
    if (out.mtp_losses.defined()) ops::add_(mtp_sum, out.mtp_losses);
    int64_t T = out.losses.numel();
    if (args_.eod_mask_loss)
      ops::dot(out.losses, batch_loss_masks_[size_t(mb)], mb_sum);
    else
      ops::sum(out.losses, mb_sum);
    ops::add_(loss_sum, mb_sum);
    Tensor dlosses;
    // The MoE aux losses' gradient scale (Megatron-LM d98e8a6 schedules.py forward_step's
    // MoEAuxLossAutoScaler.set_loss_scale).
    // Under context parallelism times cp (schedules.py: loss_scale * cp_size /
    // num_microbatches): the aux loss is a partial sum, the gradients a mean over DP x CP.
    float aux_grad_scale = float(double(loss_scale) * double(grid_->cp().size()) / double(n_mb));
    if (args_.calculate_per_token_loss) {
      // Megatron's forward_step with calculate_per_token_loss: the micro-batch's masked sum
      // (loss_func's sum(losses * mask)) is not divided by its num_tokens nor by
      // num_microbatches; run_step divides the gradients by the step's tokens. The aux-loss
      // scale is loss_scale alone, and the router (router.py attach_and_log_load_balancing_loss
      // and apply_z_loss) multiplies each injected loss by its tokens times the TP x CP size,
      // the micro-batch's B x S tokens: here one factor.
      if (args_.eod_mask_loss) {
        dlosses = batch_loss_masks_[size_t(mb)].clone();
        ops::scale_(dlosses, loss_scale);
      } else {
        tokens_sum += double(T);
        dlosses = Tensor::empty({T}, DType::F32, device);
        dlosses.fill(loss_scale);
      }
      aux_grad_scale = float(double(loss_scale) * double(mbs * args_.model.seq_length));
    } else if (args_.eod_mask_loss) {
      // Megatron's loss with its mask: the mean over the micro-batch's unmasked tokens,
      // averaged over micro-batches (the staged weights are mask / unmasked tokens).
      dlosses = batch_loss_weights_[size_t(mb)].clone();
      ops::scale_(dlosses, float(double(loss_scale) / double(n_mb)));
    } else {
      tokens_sum += double(T);
      // Megatron's default loss: the token mean per micro-batch, averaged over micro-batches.
      dlosses = Tensor::empty({T}, DType::F32, device);
      dlosses.fill(float(double(loss_scale) / (double(T) * double(n_mb))));
    }
    chunks_[0]->backward(dlosses, aux_grad_scale);
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
  finalize_model_grads(chunk_pointers(), *grid_, *comm_, *ddp_);
  // The LM losses are whole on every tensor-parallel rank (counted on TP rank 0) and
  // averaged over data parallel.
  // Every data- and context-parallel rank has as many tokens as this one.
  if (grid_->tp().rank != 0) loss_sum.zero();
  comm_->all_reduce(loss_sum, grid_->tp_dp_cp());
  if (mtp_sum.defined()) {
    // Megatron's MTPLossLoggingHelper: the mean over micro-batches, averaged over DP x CP.
    if (schedule_) comm_->all_reduce(mtp_sum, grid_->pp());
    if (grid_->tp().rank != 0) mtp_sum.zero();
    comm_->all_reduce(mtp_sum, grid_->tp_dp_cp());
    ops::scale_(mtp_sum, float(1.0 / (double(n_mb) *
                                      double(grid_->tp_dp_cp().size() / grid_->tp().size()))));
  }
  // With the loss mask the tokens were summed over the data-parallel ranks already (by the
  // pipeline branch above, or when the inputs were staged).
  if (args_.eod_mask_loss) return {loss_sum, schedule_ ? tokens_sum : staged_loss_tokens_, mtp_sum};
  return {loss_sum, tokens_sum * double(grid_->tp_dp_cp().size() / grid_->tp().size()), mtp_sum};
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
  // --calculate-per-token-loss: the gradients (of the summed losses, summed over the
  // data-parallel ranks) divided by the step's loss tokens over the data- and context-parallel
  // ranks (Megatron-LM d98e8a6 finalize_model_grads: num_tokens broadcast from the last
  // stage and all-reduced over dp_cp, then scale_gradients(1 / num_tokens)), folded into the
  // optimizer's unscaling. The count is the logged loss's: out.loss.tokens, on the host.
  std::optional<double> per_token_loss_tokens;
  if (args_.calculate_per_token_loss) per_token_loss_tokens = out.loss.tokens;
  out.update = optimizer_->step_on_device(lr_, double(args_.clip_grad), out.loss.sum,
                                          args_.check_for_nan_in_loss_and_grad,
                                          scaler_->inv_scale(), per_token_loss_tokens);
  ddp_->start_param_sync();  // the unchanged weights again after a skipped step
  // Expert biases (updated whether or not the step was skipped, as Megatron's
  // finalize_model_grads does) and the routers' metrics.
  out.moe = moe_->finish_step(local_micro_batches());
  return out;
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
  std::string line =
      fmt::format(" validation loss {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ", where,
                  loss, std::exp(std::min(loss, 20.0)));
  fmt::print("{}\n{}\n{}\n", std::string(line.size(), '-'), line, std::string(line.size(), '-'));
  std::fflush(stdout);
}

TrainResult Trainer::train() {
  RunControl control(args_.logging, *comm_, *grid_);
  job_start_ = std::chrono::steady_clock::now();
  job_start_flops_ = floating_point_operations_so_far_;
  run_logger_->progress("Starting job");
  if (args_.async_save && !args_.save.empty()) reserve_snapshot(checkpoint_entries());
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
    control.profile_before_step(iteration_);
    step.global_batch_size = current_global_batch_size();
    step.lr = optim::learning_rate(args_.lr, scheduler_samples_);
    // Megatron's scheduler sets the weight decay with the learning rate.
    step.weight_decay = optim::weight_decay(args_.lr, scheduler_samples_);
    if (args_.lr.weight_decay_incr_style != optim::WeightDecayIncrStyle::Constant)
      optimizer_->set_weight_decay(float(step.weight_decay));
    scheduler_samples_ += step.global_batch_size;  // taken back by finish_step if skipped
    ++iteration_;
    step.iteration = iteration_;
    dist::set_comm_iteration(iteration_);  // named by a collective's timeout message
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
          fmt::print(
              " cuda graph: the training step captured at iteration {} ({} nodes, {} in "
              "its memory pool); later steps replay it\n",
              iteration_, step_graph_->num_nodes(), human_bytes(double(step_graph_->pool_bytes())));
      }
    } else {
      body();
    }
    const StepOutputs& out = step_outputs_;
    const optim::DistributedAdamW::DeviceStep& update = out.update;
    // The tokens in the loss; with the loss mask and no pipeline, counted when the inputs
    // were staged (a replayed step does not run train_step's host code).
    step.tokens = args_.eod_mask_loss && !schedule_ ? staged_loss_tokens_ : out.loss.tokens;
    step.num_zeros = out.num_zeros;
    step.moe = out.moe;
    std::vector<Tensor> read = {out.loss.sum,        local_loss_sum_, update.grad_norm,
                                update.local_sum_sq, update.control,  update.state};
    if (step.moe.values.defined()) read.push_back(step.moe.values);  // the log line's
    step.mtp_index = -1;
    if (out.loss.mtp_sum.defined()) {
      step.mtp_index = int64_t(read.size());
      read.push_back(out.loss.mtp_sum);
    }
    step.values = std::make_unique<Readback>(read);
    // Waits for the step's GPU work, so with the profiler on the elapsed time below covers
    // it (without, the optimizer's kernels may still run when the next iteration starts).
    if (op_profile) ops::profile_flush();
    consumed_samples_ += step.global_batch_size;
    step.consumed_samples = consumed_samples_;
    floating_point_operations_so_far_ +=
        num_floating_point_operations(args_.model, step.global_batch_size * args_.model.seq_length);
    // After the update, as Megatron logs it; -1: not logged (a host synchronization).
    step.params_norm = args_.log_params_norm ? optimizer_->params_norm() : -1.0;
    // The previous step, now that this one is queued.
    read_pending();
    pending = std::move(step);
    // The profiler has waited for the step (profile_flush): read it now, so the elapsed
    // times stay those of the step they are logged for.
    // Dynamic loss scaling: the next step's scale and learning rate depend on whether this
    // one overflowed, so its values are read now (a host synchronization per step, as
    // Megatron's found_inf.item()).
    if (op_profile || scaler_->dynamic()) read_pending();
    if (op_profile) {
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      if (++profile_run_iters == kOpProfileWarmupIterations) {
        ops::profile_reset();
      } else if (profile_run_iters > kOpProfileWarmupIterations) {
        ++profile_counted_iters;
        profile_wall_ms += ms;
      }
    }
    control.profile_after_step(iteration_);
    finalize_async_save(false);  // commits a background save once every rank has written
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
      if (v >= 0) run_logger_->validation(iteration_, consumed_samples_, v);
    }
    saved_last = false;
    if (save_now) {
      save(iteration_);
      saved_last = true;
    }
    // The next step's time starts now, not at the read before the evaluation or save.
    if (evaluate_now || save_now) {
      interval.last_done = std::chrono::steady_clock::now();
      interval.last_values.reset();  // the evaluation's or save's GPU work is no step's
    }
    if (exit_now) {
      if (!args_.save.empty() && !saved_last) save(iteration_);
      finalize_async_save(true);
      ddp_->finish_param_sync();
      if (op_profile && is_logging_rank()) print_op_profile(profile_counted_iters, profile_wall_ms);
      if (is_logging_rank()) fmt::print("exiting program at iteration {}\n", iteration_);
      result.final_iteration = iteration_;
      return result;
    }
    // --exit-duration-in-mins, --exit-signal-handler: every rank stops at this iteration.
    std::string why;
    if (control.active() && control.should_exit(why)) {
      read_pending();
      if (!args_.save.empty() && !saved_last) save(iteration_);
      finalize_async_save(true);
      ddp_->finish_param_sync();
      if (is_logging_rank()) fmt::print("{}\n", why);
      result.final_iteration = iteration_;
      return result;
    }
  }
  read_pending();
  if (!args_.save.empty() && !saved_last) save(iteration_);
  finalize_async_save(true);
  ddp_->finish_param_sync();
  if (op_profile && is_logging_rank()) print_op_profile(profile_counted_iters, profile_wall_ms);
  result.last_valid_loss = evaluate();
  if (op_profile) ops::profile_discard();
  if (result.last_valid_loss >= 0 && is_logging_rank())
    print_eval("at the end of training", result.last_valid_loss);
  result.final_iteration = iteration_;
  return result;
}

}  // namespace megaton
