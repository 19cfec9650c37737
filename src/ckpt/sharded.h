// The sharded checkpoint format: each rank writes the pieces of global tensors it holds to
// its own safetensors file; rank 0 commits an index (metadata.json) of which piece of which
// tensor lies where; a reader assembles any box or flat range of a tensor from the pieces.
//
// The idea is Megatron-LM's dist-checkpointing ShardedTensor (a global tensor, and per rank
// a box of it at global offsets, optionally a flat range of that box: the distributed
// optimizer's shard of a tensor-parallel slice); the file format is Megaton's own.
//
// Directory (Megatron's layout, as ckpt/checkpoint.h):
//   <save>/iter_XXXXXXX/rank_00000.safetensors ... rank_<N-1>.safetensors, metadata.json
//   <save>/latest_checkpointed_iteration.txt
//
// A save by N ranks sharing a filesystem (the collectives are the caller's; no MPI here):
//   rank 0:    tmp = begin_sharded_save(save, it)           broadcast tmp to every rank
//   each rank: record = write_rank_shard(tmp, rank, pieces)  gather record.to_json() to rank 0
//   rank 0:    commit_sharded_checkpoint(save, it, tmp, records, run_metadata, options)
//   (barrier, so no rank goes on before the checkpoint is complete)
// Until the commit renames tmp to iter_XXXXXXX, the tracker names the previous checkpoint;
// a killed save's tmp dir (named after rank 0's PID) is removed by the next save
// (remove_stale_partial_saves).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "core/tensor.h"

namespace megaton::ckpt {

// metadata.json's "checkpoint_format" and "checkpoint_format_version".
inline constexpr const char* kShardedFormatName = "megaton_sharded";
inline constexpr int kShardedFormatVersion = 1;

// A piece of a global tensor that one rank holds. Coordinates are in elements, global.
struct ShardedPiece {
  std::string name;                   // the global tensor's name (the same on every rank)
  std::vector<int64_t> global_shape;  // the whole tensor's shape; [] for a scalar
  std::vector<int64_t> offsets;       // where the box starts, one per dimension
  std::vector<int64_t> box_shape;     // the box's extent, one per dimension
  // A flat range [flat_begin, flat_end) of the box's elements in row-major order;
  // flat_end = -1: up to the box's end (the whole box when flat_begin = 0).
  int64_t flat_begin = 0, flat_end = -1;
  // CPU, contiguous, dtype = the global tensor's; numel = flat_end - flat_begin (or the
  // box's numel when flat_end = -1); any shape with that numel.
  Tensor data;
  // Instead of `data` (left undefined): the piece made when the file reaches it, of dtype
  // `dtype` (so a writer of many pieces holds one at a time: megaton convert).
  std::function<Tensor()> produce;
  DType dtype = DType::F32;
};

// Where one piece's bytes lie, as recorded by its rank and indexed by metadata.json.
struct PieceRecord {
  std::string name;  // the global tensor
  DType dtype = DType::F32;
  std::vector<int64_t> global_shape, offsets, box_shape;
  int64_t flat_begin = 0, flat_end = 0;  // resolved: flat_end is never -1 here
  std::string key;                       // the tensor's key in the rank's safetensors file
  uint64_t byte_offset = 0;              // of its first byte in the file (bytes)
  uint64_t nbytes = 0;                   // (flat_end - flat_begin) x dtype size
  uint32_t crc32 = 0;                    // zlib crc32 of the piece's bytes
};

// What one rank wrote: sent to rank 0 as JSON (to_json / from_json) for the commit.
struct RankShardRecord {
  int rank = 0;
  std::string file;         // file name within the iteration directory: rank_<5 digits>.safetensors
  uint64_t file_bytes = 0;  // the file's size (bytes)
  uint32_t file_crc32 = 0;  // zlib crc32 of the whole file
  std::vector<PieceRecord> pieces;  // in the order given to write_rank_shard

  // A JSON object string; from_json(to_json()) gives this record back. from_json throws
  // megaton::Error naming the field when `json` is not such an object.
  std::string to_json() const;
  static RankShardRecord from_json(const std::string& json);
};

// "rank_00003.safetensors".
std::string rank_shard_file_name(int rank);

// The temporary directory of a save in progress: <save_dir>/iter_XXXXXXX.tmp<rank0_pid>.
// The PID is rank 0's (the committing process), so remove_stale_partial_saves removes the
// directory once that process is gone.
std::string sharded_tmp_iteration_dir(const std::string& save_dir, int64_t iteration,
                                      int64_t rank0_pid);

// Rank 0, before any rank writes: creates `save_dir` when missing, removes the partial
// saves of dead processes (printing their names), and makes an empty
// sharded_tmp_iteration_dir(save_dir, iteration, getpid()) (removing one left by this
// process). Returns its path, for the caller to broadcast. Throws megaton::Error naming
// the directory when it cannot be created.
std::string begin_sharded_save(const std::string& save_dir, int64_t iteration);

// Each rank: writes `pieces` to <tmp_iteration_dir>/rank_<rank, 5 digits>.safetensors
// (keys name + "#" + index in `pieces`; the file is written under a .tmp name, flushed to
// disk and renamed; the directory is flushed) and returns its record. Pieces with
// `produce` are made one at a time as the file is written. Pieces may be of any
// DType and may be empty (flat_begin == flat_end); a rank with no pieces writes a file with
// none. Throws InternalError when a piece is inconsistent (box outside the global shape,
// flat range outside the box, data not on the CPU or of the wrong numel, rank < 0);
// megaton::Error naming the file when it cannot be written.
RankShardRecord write_rank_shard(const std::string& tmp_iteration_dir, int rank,
                                 const std::vector<ShardedPiece>& pieces);

// Rank 0, after gathering every rank's record: checks that each record's file is in
// `tmp_iteration_dir` with its recorded size (megaton::Error naming the file otherwise:
// ranks not sharing the filesystem), that the pieces of each global tensor agree on dtype
// and global shape and tile it exactly once: no element missing, none held twice, even
// with identical values (a replicated tensor is to be written by one rank only)
// (InternalError naming the tensor otherwise). Then writes metadata.json (format below),
// flushes it and the directory to disk, renames `tmp_iteration_dir` to
// <save_dir>/iter_XXXXXXX (an existing one for this iteration is swapped out atomically
// where the filesystem can, else removed first, and deleted), flushes `save_dir`, moves the
// tracker to `iteration` (write_tracker) and applies the retention of `options` as
// save_checkpoint does. Returns the directory retention removed ("" when none).
//
// metadata.json is `run_metadata_json` (a JSON object: iteration, consumed samples, args...)
// with these keys added at its top level, which it must not hold already (InternalError):
//   "checkpoint_format": "megaton_sharded", "checkpoint_format_version": 1,
//   "sharded_files": {"rank_00000.safetensors": {"rank": 0, "bytes": B, "crc32": C}, ...},
//   "sharded_tensors": {"<name>": {"dtype": "BF16", "global_shape": [..], "pieces": [
//       {"file": "rank_00000.safetensors", "key": "<name>#0", "byte_offset": O,
//        "offsets": [..], "box_shape": [..], "flat_range": [b, e], "crc32": C}, ...]}, ...}
// So read_checkpoint_metadata (and its iteration check) reads it as it reads the old format.
std::string commit_sharded_checkpoint(const std::string& save_dir, int64_t iteration,
                                      const std::string& tmp_iteration_dir,
                                      const std::vector<RankShardRecord>& records,
                                      const std::string& run_metadata_json,
                                      const SaveOptions& options = {});

// Whether <iteration_dir>/metadata.json is a JSON object whose "checkpoint_format" is
// "megaton_sharded". False (never throws) for the single-file format, a missing or corrupt
// file: the old loader then gives its own error.
bool is_sharded_checkpoint(const std::string& iteration_dir);

// Reads pieces of a committed sharded checkpoint through mmap: only the bytes a read needs
// are touched. Each file is opened (and its size checked against metadata.json) the first
// time a read needs it; each piece's crc32 is checked the first time its bytes are used and
// the verdict kept. So a damaged file fails only the reads that use its damaged pieces;
// the rest of the checkpoint stays readable. Not thread-safe.
class ShardedCheckpointReader {
 public:
  struct TensorInfo {
    DType dtype = DType::F32;
    std::vector<int64_t> global_shape;
  };

  // Opens <iteration_dir>/metadata.json. Throws megaton::Error with one line naming the
  // file when it is missing, not JSON, not of this format or a newer version, or its index
  // is malformed.
  explicit ShardedCheckpointReader(const std::string& iteration_dir);
  ~ShardedCheckpointReader();
  ShardedCheckpointReader(ShardedCheckpointReader&&) noexcept;
  ShardedCheckpointReader& operator=(ShardedCheckpointReader&&) noexcept;

  const std::string& path() const;                           // the iteration directory
  const std::string& metadata_json() const;                  // the whole metadata.json text
  const std::map<std::string, TensorInfo>& tensors() const;  // name -> dtype, global shape
  // The bytes the reads below have returned so far (what this reader copied out of the
  // files; pieces touched only for their checksum are not counted).
  int64_t bytes_read() const;
  // Lets the kernel drop this process's resident pages of the mapped files (madvise
  // MADV_DONTNEED; the page cache keeps them, a later read maps them again): a reader going
  // through a large checkpoint part by part (megaton convert --to hf) then holds only what
  // it copied out.
  void release_mapped_pages();

  // The box [offsets, offsets + box_shape) of tensor `name`: a CPU tensor of shape
  // box_shape and the stored dtype, assembled from every piece overlapping it.
  // Throws megaton::Error naming the tensor when the checkpoint has no such tensor, the
  // box is outside its global shape, or the pieces do not cover the box; megaton::Error
  // naming the file when a file it needs is missing or not of its recorded size, or a
  // piece's bytes fail their checksum (naming the tensor too).
  Tensor read_box(const std::string& name, const std::vector<int64_t>& offsets,
                  const std::vector<int64_t>& box_shape);
  // The flat range [flat_begin, flat_end) (row-major, elements) of that box: a 1-D CPU
  // tensor of flat_end - flat_begin elements. Same errors, and megaton::Error when the
  // range is outside the box.
  Tensor read_flat(const std::string& name, const std::vector<int64_t>& offsets,
                   const std::vector<int64_t>& box_shape, int64_t flat_begin, int64_t flat_end);
  // The whole tensor, of its global shape. Same errors.
  Tensor read(const std::string& name);

  // Checks every file: present, of its recorded size and whole-file crc32, and every
  // piece's crc32 (reads the whole checkpoint). Throws as the reads do.
  void verify_all();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The iteration directory that <load_dir>/latest_checkpointed_iteration.txt names, or with
// iteration >= 0 (Megatron's --ckpt-step) <load_dir>/iter_<iteration>, resolved and checked
// as load_checkpoint does (read_checkpoint_metadata: same errors), then opened.
ShardedCheckpointReader open_sharded_checkpoint(const std::string& load_dir,
                                                int64_t iteration = -1);

}  // namespace megaton::ckpt
