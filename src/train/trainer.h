// Trainer: the training loop (data -> forward/backward -> clip -> AdamW -> log/eval/save).
#pragma once
#include <array>
#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "ckpt/sharded.h"
#include "core/copy_stream.h"
#include "core/readback.h"
#include "data/blended_dataset.h"
#include "data/gpt_dataset.h"
#include "data/tokenizer.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "model/gpt.h"
#include "optim/distrib_optimizer.h"
#include "optim/distributed_data_parallel.h"
#include "optim/grad_scaler.h"
#include "train/arguments.h"
#include "train/batch_schedule.h"
#include "train/moe_metrics.h"
#include "train/pipeline_schedule.h"
#include "train/run_logger.h"
#include "train/step_graph.h"

namespace megaton {

// What one run reports back (used by tests and the demo).
struct TrainResult {
  std::vector<double> losses;      // lm loss of every iteration run, in order
  std::vector<double> grad_norms;  // grad norm of every iteration run
  double first_valid_loss = -1;    // before training (fresh runs), -1 when not evaluated
  double last_valid_loss = -1;     // after training
  int64_t final_iteration = 0;
  // --cuda-graph-impl full_iteration: the iteration whose step was captured and the nodes
  // of the graph (0 when none was captured).
  int64_t cuda_graph_iteration = 0, cuda_graph_nodes = 0;
};

// What the Trainer does with its arguments before it builds anything, shared with
// `megaton train --dry-run` (train/memory_plan.h): makes the tokenizer and puts its
// vocabulary size into the model config, finalizes that config for the tensor-parallel
// size, checks the FP8 GEMM dimensions and the parallel layout of `world` ranks (returned
// in `layout`). megaton::Error naming the flag on bad values.
std::unique_ptr<data::Tokenizer> finish_train_args(TrainArgs& args, int64_t world,
                                                   dist::ValidatedLayout& layout);
// The global batch split into micro-batches: global-batch-size, and every batch size of
// the batch-size schedule, divisible by micro-batch-size x the data-parallel size, and the
// interleaved schedule's micro-batch groups (check_interleaved_micro_batches). Returns the
// schedule. megaton::Error otherwise, naming the flag.
std::unique_ptr<BatchSchedule> check_micro_batch_split(const TrainArgs& args,
                                                       const dist::ParallelSizes& sizes);

class Trainer {
 public:
  // Builds tokenizer, model, optimizer and datasets; loads --load when given. Throws
  // megaton::Error on bad arguments, data or checkpoint, before anything is written.
  Trainer(TrainArgs args, RawOptions raw);
  TrainResult train();

  // Mean lm loss over eval_iters global batches of the validation split (no dropout),
  // over all data-parallel ranks.
  double evaluate();
  // The model (under pipeline parallelism: this rank's first model chunk).
  GPTModel& model() { return *chunks_[0]; }

 private:
  void build_datasets(const std::array<int64_t, 3>& num_samples);
  std::vector<GPTModel*> chunk_pointers() const;
  // Every param of this rank's chunks by name (checkpoint entries -> params).
  std::map<std::string, const Param*> params_by_name() const;
  // The pipeline schedule's view of the global batch starting at sample batch_start of
  // `source`: this data-parallel rank's `count` micro-batches.
  PipelineMicroBatches pipeline_micro_batches(const data::SampleSource& source, int64_t batch_start,
                                              int64_t count,
                                              std::function<ForwardContext(int64_t)> context) const;
  // One step's forwards and backwards and the gradient reduction. Returns the LM loss
  // summed over the step's tokens on every rank ([1] fp32 on the model's device, reduced
  // there: no host synchronization except the pipeline schedule's per-micro-batch sums)
  // and the number of those tokens; local_loss_sum_ gets this rank's own sum.
  struct StepLoss {
    Tensor sum;
    double tokens = 0;
    // --mtp-num-layers: each depth's loss, the mean over the step's micro-batches and the
    // data-parallel ranks ([mtp_num_layers] fp32 on the device); undefined without MTP.
    Tensor mtp_sum;
  };
  StepLoss train_step(int64_t iteration);
  // The step's inputs that change from step to step, written to device memory before the
  // step runs, so a captured step (FullIterationGraph) reads each step's values: the
  // learning rate (lr_) and, without a pipeline, the micro-batches' tokens and labels
  // (batch_tokens_, batch_labels_, from consumed_samples_) and with --eod-mask-loss their
  // loss masks and weights (batch_loss_masks_, batch_loss_weights_) and the step's token
  // count over the data-parallel ranks (staged_loss_tokens_; a host collective).
  void stage_step_inputs(double lr);
  // One whole step on the device: train_step, the number of zero gradients (eager runs
  // only), the optimizer (step_on_device), the parameter all-gather's start and the MoE
  // bookkeeping. What the host reads of it afterwards, all on the device.
  struct StepOutputs {
    StepLoss loss;
    optim::DistributedAdamW::DeviceStep update;
    PendingMoEMetrics moe;
    int64_t num_zeros = -1;
  };
  StepOutputs run_step(int64_t iteration);
  // A step whose values are still on the device (queued, maybe not run yet): the trainer
  // reads them after it has queued the next step, so the GPU never waits for the host in
  // the steady state (train()).
  struct PendingStep {
    int64_t iteration = 0, consumed_samples = 0;
    int64_t global_batch_size = 0;  // this iteration's (the batch-size schedule's)
    double lr = 0, tokens = 0;
    double weight_decay = 0;  // the scheduled weight decay (--weight-decay-incr-style)
    // loss sum, local loss sum, grad norm, local squared sum, control, state, and the MoE
    // metrics (moe.values) when the model has MoE layers
    std::unique_ptr<Readback> values;
    int64_t mtp_index = -1;  // the MTP losses' tensor in `values` (-1: none)
    PendingMoEMetrics moe;
    int64_t num_zeros = -1;
    double params_norm = -1;
  };
  // What the host does with a step's values once they are read: the non-finite check
  // (stop_on_non_finite) and the skipped-iteration counts, the result, the metrics file,
  // the log interval and its log line. `interval` carries the log interval's sums.
  struct LogInterval {
    double loss = 0, ms = 0;         // loss: summed over the advanced (not skipped) iterations
    std::vector<double> mtp_losses;  // per MTP depth, summed like loss
    int64_t iterations = 0, advanced = 0, skipped = 0, nan = 0;
    std::vector<PendingMoEMetrics> moe;               // read by the log line
    std::chrono::steady_clock::time_point last_done;  // when the previous step was read
    // The previous step's values (its GPU event times the next step; reset when other work,
    // an evaluation or a checkpoint, came between).
    std::unique_ptr<Readback> last_values;
  };
  void finish_step(PendingStep& step, LogInterval& interval, TrainResult& result);
  // Rank 0's notices on the MoE token exchange at start: which one flex runs, and a pull
  // asked for that the chunks of --overlap-moe-expert-parallel-comm do not use. Collective
  // over the expert groups (flex: whether they have peer memory).
  void announce_moe_exchange(const ModelParallel& mp) const;
  // Micro-batches per step on this data-parallel rank.
  // This iteration's micro-batches on this data-parallel rank (the batch-size schedule at
  // consumed_samples_).
  int64_t local_micro_batches() const;
  int64_t current_global_batch_size() const;
  // First sample of local micro-batch `mb` of the global batch starting at `batch_start`:
  // Megatron's MegatronPretrainingSampler order (rank r takes the r-th micro-batch of
  // every data-parallel-size consecutive ones).
  int64_t micro_batch_start(int64_t batch_start, int64_t mb) const;
  // Whether this rank prints the log lines (world rank 0).
  bool is_logging_rank() const { return grid_->world_rank() == 0; }
  // --eod-mask-loss: the loss mask of this rank's rows of a micro-batch from its whole
  // tokens (train/loss_mask.h; under CP its weights count the whole micro-batch's tokens).
  LossMask loss_mask_of(const Tensor& whole_tokens) const;
  // whole_tokens (optional): the tokens before the context-parallel split (the packing's).
  void load_batch(const data::SampleSource& source, int64_t first_sample, int64_t count,
                  Tensor& tokens, Tensor& labels, Tensor* whole_tokens = nullptr) const;
  // --reset-position-ids / --reset-attention-mask: the packed documents of a micro-batch's
  // whole tokens [micro_batch_size, seq_length] (host I32, before any context-parallel
  // split) on the model's device (train/packed_batch.h), its position ids written to
  // position_ids_buffer when given; null when neither flag is on. Under context parallelism
  // cp_params_ without the flags, else this rank's rows' packing
  // (context_parallel_packed_seq_params). The second form loads the
  // micro-batch (micro_batch_size samples from first_sample of source) itself: the pipeline's
  // stages that read no tokens.
  std::shared_ptr<const PackedSeqParams> packing(const Tensor& tokens,
                                                 Tensor position_ids_buffer = Tensor()) const;
  std::shared_ptr<const PackedSeqParams> packing(const data::SampleSource& source,
                                                 int64_t first_sample) const;
  // The rows of a sample on this rank: seq_length / context-parallel-size.
  int64_t local_seq_length() const { return args_.model.seq_length / grid_->cp().size(); }
  void save(int64_t iteration);
  // The run's metadata.json fields of a checkpoint at `iteration` (a JSON object string).
  std::string checkpoint_metadata(int64_t iteration) const;
  // The second half of a save, once every rank's file is written: rank 0 gathers the
  // records and commits the index, every rank waits for it, rank 0 reports. Collective.
  // metadata: checkpoint_metadata(iteration) taken when the snapshot was; flops and
  // consumed_samples: the run's counts then (the progress log's line).
  struct SaveState {
    int64_t iteration = 0;
    std::string tmp, metadata;
    double flops = 0;
    int64_t consumed_samples = 0;
  };
  void finish_save(const SaveState& state, const ckpt::RankShardRecord& record);
  // After every rank's write of `state` (collective over the world): when a rank's write
  // failed (`error` non-empty on it), rank 0 removes the temporary directory once every rank
  // has stopped and every rank throws megaton::Error naming the iteration, the failing rank
  // and its error ("background" says which kind of save in the message).
  // `own` (optional): this rank's exception, rethrown instead when it is not a
  // megaton::Error (an internal error keeps its kind).
  void fail_if_a_write_failed(const SaveState& state, const std::string& error, bool background,
                              std::exception_ptr own = nullptr);
  // --async-save: commits the save in flight when every rank's background write is done
  // (blocking: waits for it), or does nothing (none in flight, or not all done yet). A
  // failed background write on any rank removes the temporary directory and raises
  // megaton::Error on every rank (the tracker keeps naming the previous checkpoint).
  // Collective (one all-reduce while a save is in flight).
  void finalize_async_save(bool blocking);
  // The host copy a save writes from (pinned on the GPU), reused by every save: declared
  // before async_save_, whose pending write (destroyed first) reads it.
  std::unique_ptr<HostBuffer> snapshot_buffer_;
  // What this rank writes to a checkpoint: the optimizer's local state, the routers' expert
  // biases and the FP8 state it owns (names, tensors where they live). Collective over the
  // data-parallel groups (DistributedAdamW::local_state).
  std::vector<optim::DistributedAdamW::LocalStateEntry> checkpoint_entries();
  // Makes snapshot_buffer_ hold the entries' bytes (64-byte aligned each). With
  // --async-save the trainer calls it before the first step, so the first save does not
  // pay for allocating (and pinning) the buffer.
  void reserve_snapshot(const std::vector<optim::DistributedAdamW::LocalStateEntry>& entries);
  struct AsyncSave {
    SaveState state;
    std::future<ckpt::RankShardRecord> record;
    std::chrono::steady_clock::time_point start;
  };
  std::optional<AsyncSave> async_save_;
  // The FP8 delayed recipe's amax histories and scales of this rank's layers, by name
  // (TransformerLayer::fp8_state: the dense linears', or with `experts` the routed
  // experts'). Every (expert-)tensor-parallel rank holds the same values (the amaxes are
  // reduced over the group); checkpoints keep (expert-)data-parallel rank 0's.
  std::vector<std::pair<std::string, Tensor*>> fp8_state(bool experts);
  // --check-for-nan-in-loss-and-grad: throws megaton::Error naming the iteration, what was
  // non-finite (loss or gradient norm) and the ranks where it was found. The parameters
  // are those of the last finite step (the device stopped updating them); the MoE expert
  // biases may have been updated once more, by the step queued after it. Collective: the
  // loss and the gradient norm are global values, so every rank calls it at once.
  // local_loss_sum, local_grad_sum_sq: this rank's values of the step.
  [[noreturn]] void stop_on_non_finite(int64_t iteration, double loss, double grad_norm,
                                       double local_loss_sum, double local_grad_sum_sq);
  void load();
  // params_norm < 0, num_zeros < 0: not logged. moe: the interval's mean MoE metrics.
  // loss: the mean over the interval's advanced iterations; skipped, nan: the interval's
  // counts (Megatron's, reset at each log line).
  void log_line(const std::string& extra_fields, int64_t iteration, int64_t consumed_samples,
                int64_t global_batch_size, double ms_per_iter, double lr, double loss,
                const std::vector<double>& mtp_losses, const MoEStepMetrics& moe, double grad_norm,
                int64_t num_zeros, double params_norm, int64_t skipped, int64_t nan);

  TrainArgs args_;
  RawOptions raw_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  // This pipeline rank's model chunks (one without interleaving; the whole model at pp 1).
  std::vector<std::unique_ptr<GPTModel>> chunks_;
  std::unique_ptr<PipelineSchedule> schedule_;  // pp > 1 only
  std::unique_ptr<dist::Grid> grid_;
  std::unique_ptr<dist::Comm> comm_;
  std::unique_ptr<optim::DistributedDataParallel> ddp_;
  std::unique_ptr<MoEStepBookkeeping> moe_;
  std::unique_ptr<optim::DistributedAdamW> optimizer_;
  std::array<std::unique_ptr<data::SampleSource>, 3> datasets_;
  int64_t iteration_ = 0;
  int64_t consumed_samples_ = 0;
  double floating_point_operations_so_far_ = 0;
  int64_t skipped_iterations_ = 0, nan_iterations_ = 0;  // over the whole run
  // The loss scaler (--fp16, --loss-scale; a scale of 1 that never changes without them).
  std::unique_ptr<optim::GradScaler> scaler_;
  // TensorBoard, energy, memory reports, the progress log (train/run_logger.h).
  std::unique_ptr<RunLogger> run_logger_;
  // This job's start and the floating-point operations before it (a resumed run's), for
  // the progress log's job throughput.
  std::chrono::steady_clock::time_point job_start_ = std::chrono::steady_clock::now();
  double job_start_flops_ = 0;
  // Steps of the learning-rate and weight-decay schedule, in samples: the global batches of
  // the updates applied so far (Megatron's OptimizerParamScheduler steps by the batch's
  // samples, and only after a successful update). Counted when a step is queued and taken
  // back when its values show it skipped; under dynamic loss scaling each step is read
  // before the next is queued, so the count is exact there, elsewhere a skipped step (a
  // non-finite gradient without --check-for-nan-in-loss-and-grad) is seen one step late.
  int64_t scheduler_samples_ = 0;
  // The global batch size of each iteration (--rampup-batch-size,
  // --step-batch-size-schedule, or constant), by samples consumed.
  std::unique_ptr<BatchSchedule> batch_schedule_;
  // This rank's sum of per-token losses in the last train_step (0 on ranks that compute
  // no loss: pipeline stages before the last), to name the rank of a non-finite loss:
  // [1] fp32 on the model's device.
  Tensor local_loss_sum_;
  // stage_step_inputs's device buffers, made by the constructor: F32 [1]; one
  // [micro_batch_size, seq_length] I32 per local micro-batch (none with a pipeline).
  Tensor lr_;
  std::vector<Tensor> batch_tokens_, batch_labels_;
  // --eod-mask-loss without a pipeline: per local micro-batch its LossMask's mask and
  // weights, F32 [micro_batch_size * seq_length] on the model's device, and the tokens in
  // the step's loss over all data-parallel ranks (the log line's denominator; a replayed
  // step does not rerun train_step's host code, so train() reads it from here).
  std::vector<Tensor> batch_loss_masks_, batch_loss_weights_;
  double staged_loss_tokens_ = 0;
  // --reset-position-ids / --reset-attention-mask without a pipeline: per local
  // micro-batch its packing (staged with its tokens) and, with --reset-position-ids, the
  // I32 [micro_batch_size * seq_length] device buffer its position ids live in (fixed
  // addresses for a captured step).
  std::vector<std::shared_ptr<const PackedSeqParams>> batch_packing_;
  std::vector<Tensor> batch_position_ids_;
  // Context parallelism (cp > 1): every micro-batch's rows are this rank's two chunks of
  // each sample (load_batch splits them): their global positions and the CP group, the same
  // for every micro-batch (packing() returns it). Null without CP.
  std::shared_ptr<const PackedSeqParams> cp_params_;
  // --cuda-graph-impl full_iteration (null otherwise) and the outputs of the captured step,
  // which its replays rewrite.
  std::unique_ptr<FullIterationGraph> step_graph_;
  StepOutputs step_outputs_;
};

// Peak memory in bytes: device memory held by tensors on the GPU (the caching
// allocator's peak), or the process's peak resident memory (getrusage) on the CPU.
int64_t peak_memory_bytes(Device device);

}  // namespace megaton
