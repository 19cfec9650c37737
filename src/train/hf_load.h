// `megaton train --load DIR` where DIR is a Hugging Face model directory: the same as
// `megaton convert --from hf DIR --save TMP` first and `--load TMP`.
#pragma once
#include <memory>
#include <string>

#include "train/arguments.h"

namespace megaton {

// Whether `dir` is a Hugging Face model directory rather than a Megaton checkpoint
// directory: it holds config.json and no latest_checkpointed_iteration.txt.
bool is_hf_model_directory(const std::string& dir);

// A checkpoint imported for this run; world rank 0 removes its directory when the object
// is destroyed (after a barrier over the world on the normal path, so no rank is still
// reading it).
class StagedHFLoad {
 public:
  explicit StagedHFLoad(std::string dir) : dir_(std::move(dir)) {}
  ~StagedHFLoad();
  StagedHFLoad(const StagedHFLoad&) = delete;
  StagedHFLoad& operator=(const StagedHFLoad&) = delete;
  // Call on the normal exit path of every rank: waits for all ranks, then rank 0 removes
  // the directory.
  void release();
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  bool released_ = false;
};

// When raw's --load names a Hugging Face model directory (is_hf_model_directory), world
// rank 0 imports it as `megaton convert --from hf` does (import_hf_checkpoint: weights
// only, one rank file, the tokenizer named where it is in DIR, --make-vocab-size-divisible-by
// from `raw`) into <temp>/megaton-hf-load-<PID> (<temp>: std::filesystem::temp_directory_path,
// i.e. $TMPDIR or /tmp; it needs room for the model's fp32 weights), prints what it did,
// and every rank's raw["load"] becomes that directory, so --use-checkpoint-args and the
// load read it as any Megaton checkpoint. Returns nullptr (raw unchanged) otherwise.
// Throws megaton::Error (exit 2) on every rank, with rank 0's one line, when the import
// fails (train/hf_convert.h lists its errors) or when neither --finetune nor
// --no-load-optim is given (the directory holds no optimizer state).
std::unique_ptr<StagedHFLoad> stage_hf_load(RawOptions& raw);

}  // namespace megaton
