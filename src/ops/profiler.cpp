// Per-op GPU time with CUDA events (see profiler.h).
#include "ops/profiler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/cuda_check.h"
#include "core/cuda/host_sync.h"
#endif

namespace megaton::ops {
namespace {

// MEGATON_OP_PROFILE's value when it is none of unset, "", "0", "1". Kept for
// profile_check_environment() rather than reported here: static initialization cannot
// raise a user error, and the CLI re-executes itself (OPENBLAS_CORETYPE), so a message
// printed now would appear twice. Defined before op_profile_enabled, so initialized first.
std::string invalid_setting;

bool read_op_profile_env() {
  const char* value = std::getenv("MEGATON_OP_PROFILE");
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  invalid_setting = value;
  return false;
}

}  // namespace

namespace detail {
const bool op_profile_enabled = read_op_profile_env();
}  // namespace detail

void profile_check_environment() {
  if (!invalid_setting.empty())
    fail("MEGATON_OP_PROFILE={}: expected 1 (time every GPU op) or 0 (off)", invalid_setting);
}

#ifdef MEGATON_WITH_CUDA
namespace {

struct PendingPair {
  const char* op;
  cudaEvent_t start;
  cudaEvent_t stop;  // recorded unless the destructor's record failed (deferred_error)
};

struct OpTotal {
  int64_t calls = 0;
  double ms = 0.0;
};

struct ProfileState {
  std::vector<cudaEvent_t> free_events;
  std::vector<PendingPair> pending;  // in the order the ops were enqueued
  // Keyed by the op's name pointer (__func__ of its door); profile_report merges equal
  // names, so the per-pair work in profile_flush is a pointer hash.
  std::unordered_map<const char*, OpTotal> totals;
  int64_t open_scopes = 0;     // timed and nested scopes alive
  std::string deferred_error;  // the first failure in a destructor, thrown by the next flush
  // Host synchronisations (core/cuda/host_sync.h) at the last profile_reset, and the
  // profiler's own since then (its flushes), which the report leaves out.
  uint64_t syncs_at_reset = 0, own_syncs = 0;
};

// Never destroyed: the events must outlive every scope, and destroying them after the
// CUDA runtime has shut down at exit would fail.
ProfileState& state() {
  static ProfileState* const profile_state = new ProfileState;
  return *profile_state;
}

cudaEvent_t take_event(ProfileState& s) {
  if (!s.free_events.empty()) {
    cudaEvent_t event = s.free_events.back();
    s.free_events.pop_back();
    return event;
  }
  cudaEvent_t event = nullptr;
  MEGATON_CUDA_CHECK(cudaEventCreate(&event));
  return event;
}

// Ends the pending pairs: synchronizes, then adds them to the totals when `count`, and
// returns every event to the pool (also when a check throws).
void drain_pending(bool count, const char* caller) {
  ProfileState& s = state();
  MEGATON_CHECK(s.open_scopes == 0, "{}: {} op scope(s) still open; call it between steps", caller,
                s.open_scopes);
  if (s.pending.empty() && s.deferred_error.empty()) return;
  std::vector<PendingPair> pending;
  pending.swap(s.pending);
  const std::string deferred_error = std::exchange(s.deferred_error, {});
  // No scope is open, so nothing is added to s.pending meanwhile; the emptied list goes
  // back to keep its capacity for the next step.
  struct ReturnToPool {
    ProfileState& s;
    std::vector<PendingPair>& pairs;
    ~ReturnToPool() {
      for (const PendingPair& p : pairs) {
        s.free_events.push_back(p.start);
        s.free_events.push_back(p.stop);
      }
      pairs.clear();
      s.pending.swap(pairs);
    }
  } return_to_pool{s, pending};
  if (!deferred_error.empty()) throw InternalError(deferred_error);
  ::megaton::cuda::synchronize();
  ++s.own_syncs;
  if (!count) return;
  for (const PendingPair& p : pending) {
    float ms = 0.0f;
    MEGATON_CUDA_CHECK(cudaEventElapsedTime(&ms, p.start, p.stop));
    OpTotal& total = s.totals[p.op];
    ++total.calls;
    total.ms += double(ms);
  }
}

}  // namespace

OpProfileScope::OpProfileScope(const char* op) {
  if (!profile_enabled()) return;
  ProfileState& s = state();
  if (s.open_scopes > 0) {
    ++s.open_scopes;
    pair_ = kNested;
    return;
  }
  const cudaEvent_t start = take_event(s);
  cudaEvent_t stop = nullptr;
  try {
    stop = take_event(s);
    MEGATON_CUDA_CHECK(cudaEventRecord(start, ::megaton::cuda::stream()));
  } catch (...) {
    s.free_events.push_back(start);
    if (stop != nullptr) s.free_events.push_back(stop);
    throw;
  }
  s.pending.push_back({op, start, stop});
  pair_ = int64_t(s.pending.size()) - 1;
  ++s.open_scopes;
}

OpProfileScope::~OpProfileScope() {
  if (pair_ == kNotTimed) return;
  ProfileState& s = state();
  --s.open_scopes;
  if (pair_ == kNested) return;
  PendingPair& p = s.pending[size_t(pair_)];
  const cudaError_t err = cudaEventRecord(p.stop, ::megaton::cuda::stream());
  if (err != cudaSuccess && s.deferred_error.empty()) {
    s.deferred_error = fmt::format("{}:{}: cudaEventRecord(stop of op {}) failed: {} ({})",
                                   __FILE__, __LINE__, p.op, cudaGetErrorString(err), int(err));
  }
}

void profile_flush() { drain_pending(true, "profile_flush"); }

void profile_discard() { drain_pending(false, "profile_discard"); }

void profile_reset() {
  drain_pending(false, "profile_reset");
  ProfileState& s = state();
  s.totals.clear();
  s.syncs_at_reset = ::megaton::cuda::host_synchronizations();
  s.own_syncs = 0;
}

// After the table: the host synchronizations since the last profile_reset per iteration,
// the profiler's own flushes left out (core/cuda/host_sync.h).
std::string profile_report(int64_t iterations) {
  MEGATON_CHECK(iterations > 0, "profile_report: iterations {} must be > 0", iterations);
  std::map<std::string_view, OpTotal> by_name;
  for (const auto& [op, total] : state().totals) {
    OpTotal& merged = by_name[op];
    merged.calls += total.calls;
    merged.ms += total.ms;
  }
  if (by_name.empty()) return " op profile: no op ran on the GPU\n";
  std::vector<std::pair<std::string_view, OpTotal>> rows(by_name.begin(), by_name.end());
  // Longest first; ties by name (the map's order, kept by a stable sort).
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  OpTotal sum;
  size_t name_width = std::string_view("total").size();
  for (const auto& [op, total] : rows) {
    sum.calls += total.calls;
    sum.ms += total.ms;
    name_width = std::max(name_width, op.size());
  }
  const double per = double(iterations);
  const int calls_precision = iterations == 1 ? 0 : 1;
  std::string table =
      fmt::format(" {:<{}}  {:>10}  {:>12}  {:>6}\n", "op", name_width, "calls", "time (ms)", "%");
  auto add_row = [&](std::string_view op, const OpTotal& total) {
    table += fmt::format(" {:<{}}  {:>10.{}f}  {:>12.3f}  {:>6.1f}\n", op, name_width,
                         double(total.calls) / per, calls_precision, total.ms / per,
                         sum.ms > 0.0 ? 100.0 * total.ms / sum.ms : 0.0);
  };
  for (const auto& [op, total] : rows) add_row(op, total);
  add_row("total", sum);
  const ProfileState& s = state();
  const uint64_t syncs =
      ::megaton::cuda::host_synchronizations() - s.syncs_at_reset - s.own_syncs;
  table += fmt::format(" host synchronizations per iteration: {:.1f}\n", double(syncs) / per);
  return table;
}

#else  // no CUDA backend: nothing runs on a GPU, so there is nothing to time

OpProfileScope::OpProfileScope(const char* op) {}
OpProfileScope::~OpProfileScope() {}
void profile_flush() {}
void profile_discard() {}
void profile_reset() {}

std::string profile_report(int64_t iterations) {
  return " op profile: this build has no CUDA backend; no op was timed\n";
}

#endif

}  // namespace megaton::ops
