// TensorBoardWriter: scalar summaries in TensorBoard's event-file format (--tensorboard-dir).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace megaton {

// CRC-32C (Castagnoli, polynomial 0x1EDC6F41 reflected as 0x82F63B78) of `data`, and the
// masked form TFRecord framing stores: ((crc >> 15) | (crc << 17)) + 0xa282ead8
// (TensorFlow's tensorflow/core/lib/hash/crc32c.h Mask).
uint32_t crc32c(std::string_view data);
uint32_t masked_crc32c(std::string_view data);

// Writes one event file, events.out.tfevents.<unix seconds>.<hostname>.<pid>.0 in `dir`
// (created if missing), as PyTorch's SummaryWriter does: TFRecord records (uint64 length,
// masked CRC-32C of the length, the serialized Event, masked CRC-32C of it; little
// endian), the first Event holding file_version "brain.Event:2", then one Event per
// scalar: wall_time (seconds since the epoch), step, and a Summary with one Value {tag,
// simple_value}. The protobuf fields are tensorflow/core/util/event.proto's and
// summary.proto's numbers: Event.wall_time 1 (double), step 2 (int64), file_version 3
// (string), summary 5; Summary.value 1; Value.tag 1, simple_value 2 (float).
// TensorBoard and tensorboard's EventAccumulator read the file while it grows; flush()
// makes what was added visible. Not thread-safe.
class TensorBoardWriter {
 public:
  // Throws megaton::Error naming `dir` when it cannot be created or the file cannot be
  // opened (the flag is the user's: --tensorboard-dir).
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One scalar at `step`; wall_time < 0 means now. Throws megaton::Error on a write error.
  void add_scalar(std::string_view tag, double value, int64_t step, double wall_time = -1);
  // Hands what was added to the OS. Throws megaton::Error on a write error.
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace megaton
