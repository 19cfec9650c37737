// megaton train --load of a Hugging Face model directory: imported to a temporary
// checkpoint by rank 0, then loaded as any other.
#include "train/hf_load.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>

#include "core/error.h"
#include "dist/runtime.h"
#include "train/hf_convert.h"

namespace fs = std::filesystem;

namespace megaton {

namespace {

bool switch_given(const RawOptions& raw, const char* key) {
  auto it = raw.find(key);
  return it != raw.end() && it->second == std::vector<std::string>{"true"};
}

// The message that marks a failed import in the broadcast (a path never starts with it).
constexpr char kFailed[] =
    "\x01"
    "failed:";

}  // namespace

bool is_hf_model_directory(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / "config.json", ec) &&
         !fs::exists(fs::path(dir) / "latest_checkpointed_iteration.txt", ec);
}

StagedHFLoad::~StagedHFLoad() {
  // An error path: the other ranks may be gone, so no barrier; rank 0 still cleans up.
  if (!released_ && dist::world_rank() == 0) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
}

void StagedHFLoad::release() {
  if (released_) return;
  dist::world_barrier();
  if (dist::world_rank() == 0) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  released_ = true;
}

std::unique_ptr<StagedHFLoad> stage_hf_load(RawOptions& raw) {
  auto load = raw.find("load");
  if (load == raw.end() || load->second.size() != 1) return nullptr;
  // Rank 0's view of the directory decides for every rank (one filesystem is assumed; a
  // rank that saw otherwise would otherwise go on alone).
  const bool hf =
      dist::broadcast_from_rank0(
          dist::world_rank() == 0 && is_hf_model_directory(load->second[0]) ? "1" : "0") == "1";
  if (!hf) return nullptr;
  const std::string hf_dir = load->second[0];
  if (!switch_given(raw, "finetune") && !switch_given(raw, "no-load-optim"))
    fail(
        "--load {} is a Hugging Face model directory (weights, no optimizer state): give "
        "--finetune (start at iteration 0) or --no-load-optim",
        hf_dir);
  std::string staged;
  std::exception_ptr failure;  // rank 0's own exception, rethrown as it was
  if (dist::world_rank() == 0) {
    try {
      const fs::path target =
          fs::temp_directory_path() / fmt::format("megaton-hf-load-{}", ::getpid());
      HFImportOptions o;
      o.hf_dir = hf_dir;
      o.save_dir = target.string();
      o.tokenizer_in_place = true;
      auto divisible = raw.find("make-vocab-size-divisible-by");
      if (divisible != raw.end() && divisible->second.size() == 1)
        o.make_vocab_size_divisible_by = std::stoll(divisible->second[0]);
      fmt::print("importing the Hugging Face model {} into {} (as megaton convert --from hf)\n",
                 hf_dir, target.string());
      import_hf_checkpoint(o, [](const std::string& line) { fmt::print(" {}\n", line); });
      staged = target.string();
    } catch (const std::exception& e) {
      staged = std::string(kFailed) + e.what();
      failure = std::current_exception();
    }
  }
  staged = dist::broadcast_from_rank0(staged);
  if (failure) std::rethrow_exception(failure);
  // The other ranks end with rank 0's line (mpirun shows the first).
  if (staged.starts_with(kFailed)) throw Error(staged.substr(sizeof(kFailed) - 1));
  auto out = std::make_unique<StagedHFLoad>(staged);
  load->second = {staged};
  return out;
}

}  // namespace megaton
