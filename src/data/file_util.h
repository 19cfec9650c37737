// File helpers for the data module: read-only memory maps and files written atomically.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace megaton::data {

// A whole file mapped read-only. An empty file maps to data() == nullptr, size() == 0.
// Throws megaton::Error naming the file when it cannot be opened or mapped.
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release();
  std::string path_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// A file written under a temporary name in the same directory ("<path>.tmp.<pid>.<n>")
// and renamed over `path` by commit(), so readers never see a half-written file. If the
// object is destroyed before commit() (an exception, an early return), the temporary
// file is removed. Throws megaton::Error naming `path` when it cannot be created or
// written.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  // Bytes written so far.
  uint64_t offset() const { return offset_; }
  // Flushes and closes the temporary file, keeping it for commit(): write errors (a full
  // disk, ulimit -f) surface here, before anything is renamed. On failure the temporary
  // file is removed and megaton::Error names path(). Optional before commit().
  void close();
  // Closes (unless close() ran) and renames the temporary file to path(). On failure the
  // temporary file is removed and megaton::Error names path().
  void commit();
  // Closes and removes the temporary file (no-op after commit()).
  void abandon();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }

 private:
  std::string path_;
  std::string temp_path_;
  std::FILE* file_ = nullptr;
  uint64_t offset_ = 0;
  bool committed_ = false;
};

// Writes `bytes` to `path` atomically (AtomicFile).
void write_file_atomic(const std::string& path, const void* data, size_t bytes);

// The whole file as a string; throws megaton::Error naming the file when unreadable.
std::string read_file(const std::string& path);

// 64-bit FNV-1a of `text`, as 16 lower-case hex digits (cache file names).
std::string fnv1a_hex(std::string_view text);

}  // namespace megaton::data
