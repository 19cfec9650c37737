// Checkpoint directories in Megatron's layout: <dir>/iter_XXXXXXX/ and
// <dir>/latest_checkpointed_iteration.txt.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace megaton::ckpt {

// Megatron's directory name for an iteration: "iter_0000100".
std::string iteration_dir_name(int64_t iteration);

// Writes <save_dir>/iter_XXXXXXX/ holding model_optim_rng.safetensors (every tensor,
// named) and metadata.json (`metadata`, a JSON object string: iteration, consumed samples,
// args, RNG seed, a shape index), then updates latest_checkpointed_iteration.txt. The
// iteration directory is written under a temporary name and renamed when complete, and
// the tracker file is replaced atomically, so an interrupted save leaves the previous
// checkpoint intact. An existing directory for the same iteration is replaced. The
// partial saves of dead processes are removed first (remove_stale_partial_saves).
void save_checkpoint(const std::string& save_dir, int64_t iteration,
                     const std::vector<std::pair<std::string, Tensor>>& tensors,
                     const std::string& metadata_json);

// What save_checkpoint does after the tracker names the new iteration.
struct SaveOptions {
  // Megatron's --save-retain-interval (0: keep every checkpoint): the checkpoint the tracker
  // named before this save is removed once the new one is complete, unless its iteration is
  // a multiple of the interval, it is this iteration, or it is a symbolic link (Megatron's
  // checkpointing.py iter_finalize_fn). So the latest checkpoint and every multiple of the
  // interval stay.
  int64_t save_retain_interval = 0;
};

// save_checkpoint above, then the retention of `options`. Returns the iteration directory
// removed by retention ("" when none).
std::string save_checkpoint(const std::string& save_dir, int64_t iteration,
                            const std::vector<std::pair<std::string, Tensor>>& tensors,
                            const std::string& metadata_json, const SaveOptions& options);

// The iteration <dir>/latest_checkpointed_iteration.txt names, or -1 when there is no
// readable tracker holding a number.
int64_t tracked_iteration(const std::string& dir);

// Replaces <save_dir>/latest_checkpointed_iteration.txt with `iteration` atomically (written
// as a .tmp<PID> file, flushed to disk, renamed, the directory flushed). Throws
// megaton::Error naming the file when it cannot be written.
void write_tracker(const std::string& save_dir, int64_t iteration);

// The retention of `options` once the tracker has moved from `previous_iteration` (-1:
// none) to `iteration`: removes <save_dir>/iter_<previous_iteration> unless SaveOptions says
// it stays. The directory is first renamed to iter_<previous_iteration>.tmp<PID>, so an
// interrupted removal leaves a partial save for remove_stale_partial_saves, not an iteration
// directory with files missing. Returns the directory removed ("" when none). Throws
// megaton::Error naming the directory when it cannot be renamed or removed.
std::string apply_save_retention(const std::string& save_dir, int64_t previous_iteration,
                                 int64_t iteration, const SaveOptions& options);

// Flushes a file's or a directory's contents and entries to disk (fsync). Throws
// megaton::Error naming the path when it cannot be opened or flushed.
void fsync_path(const std::string& path);

// Checks at start-up, before any training time is spent, that `save_dir` can be written:
// it is a directory that exists and is writable, or the nearest existing ancestor is a
// writable directory in which it can be created. Creates nothing. Throws megaton::Error
// naming the flag and the path.
void check_save_dir_writable(const std::string& save_dir);

// Removes the temporary directories and files of saves whose process is gone
// (iter_XXXXXXX.tmp<PID>, latest_checkpointed_iteration.txt.tmp<PID>, left by a killed
// save: up to a checkpoint's size each) from `save_dir`. A PID still running on this host
// keeps its files (it may be saving now). Returns the names removed.
std::vector<std::string> remove_stale_partial_saves(const std::string& save_dir);

struct LoadedCheckpoint {
  int64_t iteration = 0;
  std::string path;                       // the iter_XXXXXXX directory
  std::map<std::string, Tensor> tensors;
  std::string metadata_json;
};

// Reads the checkpoint named by <load_dir>/latest_checkpointed_iteration.txt (either format:
// a sharded checkpoint, ckpt/sharded.h, is assembled into whole tensors), or, with
// iteration >= 0 (Megatron's --ckpt-step), <load_dir>/iter_<iteration> whatever the
// tracker says (no tracker needed). Throws megaton::Error naming the file when the
// directory, tracker, iteration directory or either file is missing or corrupt.
LoadedCheckpoint load_checkpoint(const std::string& load_dir, int64_t iteration = -1);

// load_checkpoint without the tensors: the iteration, path and metadata only (the
// safetensors file is not opened). Same errors.
LoadedCheckpoint read_checkpoint_metadata(const std::string& load_dir, int64_t iteration = -1);

}  // namespace megaton::ckpt
