// RunControl: the exit signal's handler and the world's agreement to stop.
#include "train/run_control.h"

#include <csignal>
#include <cstring>

#include <algorithm>

#include "core/error.h"
#include "dist/host_reduce.h"
#ifdef MEGATON_WITH_CUDA
#include <cuda_profiler_api.h>

#include "core/cuda/cuda_check.h"
#endif

namespace megaton {

namespace {
volatile std::sig_atomic_t g_signal_received = 0;
struct sigaction g_previous {};

extern "C" void record_exit_signal(int) { g_signal_received = 1; }
}  // namespace

RunControl::RunControl(const LoggingFlags& flags, dist::Comm& comm, const dist::Grid& grid)
    : flags_(flags), comm_(comm), grid_(grid), start_(std::chrono::steady_clock::now()) {
#ifdef MEGATON_WITH_CUDA
  profiles_ = flags.profile && comm.device() == Device::CUDA &&
              std::find(flags.profile_ranks.begin(), flags.profile_ranks.end(),
                        int64_t(grid.world_rank())) != flags.profile_ranks.end();
#endif
  if (!flags.exit_signal_handler) return;
  g_signal_received = 0;
  struct sigaction action {};
  action.sa_handler = record_exit_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a blocking call the signal interrupts resumes
  if (sigaction(int(flags.exit_signal), &action, &g_previous) != 0)
    fail("exit-signal-handler: cannot install the handler of signal {}: {}", flags.exit_signal,
         std::strerror(errno));
  installed_ = true;
}

RunControl::~RunControl() {
  if (installed_) sigaction(int(flags_.exit_signal), &g_previous, nullptr);
#ifdef MEGATON_WITH_CUDA
  if (profiling_) cudaProfilerStop();  // a run that ended inside the range
#endif
}

void RunControl::profile_before_step(int64_t completed) {
  if (!profiles_ || profiling_ || completed != flags_.profile_step_start) return;
#ifdef MEGATON_WITH_CUDA
  MEGATON_CUDA_CHECK(cudaProfilerStart());
  profiling_ = true;
#endif
}

void RunControl::profile_after_step(int64_t completed) {
  if (!profiling_ || completed != flags_.profile_step_end) return;
#ifdef MEGATON_WITH_CUDA
  MEGATON_CUDA_CHECK(cudaProfilerStop());
  profiling_ = false;
#endif
}

bool RunControl::should_exit(std::string& why) {
  if (!active()) return false;
  const double minutes =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() / 60.0;
  const double signalled = g_signal_received ? 1.0 : 0.0;
  const double late = flags_.exit_duration_in_mins > 0 && minutes > flags_.exit_duration_in_mins;
  // A sum of 0/1 flags: positive when any rank has one (the max Megatron takes).
  const std::vector<double> any = dist::sum_over(comm_, grid_.world(), {signalled, late ? 1.0 : 0.0});
  if (any[0] > 0) {
    why = std::string("exiting program after receiving ") +
          (flags_.exit_signal == SIGTERM ? "SIGTERM" : "signal " + std::to_string(flags_.exit_signal)) + ".";
    return true;
  }
  if (any[1] > 0) {
    why = fmt::format("exiting program after {} minutes", minutes);
    return true;
  }
  return false;
}

}  // namespace megaton
