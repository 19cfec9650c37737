// Checkpoint save/load with atomic directory and tracker-file updates.
#include "ckpt/checkpoint.h"

#include <unistd.h>

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

void save_checkpoint(const std::string& save_dir, int64_t iteration,
                     const std::vector<std::pair<std::string, Tensor>>& tensors,
                     const std::string& metadata_json) {
  std::error_code ec;
  fs::create_directories(save_dir, ec);
  if (ec) fail("cannot create checkpoint directory '{}': {}", save_dir, ec.message());
  fs::path final_dir = fs::path(save_dir) / iteration_dir_name(iteration);
  fs::path tmp_dir = fs::path(save_dir) / (iteration_dir_name(iteration) + fmt::format(".tmp{}", getpid()));
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  save_safetensors((tmp_dir / kTensors).string(), tensors);
  // Metadata last: a directory without it is an unfinished save.
  write_text_atomic(tmp_dir / kMetadata, metadata_json);
  fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);
  write_text_atomic(fs::path(save_dir) / kTracker, std::to_string(iteration) + "\n");
}

LoadedCheckpoint load_checkpoint(const std::string& load_dir) {
  if (!fs::is_directory(load_dir)) fail("checkpoint directory '{}' does not exist", load_dir);
  fs::path tracker = fs::path(load_dir) / kTracker;
  std::ifstream in(tracker);
  if (!in) fail("checkpoint tracker '{}' does not exist", tracker.string());
  std::string text;
  std::getline(in, text);
  LoadedCheckpoint ck;
  try {
    size_t used = 0;
    ck.iteration = std::stoll(text, &used);
    if (used != text.size() || ck.iteration < 0) throw std::invalid_argument(text);
  } catch (const std::exception&) {
    fail("checkpoint tracker '{}' holds '{}', expected an iteration number", tracker.string(),
         text);
  }
  fs::path dir = fs::path(load_dir) / iteration_dir_name(ck.iteration);
  ck.path = dir.string();
  fs::path meta = dir / kMetadata;
  std::ifstream min(meta, std::ios::binary);
  if (!min) fail("checkpoint metadata '{}' does not exist (unfinished save?)", meta.string());
  ck.metadata_json.assign(std::istreambuf_iterator<char>(min), {});
  if (!nlohmann::json::accept(ck.metadata_json))
    fail("checkpoint metadata '{}' is not valid JSON", meta.string());
  ck.tensors = load_safetensors((dir / kTensors).string()).tensors;
  return ck;
}

}  // namespace megaton::ckpt
