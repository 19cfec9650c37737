// Checkpoint save/load with atomic directory and tracker-file updates.
#include "ckpt/checkpoint.h"
#include "ckpt/sharded.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/safetensors.h"
#include "core/error.h"

namespace fs = std::filesystem;

namespace megaton::ckpt {

static const char* kTracker = "latest_checkpointed_iteration.txt";
static const char* kTensors = "model_optim_rng.safetensors";
static const char* kMetadata = "metadata.json";

std::string iteration_dir_name(int64_t iteration) {
  return fmt::format("iter_{:07d}", iteration);
}

static void write_text_atomic(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += fmt::format(".tmp{}", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("cannot write '{}'", tmp.string());
    out << text;
    out.flush();
    if (!out) fail("cannot write '{}' (disk full?)", tmp.string());
  }
  fs::rename(tmp, path);
}

// Whether an entry can be created in directory `dir`: permission bits do not tell for root,
// nor for read-only or virtual file systems (/proc), so a probe directory is made and
// removed. Returns the error, or 0.
static int probe_create_in(const fs::path& dir) {
  const fs::path probe = dir / fmt::format(".megaton-probe.tmp{}", getpid());
  if (::mkdir(probe.c_str(), 0700) != 0) return errno;
  ::rmdir(probe.c_str());
  return 0;
}

void check_save_dir_writable(const std::string& save_dir) {
  std::error_code ec;
  fs::path path = fs::absolute(save_dir, ec);
  if (ec) fail("save: cannot resolve '{}': {}", save_dir, ec.message());
  if (fs::exists(path, ec)) {
    if (!fs::is_directory(path, ec)) fail("save: '{}' exists and is not a directory", save_dir);
    if (int err = probe_create_in(path))
      fail("save: cannot write in directory '{}': {}", save_dir, std::strerror(err));
    return;
  }
  // The nearest existing ancestor must be a directory we may create entries in.
  fs::path ancestor = path.parent_path();
  while (!fs::exists(ancestor, ec) && ancestor != ancestor.root_path()) ancestor = ancestor.parent_path();
  if (!fs::is_directory(ancestor, ec))
    fail("save: cannot create '{}': '{}' is not a directory", save_dir, ancestor.string());
  if (int err = probe_create_in(ancestor))
    fail("save: cannot create '{}' in '{}': {}", save_dir, ancestor.string(), std::strerror(err));
}

// The PID in a temporary name "<stem>.tmp<PID>", or -1 when `name` is not one.
static pid_t temporary_owner(const std::string& name) {
  const size_t at = name.rfind(".tmp");
  if (at == std::string::npos || at + 4 == name.size()) return -1;
  const std::string digits = name.substr(at + 4);
  if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  const std::string stem = name.substr(0, at);
  const bool iteration_dir = stem.size() == 12 && stem.starts_with("iter_") &&
                             stem.find_first_not_of("0123456789", 5) == std::string::npos;
  if (!iteration_dir && stem != kTracker && stem != kMetadata) return -1;
  return pid_t(std::stol(digits));
}

std::vector<std::string> remove_stale_partial_saves(const std::string& save_dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(save_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const pid_t owner = temporary_owner(name);
    if (owner <= 0 || owner == getpid()) continue;
    // kill(pid, 0) fails with ESRCH only when no such process exists; EPERM means one
    // does (another user's), so its files stay.
    if (::kill(owner, 0) == 0 || errno != ESRCH) continue;
    std::error_code remove_ec;
    fs::remove_all(entry.path(), remove_ec);
    if (!remove_ec) removed.push_back(name);
  }
  return removed;
}

int64_t tracked_iteration(const std::string& dir) {
  std::ifstream in(fs::path(dir) / kTracker);
  std::string text;
  if (!in || !(in >> text) || text.empty() || text.size() > 18 ||
      text.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  return std::stoll(text);
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open '{}' to flush it to disk: {}", path, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail("cannot flush '{}' to disk: {}", path, std::strerror(err));
}

void write_tracker(const std::string& save_dir, int64_t iteration) {
  const fs::path tracker = fs::path(save_dir) / kTracker;
  fs::path tmp = tracker;
  tmp += fmt::format(".tmp{}", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("cannot write '{}'", tmp.string());
    out << iteration << "\n";
    out.flush();
    if (!out) fail("cannot write '{}' (disk full?)", tmp.string());
  }
  fsync_path(tmp.string());
  std::error_code ec;
  fs::rename(tmp, tracker, ec);
  if (ec) fail("cannot rename '{}' to '{}': {}", tmp.string(), tracker.string(), ec.message());
  fsync_path(save_dir);
}

std::string apply_save_retention(const std::string& save_dir, int64_t previous, int64_t iteration,
                                 const SaveOptions& options) {
  if (options.save_retain_interval <= 0 || previous <= 0 || previous == iteration ||
      previous % options.save_retain_interval == 0)
    return "";
  const fs::path old_dir = fs::path(save_dir) / iteration_dir_name(previous);
  std::error_code ec;
  if (fs::is_symlink(old_dir, ec) || !fs::is_directory(old_dir, ec)) return "";
  // Out of the way under a temporary name first: a process killed while removing the files
  // then leaves a partial directory that the next save removes (remove_stale_partial_saves),
  // never an iter_XXXXXXX directory missing some of the files its metadata.json lists.
  fs::path doomed = old_dir;
  doomed += fmt::format(".tmp{}", getpid());
  fs::remove_all(doomed, ec);
  fs::rename(old_dir, doomed, ec);
  if (ec)
    fail("save-retain-interval: cannot rename '{}' to '{}': {}", old_dir.string(), doomed.string(),
         ec.message());
  fsync_path(save_dir);
  fs::remove_all(doomed, ec);
  if (ec) fail("save-retain-interval: cannot remove '{}': {}", doomed.string(), ec.message());
  return old_dir.string();
}

std::string save_checkpoint(const std::string& save_dir, int64_t iteration,
                            const std::vector<std::pair<std::string, Tensor>>& tensors,
                            const std::string& metadata_json, const SaveOptions& options) {
  const int64_t previous = options.save_retain_interval > 0 ? tracked_iteration(save_dir) : -1;
  save_checkpoint(save_dir, iteration, tensors, metadata_json);
  return apply_save_retention(save_dir, previous, iteration, options);
}

void save_checkpoint(const std::string& save_dir, int64_t iteration,
                     const std::vector<std::pair<std::string, Tensor>>& tensors,
                     const std::string& metadata_json) {
  std::error_code ec;
  fs::create_directories(save_dir, ec);
  if (ec) fail("cannot create checkpoint directory '{}': {}", save_dir, ec.message());
  for (const std::string& name : remove_stale_partial_saves(save_dir))
    fmt::print(" removed '{}' in '{}', the partial save of a process no longer running\n", name,
               save_dir);
  fs::path final_dir = fs::path(save_dir) / iteration_dir_name(iteration);
  fs::path tmp_dir = fs::path(save_dir) / (iteration_dir_name(iteration) + fmt::format(".tmp{}", getpid()));
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  save_safetensors((tmp_dir / kTensors).string(), tensors);
  // Metadata last: a directory without it is an unfinished save.
  write_text_atomic(tmp_dir / kMetadata, metadata_json);
  fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);
  write_tracker(save_dir, iteration);
}

LoadedCheckpoint read_checkpoint_metadata(const std::string& load_dir, int64_t iteration) {
  if (!fs::is_directory(load_dir)) fail("checkpoint directory '{}' does not exist", load_dir);
  fs::path tracker = fs::path(load_dir) / kTracker;
  LoadedCheckpoint ck;
  if (iteration >= 0) {
    ck.iteration = iteration;
  } else {
    std::ifstream in(tracker);
    if (!in) fail("checkpoint tracker '{}' does not exist", tracker.string());
    std::string text;
    std::getline(in, text);
    try {
      size_t used = 0;
      ck.iteration = std::stoll(text, &used);
      if (used != text.size() || ck.iteration < 0) throw std::invalid_argument(text);
    } catch (const std::exception&) {
      fail("checkpoint tracker '{}' holds '{}', expected an iteration number", tracker.string(),
           text);
    }
  }
  fs::path dir = fs::path(load_dir) / iteration_dir_name(ck.iteration);
  ck.path = dir.string();
  if (iteration >= 0 && !fs::is_directory(dir))
    fail("checkpoint directory '{}' (iteration {}) does not exist", dir.string(), iteration);
  fs::path meta = dir / kMetadata;
  std::ifstream min(meta, std::ios::binary);
  if (!min) fail("checkpoint metadata '{}' does not exist (unfinished save?)", meta.string());
  ck.metadata_json.assign(std::istreambuf_iterator<char>(min), {});
  if (!nlohmann::json::accept(ck.metadata_json))
    fail("checkpoint metadata '{}' is not valid JSON", meta.string());
  // The tracker (or the iteration asked for), the directory name and the metadata must
  // name one iteration: a copied or renamed directory would otherwise resume at the wrong
  // step of the LR schedule and data.
  const nlohmann::json parsed = nlohmann::json::parse(ck.metadata_json);
  if (!parsed.is_object()) fail("checkpoint metadata '{}' is not a JSON object", meta.string());
  if (parsed.contains("iteration") && (!parsed["iteration"].is_number_integer() ||
                                       parsed["iteration"].get<int64_t>() != ck.iteration))
    fail("checkpoint metadata '{}' says iteration {}, but its directory and {} say {}",
         meta.string(), parsed["iteration"].dump(),
         iteration >= 0 ? std::string("--ckpt-step") : "'" + tracker.string() + "'",
         ck.iteration);
  return ck;
}

LoadedCheckpoint load_checkpoint(const std::string& load_dir, int64_t iteration) {
  LoadedCheckpoint ck = read_checkpoint_metadata(load_dir, iteration);
  if (is_sharded_checkpoint(ck.path)) {
    // Every tensor whole, assembled from the ranks' pieces (generation, tools).
    ShardedCheckpointReader reader(ck.path);
    for (const auto& [name, info] : reader.tensors()) ck.tensors.emplace(name, reader.read(name));
    return ck;
  }
  ck.tensors = load_safetensors((fs::path(ck.path) / kTensors).string()).tensors;
  return ck;
}

}  // namespace megaton::ckpt
