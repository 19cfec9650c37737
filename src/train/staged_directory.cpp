// StagedDirectory: write under a temporary name, rename when complete.
#include "train/staged_directory.h"

#include <unistd.h>

#include <filesystem>
#include <system_error>

#include "ckpt/checkpoint.h"
#include "core/error.h"

namespace fs = std::filesystem;

namespace megaton {

namespace {
bool absent_or_empty(const fs::path& p) {
  std::error_code ec;
  if (!fs::exists(p, ec)) return true;
  return fs::is_directory(p, ec) && fs::is_empty(p, ec);
}
}  // namespace

StagedDirectory::StagedDirectory(const std::string& final_dir, const std::string& flag)
    : flag_(flag) {
  if (final_dir.empty()) fail("{} needs a directory", flag);
  fs::path final_path = fs::absolute(fs::path(final_dir)).lexically_normal();
  if (!final_path.has_filename()) final_path = final_path.parent_path();
  final_ = final_path.string();
  if (!absent_or_empty(final_path))
    fail("{} {}: exists and is not an empty directory (nothing written)", flag, final_dir);
  tmp_ = final_ + ".tmp" + std::to_string(::getpid());
  std::error_code ec;
  fs::create_directories(final_path.parent_path(), ec);
  if (ec) fail("{} {}: cannot create its parent directory: {}", flag, final_dir, ec.message());
  fs::remove_all(tmp_, ec);
  if (!fs::create_directory(tmp_, ec) || ec)
    fail("{} {}: cannot create '{}': {}", flag, final_dir, tmp_,
         ec ? ec.message() : std::string("already exists"));
}

StagedDirectory::~StagedDirectory() {
  if (committed_) return;
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

void StagedDirectory::commit() {
  std::error_code ec;
  // Checked again: another process may have written there meanwhile.
  if (!absent_or_empty(final_))
    fail("{} {}: exists and is not an empty directory (nothing written)", flag_, final_);
  if (fs::exists(final_, ec)) fs::remove(final_, ec);
  fs::rename(tmp_, final_, ec);
  if (ec) fail("{}: cannot rename '{}' to '{}': {}", flag_, tmp_, final_, ec.message());
  committed_ = true;
  ckpt::fsync_path(fs::path(final_).parent_path().string());
}

}  // namespace megaton
