// NcclWatchdog: polls the oldest pending operation; ends the process on a failure or a
// missed deadline (see the header).
#include "dist/cuda/nccl_watchdog.h"

#include <cstdio>
#include <cstdlib>

#include "core/cuda/cuda_check.h"

namespace megaton::dist::detail {

NcclWatchdog::~NcclWatchdog() {
  stop();
  for (cudaEvent_t ev : free_events_) cudaEventDestroy(ev);
  for (auto& [stream, queue] : pending_)
    for (Pending& p : queue) cudaEventDestroy(p.event);
}

void NcclWatchdog::stop() {
  if (!thread_.joinable()) return;
  stop_ = true;
  thread_.join();
}

void NcclWatchdog::watch(ncclComm_t comm, cudaStream_t stream, Clock::time_point deadline,
                         std::string timeout, std::string failure, int world_rank) {
  if (!thread_.joinable()) {
    int device = 0;
    MEGATON_CUDA_CHECK(cudaGetDevice(&device));
    world_rank_ = world_rank;
    thread_ = std::thread([this, device] { loop(device); });
  }
  std::lock_guard<std::mutex> lock(mu_);
  cudaEvent_t ev;
  if (free_events_.empty()) {
    MEGATON_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  } else {
    ev = free_events_.back();
    free_events_.pop_back();
  }
  MEGATON_CUDA_CHECK(cudaEventRecord(ev, stream));
  pending_[stream].push_back({ev, deadline, comm, std::move(timeout), std::move(failure)});
}

void NcclWatchdog::forget(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [stream, queue] : pending_)
    for (auto it = queue.begin(); it != queue.end();)
      if (it->comm == comm) {
        free_events_.push_back(it->event);
        it = queue.erase(it);
      } else {
        ++it;
      }
}

void NcclWatchdog::fatal(ncclComm_t comm, const std::string& message) {
  std::fprintf(stderr, "[rank %d] communication error: %s\n", world_rank_, message.c_str());
  std::fflush(stderr);
  // The process ends (and with it, through mpirun, the job) whatever NCCL does: the abort
  // (which releases the communicator's network resources) runs on a thread of its own,
  // given a second, only outside the main thread's NCCL calls. On two H200s (NCCL 2.28)
  // ncclCommAbort of a communicator whose peer was stopped did not return, and a fatal
  // that waited for it let the main thread go on past the timeout.
  std::thread([this, comm] {
    std::unique_lock<NcclMutex> nccl(nccl_mu_, std::chrono::milliseconds(200));
    if (nccl.owns_lock() && comm != nullptr) (void)ncclCommAbort(comm);
  }).detach();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::_Exit(1);
}

void NcclWatchdog::loop(int device) {
  cudaSetDevice(device);
  while (!stop_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [stream, queue] : pending_) {
        while (!queue.empty()) {
          Pending& p = queue.front();
          const cudaError_t q = cudaEventQuery(p.event);
          if (q == cudaSuccess) {
            free_events_.push_back(p.event);
            queue.pop_front();
            continue;
          }
          if (q != cudaErrorNotReady) fatal(p.comm, p.failure + ": CUDA " + cudaGetErrorString(q));
          std::unique_lock<NcclMutex> nccl(nccl_mu_, std::try_to_lock);
          ncclResult_t state = ncclSuccess;
          if (nccl.owns_lock() && ncclCommGetAsyncError(p.comm, &state) == ncclSuccess &&
              state != ncclSuccess && state != ncclInProgress)
            fatal(p.comm, p.failure + ": " + ncclGetErrorString(state));
          if (Clock::now() >= p.deadline) fatal(p.comm, p.timeout);
          break;  // this stream's oldest decides
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace megaton::dist::detail
