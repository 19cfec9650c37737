// Host memory this process can still obtain (HostMemoryAvailable, from /proc and /sys) and
// the byte counts of messages (human_bytes), declared in core/tensor.h.
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string_view>

#include "core/tensor.h"

namespace megaton {

namespace {

int64_t saturating_int64(double bytes) {
  return bytes >= 9.2e18 ? std::numeric_limits<int64_t>::max() : int64_t(bytes);
}

// ---- /proc and /sys readers for host_memory_available (-1: absent or unreadable) -----

// The number after `key` in a "key value [kB]" file (/proc/meminfo, /proc/self/status,
// memory.stat); `scale` multiplies it (1024 for kB).
int64_t read_keyed_value(const std::string& path, std::string_view key, int64_t scale) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.size() <= key.size() || line.compare(0, key.size(), key) != 0) continue;
    const char c = line[key.size()];
    if (c != ' ' && c != ':' && c != '\t') continue;
    const char* p = line.c_str() + key.size();
    while (*p == ':' || *p == ' ' || *p == '\t') ++p;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(p, &end, 10);
    if (end == p) return -1;
    return saturating_int64(double(v) * double(scale));
  }
  return -1;
}

// A file holding one number; -1 for "max", absent or unreadable.
int64_t read_single_value(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(word.c_str(), &end, 10);
  if (end == word.c_str()) return -1;
  return saturating_int64(double(v));
}

// What the memory cgroup of this process still lets it have: limit - usage + the page
// cache charged to it (reclaimable, as MemAvailable counts it), the smallest over the
// cgroup and its ancestors. -1 when there is no limit or no cgroup.
int64_t cgroup_memory_available() {
  std::ifstream in("/proc/self/cgroup");
  std::string v1_path, v2_path;
  for (std::string line; std::getline(in, line);) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) v2_path = path;
    std::string list = "," + controllers + ",";
    if (list.find(",memory,") != std::string::npos) v1_path = path;
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  int64_t best = -1;
  auto consider = [&best](int64_t limit, int64_t usage, int64_t cache) {
    // Limits near 2^63 (cgroup v1's "unlimited") are no limit.
    if (limit < 0 || usage < 0 || limit >= (int64_t(1) << 62)) return;
    const int64_t left = std::max<int64_t>(0, limit - usage + std::max<int64_t>(cache, 0));
    best = best < 0 ? left : std::min(best, left);
  };
  if (!v1_path.empty()) {
    // cgroup v1: hierarchical_memory_limit already takes the ancestors' limits.
    fs::path dir = fs::path("/sys/fs/cgroup/memory") / fs::path(v1_path).relative_path();
    if (!fs::exists(dir / "memory.usage_in_bytes", ec)) dir = "/sys/fs/cgroup/memory";
    const std::string stat = (dir / "memory.stat").string();
    int64_t limit = read_keyed_value(stat, "hierarchical_memory_limit", 1);
    if (limit < 0) limit = read_single_value((dir / "memory.limit_in_bytes").string());
    consider(limit, read_single_value((dir / "memory.usage_in_bytes").string()),
             read_keyed_value(stat, "total_cache", 1));
  } else if (!v2_path.empty()) {
    const fs::path root = "/sys/fs/cgroup";
    fs::path dir = root / fs::path(v2_path).relative_path();
    if (!fs::exists(dir / "memory.current", ec)) dir = root;
    for (;;) {
      consider(read_single_value((dir / "memory.max").string()),
               read_single_value((dir / "memory.current").string()),
               read_keyed_value((dir / "memory.stat").string(), "file", 1));
      if (dir == root || !dir.has_parent_path() || dir.parent_path() == dir) break;
      dir = dir.parent_path();
    }
  }
  return best;
}

}  // namespace

int64_t HostMemoryAvailable::physical() const {
  int64_t ram = -1;
  if (mem_available >= 0) ram = mem_available;
  if (cgroup_available >= 0) ram = ram < 0 ? cgroup_available : std::min(ram, cgroup_available);
  if (ram < 0) return std::numeric_limits<int64_t>::max();
  return saturating_int64(double(ram) + double(std::max<int64_t>(swap_free, 0)));
}

int64_t HostMemoryAvailable::available() const {
  const int64_t p = physical();
  return address_space_left >= 0 ? std::min(p, address_space_left) : p;
}

std::string HostMemoryAvailable::binding_limit() const {
  if (address_space_left >= 0 && address_space_left <= physical())
    return "ulimit -v (address space)";
  return physical_limit();
}

std::string HostMemoryAvailable::physical_limit() const {
  if (cgroup_available >= 0 && (mem_available < 0 || cgroup_available < mem_available))
    return swap_free > 0 ? "cgroup memory limit + SwapFree" : "cgroup memory limit";
  if (mem_available >= 0) return swap_free > 0 ? "MemAvailable + SwapFree" : "MemAvailable";
  return "no known limit";
}

HostMemoryAvailable host_memory_available() {
  HostMemoryAvailable out;
  out.mem_available = read_keyed_value("/proc/meminfo", "MemAvailable", 1024);
  out.swap_free = read_keyed_value("/proc/meminfo", "SwapFree", 1024);
  out.cgroup_available = cgroup_memory_available();
  out.resident_bytes = read_keyed_value("/proc/self/status", "VmRSS", 1024);
  rlimit limit{};
  if (::getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    const int64_t used = read_keyed_value("/proc/self/status", "VmSize", 1024);
    const int64_t cap = saturating_int64(double(limit.rlim_cur));
    out.address_space_left = std::max<int64_t>(0, cap - std::max<int64_t>(used, 0));
  }
  return out;
}

std::string human_bytes(double bytes) {
  if (!(bytes >= 1000)) return fmt::format("{:.0f} bytes", bytes);
  static const char* const units[] = {"KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"};
  int u = -1;
  while (bytes >= 999.95 && u < 7) {
    bytes /= 1000;
    ++u;
  }
  if (bytes >= 999.95) return fmt::format("{:.3g} YB", bytes);  // beyond the units
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

std::string human_bytes_exact(double bytes) {
  if (std::isinf(bytes)) return "an unlimited amount";
  if (bytes < 1e18) return fmt::format("{} ({:.0f} bytes)", human_bytes(bytes), bytes);
  return fmt::format("{} ({:.3e} bytes)", human_bytes(bytes), bytes);
}

}  // namespace megaton
