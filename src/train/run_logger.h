// RunLogger: Megatron's optional run logs beside the log line: TensorBoard scalars
// (--tensorboard-dir), GPU energy (--log-energy), memory reports (--log-memory-interval,
// --log-device-memory-used) and the progress log (--log-progress).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "dist/comm.h"
#include "dist/grid.h"
#include "train/arguments.h"
#include "train/energy_monitor.h"
#include "train/moe_metrics.h"
#include "train/tensorboard.h"

namespace megaton {

// One iteration's values as the trainer has read them (finish_step).
struct RunLogStep {
  int64_t iteration = 0, consumed_samples = 0, global_batch_size = 0;
  double lr = 0, loss = 0, grad_norm = 0;
  double loss_scale = -1;   // < 0: no loss scaler
  double params_norm = -1;  // < 0: not computed
  int64_t num_zeros = -1;   // < 0: not counted
  const MoEStepMetrics* moe = nullptr;  // the step's MoE metrics (null without MoE layers)
  std::vector<double> mtp_losses;       // "mtp_<k> loss" per MTP depth (empty without)
};

class RunLogger {
 public:
  // Opens the TensorBoard event file on the world's rank 0 (megaton::Error naming
  // --tensorboard-dir when it cannot) and, with --log-energy on a GPU, NVML on every rank
  // (cuda_bus_id: the device's PCI bus id; megaton::Error with the reason when NVML cannot
  // read the energy counter). On the CPU --log-energy is reported as having no effect.
  RunLogger(const TrainArgs& args, const dist::Grid& grid, dist::Comm& comm,
            const std::string& cuda_bus_id);
  ~RunLogger();

  // Rank 0, every iteration: Megatron's training_log scalars every --tensorboard-log-interval
  // iterations ("learning-rate", "batch-size", "lm loss", "loss-scale", "world-size",
  // "grad-norm", "num-zeros", "params-norm", the MoE losses, memory; each also " vs
  // samples" against the consumed samples, as Megatron writes them).
  void step(const RunLogStep& step);
  // Whether step() writes anything at `iteration` (a TensorBoard and its log interval), so
  // the trainer gathers the step's values only then.
  bool writes_step(int64_t iteration) const {
    return tensorboard_ && iteration % args_.logging.tensorboard_log_interval == 0;
  }
  // Every rank, at each log interval of `iterations` iterations of ms_per_iteration each:
  // the energy lap summed over the world (a collective with --log-energy), and on rank 0
  // "iteration-time" / "throughput" to TensorBoard with --log-timers-to-tensorboard. Returns
  // the log line's energy fields ("energy per GPU (J/iter/GPU): .. | power per GPU (W/GPU):
  // .. | ") or "".
  std::string log_interval(int64_t iteration, int64_t iterations, double ms_per_iteration,
                           double tflops_per_gpu);
  // Every rank after iteration `iteration`: with --log-memory-interval, Megatron's
  // report_memory line on each data-parallel rank 0 when the iteration is a multiple.
  void memory(int64_t iteration);
  // Rank 0: "lm loss validation" (and " ppl" with --log-validation-ppl-to-tensorboard).
  void validation(int64_t iteration, int64_t consumed_samples, double loss);
  // Rank 0 with --log-progress and --save: appends "<time>\tJob ID: ..\t# GPUs: ..\t<text>"
  // to <save>/progress.txt (Megatron's append_to_progress_log).
  void progress(const std::string& text);
  void flush();

 private:
  void scalar(const std::string& tag, double value, int64_t iteration, int64_t samples = -1);
  const TrainArgs& args_;
  const dist::Grid& grid_;
  dist::Comm& comm_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<EnergyMonitor> energy_;
  int64_t unflushed_ = 0;  // events since the last flush (--tensorboard-queue-size)
};

}  // namespace megaton
