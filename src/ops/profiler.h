// Per-op GPU time (MEGATON_OP_PROFILE=1): CUDA events around every op that
// MEGATON_CUDA_DISPATCH sends to the GPU, summed per op name, reported as a table.
//
// Off unless the environment variable MEGATON_OP_PROFILE is "1" when the process starts
// (read once, during static initialization; unset or "0": off; any other value: off, and
// profile_check_environment() throws). Off, a dispatched op pays one branch on a cached
// bool.
//
// On, each op's time is the span of megaton::cuda::stream() between an event recorded when
// the door function hands the op to its CUDA implementation and one recorded when that
// returns: the op's kernels, copies and library calls, plus any gap between them while
// the host was still launching. The blocking NCCL collectives (dist/cuda/comm_nccl.cpp)
// and the token exchange's peer copies are timed the same way under their own names
// (all_to_allv, all_gather, pull_rows, ...); the *_async collectives, on the
// communication stream, are not. Other work not dispatched through an op door (memsets,
// Tensor copies, allocator frees) is not timed. A door reached inside another timed op counts
// toward the outer op only, so the per-op times add up to no more than the stream's busy
// span. Recording an event costs a few microseconds of host time per op, and
// profile_flush() synchronizes the stream: timings of a profiled run are not those of an
// unprofiled one, only their breakdown is meant to be read.
//
// Host use from one thread at a time (the training loop); the state is shared by the
// whole process. In a build without CUDA everything here does nothing (and profile_report
// says so).
#pragma once
#include <cstdint>
#include <string>

namespace megaton::ops {

namespace detail {
// MEGATON_OP_PROFILE == "1" at start-up. Defined in profiler.cpp; false until its static
// initialization has run (ops called from other static initializers are not timed).
extern const bool op_profile_enabled;
}  // namespace detail

// Whether ops are being timed (the cached MEGATON_OP_PROFILE=1).
inline bool profile_enabled() { return detail::op_profile_enabled; }

// Throws megaton::Error naming MEGATON_OP_PROFILE's value when it is set to anything but
// "1" or "0" (a typo such as "yes" would otherwise leave profiling off in silence).
void profile_check_environment();

// Times the GPU work enqueued on megaton::cuda::stream() during its lifetime under `op`
// (a string with static storage duration, e.g. __func__), when profile_enabled(). Events
// come from a pool that grows as needed and is never freed. Throws InternalError when
// creating or recording the start event fails; a failure recording the stop event is kept
// and thrown by the next profile_flush() (a destructor must not throw).
class OpProfileScope {
 public:
  explicit OpProfileScope(const char* op);
  ~OpProfileScope();
  OpProfileScope(const OpProfileScope&) = delete;
  OpProfileScope& operator=(const OpProfileScope&) = delete;

 private:
  // Index of this scope's event pair in the pending list; kNotTimed when profiling is off
  // and kNested inside another timed scope.
  static constexpr int64_t kNotTimed = -1;
  static constexpr int64_t kNested = -2;
  int64_t pair_ = kNotTimed;
};

// Synchronizes the stream once, adds each pending event pair's elapsed time (ms) and one
// call to its op's totals, and returns the events to the pool. Call it between steps, with
// no OpProfileScope alive. Throws InternalError when a scope is alive or a CUDA call
// failed (the pending pairs are then dropped). No-op when nothing is pending.
void profile_flush();

// As profile_flush(), but the pending pairs are dropped instead of counted (work that is
// not part of a training step, e.g. evaluation).
void profile_discard();

// Drops the pending pairs and the totals (end of warmup).
void profile_reset();

// The totals as a table, one row per op sorted by time (longest first), then a total row:
//   op | calls | time (ms) | % of the timed ops' total
// with calls and time divided by `iterations` (> 0; 1 gives the raw totals). Each line
// starts with a space, as the trainer's log lines; the string ends with a newline.
std::string profile_report(int64_t iterations = 1);

}  // namespace megaton::ops
