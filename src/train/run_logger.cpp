// RunLogger: TensorBoard scalars, energy, memory reports and the progress log.
#include "train/run_logger.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/printable.h"
#include "dist/host_reduce.h"
#ifdef MEGATON_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#endif

namespace megaton {

namespace {

struct MemoryNow {
  double allocated = 0, max_allocated = 0, reserved = 0, device_used = -1;  // bytes
};

MemoryNow memory_now(Device device) {
  MemoryNow m;
#ifdef MEGATON_WITH_CUDA
  if (device == Device::CUDA) {
    const cuda::DeviceMemoryStats s = cuda::device_memory_stats();
    m.allocated = double(s.allocated_bytes);
    m.max_allocated = double(s.peak_allocated_bytes);
    m.reserved = double(s.reserved_bytes);
    size_t free = 0, total = 0;
    MEGATON_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    m.device_used = double(total - free);  // every process's, as nvidia-smi counts
    return m;
  }
#endif
  const HostAllocatorStats s = host_allocator_stats();
  m.allocated = double(s.allocated_bytes);
  m.max_allocated = double(s.peak_allocated_bytes);
  m.reserved = double(s.cached_bytes + s.allocated_bytes);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  m.device_used = double(usage.ru_maxrss) * 1024;  // the process's peak resident set
  return m;
}

}  // namespace

RunLogger::RunLogger(const TrainArgs& args, const dist::Grid& grid, dist::Comm& comm,
                     const std::string& cuda_bus_id)
    : args_(args), grid_(grid), comm_(comm) {
  if (!args.logging.tensorboard_dir.empty() && grid.world_rank() == 0)
    tensorboard_ = std::make_unique<TensorBoardWriter>(args.logging.tensorboard_dir);
  if (args.logging.log_energy && args.model.device == Device::CUDA) {
    energy_ = std::make_unique<EnergyMonitor>();
    const std::string why = energy_->open(cuda_bus_id);
    if (!why.empty()) fail("log-energy: the GPU's energy counter cannot be read: {}", why);
  }
}

RunLogger::~RunLogger() {
  try {
    flush();
  } catch (...) {  // a destructor does not throw; the last write error was reported already
  }
}

void RunLogger::scalar(const std::string& tag, double value, int64_t iteration, int64_t samples) {
  tensorboard_->add_scalar(tag, value, iteration);
  if (samples >= 0) tensorboard_->add_scalar(tag + " vs samples", value, samples);
  unflushed_ += samples >= 0 ? 2 : 1;
  if (unflushed_ >= args_.logging.tensorboard_queue_size) flush();
}

void RunLogger::step(const RunLogStep& s) {
  if (!writes_step(s.iteration)) return;
  const int64_t it = s.iteration, samples = s.consumed_samples;
  scalar("learning-rate", s.lr, it, samples);
  scalar("batch-size", double(s.global_batch_size), it, samples);
  scalar("lm loss", s.loss, it, samples);
  for (size_t k = 0; k < s.mtp_losses.size(); ++k)
    scalar("mtp_" + std::to_string(k + 1) + " loss", s.mtp_losses[k], it, samples);
  if (s.loss_scale >= 0 && args_.logging.log_loss_scale_to_tensorboard)
    scalar("loss-scale", s.loss_scale, it, samples);
  if (args_.logging.log_world_size_to_tensorboard)
    scalar("world-size", double(grid_.world_size()), it, samples);
  scalar("grad-norm", s.grad_norm, it, samples);
  if (s.num_zeros >= 0) scalar("num-zeros", double(s.num_zeros), it, samples);
  if (s.params_norm >= 0) scalar("params-norm", s.params_norm, it, samples);
  if (s.moe) {  // Megatron's track_moe_metrics: each loss averaged over the MoE layers
    const MoELayerMetrics& m = s.moe->mean;
    if (m.load_balancing_loss >= 0) scalar("load_balancing_loss", m.load_balancing_loss, it);
    if (m.seq_load_balancing_loss >= 0)
      scalar("seq_load_balancing_loss", m.seq_load_balancing_loss, it);
    if (m.global_load_balancing_loss >= 0)
      scalar("global_load_balancing_loss", m.global_load_balancing_loss, it);
    if (m.z_loss >= 0) scalar("z_loss", m.z_loss, it);
    if (args_.moe_per_layer_logging)
      for (const MoELayerMetrics& l : s.moe->layers)
        if (l.load_balancing_loss >= 0)
          scalar("moe/load_balancing_loss_layer_" + std::to_string(l.layer), l.load_balancing_loss, it);
  }
  if (args_.logging.log_memory_to_tensorboard) {
    const MemoryNow m = memory_now(args_.model.device);
    scalar("mem-reserved-bytes", m.reserved, it);
    scalar("mem-allocated-bytes", m.allocated, it);
    scalar("mem-max-allocated-bytes", m.max_allocated, it);
  }
}

std::string RunLogger::log_interval(int64_t iteration, int64_t iterations, double ms_per_iteration,
                                    double tflops_per_gpu) {
  std::string fields;
  if (args_.logging.log_energy && args_.model.device == Device::CUDA) {
    // Megatron's EnergyMonitor.lap: the joules of every GPU summed over the world, per
    // iteration and GPU.
    const double local_j = double(energy_->lap_millijoules()) / 1000.0;
    const double world_j = dist::sum_over(comm_, grid_.world(), {local_j})[0];
    const double energy = world_j / double(std::max<int64_t>(iterations, 1)) / double(grid_.world_size());
    const double power = energy / (ms_per_iteration / 1000.0);
    fields = fmt::format("energy per GPU (J/iter/GPU): {:.1f} | power per GPU (W/GPU): {:.1f} | ",
                         energy, power);
    if (tensorboard_) {
      scalar("iter-energy/gpu", energy, iteration);
      scalar("power/gpu", power, iteration);
    }
  }
  if (tensorboard_ && args_.logging.log_timers_to_tensorboard) {
    scalar("iteration-time", ms_per_iteration / 1000.0, iteration);  // Megatron's seconds
    if (args_.logging.log_throughput) scalar("throughput", tflops_per_gpu, iteration);
  }
  if (tensorboard_) flush();
  return fields;
}

void RunLogger::memory(int64_t iteration) {
  const int64_t every = args_.logging.log_memory_interval;
  if (every <= 0 || iteration % every != 0 || grid_.dp().rank != 0) return;
  const MemoryNow m = memory_now(args_.model.device);
  const double mb = 1024.0 * 1024.0;
  std::string line = fmt::format(
      "(after {} iterations) memory (MB) | allocated: {:.2f} | max allocated: {:.2f} | "
      "reserved: {:.2f}", iteration, m.allocated / mb, m.max_allocated / mb, m.reserved / mb);
  if (args_.logging.log_device_memory_used && m.device_used >= 0)
    line += fmt::format(" | total device memory used: {:.2f}", m.device_used / mb);
  fmt::print("[Rank {}] {}\n", grid_.world_rank(), line);
  std::fflush(stdout);
}

void RunLogger::validation(int64_t iteration, int64_t consumed_samples, double loss) {
  if (!tensorboard_) return;
  scalar("lm loss validation", loss, iteration, consumed_samples);
  if (args_.logging.log_validation_ppl_to_tensorboard)
    scalar("lm loss validation ppl", std::exp(std::min(loss, 20.0)), iteration, consumed_samples);
  flush();
}

void RunLogger::progress(const std::string& text) {
  if (!args_.logging.log_progress || args_.save.empty() || grid_.world_rank() != 0) return;
  std::filesystem::create_directories(args_.save);
  const std::string path = (std::filesystem::path(args_.save) / "progress.txt").string();
  const std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  const char* job = std::getenv("SLURM_JOB_ID");
  std::ofstream out(path, std::ios::app);
  out << stamp << "\tJob ID: " << (job ? job : "") << "\t# GPUs: " << grid_.world_size() << "\t"
      << text << "\n";
  if (!out) fail("log-progress: cannot write '{}'", printable(path));
}

void RunLogger::flush() {
  if (!tensorboard_) return;
  tensorboard_->flush();
  unflushed_ = 0;
}

}  // namespace megaton
