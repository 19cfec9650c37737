// RunControl: Megatron's exits mid-run (--exit-duration-in-mins, --exit-signal-handler):
// every rank learns that one rank wants to stop, at the same iteration.
#pragma once
#include <chrono>
#include <string>

#include "dist/comm.h"
#include "dist/grid.h"
#include "train/arguments.h"

namespace megaton {

class RunControl {
 public:
  // Starts the clock and, with exit_signal_handler, installs the handler of exit_signal
  // (it only records that the signal came; the previous handler is restored on
  // destruction). One RunControl at a time per process.
  RunControl(const LoggingFlags& flags, dist::Comm& comm, const dist::Grid& grid);
  ~RunControl();
  RunControl(const RunControl&) = delete;
  RunControl& operator=(const RunControl&) = delete;

  // Whether anything is watched (then should_exit is a collective every iteration).
  bool active() const { return flags_.exit_duration_in_mins > 0 || flags_.exit_signal_handler; }
  // Collective over the world (a max of two flags, as Megatron's all-reduce of its
  // signals_received and of train_time > exit-duration-in-mins): true on every rank when
  // some rank received the signal or has trained longer than the duration. `why` is then
  // Megatron's message ("exiting program after receiving SIGTERM." / "exiting program after
  // X minutes").
  bool should_exit(std::string& why);

  // --profile on a GPU rank of --profile-ranks: cudaProfilerStart when `completed`
  // iterations are done and the next begins at --profile-step-start (before its step),
  // cudaProfilerStop when `completed` reaches --profile-step-end (after its step), as
  // Megatron's train loop (Nsight Systems' capture range cudaProfilerApi).
  void profile_before_step(int64_t completed);
  void profile_after_step(int64_t completed);

 private:
  const LoggingFlags& flags_;
  dist::Comm& comm_;
  const dist::Grid& grid_;
  std::chrono::steady_clock::time_point start_;
  bool installed_ = false;
  bool profiling_ = false;
  bool profiles_ = false;  // --profile and this rank is listed and runs on a GPU
};

}  // namespace megaton
