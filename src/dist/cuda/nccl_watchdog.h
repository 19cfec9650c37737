// NcclWatchdog: the deadline keeper of NcclComm's stream-ordered operations (PyTorch's NCCL
// watchdog idea). Each operation records a CUDA event after it on its stream; a thread
// polls, per stream, the oldest pending event and its communicator's async error, and when
// an operation fails or outlives its deadline it prints the operation's message (naming the
// collective, group, rank and call site), aborts the communicator (ncclCommAbort) and ends
// the process with status 1, so mpirun ends the job instead of every rank hanging.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace megaton::dist::detail {

// Held by NcclComm around every NCCL call on its communicators (recursive: an abort may come
// from inside a held section; timed: the watchdog waits for it only briefly).
using NcclMutex = std::recursive_timed_mutex;

class NcclWatchdog {
 public:
  using Clock = std::chrono::steady_clock;
  // nccl_mu: held by the owner around every NCCL call on its communicators; the watchdog
  // polls a communicator's error only when it can take it at once (NCCL communicators are
  // not thread-safe: an unguarded poll beside the main thread's calls crashed inside NCCL).
  explicit NcclWatchdog(NcclMutex& nccl_mu) : nccl_mu_(nccl_mu) {}
  // Stops the thread (the owner synchronizes its streams first) and frees the events.
  ~NcclWatchdog();
  // Ends the polling thread (idempotent); call once every watched stream is synchronized.
  void stop();
  NcclWatchdog(const NcclWatchdog&) = delete;
  NcclWatchdog& operator=(const NcclWatchdog&) = delete;

  // Watches the operation just queued on `stream` over `comm` until it completes: `timeout`
  // is printed if it is not done by `deadline`, `failure` (with NCCL's or CUDA's error) if it
  // fails. Starts the thread on first use (on the calling thread's device); world_rank tags
  // the messages. Throws InternalError when the event cannot be recorded.
  void watch(ncclComm_t comm, cudaStream_t stream, Clock::time_point deadline, std::string timeout,
             std::string failure, int world_rank);
  // Stops watching every operation on `comm` (before the owner aborts it).
  void forget(ncclComm_t comm);

 private:
  struct Pending {
    cudaEvent_t event;
    Clock::time_point deadline;
    ncclComm_t comm;
    std::string timeout, failure;  // messages, made when the operation was queued
  };
  [[noreturn]] void fatal(ncclComm_t comm, const std::string& message);
  void loop(int device);

  NcclMutex& nccl_mu_;
  std::mutex mu_;  // guards pending_ and free_events_
  // Per stream, in the order queued (operations of one stream complete in order).
  std::map<cudaStream_t, std::deque<Pending>> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  int world_rank_ = 0;
};

}  // namespace megaton::dist::detail
