// The deterministic-mode switch (ops/determinism.h).
#include "ops/determinism.h"

#include <atomic>

namespace megaton::ops {
namespace {
std::atomic<bool> g_deterministic{false};
}  // namespace

void set_deterministic(bool on) { g_deterministic.store(on, std::memory_order_relaxed); }
bool deterministic() { return g_deterministic.load(std::memory_order_relaxed); }

}  // namespace megaton::ops
